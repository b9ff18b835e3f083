//! The NCCL communicator (feature `cuda`): one rank's NCCL communicator on its own CUDA stream,
//! behind the same [`Communicator`] interface as the in-process one, so the executor runs a plan
//! over GPUs unchanged. libcuda and libnccl are loaded at run time ([`nccl_available`] says
//! whether they are there); nothing links against them at build time.
//!
//! This path reduces host buffers (the gradients of a host inner backend such as NdArray): a
//! comm thread per rank copies each buffer to the device on the communicator's stream, calls
//! `ncclAllReduce` in place (`ncclSum`, or `ncclAvg` for a mean), and copies the result back.
//! Collectives run in the order they were enqueued, as NCCL requires of every rank.
//!
//! Nothing waits unbounded: after the call the thread records an event and polls it against
//! the timeout; on expiry (a peer that never called, a dead rank) it aborts the NCCL
//! communicator (`ncclCommAbort`, which makes the pending kernel return) and every later call
//! fails with a typed error. `ncclCommInitRank` itself blocks until every rank calls it, so
//! [`NcclComm::new`] waits for it on the comm thread under the same timeout; the multi-process
//! [`rendezvous`](super::rendezvous) before it makes that wait short.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp as NcclOp};

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, CommSpan, Communicator, Job, PendingReduce};
use super::rendezvous::{RendezvousConfig, RendezvousError, rendezvous};
use crate::graph::ReduceOp;

/// Whether the CUDA driver and NCCL libraries can be loaded on this machine.
pub fn nccl_available() -> bool {
    // SAFETY: these only try to open the shared libraries.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present() }
}

/// CUDA devices on this machine (0 without a driver).
pub fn device_count() -> usize {
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Why an NCCL communicator could not be created.
#[derive(Debug, thiserror::Error)]
pub enum NcclInitError {
    /// libcuda or libnccl is not on this machine.
    #[error("NCCL: the CUDA driver or libnccl cannot be loaded on this machine")]
    Unavailable,
    /// The rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// A CUDA or NCCL call failed.
    #[error("NCCL: rank {rank}: {what}: {why}")]
    Cuda {
        /// The rank.
        rank: usize,
        /// What was being done.
        what: &'static str,
        /// The driver's or NCCL's error.
        why: String,
    },
    /// `ncclCommInitRank` did not return within the timeout (a rank never called it).
    #[error("NCCL: rank {rank}: ncclCommInitRank did not complete within {waited:?}")]
    InitTimeout {
        /// The rank.
        rank: usize,
        /// How long it waited.
        waited: Duration,
    },
}

/// A fresh NCCL unique id (what rank 0 shares), as bytes.
pub fn unique_id() -> Result<Vec<u8>, NcclInitError> {
    if !nccl_available() {
        return Err(NcclInitError::Unavailable);
    }
    let id = Id::new().map_err(|e| NcclInitError::Cuda {
        rank: 0,
        what: "ncclGetUniqueId",
        why: format!("{e:?}"),
    })?;
    Ok(id.internal().iter().map(|c| *c as u8).collect())
}

/// Shared between the handle and its comm thread.
struct Control {
    aborted: AtomicBool,
    reason: Mutex<String>,
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    rank: usize,
    world: usize,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    control: Arc<Control>,
}

impl NcclComm {
    /// Joins the group `id` names as `rank` of `world`, on CUDA device `device`, with every
    /// wait bounded by `timeout`.
    pub fn new(
        device: usize,
        rank: usize,
        world: usize,
        id: &[u8],
        timeout: Duration,
    ) -> Result<Self, NcclInitError> {
        if !nccl_available() {
            return Err(NcclInitError::Unavailable);
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        if id.len() != internal.len() {
            return Err(NcclInitError::Cuda {
                rank,
                what: "reading the NCCL id",
                why: format!("it has {} bytes, not 128", id.len()),
            });
        }
        for (d, s) in internal.iter_mut().zip(id) {
            *d = *s as std::ffi::c_char;
        }
        let control = Arc::new(Control {
            aborted: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
        });
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), NcclInitError>>();
        let ctl = control.clone();
        std::thread::Builder::new()
            .name(format!("cf-nccl-rank{rank}"))
            .spawn(move || {
                let cuda = |what: &'static str| {
                    move |e: cudarc::driver::DriverError| NcclInitError::Cuda {
                        rank,
                        what,
                        why: format!("{e:?}"),
                    }
                };
                let setup = CudaContext::new(device)
                    .map_err(cuda("creating the CUDA context"))
                    .and_then(|ctx| ctx.new_stream().map_err(cuda("creating the comm stream")))
                    .and_then(|stream| {
                        Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
                            .map(|comm| (stream, comm))
                            .map_err(|e| NcclInitError::Cuda {
                                rank,
                                what: "ncclCommInitRank",
                                why: format!("{e:?}"),
                            })
                    });
                let (stream, comm) = match setup {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                serve(rank, stream, comm, rx, &ctl, timeout);
            })
            .map_err(|e| NcclInitError::Cuda {
                rank,
                what: "starting the comm thread",
                why: e.to_string(),
            })?;
        let t0 = Instant::now();
        match ready_rx.recv_timeout(timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(NcclInitError::InitTimeout {
                    rank,
                    waited: t0.elapsed(),
                });
            }
        }
        Ok(NcclComm {
            rank,
            world,
            jobs: Mutex::new(Some(jobs)),
            control,
        })
    }

    /// The multi-process start: reads the launcher's environment (`RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), shares rank 0's NCCL id through the
    /// rendezvous, and joins on device `LOCAL_RANK`.
    pub fn from_env(timeout: Duration) -> Result<Self, NcclInitError> {
        if !nccl_available() {
            return Err(NcclInitError::Unavailable);
        }
        let cfg = RendezvousConfig::from_env(timeout)?;
        NcclComm::join(&cfg, timeout)
    }

    /// Joins the group `cfg` describes: rank 0's NCCL id is shared through the rendezvous, and
    /// this rank joins on CUDA device `cfg.local_rank`.
    pub fn join(cfg: &RendezvousConfig, timeout: Duration) -> Result<Self, NcclInitError> {
        if !nccl_available() {
            return Err(NcclInitError::Unavailable);
        }
        let mut id_err = None;
        let id = rendezvous(cfg, || match unique_id() {
            Ok(id) => id,
            Err(e) => {
                id_err = Some(e);
                Vec::new()
            }
        })?;
        if let Some(e) = id_err {
            return Err(e);
        }
        NcclComm::new(cfg.local_rank, cfg.rank, cfg.world, &id, timeout)
    }
}

/// The comm thread: runs the jobs in order until the handle drops.
fn serve(
    rank: usize,
    stream: Arc<CudaStream>,
    comm: Comm,
    rx: mpsc::Receiver<Job>,
    control: &Control,
    timeout: Duration,
) {
    let mut comm = Some(comm);
    for job in rx {
        let start = Instant::now();
        let Job {
            mut buffer,
            what,
            reply,
        } = job;
        let result = match comm.as_ref() {
            None => Err(CommError::Aborted {
                rank,
                what,
                reason: control.reason.lock().map(|r| r.clone()).unwrap_or_default(),
            }),
            Some(c) => {
                let op = match what.op {
                    ReduceOp::Sum => NcclOp::Sum,
                    ReduceOp::Mean => NcclOp::Avg,
                };
                let done = match &mut buffer {
                    HostBuffer::F32(v) => reduce(&stream, c, v, &op, control, timeout),
                    HostBuffer::F64(v) => reduce(&stream, c, v, &op, control, timeout),
                    HostBuffer::F16(v) => reduce(&stream, c, v, &op, control, timeout),
                    HostBuffer::BF16(v) => reduce(&stream, c, v, &op, control, timeout),
                };
                match done {
                    Ok(()) => Ok((
                        buffer,
                        CommSpan {
                            start,
                            end: Instant::now(),
                        },
                    )),
                    Err(Failure::Call(why)) => Err(CommError::Unsupported { rank, what, why }),
                    Err(Failure::Timeout) => {
                        // Abort, so that the pending NCCL kernel returns and nothing more runs.
                        comm = None;
                        if let Ok(mut r) = control.reason.lock() {
                            *r = format!("rank {rank} timed out in NCCL");
                        }
                        control.aborted.store(true, Ordering::SeqCst);
                        Err(CommError::Timeout {
                            rank,
                            what,
                            waited: start.elapsed(),
                            missing: Vec::new(),
                        })
                    }
                    Err(Failure::Aborted) => {
                        comm = None;
                        Err(CommError::Aborted {
                            rank,
                            what,
                            reason: control.reason.lock().map(|r| r.clone()).unwrap_or_default(),
                        })
                    }
                }
            }
        };
        let _ = reply.send(result);
    }
}

enum Failure {
    Call(String),
    Timeout,
    Aborted,
}

/// Host → device, `ncclAllReduce` in place, wait (bounded), device → host.
fn reduce<T: DeviceRepr + ValidAsZeroBits + NcclType>(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    host: &mut [T],
    op: &NcclOp,
    control: &Control,
    timeout: Duration,
) -> Result<(), Failure> {
    if host.is_empty() {
        return Ok(());
    }
    let call = |what: &str| {
        let what = what.to_string();
        move |e: cudarc::driver::DriverError| Failure::Call(format!("{what}: {e:?}"))
    };
    let mut dev = stream
        .clone_htod(host)
        .map_err(call("copying the buffer to the device"))?;
    comm.all_reduce_in_place(&mut dev, op)
        .map_err(|e| Failure::Call(format!("ncclAllReduce: {e:?}")))?;
    let done = stream
        .record_event(None)
        .map_err(call("recording the completion event"))?;
    let deadline = Instant::now() + timeout;
    while !done.is_complete() {
        if control.aborted.load(Ordering::SeqCst) {
            return Err(Failure::Aborted);
        }
        if Instant::now() >= deadline {
            return Err(Failure::Timeout);
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    stream
        .memcpy_dtoh(&dev, host)
        .map_err(call("copying the result to the host"))?;
    Ok(())
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        match self.jobs.lock() {
            Ok(jobs) => super::comm::enqueue(self.rank, jobs.as_ref(), buffer, what),
            Err(_) => Err(CommError::Closed {
                rank: self.rank,
                what,
            }),
        }
    }

    fn abort(&self, reason: &str) {
        if let Ok(mut r) = self.control.reason.lock() {
            *r = reason.to_string();
        }
        self.control.aborted.store(true, Ordering::SeqCst);
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Closing the queue ends the comm thread, which drops (aborts) the NCCL communicator.
        if let Ok(mut j) = self.jobs.lock() {
            j.take();
        }
    }
}

//! The NCCL communicator (feature `cuda`): one rank's NCCL communicator on its own CUDA stream,
//! behind the same [`Communicator`] interface as the in-process one, so the executor runs a plan
//! over GPUs unchanged. libcuda and libnccl are loaded at run time ([`nccl_available`] says
//! whether they are there); nothing links against them at build time.
//!
//! Two kinds of buffer, one comm thread per rank that runs them in the order they were enqueued,
//! as NCCL requires of every rank:
//! - a bucket packed in CUDA memory on this communicator's GPU (the gradients of
//!   `Collective<Cuda>`, [`Communicator::all_reduce_device`]) is reduced in place: the comm
//!   thread waits for the pack kernel (through a CubeCL stream that waits on an event after
//!   it, as CubeCL does not expose its streams to take an event from; the thread that
//!   launched the kernel goes on), and `ncclAllReduce` runs on the communicator's stream over
//!   the bucket's own memory; nothing crosses to the host;
//! - a host buffer (the gradients of a host inner backend such as NdArray) is copied to the
//!   device on the communicator's stream, reduced in place, and copied back; a device bucket
//!   it declines (another GPU's memory, wgpu's) is first read into host memory on the comm
//!   thread ([`Communicator::all_reduce_read`]).
//!
//! Either way the call is `ncclSum`, or `ncclAvg` for a mean. The calls of one plan collective
//! (several gradients reduced without a bucket) launch inside one `ncclGroupStart`/
//! `ncclGroupEnd` ([`Communicator::group`]) and are waited for once.
//!
//! Nothing waits unbounded: after the call the thread records an event and polls it against
//! the timeout, and polls NCCL for an asynchronous error (`ncclCommGetAsyncError`: a failed
//! peer or network) and the stream for a device error. On expiry (a peer that never called, a
//! dead rank) or an error it aborts the NCCL communicator (`ncclCommAbort`, which makes the
//! pending kernel return): the collective fails with [`CommError::Timeout`] or
//! [`CommError::Failed`], every later call with [`CommError::Aborted`] naming the first
//! failure, as after [`Communicator::abort`]. NCCL errors read as NCCL's name and text for
//! them and its last message (`ncclGetLastError`). `ncclCommInitRank` itself blocks until every rank calls it, so
//! [`NcclComm::new`] waits for it on the comm thread under the same timeout; the multi-process
//! [`rendezvous`](super::rendezvous) before it makes that wait short.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use cudarc::nccl::NcclType;
use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys as nccl_sys;
use half::{bf16, f16};

use super::buffer::HostBuffer;
use super::comm::{
    CollectiveDesc, CommError, CommResult, CommSpan, Communicator, Contribution, DeviceLaunch, Job,
    PendingReduce,
};
use super::grad::{CudaMemory, DeviceBucket};
use super::rendezvous::{RendezvousConfig, RendezvousError, rendezvous};
use crate::graph::DType;
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
    /// Two ranks of one process were given the same GPU (NCCL allows one rank per GPU).
    #[error("NCCL: ranks {ranks:?} are all on CUDA device {device}; each rank needs its own GPU")]
    SharedDevice {
        /// The device.
        device: usize,
        /// The ranks on it.
        ranks: Vec<usize>,
    },
    /// `ncclCommInitRank` did not return within the timeout (a rank never called it). The
    /// blocking call cannot be cancelled: its thread stays in it, idle, until the process ends
    /// or the missing rank arrives.
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
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| NcclInitError::Cuda {
        rank: 0,
        what: "ncclGetUniqueId",
        why: nccl_why(&e),
    })?;
    Ok(id.internal.iter().map(|c| *c as u8).collect())
}

/// An NCCL error as its name, NCCL's text for it, and NCCL's last message (which says what
/// went wrong, e.g. which peer), not cudarc's bare `NcclError`.
fn nccl_why(e: &NcclError) -> String {
    // SAFETY: NCCL returns pointers to static or thread-local NUL-terminated strings (or null);
    // its last-error text takes a null communicator.
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .trim()
                .to_string()
        }
    };
    let what = text(unsafe { nccl_sys::ncclGetErrorString(e.0) });
    let last = text(unsafe { nccl_sys::ncclGetLastError(std::ptr::null_mut()) });
    if last.is_empty() {
        format!("{:?} ({what})", e.0)
    } else {
        format!("{:?} ({what}): {last}", e.0)
    }
}

/// This rank's NCCL communicator, owned by its comm thread. Dropping it aborts it
/// (`ncclCommAbort`), which makes a kernel still waiting for a peer return.
struct RawComm(nccl_sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one at a time; only the comm
// thread that created it uses it (and drops it).
unsafe impl Send for RawComm {}

impl RawComm {
    /// `ncclCommInitRank`: blocks until every rank of the group has called it.
    fn init(rank: usize, world: usize, id: [std::ffi::c_char; 128]) -> Result<Self, String> {
        let ranks = |n: usize| {
            std::ffi::c_int::try_from(n).map_err(|_| format!("{n} does not fit NCCL's int"))
        };
        let (rank, world) = (ranks(rank)?, ranks(world)?);
        let mut comm = std::mem::MaybeUninit::<nccl_sys::ncclComm_t>::uninit();
        // SAFETY: NCCL writes the communicator handle on success; the id is 128 bytes.
        unsafe {
            cudarc::nccl::result::comm_init_rank(
                comm.as_mut_ptr(),
                world,
                nccl_sys::ncclUniqueId { internal: id },
                rank,
            )
            .map_err(|e| nccl_why(&e))?;
            Ok(RawComm(comm.assume_init()))
        }
    }

    /// `ncclAllReduce` in place on `count` elements of type `T` at `ptr`, queued on `stream`.
    ///
    /// # Safety
    /// `ptr` must be device memory of this communicator's GPU holding `count` elements of `T`,
    /// left alone by everything else until the stream passes the call.
    unsafe fn all_reduce_in_place<T: NcclType>(
        &self,
        ptr: u64,
        count: usize,
        op: ReduceOp,
        stream: &CudaStream,
    ) -> Result<(), String> {
        let op = match op {
            ReduceOp::Sum => nccl_sys::ncclRedOp_t::ncclSum,
            ReduceOp::Mean => nccl_sys::ncclRedOp_t::ncclAvg,
        };
        let buf = ptr as *mut std::ffi::c_void;
        // SAFETY: the caller's contract; the stream belongs to this communicator's context.
        unsafe {
            cudarc::nccl::result::all_reduce(
                buf,
                buf,
                count,
                T::as_nccl_type(),
                op,
                self.0,
                stream.cu_stream() as nccl_sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(|e| format!("ncclAllReduce: {}", nccl_why(&e)))
    }

    /// An error NCCL met asynchronously (a peer that failed, a network error), if any.
    fn async_error(&self) -> Option<String> {
        let mut found = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: the handle is live; NCCL writes one result.
        let asked = unsafe { nccl_sys::ncclCommGetAsyncError(self.0, &mut found) };
        match (asked.result(), found.result()) {
            (Err(e), _) | (Ok(_), Err(e)) => Some(format!("NCCL reported {}", nccl_why(&e))),
            _ => None,
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle is live and used by no one else; nothing uses it afterwards.
        if let Err(e) = unsafe { cudarc::nccl::result::comm_abort(self.0) } {
            tracing::warn!("ncclCommAbort: {}", nccl_why(&e));
        }
    }
}

/// Shared between the handle and its comm thread.
struct Control {
    aborted: AtomicBool,
    reason: Mutex<String>,
}

impl Control {
    /// Marks the rank aborted; the first reason given is the one later calls report.
    fn abort(&self, why: String) {
        if let Ok(mut r) = self.reason.lock()
            && r.is_empty()
        {
            *r = why;
        }
        self.aborted.store(true, Ordering::SeqCst);
    }
}

/// A collective queued on the comm thread, or a group bracket.
enum NcclJob {
    /// The jobs up to the next `GroupEnd` launch together.
    GroupStart,
    /// Closes a group.
    GroupEnd,
    /// A host buffer: copied over, reduced, copied back.
    Host {
        buffer: HostBuffer,
        what: CollectiveDesc,
        reply: mpsc::Sender<CommResult>,
    },
    /// A device bucket this communicator does not reduce in place: read on the comm thread,
    /// then a [`NcclJob::Host`].
    Read {
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
        reply: mpsc::Sender<CommResult>,
    },
    /// A device bucket, reduced in place.
    Device {
        bucket: Box<dyn DeviceBucket>,
        memory: CudaMemory,
        what: CollectiveDesc,
        reply: mpsc::Sender<CommResult<Box<dyn DeviceBucket>>>,
    },
}

impl From<Job> for NcclJob {
    fn from(job: Job) -> Self {
        let Job {
            contribution,
            what,
            reply,
        } = job;
        match contribution {
            Contribution::Host(buffer) => NcclJob::Host {
                buffer,
                what,
                reply,
            },
            Contribution::Device(bucket) => NcclJob::Read {
                bucket,
                what,
                reply,
            },
        }
    }
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    rank: usize,
    world: usize,
    /// The CUDA device it runs on.
    device: usize,
    /// That device's primary context (CubeCL's too), bound on a caller's thread before a
    /// device pointer is looked up there.
    ctx: Arc<CudaContext>,
    /// Whether the "bucket on another GPU" warning was given.
    warned: AtomicBool,
    jobs: Mutex<Option<mpsc::Sender<NcclJob>>>,
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
        let (jobs, rx) = mpsc::channel::<NcclJob>();
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
                        RawComm::init(rank, world, internal)
                            .map(|comm| (stream, comm))
                            .map_err(|why| NcclInitError::Cuda {
                                rank,
                                what: "ncclCommInitRank",
                                why,
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
        let ctx = CudaContext::new(device).map_err(|e| NcclInitError::Cuda {
            rank,
            what: "creating the CUDA context",
            why: format!("{e:?}"),
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
            device,
            ctx,
            warned: AtomicBool::new(false),
            jobs: Mutex::new(Some(jobs)),
            control,
        })
    }

    /// Every rank of a group in this process (single-process multi-GPU): rank `r` on CUDA device
    /// `devices[r]`, a fresh NCCL id, the ranks joining concurrently (`ncclCommInitRank` waits
    /// for all of them), each wait bounded by `timeout`.
    pub fn group(devices: &[usize], timeout: Duration) -> Result<Vec<Self>, NcclInitError> {
        for (r, d) in devices.iter().enumerate() {
            let ranks: Vec<usize> = (0..devices.len()).filter(|q| devices[*q] == *d).collect();
            if ranks.len() > 1 && ranks[0] == r {
                return Err(NcclInitError::SharedDevice { device: *d, ranks });
            }
        }
        if !nccl_available() {
            return Err(NcclInitError::Unavailable);
        }
        let id = unique_id()?;
        let world = devices.len();
        let joined: Vec<Result<NcclComm, NcclInitError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = devices
                .iter()
                .enumerate()
                .map(|(rank, device)| {
                    let id = &id;
                    scope.spawn(move || NcclComm::new(*device, rank, world, id, timeout))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(NcclInitError::Cuda {
                            rank,
                            what: "joining the group",
                            why: "the joining thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        joined.into_iter().collect()
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

/// The comm thread: runs the jobs in order until the handle drops; the jobs between a
/// `GroupStart` and a `GroupEnd` launch together (`ncclGroupStart`/`ncclGroupEnd`).
fn serve(
    rank: usize,
    stream: Arc<CudaStream>,
    comm: RawComm,
    rx: mpsc::Receiver<NcclJob>,
    control: &Control,
    timeout: Duration,
) {
    let mut comm = Some(comm);
    let mut group: Option<Vec<NcclJob>> = None;
    for job in rx {
        match job {
            NcclJob::GroupStart => {
                if let Some(open) = group.replace(Vec::new()) {
                    // Not closed: those launch on their own.
                    run_jobs(rank, &stream, &mut comm, open, false, control, timeout);
                }
            }
            NcclJob::GroupEnd => {
                let jobs = group.take().unwrap_or_default();
                let grouped = jobs.len() > 1;
                run_jobs(rank, &stream, &mut comm, jobs, grouped, control, timeout);
            }
            job => match group.as_mut() {
                Some(g) => g.push(job),
                None => run_jobs(rank, &stream, &mut comm, vec![job], false, control, timeout),
            },
        }
    }
}

/// A job whose NCCL call was issued on the stream.
struct Issued {
    job: NcclJob,
    /// A host buffer's device copy, reduced in place (none for a device bucket, an empty
    /// buffer, or a call that was not issued).
    dev: Option<DevBuf>,
}

/// A host buffer's device copy.
enum DevBuf {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
}

/// Issues each job's NCCL call (inside one NCCL group when `grouped`), waits once for the
/// stream, then finishes each job (device → host for host buffers) and replies. A rank
/// aborted before this (by [`Communicator::abort`], or by an earlier failure) issues nothing:
/// its NCCL communicator is aborted and every job fails with the reason.
fn run_jobs(
    rank: usize,
    stream: &Arc<CudaStream>,
    comm: &mut Option<RawComm>,
    jobs: Vec<NcclJob>,
    grouped: bool,
    control: &Control,
    timeout: Duration,
) {
    let start = Instant::now();
    if control.aborted.load(Ordering::SeqCst) {
        *comm = None;
    }
    let issued: Vec<(Issued, Option<Result<(), Failure>>)> = match comm.as_ref() {
        None => jobs
            .into_iter()
            .filter_map(|job| unissued(job).map(|i| (i, None)))
            .collect(),
        Some(c) => {
            // First each device bucket's pack kernel is waited for, and each declined bucket
            // read (on this thread, so the backward thread that launched the kernel went on);
            // then the calls are issued, none if any of that failed (the rank aborts).
            let ready: Vec<(Issued, Result<(), Failure>)> = jobs
                .into_iter()
                .filter_map(|j| unissued(j).map(prepare))
                .collect();
            let refused = ready.iter().find_map(|(_, r)| r.clone().err());
            let opened = if let Some(first) = refused {
                Err(first)
            } else if grouped {
                cudarc::nccl::result::group_start()
                    .map(|_| ())
                    .map_err(|e| Failure::Failed(format!("ncclGroupStart: {}", nccl_why(&e))))
            } else {
                Ok(())
            };
            let mut issued: Vec<(Issued, Result<(), Failure>)> = ready
                .into_iter()
                .map(|(i, r)| match (&opened, r) {
                    (Ok(()), Ok(())) => issue(stream, c, i),
                    (_, Err(e)) => (i, Err(e)),
                    (Err(e), _) => (i, Err(e.clone())),
                })
                .collect();
            if grouped
                && opened.is_ok()
                && let Err(e) = cudarc::nccl::result::group_end()
            {
                let why = Failure::Failed(format!("ncclGroupEnd: {}", nccl_why(&e)));
                for (_, r) in &mut issued {
                    *r = Err(why.clone());
                }
            }
            let waited = if issued.iter().any(|(_, r)| r.is_ok()) {
                await_stream(stream, c, control, timeout)
            } else {
                Ok(())
            };
            issued
                .into_iter()
                .map(|(i, r)| (i, Some(r.and_then(|()| waited.clone()))))
                .collect()
        }
    };
    for (Issued { job, dev }, done) in issued {
        match job {
            NcclJob::Host {
                mut buffer,
                what,
                reply,
            } => {
                let done = done.map(|r| r.and_then(|()| copy_back(stream, dev, &mut buffer)));
                let _ = reply.send(outcome(rank, comm, done, buffer, what, start, control));
            }
            NcclJob::Read { what, reply, .. } => {
                // Still unread: its read failed, or the rank was aborted before it.
                let unread = || Failure::Local("the declined bucket was not read".into());
                let done = done.map(|r| r.and(Err(unread())));
                let none = HostBuffer::F32(Vec::new());
                let _ = reply.send(outcome(rank, comm, done, none, what, start, control));
            }
            NcclJob::Device {
                bucket,
                memory,
                what,
                reply,
            } => {
                // The memory stays held until NCCL is done with it (or aborted above).
                drop(memory);
                let _ = reply.send(outcome(rank, comm, done, bucket, what, start, control));
            }
            NcclJob::GroupStart | NcclJob::GroupEnd => {}
        }
    }
}

/// Makes a job ready to issue on this thread: waits for a device bucket's pack kernel; reads
/// a declined bucket into host memory (a [`NcclJob::Host`] then).
fn prepare(mut i: Issued) -> (Issued, Result<(), Failure>) {
    let r = match i.job {
        NcclJob::Device { ref mut memory, .. } => memory.wait_ready().map_err(Failure::Failed),
        NcclJob::Read {
            bucket,
            what,
            reply,
        } => match bucket.read() {
            Ok(buffer) => {
                i.job = NcclJob::Host {
                    buffer,
                    what,
                    reply,
                };
                Ok(())
            }
            Err(e) => {
                i.job = NcclJob::Read {
                    bucket,
                    what,
                    reply,
                };
                Err(Failure::Failed(e.to_string()))
            }
        },
        _ => Ok(()),
    };
    (i, r)
}

/// A job as not yet issued (`None` for the group markers).
fn unissued(job: NcclJob) -> Option<Issued> {
    match job {
        NcclJob::GroupStart | NcclJob::GroupEnd => None,
        job => Some(Issued { job, dev: None }),
    }
}

/// Queues a job's work on the stream: host → device and `ncclAllReduce` in place for a host
/// buffer, `ncclAllReduce` in place on its own memory for a device bucket.
fn issue(stream: &Arc<CudaStream>, comm: &RawComm, i: Issued) -> (Issued, Result<(), Failure>) {
    let issued = match &i.job {
        NcclJob::Read { .. } => Err(Failure::Local("the declined bucket was not read".into())),
        NcclJob::Host { buffer, what, .. } => {
            let op = what.op;
            match buffer {
                b if b.is_empty() => Ok(None),
                HostBuffer::F32(v) => to_device(stream, comm, v, op).map(|d| Some(DevBuf::F32(d))),
                HostBuffer::F64(v) => to_device(stream, comm, v, op).map(|d| Some(DevBuf::F64(d))),
                HostBuffer::F16(v) => to_device(stream, comm, v, op).map(|d| Some(DevBuf::F16(d))),
                HostBuffer::BF16(v) => {
                    to_device(stream, comm, v, op).map(|d| Some(DevBuf::BF16(d)))
                }
            }
        }
        NcclJob::Device {
            bucket,
            memory,
            what,
            ..
        } => {
            let (ptr, len, op) = (memory.ptr, bucket.len(), what.op);
            // SAFETY: `all_reduce_device` checked that the memory is on this communicator's
            // GPU and holds the bucket; the pack kernel that wrote it was waited for, and the
            // bucket is held (and left alone) until the stream has passed the call.
            unsafe {
                match bucket.dtype() {
                    DType::F32 => comm.all_reduce_in_place::<f32>(ptr, len, op, stream),
                    DType::F64 => comm.all_reduce_in_place::<f64>(ptr, len, op, stream),
                    DType::F16 => comm.all_reduce_in_place::<f16>(ptr, len, op, stream),
                    DType::BF16 => comm.all_reduce_in_place::<bf16>(ptr, len, op, stream),
                    other => {
                        return (
                            i,
                            Err(Failure::Local(format!(
                                "an {other} bucket cannot be reduced in place"
                            ))),
                        );
                    }
                }
            }
            .map_err(Failure::Failed)
            .map(|()| None)
        }
        NcclJob::GroupStart | NcclJob::GroupEnd => Ok(None),
    };
    match issued {
        Ok(dev) => (Issued { job: i.job, dev }, Ok(())),
        Err(e) => (i, Err(e)),
    }
}

/// Device → host for a reduced host buffer.
fn copy_back(
    stream: &Arc<CudaStream>,
    dev: Option<DevBuf>,
    host: &mut HostBuffer,
) -> Result<(), Failure> {
    let back = "copying the result to the host";
    match (dev, host) {
        (None, _) => Ok(()),
        (Some(DevBuf::F32(d)), HostBuffer::F32(h)) => {
            stream.memcpy_dtoh(&d, h).map_err(device_failed(back))
        }
        (Some(DevBuf::F64(d)), HostBuffer::F64(h)) => {
            stream.memcpy_dtoh(&d, h).map_err(device_failed(back))
        }
        (Some(DevBuf::F16(d)), HostBuffer::F16(h)) => {
            stream.memcpy_dtoh(&d, h).map_err(device_failed(back))
        }
        (Some(DevBuf::BF16(d)), HostBuffer::BF16(h)) => {
            stream.memcpy_dtoh(&d, h).map_err(device_failed(back))
        }
        _ => Err(Failure::Local(
            "the device copy and the host buffer differ in dtype".into(),
        )),
    }
}

/// The reply for one job: its buffer, or the typed error. Any failure aborts this rank: the NCCL communicator is dropped (`ncclCommAbort`, so the pending kernel
/// returns) and every later call fails with [`CommError::Aborted`] naming the first failure.
fn outcome<T>(
    rank: usize,
    comm: &mut Option<RawComm>,
    done: Option<Result<(), Failure>>,
    value: T,
    what: CollectiveDesc,
    start: Instant,
    control: &Control,
) -> CommResult<T> {
    let reason = || control.reason.lock().map(|r| r.clone()).unwrap_or_default();
    let abort = |comm: &mut Option<RawComm>, why: String| {
        *comm = None;
        control.abort(why);
    };
    match done {
        None => Err(CommError::Aborted {
            rank,
            what,
            reason: reason(),
        }),
        Some(Ok(())) => Ok((
            value,
            CommSpan {
                start,
                end: Instant::now(),
            },
        )),
        Some(Err(Failure::Local(why))) => {
            abort(comm, format!("rank {rank}: {what}: {why}"));
            Err(CommError::Unsupported { rank, what, why })
        }
        Some(Err(Failure::Failed(why))) => {
            abort(comm, format!("rank {rank}: {what} failed: {why}"));
            Err(CommError::Failed { rank, what, why })
        }
        Some(Err(Failure::Timeout)) => {
            abort(comm, format!("rank {rank} timed out in NCCL"));
            Err(CommError::Timeout {
                rank,
                what,
                waited: start.elapsed(),
                missing: Vec::new(),
            })
        }
        Some(Err(Failure::Aborted)) => {
            *comm = None;
            Err(CommError::Aborted {
                rank,
                what,
                reason: reason(),
            })
        }
    }
}

/// Why a job did not complete.
#[derive(Clone)]
enum Failure {
    /// Refused here before NCCL was called. The rank still aborts: its later calls would
    /// otherwise meet its peers' calls for this one, as NCCL pairs calls by their order.
    Local(String),
    /// NCCL or the device reported an error on the call, or while it ran (this rank aborts).
    Failed(String),
    /// The stream did not pass the call within the timeout (this rank aborts).
    Timeout,
    /// This rank was aborted while waiting.
    Aborted,
}

/// A CUDA driver error on a copy this rank queued: the device is in trouble, so the rank aborts.
fn device_failed(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Failure + '_ {
    move |e| Failure::Failed(format!("{what}: {e:?}"))
}

/// Waits (bounded, abortable) for everything queued on `stream` so far, and fails early on a
/// device error of the stream or an error NCCL met asynchronously (such as a failed peer).
fn await_stream(
    stream: &Arc<CudaStream>,
    comm: &RawComm,
    control: &Control,
    timeout: Duration,
) -> Result<(), Failure> {
    let done = stream
        .record_event(None)
        .map_err(device_failed("recording the completion event"))?;
    let deadline = Instant::now() + timeout;
    loop {
        match done.try_is_complete() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => return Err(Failure::Failed(format!("the comm stream failed: {e:?}"))),
        }
        if let Some(why) = comm.async_error() {
            return Err(Failure::Failed(why));
        }
        if control.aborted.load(Ordering::SeqCst) {
            return Err(Failure::Aborted);
        }
        if Instant::now() >= deadline {
            return Err(Failure::Timeout);
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Host → device and `ncclAllReduce` in place on the copy, queued on the stream.
fn to_device<T: DeviceRepr + ValidAsZeroBits + NcclType>(
    stream: &Arc<CudaStream>,
    comm: &RawComm,
    host: &[T],
    op: ReduceOp,
) -> Result<CudaSlice<T>, Failure> {
    let mut dev = stream
        .clone_htod(host)
        .map_err(device_failed("copying the buffer to the device"))?;
    let len = dev.len();
    let (ptr, written) = dev.device_ptr_mut(stream);
    // SAFETY: the copy is this communicator's GPU memory of `len` elements, written by the
    // copy queued before on the same stream and read back only after the stream passes.
    let reduced = unsafe { comm.all_reduce_in_place::<T>(ptr, len, op, stream) };
    drop(written);
    reduced.map_err(Failure::Failed)?;
    Ok(dev)
}

/// The CUDA device that owns `ptr`, if the driver can say.
fn device_of(ptr: u64) -> Option<usize> {
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: the driver writes one int for this attribute; `ptr` is only looked up.
    let status = unsafe {
        cudarc::driver::sys::cuPointerGetAttribute(
            (&mut ordinal as *mut std::ffi::c_int).cast(),
            cudarc::driver::sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    (status == cudarc::driver::sys::CUresult::CUDA_SUCCESS && ordinal >= 0)
        .then_some(ordinal as usize)
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
        self.enqueue(Contribution::Host(buffer), what)
    }

    fn reduces_device_memory(&self) -> bool {
        true
    }

    fn group(&self, open: bool) {
        let marker = if open {
            NcclJob::GroupStart
        } else {
            NcclJob::GroupEnd
        };
        // A closed queue fails the calls themselves, with a typed error.
        if let Ok(jobs) = self.jobs.lock()
            && let Some(tx) = jobs.as_ref()
        {
            let _ = tx.send(marker);
        }
    }

    fn all_reduce_device(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<DeviceLaunch, CommError> {
        self.launch_device(bucket, what)
            .map_err(|e| self.refused(e))
    }

    fn all_reduce_read(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        self.enqueue(Contribution::Device(bucket), what)
    }

    fn abort(&self, reason: &str) {
        self.control.abort(reason.to_string());
    }
}

impl NcclComm {
    /// Queues a host-path collective on the comm thread.
    fn enqueue(
        &self,
        contribution: Contribution,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        match self.jobs.lock() {
            Ok(jobs) => super::comm::enqueue(self.rank, jobs.as_ref(), contribution, what)
                .map_err(|e| self.refused(e)),
            Err(_) => Err(CommError::Closed {
                rank: self.rank,
                what,
            }),
        }
    }

    /// A collective this rank could not queue aborts the rank (later calls fail with
    /// [`CommError::Aborted`] and this reason): NCCL pairs the ranks' calls by their order, so
    /// a later call of this rank would otherwise meet its peers' calls for this one.
    fn refused(&self, e: CommError) -> CommError {
        if !matches!(e, CommError::Aborted { .. }) {
            self.control.abort(e.to_string());
        }
        e
    }

    /// [`Communicator::all_reduce_device`] before [`NcclComm::refused`].
    fn launch_device(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<DeviceLaunch, CommError> {
        let rank = self.rank;
        if bucket.dtype() != what.dtype || bucket.len() as u64 != what.count {
            return Err(CommError::Unsupported {
                rank,
                what,
                why: format!("the bucket is {}[{}]", bucket.dtype(), bucket.len()),
            });
        }
        // A dtype NCCL is not given here (the buckets are float), and an empty bucket, go
        // through the host.
        let float = matches!(
            bucket.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        );
        if !float || bucket.is_empty() {
            return Ok(DeviceLaunch::Declined(bucket));
        }
        let memory = match bucket.cuda_memory() {
            Ok(Some(m)) => m,
            // Not CUDA memory: the host path.
            Ok(None) => return Ok(DeviceLaunch::Declined(bucket)),
            Err(e) => {
                return Err(CommError::Unsupported {
                    rank,
                    what,
                    why: e.to_string(),
                });
            }
        };
        let need = bucket.len() as u64 * bucket.dtype().size();
        if memory.bytes < need {
            return Err(CommError::Unsupported {
                rank,
                what,
                why: format!(
                    "the bucket's device memory holds {} bytes, {need} needed",
                    memory.bytes
                ),
            });
        }
        // Memory of another GPU than this communicator's goes through the host.
        let owner = self
            .ctx
            .bind_to_thread()
            .ok()
            .and_then(|()| device_of(memory.ptr));
        if owner != Some(self.device) {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    rank,
                    "NCCL runs on GPU {} but {what} is in memory of GPU {owner:?}: it goes through the host",
                    self.device
                );
            }
            return Ok(DeviceLaunch::Declined(bucket));
        }
        let (reply, rx) = mpsc::channel();
        let job = NcclJob::Device {
            bucket,
            memory,
            what: what.clone(),
            reply,
        };
        let sent = self
            .jobs
            .lock()
            .ok()
            .and_then(|jobs| jobs.as_ref().map(|tx| tx.send(job).is_ok()))
            .unwrap_or(false);
        if sent {
            Ok(DeviceLaunch::Launched(PendingReduce::new(rank, what, rx)))
        } else {
            Err(CommError::Closed { rank, what })
        }
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

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

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut};
use cudarc::nccl::NcclType;
use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys as nccl_sys;
use half::{bf16, f16};

use super::buffer::HostBuffer;
use super::comm::{
    CollectiveDesc, CommError, CommResult, CommSpan, Communicator, Contribution, DeviceLaunch, Job,
    PendingReduce,
};
use super::comm_thread::CommThread;
use super::grad::{CudaMemory, DeviceBucket};
use super::peer_watch::PeerWatch;
use super::rendezvous::{RendezvousConfig, RendezvousError, rendezvous_watched};
use crate::graph::DType;
use crate::graph::ReduceOp;

mod staging;
mod worker;
use worker::{device_of, serve};

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
    /// A rank of the group departed (its process ended) while this one joined: the
    /// `ncclCommInitRank` it waits in cannot complete.
    #[error("NCCL: rank {rank}: ncclCommInitRank cannot complete: {why}")]
    PeerDeparted {
        /// The rank reporting.
        rank: usize,
        /// Which rank departed, and how ([`Departure`](super::peer_watch::Departure)).
        why: String,
    },
}

/// How long a collective (or `ncclCommInitRank`) may still complete after this process learnt
/// that one of its ranks departed, before it fails naming that rank: a peer that ends right
/// after its last collective does not fail the others' copy of it.
pub const DEPARTURE_GRACE: Duration = Duration::from_secs(2);

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
    /// The group's rendezvous connections, when it was joined through one: which rank
    /// departed, for a wait NCCL cannot end on its own.
    peers: Option<PeerWatch>,
}

impl Control {
    /// A departure of a rank of the group, [`DEPARTURE_GRACE`] after this process learnt of it.
    fn departed(&self) -> Option<super::peer_watch::Departure> {
        self.peers.as_ref()?.departed_for(DEPARTURE_GRACE)
    }

    /// NCCL's error `why`, with the departure of a rank of the group if one is known (waiting
    /// a moment for the peer watch, which learns of a process's end at about the time NCCL
    /// does): NCCL's own text seldom says which rank failed.
    fn explain(&self, why: String) -> String {
        match self
            .peers
            .as_ref()
            .and_then(|p| p.wait_for_departure(Duration::from_millis(200)))
        {
            Some(d) => format!("{why} ({d})"),
            None => why,
        }
    }

    /// The ranks known to have departed (for a timeout's `missing`).
    fn departed_ranks(&self) -> Vec<usize> {
        self.peers
            .as_ref()
            .map(|p| p.departed().iter().map(|d| d.rank).collect())
            .unwrap_or_default()
    }

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
    control: Arc<Control>,
    /// The comm thread: closing it (on drop) ends the thread, which aborts the NCCL
    /// communicator once the queued calls are done.
    thread: CommThread<NcclJob>,
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
        Self::start(device, rank, world, id, timeout, None)
    }

    /// [`NcclComm::new`], with the group's peer watch when it was joined through a rendezvous.
    fn start(
        device: usize,
        rank: usize,
        world: usize,
        id: &[u8],
        timeout: Duration,
        peers: Option<PeerWatch>,
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
            peers,
        });
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), NcclInitError>>();
        let ctl = control.clone();
        let thread = CommThread::spawn(rank, format!("cf-nccl-rank{rank}"), move |rx| {
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
        let t0 = Instant::now();
        let failed = loop {
            let left = timeout.saturating_sub(t0.elapsed());
            match ready_rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(Ok(())) => break None,
                Ok(Err(e)) => break Some(e),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    break Some(NcclInitError::Cuda {
                        rank,
                        what: "joining the group",
                        why: "the comm thread ended without a word".into(),
                    });
                }
                Err(mpsc::RecvTimeoutError::Timeout) if left.is_zero() => {
                    break Some(NcclInitError::InitTimeout {
                        rank,
                        waited: t0.elapsed(),
                    });
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Some(d) = control.departed() {
                        break Some(NcclInitError::PeerDeparted {
                            rank,
                            why: d.to_string(),
                        });
                    }
                }
            }
        };
        if let Some(e) = failed {
            // `ncclCommInitRank` may still wait for a peer that never comes: do not wait on it.
            thread.detach();
            return Err(e);
        }
        let ctx = CudaContext::new(device).map_err(|e| NcclInitError::Cuda {
            rank,
            what: "creating the CUDA context",
            why: format!("{e:?}"),
        })?;
        Ok(NcclComm {
            rank,
            world,
            device,
            ctx,
            warned: AtomicBool::new(false),
            control,
            thread,
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
    /// this rank joins on CUDA device `cfg.local_rank`. The rendezvous connections stay open as
    /// the group's [`PeerWatch`]: a collective still waiting [`DEPARTURE_GRACE`] after a rank's
    /// process ended fails naming that rank, instead of waiting out its timeout.
    pub fn join(cfg: &RendezvousConfig, timeout: Duration) -> Result<Self, NcclInitError> {
        if !nccl_available() {
            return Err(NcclInitError::Unavailable);
        }
        let mut id_err = None;
        let (id, peers) = rendezvous_watched(cfg, || match unique_id() {
            Ok(id) => id,
            Err(e) => {
                id_err = Some(e);
                Vec::new()
            }
        })?;
        if let Some(e) = id_err {
            return Err(e);
        }
        NcclComm::start(
            cfg.local_rank,
            cfg.rank,
            cfg.world,
            &id,
            timeout,
            Some(peers),
        )
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn reduces_device_memory(&self) -> bool {
        true
    }

    fn all_reduce_device(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<DeviceLaunch, CommError> {
        self.launch_device(bucket, what)
            .map_err(|e| self.refused(e))
    }

    fn group(&self, open: bool) {
        let marker = if open {
            NcclJob::GroupStart
        } else {
            NcclJob::GroupEnd
        };
        // A closed queue fails the calls themselves, with a typed error.
        self.thread.send(marker);
    }

    // A host buffer, and a device bucket this rank does not reduce in place: staged on the
    // comm thread, in queue order.
    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        self.enqueue(Contribution::Host(buffer), what)
    }

    fn all_reduce_read(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        self.enqueue(Contribution::Device(bucket), what)
    }

    fn abort(&self, reason: &str) {
        // The others learn why at once (NCCL would only leave them waiting on this rank).
        if let Some(p) = &self.control.peers {
            p.abort(reason);
        }
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
        self.thread
            .queue(contribution, what)
            .map_err(|e| self.refused(e))
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
        if self.thread.send(job) {
            Ok(DeviceLaunch::Launched(PendingReduce::new(rank, what, rx)))
        } else {
            Err(CommError::Closed { rank, what })
        }
    }
}

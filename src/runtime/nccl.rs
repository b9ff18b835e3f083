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
//!   device on the communicator's stream, reduced in place, and copied back.
//!
//! Either way the call is `ncclSum`, or `ncclAvg` for a mean. The calls of one plan collective
//! (several gradients reduced without a bucket) launch inside one `ncclGroupStart`/
//! `ncclGroupEnd` ([`Communicator::group`]) and are waited for once.
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

use std::marker::PhantomData;

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
    ValidAsZeroBits,
};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp as NcclOp};
use half::{bf16, f16};

use super::buffer::HostBuffer;
use super::comm::{
    CollectiveDesc, CommError, CommResult, CommSpan, Communicator, DeviceLaunch, Job, PendingReduce,
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

/// A collective queued on the comm thread, or a group bracket.
enum NcclJob {
    /// The jobs up to the next `GroupEnd` launch together.
    GroupStart,
    /// Closes a group.
    GroupEnd,
    /// A host buffer: copied over, reduced, copied back.
    Host(Job),
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
        NcclJob::Host(job)
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
    comm: Comm,
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
/// stream, then finishes each job (device → host for host buffers) and replies.
fn run_jobs(
    rank: usize,
    stream: &Arc<CudaStream>,
    comm: &mut Option<Comm>,
    jobs: Vec<NcclJob>,
    grouped: bool,
    control: &Control,
    timeout: Duration,
) {
    let start = Instant::now();
    let issued: Vec<(Issued, Option<Result<(), Failure>>)> = match comm.as_ref() {
        None => jobs
            .into_iter()
            .filter_map(|job| unissued(job).map(|i| (i, None)))
            .collect(),
        Some(c) => {
            // First each device bucket's pack kernel is waited for (on this thread, so the
            // backward thread that launched it went on), then the calls are issued.
            let ready: Vec<(Issued, Result<(), Failure>)> = jobs
                .into_iter()
                .filter_map(|j| {
                    let mut i = unissued(j)?;
                    let r = match &mut i.job {
                        NcclJob::Device { memory, .. } => {
                            memory.wait_ready().map_err(Failure::Call)
                        }
                        _ => Ok(()),
                    };
                    Some((i, r))
                })
                .collect();
            let opened = if grouped {
                cudarc::nccl::result::group_start()
                    .map(|_| ())
                    .map_err(|e| Failure::Call(format!("ncclGroupStart: {e:?}")))
            } else {
                Ok(())
            };
            let mut issued: Vec<(Issued, Result<(), Failure>)> = ready
                .into_iter()
                .map(|(i, r)| match (&opened, r) {
                    (Ok(()), Ok(())) => issue(stream, c, i),
                    (Err(e), _) => (i, Err(e.clone())),
                    (_, Err(e)) => (i, Err(e)),
                })
                .collect();
            if grouped
                && opened.is_ok()
                && let Err(e) = cudarc::nccl::result::group_end()
            {
                let why = Failure::Call(format!("ncclGroupEnd: {e:?}"));
                for (_, r) in &mut issued {
                    *r = Err(why.clone());
                }
            }
            let waited = if issued.iter().any(|(_, r)| r.is_ok()) {
                await_stream(stream, control, timeout)
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
            NcclJob::Host(mut job) => {
                let done = done.map(|r| r.and_then(|()| copy_back(stream, dev, &mut job.buffer)));
                let out = outcome(rank, comm, done, job.buffer, job.what, start, control);
                let _ = job.reply.send(out);
            }
            NcclJob::Device {
                bucket,
                memory,
                what,
                reply,
            } => {
                // The memory stays held until NCCL is done with it.
                drop(memory);
                let _ = reply.send(outcome(rank, comm, done, bucket, what, start, control));
            }
            NcclJob::GroupStart | NcclJob::GroupEnd => {}
        }
    }
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
fn issue(stream: &Arc<CudaStream>, comm: &Comm, i: Issued) -> (Issued, Result<(), Failure>) {
    let op = |what: &CollectiveDesc| nccl_op(what.op);
    let issued = match &i.job {
        NcclJob::Host(job) => {
            let op = op(&job.what);
            match &job.buffer {
                b if b.is_empty() => Ok(None),
                HostBuffer::F32(v) => to_device(stream, comm, v, &op).map(|d| Some(DevBuf::F32(d))),
                HostBuffer::F64(v) => to_device(stream, comm, v, &op).map(|d| Some(DevBuf::F64(d))),
                HostBuffer::F16(v) => to_device(stream, comm, v, &op).map(|d| Some(DevBuf::F16(d))),
                HostBuffer::BF16(v) => {
                    to_device(stream, comm, v, &op).map(|d| Some(DevBuf::BF16(d)))
                }
            }
        }
        NcclJob::Device {
            bucket,
            memory,
            what,
            ..
        } => {
            let op = op(what);
            let (ptr, len) = (memory.ptr, bucket.len());
            match bucket.dtype() {
                DType::F32 => in_place::<f32>(stream, comm, ptr, len, &op),
                DType::F64 => in_place::<f64>(stream, comm, ptr, len, &op),
                DType::F16 => in_place::<f16>(stream, comm, ptr, len, &op),
                DType::BF16 => in_place::<bf16>(stream, comm, ptr, len, &op),
                other => Err(Failure::Call(format!(
                    "an {other} bucket cannot be reduced in place"
                ))),
            }
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
            stream.memcpy_dtoh(&d, h).map_err(call_failed(back))
        }
        (Some(DevBuf::F64(d)), HostBuffer::F64(h)) => {
            stream.memcpy_dtoh(&d, h).map_err(call_failed(back))
        }
        (Some(DevBuf::F16(d)), HostBuffer::F16(h)) => {
            stream.memcpy_dtoh(&d, h).map_err(call_failed(back))
        }
        (Some(DevBuf::BF16(d)), HostBuffer::BF16(h)) => {
            stream.memcpy_dtoh(&d, h).map_err(call_failed(back))
        }
        _ => Err(Failure::Call(
            "the device copy and the host buffer differ in dtype".into(),
        )),
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Mean => NcclOp::Avg,
    }
}

/// The reply for one job: its buffer, or the typed error. A timeout or abort drops the NCCL
/// communicator (`comm = None`: aborted, so the pending kernel returns and nothing more runs).
fn outcome<T>(
    rank: usize,
    comm: &mut Option<Comm>,
    done: Option<Result<(), Failure>>,
    value: T,
    what: CollectiveDesc,
    start: Instant,
    control: &Control,
) -> CommResult<T> {
    let reason = || control.reason.lock().map(|r| r.clone()).unwrap_or_default();
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
        Some(Err(Failure::Call(why))) => Err(CommError::Unsupported { rank, what, why }),
        Some(Err(Failure::Timeout)) => {
            *comm = None;
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

#[derive(Clone)]
enum Failure {
    Call(String),
    Timeout,
    Aborted,
}

fn call_failed(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Failure + '_ {
    move |e| Failure::Call(format!("{what}: {e:?}"))
}

/// Waits (bounded, abortable) for everything queued on `stream` so far.
fn await_stream(
    stream: &Arc<CudaStream>,
    control: &Control,
    timeout: Duration,
) -> Result<(), Failure> {
    let done = stream
        .record_event(None)
        .map_err(call_failed("recording the completion event"))?;
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
    Ok(())
}

/// Host → device and `ncclAllReduce` in place on the copy, queued on the stream.
fn to_device<T: DeviceRepr + ValidAsZeroBits + NcclType>(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    host: &[T],
    op: &NcclOp,
) -> Result<CudaSlice<T>, Failure> {
    let mut dev = stream
        .clone_htod(host)
        .map_err(call_failed("copying the buffer to the device"))?;
    comm.all_reduce_in_place(&mut dev, op)
        .map_err(|e| Failure::Call(format!("ncclAllReduce: {e:?}")))?;
    Ok(dev)
}

/// Device memory NCCL reduces in place: a bucket's own buffer, which another allocator owns.
struct InPlace<T> {
    ptr: cudarc::driver::sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: PhantomData<T>,
}

impl<T> DeviceSlice<T> for InPlace<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtrMut<T> for InPlace<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        // The writer (the pack kernel) was waited for before the job was queued.
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// `ncclAllReduce` in place on a bucket's device memory, queued on the stream.
fn in_place<T: NcclType>(
    stream: &Arc<CudaStream>,
    comm: &Comm,
    ptr: u64,
    len: usize,
    op: &NcclOp,
) -> Result<(), Failure> {
    if len == 0 {
        return Ok(());
    }
    let mut buf = InPlace::<T> {
        ptr,
        len,
        stream: stream.clone(),
        _elem: PhantomData,
    };
    comm.all_reduce_in_place(&mut buf, op)
        .map(|_| ())
        .map_err(|e| Failure::Call(format!("ncclAllReduce: {e:?}")))
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
        match self.jobs.lock() {
            Ok(jobs) => super::comm::enqueue(self.rank, jobs.as_ref(), buffer, what),
            Err(_) => Err(CommError::Closed {
                rank: self.rank,
                what,
            }),
        }
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

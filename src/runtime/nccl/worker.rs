//! The NCCL communicator's comm thread: runs the jobs in the order they were enqueued, issues
//! each NCCL call (a group's together), waits for the stream against the timeout while polling
//! NCCL and the device for errors, aborts on a failure, and replies.
//!
//! Each collective's [`CommSpan`] is what the device reports: timed CUDA events before the
//! calls, after each call (after the group's for grouped calls) and at the end, their elapsed
//! times anchored at the moment the thread saw the last one complete. So a collective is timed
//! from when the stream reached its call to when the stream passed it, without the host's
//! polling interval or the wait for a pack kernel in it; where the events cannot be timed the
//! host's view stands in (from the batch's start to the reply).

use std::ops::Range;

use cudarc::driver::{CudaEvent, DevicePtr, sys::CUevent_flags};

use super::staging::Staging;
use super::*;
use crate::runtime::comm::PollBackoff;

/// Events that can be timed (CUDA's default flags; cudarc's default disables timing).
const TIMED: Option<CUevent_flags> = Some(CUevent_flags::CU_EVENT_DEFAULT);

/// The comm thread: runs the jobs in order until the handle drops; the jobs between a
/// `GroupStart` and a `GroupEnd` launch together (`ncclGroupStart`/`ncclGroupEnd`).
pub(super) fn serve(
    rank: usize,
    stream: Arc<CudaStream>,
    comm: RawComm,
    rx: mpsc::Receiver<NcclJob>,
    control: &Control,
    timeout: Duration,
) {
    let mut comm = Some(comm);
    let mut staging = Staging::new(stream.context().clone());
    let thread = Thread {
        rank,
        stream,
        control,
        timeout,
    };
    let mut group: Option<Vec<NcclJob>> = None;
    for job in rx {
        match job {
            NcclJob::GroupStart => {
                if let Some(open) = group.replace(Vec::new()) {
                    // Not closed: those launch on their own.
                    run_jobs(&thread, &mut comm, &mut staging, open, false);
                }
            }
            NcclJob::GroupEnd => {
                let jobs = group.take().unwrap_or_default();
                let grouped = jobs.len() > 1;
                run_jobs(&thread, &mut comm, &mut staging, jobs, grouped);
            }
            job => match group.as_mut() {
                Some(g) => g.push(job),
                None => run_jobs(&thread, &mut comm, &mut staging, vec![job], false),
            },
        }
    }
}

/// What the comm thread runs every batch with.
struct Thread<'a> {
    rank: usize,
    stream: Arc<CudaStream>,
    control: &'a Control,
    timeout: Duration,
}

/// A job whose NCCL call was issued on the stream.
struct Issued {
    job: NcclJob,
    /// A host buffer's place in the staging memory (none for a device bucket or an empty buffer).
    place: Option<Range<usize>>,
    /// A host buffer's device copy, reduced in place (none for a device bucket, an empty
    /// buffer, or a call that was not issued).
    dev: Option<CudaSlice<u8>>,
    /// A timed event the stream passes right after this job's call (none inside a group, whose
    /// calls launch together at its end).
    ended: Option<CudaEvent>,
}

/// Issues each job's NCCL call (inside one NCCL group when `grouped`), waits once for the
/// stream, then finishes each job (out of the staging memory for host buffers) and replies. A rank
/// aborted before this (by [`Communicator::abort`], or by an earlier failure) issues nothing:
/// its NCCL communicator is aborted and every job fails with the reason.
fn run_jobs(
    thread: &Thread<'_>,
    comm: &mut Option<RawComm>,
    staging: &mut Staging,
    jobs: Vec<NcclJob>,
    grouped: bool,
) {
    let Thread {
        rank,
        ref stream,
        control,
        timeout,
    } = *thread;
    let start = Instant::now();
    // The device's times of the issued calls, in job order, once the stream passed them.
    let mut spans: Vec<Option<CommSpan>> = Vec::new();
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
            let mut ready: Vec<(Issued, Result<(), Failure>)> = jobs
                .into_iter()
                .filter_map(|j| unissued(j).map(prepare))
                .collect();
            let staged = place_host_buffers(staging, &mut ready);
            let refused = ready
                .iter()
                .find_map(|(_, r)| r.clone().err())
                .or(staged.err());
            let opened = if let Some(first) = refused {
                Err(first)
            } else if grouped {
                cudarc::nccl::result::group_start()
                    .map(|_| ())
                    .map_err(|e| Failure::Failed(format!("ncclGroupStart: {}", nccl_why(&e))))
            } else {
                Ok(())
            };
            // Before the calls (inside an open group too: its kernels launch at its end).
            let began = stream.record_event(TIMED).ok();
            let mut issued: Vec<(Issued, Result<(), Failure>)> = ready
                .into_iter()
                .map(|(i, r)| match (&opened, r) {
                    (Ok(()), Ok(())) => {
                        let (mut i, r) = issue(stream, c, staging, i);
                        if !grouped && r.is_ok() {
                            i.ended = stream.record_event(TIMED).ok();
                            let back = queue_back(stream, staging, &i);
                            return (i, back);
                        }
                        (i, r)
                    }
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
            } else if grouped {
                // The group's calls were queued at its end: the copies back go after them.
                for (i, r) in &mut issued {
                    if r.is_ok() {
                        *r = queue_back(stream, staging, i);
                    }
                }
            }
            let waited = if issued.iter().any(|(_, r)| r.is_ok()) {
                await_stream(stream, c, control, timeout).map(|done| {
                    staging.set_in_flight(false);
                    let ends: Vec<Option<&CudaEvent>> =
                        issued.iter().map(|(i, _)| i.ended.as_ref()).collect();
                    spans = device_spans(began.as_ref(), &ends, &done);
                })
            } else {
                Ok(())
            };
            issued
                .into_iter()
                .map(|(i, r)| (i, Some(r.and_then(|()| waited.clone()))))
                .collect()
        }
    };
    let mut spans = spans.into_iter();
    for (
        Issued {
            job, place, dev, ..
        },
        done,
    ) in issued
    {
        // The CPU time of this thread is not counted: it waits on the GPU.
        let span = spans.next().flatten().unwrap_or(CommSpan {
            start,
            end: Instant::now(),
            joined: None,
            cpu_us: 0.0,
        });
        match job {
            NcclJob::Host {
                mut buffer,
                what,
                reply,
            } => {
                let done = done.map(|r| r.map(|()| copy_back(staging, place, &mut buffer)));
                // The stream has passed the copies (or the rank aborted): the device copy goes.
                drop(dev);
                let _ = reply.send(outcome(rank, comm, done, buffer, what, span, control));
            }
            NcclJob::Read { what, reply, .. } => {
                // Still unread: its read failed, or the rank was aborted before it.
                let unread = || Failure::Local("the declined bucket was not read".into());
                let done = done.map(|r| r.and(Err(unread())));
                let none = HostBuffer::F32(Vec::new());
                let _ = reply.send(outcome(rank, comm, done, none, what, span, control));
            }
            NcclJob::Device {
                bucket,
                memory,
                what,
                reply,
            } => {
                // The memory stays held until NCCL is done with it (or aborted above).
                drop(memory);
                let _ = reply.send(outcome(rank, comm, done, bucket, what, span, control));
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
        job => Some(Issued {
            job,
            place: None,
            dev: None,
            ended: None,
        }),
    }
}

/// Gives every host buffer of a batch its place in the staging memory (one allocation for the
/// batch, grown when too small).
fn place_host_buffers(
    staging: &mut Staging,
    ready: &mut [(Issued, Result<(), Failure>)],
) -> Result<(), Failure> {
    let sizes: Vec<usize> = ready
        .iter()
        .map(|(i, _)| match &i.job {
            NcclJob::Host { buffer, .. } => buffer.as_bytes().len(),
            _ => 0,
        })
        .collect();
    if sizes.iter().all(|n| *n == 0) {
        return Ok(());
    }
    let places = staging
        .place(&sizes)
        .map_err(|e| Failure::Failed(format!("allocating pinned staging memory: {e}")))?;
    for ((i, _), (place, n)) in ready.iter_mut().zip(places.into_iter().zip(sizes)) {
        i.place = (n > 0).then_some(place);
    }
    Ok(())
}

/// Queues a job's work on the stream: for a host buffer, host → device from its staging place
/// and `ncclAllReduce` in place (the copy back is [`queue_back`]'s, once the call is on the
/// stream); `ncclAllReduce` in place on its own memory for a device bucket.
fn issue(
    stream: &Arc<CudaStream>,
    comm: &RawComm,
    staging: &mut Staging,
    i: Issued,
) -> (Issued, Result<(), Failure>) {
    let issued = match &i.job {
        NcclJob::Read { .. } => Err(Failure::Local("the declined bucket was not read".into())),
        NcclJob::Host { buffer, what, .. } => match &i.place {
            None => Ok(None),
            Some(place) => {
                stage_and_reduce(stream, comm, staging, place.clone(), buffer, what.op).map(Some)
            }
        },
        NcclJob::Device {
            bucket,
            memory,
            what,
            ..
        } => {
            // SAFETY: `all_reduce_device` checked that the memory is on this communicator's
            // GPU and holds the bucket; the pack kernel that wrote it was waited for, and the
            // bucket is held (and left alone) until the stream has passed the call.
            unsafe {
                reduce_in_place(
                    comm,
                    bucket.dtype(),
                    memory.ptr,
                    bucket.len(),
                    what.op,
                    stream,
                )
            }
            .map(|()| None)
        }
        NcclJob::GroupStart | NcclJob::GroupEnd => Ok(None),
    };
    match issued {
        Ok(dev) => (Issued { dev, ..i }, Ok(())),
        Err(e) => (i, Err(e)),
    }
}

/// `ncclAllReduce` in place of `len` elements of `dtype` at `ptr`.
///
/// # Safety
/// As [`RawComm::all_reduce_in_place`].
unsafe fn reduce_in_place(
    comm: &RawComm,
    dtype: DType,
    ptr: u64,
    len: usize,
    op: ReduceOp,
    stream: &CudaStream,
) -> Result<(), Failure> {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            DType::F32 => comm.all_reduce_in_place::<f32>(ptr, len, op, stream),
            DType::F64 => comm.all_reduce_in_place::<f64>(ptr, len, op, stream),
            DType::F16 => comm.all_reduce_in_place::<f16>(ptr, len, op, stream),
            DType::BF16 => comm.all_reduce_in_place::<bf16>(ptr, len, op, stream),
            other => {
                return Err(Failure::Local(format!(
                    "an {other} buffer cannot be reduced by NCCL here"
                )));
            }
        }
    }
    .map_err(Failure::Failed)
}

/// A host buffer's collective, queued: its bytes into the staging memory (on the CPU), then on
/// the stream host → device and `ncclAllReduce` in place (queued at the group's end inside a
/// group). The device copy is returned, to be held until the stream has passed it; the copy
/// back ([`queue_back`]) is queued once the call is on the stream.
fn stage_and_reduce(
    stream: &Arc<CudaStream>,
    comm: &RawComm,
    staging: &mut Staging,
    place: Range<usize>,
    buffer: &HostBuffer,
    op: ReduceOp,
) -> Result<CudaSlice<u8>, Failure> {
    // From here until the stream has passed the batch, copies may use the staging memory.
    staging.set_in_flight(true);
    // SAFETY: nothing is queued on this place yet (places are handed out per batch, and a batch
    // starts once the stream has passed the one before).
    let staged = unsafe { staging.bytes(place) };
    staged.copy_from_slice(buffer.as_bytes());
    // SAFETY: every byte is written by the copy queued next, before anything reads it.
    let mut dev = unsafe { stream.alloc::<u8>(staged.len()) }
        .map_err(device_failed("allocating the device copy"))?;
    let (ptr, written) = dev.device_ptr_mut(stream);
    let queued = "queueing a copy through pinned memory";
    // SAFETY: `staged` is pinned memory of `dev`'s size, left alone until the stream has passed
    // both copies (the caller holds `dev` and reads the place only after the wait); the
    // all-reduce runs between them on the same stream.
    let reduced = unsafe {
        cudarc::driver::result::memcpy_htod_async(ptr, &*staged, stream.cu_stream())
            .map_err(device_failed(queued))
            .and_then(|()| reduce_in_place(comm, buffer.dtype(), ptr, buffer.len(), op, stream))
    };
    drop(written);
    reduced.map(|()| dev)
}

/// Queues the device → host copy of a host buffer's reduced device copy into its staging place,
/// after its `ncclAllReduce` on the stream.
fn queue_back(stream: &Arc<CudaStream>, staging: &mut Staging, i: &Issued) -> Result<(), Failure> {
    let (Some(place), Some(dev)) = (&i.place, &i.dev) else {
        return Ok(());
    };
    let (ptr, read) = dev.device_ptr(stream);
    // SAFETY: the place is pinned memory of the device copy's size, read by the CPU only after
    // the stream has passed this copy; the device copy is held as long.
    let back = unsafe {
        cudarc::driver::result::memcpy_dtoh_async(
            staging.bytes(place.clone()),
            ptr,
            stream.cu_stream(),
        )
    };
    drop(read);
    back.map_err(device_failed(
        "queueing the copy back through pinned memory",
    ))
}

/// Out of the staging memory into a reduced host buffer, once the stream has passed its copies.
fn copy_back(staging: &mut Staging, place: Option<Range<usize>>, host: &mut HostBuffer) {
    if let Some(place) = place {
        // SAFETY: the stream has passed this batch's copies (the caller waited for it).
        host.as_bytes_mut()
            .copy_from_slice(unsafe { staging.bytes(place) });
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
    span: CommSpan,
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
        Some(Ok(())) => Ok((value, span)),
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
                waited: span.start.elapsed(),
                missing: control.departed_ranks(),
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
/// Returns the (timed) event it waited for and when this thread saw it complete.
fn await_stream(
    stream: &Arc<CudaStream>,
    comm: &RawComm,
    control: &Control,
    timeout: Duration,
) -> Result<(CudaEvent, Instant), Failure> {
    let done = stream
        .record_event(TIMED)
        .map_err(device_failed("recording the completion event"))?;
    let deadline = Instant::now() + timeout;
    let mut backoff = PollBackoff::new();
    loop {
        match done.try_is_complete() {
            Ok(true) => return Ok((done, Instant::now())),
            Ok(false) => {}
            Err(e) => return Err(Failure::Failed(format!("the comm stream failed: {e:?}"))),
        }
        if let Some(why) = comm.async_error() {
            return Err(Failure::Failed(control.explain(why)));
        }
        if control.aborted.load(Ordering::SeqCst) {
            return Err(Failure::Aborted);
        }
        if let Some(d) = control.departed() {
            return Err(Failure::Failed(d.to_string()));
        }
        if Instant::now() >= deadline {
            return Err(Failure::Timeout);
        }
        backoff.pause();
    }
}

/// Each issued call's span as the device timed it: from the event before it (the previous
/// call's, or `began` for the first) to the event after it (`done` for calls without one, as in
/// a group), anchored at `done`'s host time: the end is `seen - elapsed(after, done)`. `None`
/// for a call the events cannot time.
fn device_spans(
    began: Option<&CudaEvent>,
    ends: &[Option<&CudaEvent>],
    (done, seen): &(CudaEvent, Instant),
) -> Vec<Option<CommSpan>> {
    let secs = |a: &CudaEvent, b: &CudaEvent| {
        a.elapsed_ms(b)
            .ok()
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            .map(|ms| Duration::from_secs_f64(f64::from(ms) / 1e3))
    };
    let mut before = began;
    ends.iter()
        .map(|e| {
            let after = e.unwrap_or(done);
            let span = before.and_then(|b| {
                let end = seen.checked_sub(secs(after, done)?)?;
                let start = end.checked_sub(secs(b, after)?)?;
                Some(CommSpan {
                    start,
                    end,
                    joined: None,
                    cpu_us: 0.0,
                })
            });
            if e.is_some() {
                before = Some(after);
            }
            span
        })
        .collect()
}

/// The CUDA device that owns `ptr`, if the driver can say.
pub(super) fn device_of(ptr: u64) -> Option<usize> {
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

//! The communicator interface the executor talks to, and its errors.
//!
//! A communicator is one rank's end of a group. `all_reduce` enqueues a collective on the rank's
//! communication stream and returns at once with a [`PendingReduce`]; collectives run in the
//! order they were enqueued (a stream), and [`PendingReduce::wait`] is bounded by a timeout.

use std::fmt;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::buffer::HostBuffer;
use super::grad::DeviceBucket;
use crate::graph::{DType, ReduceOp};

/// What a collective is, for matching across ranks and for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveDesc {
    /// Launch index in the plan.
    pub collective: u32,
    /// Bucket number, when bucketed.
    pub bucket: Option<u32>,
    /// Reduction.
    pub op: ReduceOp,
    /// Element type.
    pub dtype: DType,
    /// Element count.
    pub count: u64,
    /// Parameters whose gradients it carries (first and last are enough to find them).
    pub params: Vec<String>,
}

/// What a collective is for. Each purpose has its own range of launch indices, so a call of
/// one purpose can never be matched with a call of another on a peer, and the purpose of a call
/// (one received from a peer included) is known from its launch index alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// A collective of a compiled plan (launch index = its index in the plan).
    Plan,
    /// The start-up link probe ([`super::probe::LINK_PROBE`]).
    LinkProbe,
    /// Rank 0's initial weights ([`super::agree::WEIGHT_BROADCAST`]).
    WeightBroadcast,
    /// The plan agreement and the other small exchanges of [`super::agree`].
    Agreement,
    /// A user's `all_reduce` launched on its own ([`Purpose::user_launch`]).
    User,
}

impl Purpose {
    /// The purpose of launch index `collective`.
    pub fn of(collective: u32) -> Purpose {
        use super::agree::{AGREEMENT_IDS, WEIGHT_BROADCAST};
        match collective {
            c if c > *AGREEMENT_IDS.end() => Purpose::User,
            c if AGREEMENT_IDS.contains(&c) => Purpose::Agreement,
            c if c >= WEIGHT_BROADCAST => Purpose::WeightBroadcast,
            c if c >= super::probe::LINK_PROBE => Purpose::LinkProbe,
            _ => Purpose::Plan,
        }
    }

    /// The launch index of a rank's `n`-th user all-reduce launched on its own: counting down
    /// from the top of the range and wrapping within it, so it never leaves [`Purpose::User`].
    pub fn user_launch(n: u64) -> u32 {
        let window = u64::from(u32::MAX - *super::agree::AGREEMENT_IDS.end());
        u32::MAX - (n % window) as u32
    }
}

impl CollectiveDesc {
    /// The all-reduce of bucket `bucket`, launched as collective `bucket`, naming no parameter
    /// (benches and tests of a communicator).
    pub fn of_bucket(bucket: u32, op: ReduceOp, dtype: DType, count: u64) -> Self {
        CollectiveDesc {
            collective: bucket,
            bucket: Some(bucket),
            op,
            dtype,
            count,
            params: Vec::new(),
        }
    }

    /// What it is for, from its launch index.
    pub fn purpose(&self) -> Purpose {
        Purpose::of(self.collective)
    }
}

impl fmt::Display for CollectiveDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.purpose() {
            Purpose::Agreement => {
                return write!(
                    f,
                    "{} ({}×{})",
                    super::agree::agreement_exchange(self.collective),
                    self.dtype,
                    self.count
                );
            }
            Purpose::WeightBroadcast => {
                return write!(
                    f,
                    "the initial-weight broadcast, bucket {} ({}×{}, {} params from {})",
                    self.bucket.unwrap_or(0),
                    self.dtype,
                    self.count,
                    self.params.len(),
                    self.params.first().map_or("nothing", String::as_str)
                );
            }
            Purpose::LinkProbe => {
                return write!(f, "the link probe ({}×{})", self.dtype, self.count);
            }
            Purpose::User => {
                return write!(
                    f,
                    "a user all-reduce ({} {}×{})",
                    self.op.name(),
                    self.dtype,
                    self.count
                );
            }
            Purpose::Plan => {}
        }
        match self.bucket {
            Some(b) => write!(f, "all-reduce #{} (bucket b{b}", self.collective)?,
            None => write!(f, "all-reduce #{} (", self.collective)?,
        }
        if self.bucket.is_some() {
            f.write_str(", ")?;
        }
        write!(f, "{} {}×{}", self.op.name(), self.dtype, self.count)?;
        match self.params.as_slice() {
            [] => {}
            [p] => write!(f, ", param {p}")?,
            [a, .., z] => write!(f, ", {} params {a} … {z}", self.params.len())?,
        }
        f.write_str(")")
    }
}

/// A failed collective.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CommError {
    /// Not every rank arrived within the timeout.
    #[error(
        "rank {rank}: {what} timed out after {waited:?}; {}",
        if missing.is_empty() {
            "the transport does not say which rank is late".to_string()
        } else {
            format!("ranks {missing:?} never arrived")
        }
    )]
    Timeout {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        what: CollectiveDesc,
        /// How long it waited.
        waited: Duration,
        /// Ranks that had not arrived.
        missing: Vec<usize>,
    },
    /// Ranks called different collectives at the same point of the sequence.
    #[error(
        "rank {rank}: collective mismatch: rank {rank} called {mine}, rank {other_rank} called {theirs}"
    )]
    Mismatch {
        /// The rank reporting.
        rank: usize,
        /// What this rank called.
        mine: CollectiveDesc,
        /// The first other rank that disagrees.
        other_rank: usize,
        /// What it called.
        theirs: CollectiveDesc,
    },
    /// The ranks compiled different plans: caught before the plan's first collective.
    #[error(
        "rank {rank}: the ranks' plans differ at collective call {index}: rank {rank} would launch {}, rank {other_rank} would launch {}{}",
        mine.as_ref().map_or("nothing".to_string(), |d| d.to_string()),
        theirs.as_ref().map_or("nothing".to_string(), |d| d.to_string()),
        first_member_difference(mine.as_ref(), theirs.as_ref())
    )]
    PlanMismatch {
        /// The rank reporting.
        rank: usize,
        /// Position of the first differing call in launch order.
        index: usize,
        /// This rank's call there (none: its plan is shorter).
        mine: Option<CollectiveDesc>,
        /// The first rank that differs.
        other_rank: usize,
        /// That rank's call there, its parameters included.
        theirs: Option<CollectiveDesc>,
    },
    /// The group was aborted by a rank's failure; this rank's collective did not run.
    #[error("rank {rank}: {what} aborted: {reason}")]
    Aborted {
        /// The rank reporting.
        rank: usize,
        /// The collective that did not run.
        what: CollectiveDesc,
        /// Why the group was aborted (the first failure).
        reason: String,
    },
    /// The collective failed on this rank: the transport reported an error (NCCL's, on the
    /// call or asynchronously while waiting), or the device did (reading the bucket, or the
    /// stream). The rank is aborted: later collectives fail with [`CommError::Aborted`].
    #[error("rank {rank}: {what} failed: {why}")]
    Failed {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        what: CollectiveDesc,
        /// The transport's error.
        why: String,
    },
    /// The communicator cannot do this collective.
    #[error("rank {rank}: {what}: {why}")]
    Unsupported {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        what: CollectiveDesc,
        /// Why.
        why: String,
    },
    /// The communicator's stream is gone (closed, or its thread died).
    #[error("rank {rank}: {what}: the communicator was closed")]
    Closed {
        /// The rank reporting.
        rank: usize,
        /// The collective.
        what: CollectiveDesc,
    },
}

/// When a collective ran on the communication stream.
#[derive(Clone, Copy, Debug)]
pub struct CommSpan {
    /// It started (every rank had arrived).
    pub start: Instant,
    /// It finished on this rank.
    pub end: Instant,
    /// The last rank joined it, where the communicator sees that moment itself (in-process:
    /// the last arrival, under the group's lock; TCP: the last peer's header read on rank 0,
    /// and on a peer rank 0's word of how long before its answer that was); `None` where it
    /// cannot tell (NCCL). From here to `end` is what the link took, without the wait for a
    /// late rank.
    pub joined: Option<Instant>,
    /// CPU time the communicator's thread spent on it, µs: what it took from whatever else
    /// runs on the same cores (0 where the communicator cannot tell, or spends none worth
    /// counting: NCCL's work is on the GPU).
    pub cpu_us: f64,
}

impl CommSpan {
    /// From `start` to now, with the CPU time this thread used since `cpu_start` (a
    /// [`thread_cpu_us`] reading).
    pub fn until_now(start: Instant, cpu_start: Option<f64>) -> Self {
        Self::joined_until_now(start, None, cpu_start)
    }

    /// [`CommSpan::until_now`], knowing when the last rank joined.
    pub fn joined_until_now(
        start: Instant,
        joined: Option<Instant>,
        cpu_start: Option<f64>,
    ) -> Self {
        let cpu_us = match (cpu_start, thread_cpu_us()) {
            (Some(a), Some(b)) => (b - a).max(0.0),
            _ => 0.0,
        };
        CommSpan {
            start,
            end: Instant::now(),
            joined,
            cpu_us,
        }
    }
}

/// The CPU time the calling thread has used so far, µs; `None` where the platform does not say.
pub fn thread_cpu_us() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
        let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        (r == 0).then(|| ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The outcome a communicator sends back for one collective: the reduced buffer (host memory
/// by default; a [`DeviceBucket`] for a collective reduced in place on the device).
pub type CommResult<T = HostBuffer> = Result<(T, CommSpan), CommError>;

/// How long a caller waits for a pending collective whose communicator bounds each collective
/// by `timeout` from its start: long enough that the communicator's own, more precise error
/// (which ranks never arrived) comes first, with room for a collective queued ahead.
pub fn wait_bound(timeout: Duration) -> Duration {
    timeout.saturating_mul(2) + Duration::from_secs(1)
}

/// How a thread that polls for a device event (a collective's completion) waits between polls:
/// it yields for the first [`PollBackoff::SPIN`] of the wait, so a collective that ends within
/// it is seen at once, then sleeps, from 10 µs doubling up to 50 µs. A plain sleep between
/// polls adds about half a sleep, plus the kernel's timer slack (50 µs by default on Linux), to
/// every wait, and a step that waits for its buckets feels it on a step of a millisecond.
// Only the NCCL communicator polls a device (feature `cuda`); its test runs everywhere.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct PollBackoff {
    start: Instant,
    sleep: Duration,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl PollBackoff {
    /// How long a wait yields before it sleeps.
    pub(crate) const SPIN: Duration = Duration::from_micros(100);
    const FIRST_SLEEP: Duration = Duration::from_micros(10);
    const MAX_SLEEP: Duration = Duration::from_micros(50);

    /// A wait that starts now.
    pub(crate) fn new() -> Self {
        Self::starting(Instant::now())
    }

    fn starting(start: Instant) -> Self {
        PollBackoff {
            start,
            sleep: Self::FIRST_SLEEP,
        }
    }

    /// Waits before the next poll.
    pub(crate) fn pause(&mut self) {
        match self.next(Instant::now()) {
            None => std::thread::yield_now(),
            Some(d) => std::thread::sleep(d),
        }
    }

    /// How long to sleep before the next poll at `now` (`None`: only yield).
    fn next(&mut self, now: Instant) -> Option<Duration> {
        if now.saturating_duration_since(self.start) < Self::SPIN {
            return None;
        }
        let d = self.sleep;
        self.sleep = (d * 2).min(Self::MAX_SLEEP);
        Some(d)
    }
}

/// A collective in flight.
pub struct PendingReduce<T = HostBuffer> {
    rank: usize,
    what: CollectiveDesc,
    rx: mpsc::Receiver<CommResult<T>>,
}

impl<T> PendingReduce<T> {
    /// A pending collective whose result arrives on `rx`.
    pub fn new(rank: usize, what: CollectiveDesc, rx: mpsc::Receiver<CommResult<T>>) -> Self {
        PendingReduce { rank, what, rx }
    }

    /// A collective that already finished.
    pub fn finished(rank: usize, what: CollectiveDesc, result: CommResult<T>) -> Self {
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(result);
        PendingReduce { rank, what, rx }
    }

    /// What is in flight.
    pub fn desc(&self) -> &CollectiveDesc {
        &self.what
    }

    /// The result when it is in, without waiting; `None` while the collective runs.
    pub fn try_take(&self) -> Option<CommResult<T>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(CommError::Closed {
                rank: self.rank,
                what: self.what.clone(),
            })),
        }
    }

    /// Waits for the reduced buffer, at most `timeout`.
    pub fn wait(self, timeout: Duration) -> CommResult<T> {
        let t0 = Instant::now();
        match self.rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(CommError::Timeout {
                rank: self.rank,
                what: self.what,
                waited: t0.elapsed(),
                missing: Vec::new(),
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(CommError::Closed {
                rank: self.rank,
                what: self.what,
            }),
        }
    }
}

/// What [`Communicator::all_reduce_device`] did with a packed device bucket.
pub enum DeviceLaunch {
    /// Enqueued, to be reduced in place in device memory; the bucket comes back reduced.
    Launched(PendingReduce<Box<dyn DeviceBucket>>),
    /// This communicator does not reduce that device's memory: the bucket is handed back, for
    /// the caller to pass to [`Communicator::all_reduce_read`].
    Declined(Box<dyn DeviceBucket>),
}

/// A rank's part of a collective, as queued on its communicator's stream.
pub(crate) enum Contribution {
    /// Host memory.
    Host(HostBuffer),
    /// A bucket in device memory that the communicator does not reduce in place: its thread
    /// reads it into host memory first ([`Contribution::into_host`]), so the thread that
    /// packed it goes on.
    Device(Box<dyn DeviceBucket>),
}

impl Contribution {
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Contribution::Host(b) => b.dtype(),
            Contribution::Device(b) => b.dtype(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Contribution::Host(b) => b.len(),
            Contribution::Device(b) => b.len(),
        }
    }

    /// The contribution in host memory: a device bucket is read now, on the calling thread
    /// (the communicator's). The device orders the read after the kernel that packed it; a
    /// failed read is [`CommError::Failed`].
    pub(crate) fn into_host(
        self,
        rank: usize,
        what: &CollectiveDesc,
    ) -> Result<HostBuffer, CommError> {
        match self {
            Contribution::Host(b) => Ok(b),
            Contribution::Device(b) => b.read().map_err(|e| CommError::Failed {
                rank,
                what: what.clone(),
                why: e.to_string(),
            }),
        }
    }
}

/// A collective queued on a communicator's stream (its thread).
pub(crate) struct Job {
    /// This rank's part.
    pub contribution: Contribution,
    /// What it is.
    pub what: CollectiveDesc,
    /// Where the outcome goes.
    pub reply: mpsc::Sender<CommResult>,
}

/// One rank's end of a communication group.
pub trait Communicator: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Enqueues an all-reduce of `buffer` (the whole buffer is reduced; its length and dtype must
    /// match `what`). `ReduceOp::Mean` divides every contribution by the group size before the
    /// sum, as NCCL's average does.
    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError>;
    /// Opens (`true`) or closes (`false`) a group: the collectives enqueued in between launch
    /// together, as one `ncclGroupStart`/`ncclGroupEnd` on NCCL. The executor brackets the
    /// calls of one plan collective, so every rank groups the same calls. Default: nothing.
    fn group(&self, open: bool) {
        let _ = open;
    }
    /// Whether [`Communicator::all_reduce_device`] may reduce device memory in place (else it
    /// always declines). The executor copies a device gradient that has an all-reduce of its
    /// own into a bucket only for such a communicator.
    fn reduces_device_memory(&self) -> bool {
        false
    }
    /// Enqueues an all-reduce of a bucket packed in device memory, in place, when this
    /// communicator reduces that device's memory (NCCL on the bucket's GPU); otherwise hands
    /// it back ([`DeviceLaunch::Declined`], the default). Same ordering, op and checks as
    /// [`Communicator::all_reduce`].
    fn all_reduce_device(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<DeviceLaunch, CommError> {
        let _ = what;
        Ok(DeviceLaunch::Declined(bucket))
    }
    /// Enqueues an all-reduce of a device bucket that [`Communicator::all_reduce_device`]
    /// declined: it is read into host memory and reduced as by [`Communicator::all_reduce`].
    /// The host communicators read it on their own thread, in queue order, so the caller (the
    /// backward pass that packed it) goes on queueing work instead of waiting for the device.
    /// Default: reads it on the caller's thread, then [`Communicator::all_reduce`].
    fn all_reduce_read(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        let buffer = Contribution::Device(bucket).into_host(self.rank(), &what)?;
        self.all_reduce(buffer, what)
    }
    /// Fails the group: every rank's pending and future collectives return
    /// [`CommError::Aborted`] with `reason`, instead of waiting for this rank.
    fn abort(&self, reason: &str);
}

/// A boxed communicator is one (so wrappers such as [`Recording`](super::recording::Recording)
/// take one).
impl<C: Communicator + ?Sized> Communicator for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world(&self) -> usize {
        (**self).world()
    }
    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        (**self).all_reduce(buffer, what)
    }
    fn group(&self, open: bool) {
        (**self).group(open)
    }
    fn reduces_device_memory(&self) -> bool {
        (**self).reduces_device_memory()
    }
    fn all_reduce_device(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<DeviceLaunch, CommError> {
        (**self).all_reduce_device(bucket, what)
    }
    fn all_reduce_read(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        (**self).all_reduce_read(bucket, what)
    }
    fn abort(&self, reason: &str) {
        (**self).abort(reason)
    }
}

/// Where two calls' ordered member lists first differ, for [`CommError::PlanMismatch`]: the
/// parameter each side has there (empty when the lists agree or either call is missing).
fn first_member_difference(
    mine: Option<&CollectiveDesc>,
    theirs: Option<&CollectiveDesc>,
) -> String {
    let (Some(a), Some(b)) = (mine, theirs) else {
        return String::new();
    };
    let none = "nothing";
    (0..a.params.len().max(b.params.len()))
        .find(|i| a.params.get(*i) != b.params.get(*i))
        .map_or(String::new(), |i| {
            format!(
                "; member {i} is {} here and {} there",
                a.params.get(i).map_or(none, String::as_str),
                b.params.get(i).map_or(none, String::as_str)
            )
        })
}

#[cfg(test)]
mod purpose_tests {
    use super::*;

    fn desc(collective: u32) -> CollectiveDesc {
        CollectiveDesc {
            collective,
            bucket: None,
            op: ReduceOp::Sum,
            dtype: DType::F32,
            count: 3,
            params: Vec::new(),
        }
    }

    #[test]
    fn every_launch_index_has_one_purpose_and_user_launches_stay_in_theirs() {
        assert_eq!(desc(0).purpose(), Purpose::Plan);
        assert_eq!(
            desc(super::super::probe::LINK_PROBE).purpose(),
            Purpose::LinkProbe
        );
        assert_eq!(
            desc(super::super::agree::WEIGHT_BROADCAST + 7).purpose(),
            Purpose::WeightBroadcast
        );
        let agreement = super::super::agree::AGREEMENT_IDS;
        assert_eq!(desc(*agreement.start()).purpose(), Purpose::Agreement);
        assert_eq!(desc(*agreement.end()).purpose(), Purpose::Agreement);
        // A long job's millions of metric all-reduces never reach the agreement's indices.
        for n in [0u64, 1, 999_994, 999_995, 5_000_000, u64::MAX] {
            let c = Purpose::user_launch(n);
            assert_eq!(Purpose::of(c), Purpose::User, "{n} → {c}");
        }
        assert_eq!(Purpose::user_launch(0), u32::MAX);
        assert_ne!(Purpose::user_launch(1), Purpose::user_launch(2));
        assert_eq!(
            desc(Purpose::user_launch(0)).to_string(),
            "a user all-reduce (sum f32×3)"
        );
        assert!(desc(*agreement.start()).to_string().contains("agreement"));
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    #[test]
    fn a_poll_yields_first_then_sleeps_longer_up_to_its_cap() {
        let t0 = Instant::now();
        let mut b = PollBackoff::starting(t0);
        let at = |us: u64| t0 + Duration::from_micros(us);
        assert_eq!(b.next(at(0)), None);
        assert_eq!(b.next(at(99)), None);
        let sleeps: Vec<u64> = (0..5)
            .map(|i| b.next(at(100 + i)).unwrap().as_micros() as u64)
            .collect();
        assert_eq!(sleeps, [10, 20, 40, 50, 50]);
    }
}

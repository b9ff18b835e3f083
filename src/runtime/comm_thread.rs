//! The shell every communicator runs its collectives in.
//!
//! A communicator's collectives run on one thread of its own, in the order they were queued
//! (its "stream", as a CUDA stream orders NCCL calls): `CommThread` is that thread and its
//! queue. A job queued after the thread closed or died is [`CommError::Closed`]; dropping the
//! shell closes the queue and joins the thread, so the jobs already queued finish (each bounded
//! by its communicator's timeout) before the communicator is gone.
//!
//! The host communicators (in-process, TCP) differ only in how a collective crosses ranks, so
//! they are one type, [`QueuedComm`], over the state their threads share ([`GroupState`]: how to
//! fail the group, what to do when a rank closes). NCCL queues jobs of its own (device buckets,
//! group markers) on the same `CommThread`.

use std::sync::{Arc, mpsc};
use std::thread;

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, Communicator, Contribution, Job, PendingReduce};
use super::grad::DeviceBucket;

/// One communicator's thread and the queue that feeds it.
pub(crate) struct CommThread<J> {
    rank: usize,
    tx: Option<mpsc::Sender<J>>,
    handle: Option<thread::JoinHandle<()>>,
}

impl<J: Send + 'static> CommThread<J> {
    /// Starts thread `name` for `rank`; `body` takes the jobs, in order, until the queue closes.
    pub(crate) fn spawn(
        rank: usize,
        name: String,
        body: impl FnOnce(mpsc::Receiver<J>) + Send + 'static,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let handle = thread::Builder::new().name(name).spawn(move || body(rx))?;
        Ok(CommThread {
            rank,
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    /// Lets the thread go without waiting for it (it ends when its queue closes, now): for a
    /// thread stuck in something that has no bound of its own, such as a start-up that a peer
    /// never completes.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn detach(mut self) {
        self.tx.take();
        self.handle.take();
    }

    /// Queues `job`; `false` when the thread is closed or gone.
    pub(crate) fn send(&self, job: J) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(job).is_ok())
    }

    /// Checks that `contribution` is what `what` says (dtype, count), queues it and returns the
    /// pending collective; a closed or dead thread is [`CommError::Closed`].
    pub(crate) fn queue(
        &self,
        contribution: Contribution,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError>
    where
        J: From<Job>,
    {
        let rank = self.rank;
        if contribution.dtype() != what.dtype || contribution.len() as u64 != what.count {
            let kind = match contribution {
                Contribution::Host(_) => "buffer",
                Contribution::Device(_) => "bucket",
            };
            let why = format!(
                "the {kind} is {}[{}]",
                contribution.dtype(),
                contribution.len()
            );
            return Err(CommError::Unsupported { rank, what, why });
        }
        let (reply, rx) = mpsc::channel();
        let job = Job {
            contribution,
            what: what.clone(),
            reply,
        };
        if self.send(job.into()) {
            Ok(PendingReduce::new(rank, what, rx))
        } else {
            Err(CommError::Closed { rank, what })
        }
    }
}

impl<J> Drop for CommThread<J> {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// What a host communicator's ranks share: how the group fails, and what a rank's close does.
pub trait GroupState: Send + Sync + 'static {
    /// Fails the group: every rank's pending and later collectives end with `reason`.
    fn abort(&self, reason: String);
    /// `rank` aborts the group for `reason`, its own failure (called before [`abort`]): a
    /// group whose other ranks live in other processes tells them why. Default: nothing (the
    /// ranks share this state).
    ///
    /// [`abort`]: GroupState::abort
    fn rank_aborts(&self, rank: usize, reason: &str) {
        let _ = (rank, reason);
    }
    /// `rank` closes, before its queued collectives are finished. Default: nothing.
    fn closing(&self, rank: usize) {
        let _ = rank;
    }
    /// `rank` closed: its thread has finished every queued collective. Default: nothing.
    fn closed(&self, rank: usize) {
        let _ = rank;
    }
}

/// One rank of a host communicator: its thread runs the collectives queued on it (device
/// buckets are read into host memory there, in queue order), and the group state `G` says how
/// a collective crosses ranks. [`InProcessComm`](super::inprocess::InProcessComm) and
/// [`TcpComm`](super::tcp::TcpComm) are this type.
pub struct QueuedComm<G: GroupState> {
    rank: usize,
    world: usize,
    group: Arc<G>,
    /// Taken (closed and joined) in `Drop`, between `closing` and `closed`.
    thread: Option<CommThread<Job>>,
}

impl<G: GroupState> QueuedComm<G> {
    /// `rank` of `world`, its collectives run by `thread` over `group`.
    pub(crate) fn new(rank: usize, world: usize, group: Arc<G>, thread: CommThread<Job>) -> Self {
        QueuedComm {
            rank,
            world,
            group,
            thread: Some(thread),
        }
    }

    fn queue(
        &self,
        contribution: Contribution,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        match &self.thread {
            Some(t) => t.queue(contribution, what),
            None => Err(CommError::Closed {
                rank: self.rank,
                what,
            }),
        }
    }
}

impl<G: GroupState> Communicator for QueuedComm<G> {
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
        self.queue(Contribution::Host(buffer), what)
    }

    fn all_reduce_read(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        self.queue(Contribution::Device(bucket), what)
    }

    fn abort(&self, reason: &str) {
        self.group.rank_aborts(self.rank, reason);
        self.group
            .abort(format!("rank {} aborted the group: {reason}", self.rank));
    }
}

impl<G: GroupState> Drop for QueuedComm<G> {
    fn drop(&mut self) {
        self.group.closing(self.rank);
        self.thread.take();
        self.group.closed(self.rank);
    }
}

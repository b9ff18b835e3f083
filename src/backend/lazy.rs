//! Lazy tensors of `Collective<I>`: an op records a node and returns a handle at once; the inner
//! backend runs it later, when something needs the value.
//!
//! Requires: ops are pure (a node's closure computes its result from its inputs and arguments
//! only), and a node's inputs were recorded before it.
//!
//! Guarantees:
//! - Every rank has a [`Recorder`]: a queue of the nodes it recorded, in record order, each
//!   marked with the thread that recorded it. Forcing a node first runs, oldest first, every
//!   earlier node the forcing thread recorded and every queued node those (and the forced one)
//!   read, so the inner backend sees each thread's ops in the order the thread issued them (as
//!   a stream would), and a closure's inputs are already computed when it runs: forcing never
//!   recurses deeper than one level, however long the chain.
//! - A node runs on the thread that recorded it unless another thread needs its value first.
//!   Threads that share a rank (a device used from several threads) do not run each other's
//!   ops: Burn's fusion keeps one stream per thread, and ops moved onto another thread's
//!   stream in bulk break it (wrong values, then panics inside the fusion server, in Burn's
//!   own test suite run on `Collective<Wgpu>`).
//! - A thread keeps at most a window of ops queued on a rank (64 by default,
//!   [`set_lazy_window`]); past it, the older half runs, so a device works on a step while the
//!   rest of it is recorded.
//! - A node nobody holds any more when its turn comes is skipped: its op never runs.
//! - A value is computed once. When the last handle of a computed node is consumed by an op, the
//!   value moves out instead of being cloned, so the inner backend can still work in place.
//! - A node knows its shape and dtype when its op has a rule for them (`ops/`); asking a node
//!   without one forces it.
//! - What forced the queue is counted per rank ([`lazy_stats`]), so a reader sees how lazy a
//!   step really was.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::ThreadId;

use burn_std::{DType, Shape};
use smallvec::SmallVec;

use crate::backend::rules::copy_shape;
use crate::graph::ComputeKind;

/// Ranks whose recorder sits in a fixed table; a higher rank's is in a map ([`recorder`]).
const RANKS: usize = 256;

/// Pending nodes a thread keeps on a rank by default before recording runs the older half (see
/// [`set_lazy_window`]). On an H200, a step of 12 small transformer blocks (2,246 ops) cost
/// 1.18–1.19× Burn alone with a window of the whole step (4096, the bound before) and 1.03–1.05×
/// with 64, in two runs: with the step held back, the device idles while it is recorded, and
/// Burn's own host work (autodiff's graph, the optimizer) no longer overlaps the device's.
const DEFAULT_WINDOW: usize = 64;

/// The window in force: [`DEFAULT_WINDOW`] unless [`set_lazy_window`] changed it.
static WINDOW: AtomicUsize = AtomicUsize::new(DEFAULT_WINDOW);

/// Sets how many recorded ops a thread keeps queued on a rank before the older half runs (64
/// by default, at least 2), for every rank, from the next op on. A smaller window hands work
/// to the inner backend sooner; a larger one leaves more for the `hoist-producers` rule to
/// reorder at a gradient sync. Values never depend on it: it only moves where the queue runs.
pub fn set_lazy_window(ops: usize) {
    WINDOW.store(ops.max(2), Ordering::Relaxed);
}

/// The window [`set_lazy_window`] set (64 by default).
pub fn lazy_window() -> usize {
    WINDOW.load(Ordering::Relaxed)
}

/// What made a rank's queue run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ForceReason {
    /// A value, for what is named: an op that runs eagerly, a gradient sync, a data read.
    Value(&'static str),
    /// A shape or dtype without a rule.
    Metadata,
    /// `Backend::sync`.
    Sync,
    /// The queue reached its bound.
    Bound,
}

/// Per-rank counters of the lazy recorder.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LazyStats {
    /// Ops recorded (eager ops that ran on recorded tensors included: they are logged).
    pub recorded: u64,
    /// Nodes whose op ran.
    pub executed: u64,
    /// Nodes dropped before their turn: their op never ran.
    pub skipped: u64,
    /// Forcings for a value: data reads, gradient syncs, eager ops' inputs.
    pub forced_by_value: u64,
    /// The same, by what needed the value (an eager op's name, `gradient sync`, ...).
    pub forced_by: BTreeMap<&'static str, u64>,
    /// Forcings for a shape or dtype without a rule.
    pub forced_by_metadata: u64,
    /// Forcings by `Backend::sync`.
    pub forced_by_sync: u64,
    /// Forcings because the queue was full.
    pub forced_by_bound: u64,
}

pub(crate) trait Pending: Send + Sync {
    fn run(&self) -> bool;
}

/// Entries a rank's log keeps before it drops the oldest (a program that never reaches a sync
/// point must not grow without bound).
const MAX_LOG: usize = 1 << 16;

/// What a recorded op is, for the step graph.
#[derive(Clone, Debug)]
pub(crate) struct Record {
    /// The op (`float_matmul`, `relu`, ...).
    pub op: &'static str,
    /// Its kind of work.
    pub kind: ComputeKind,
    /// The inner device, from its first input.
    pub device: AnyDevice,
    /// Result shape, when its rule knows it.
    pub shape: Option<Shape>,
    /// Result dtype, when its rule knows it.
    pub dtype: Option<DType>,
    /// Nodes it reads.
    pub inputs: SmallVec<[u64; 3]>,
    /// Estimated floating-point operations.
    pub flops: u64,
    /// Whether its result derives from a random draw (see [`CTensor::is_drawn`]).
    pub drawn: bool,
}

/// One recorded op in a rank's log.
#[derive(Clone, Debug)]
pub(crate) struct LogEntry {
    /// Its node.
    pub seq: u64,
    /// The op.
    pub op: &'static str,
    /// Its kind of work.
    pub kind: ComputeKind,
    /// Nodes it reads (only those recorded).
    pub inputs: SmallVec<[u64; 3]>,
    /// Result shape, if known.
    pub shape: Option<Shape>,
    /// Result dtype, if known.
    pub dtype: Option<DType>,
    /// Estimated floating-point operations.
    pub flops: u64,
}

/// A queued node: its number, the thread that recorded it, and the node (gone once nobody holds
/// it).
struct Queued {
    seq: u64,
    thread: ThreadId,
    node: Weak<dyn Pending>,
}

struct Queue {
    pending: VecDeque<Queued>,
    /// Queued nodes per recording thread (the bound applies to each thread's own).
    per_thread: hashbrown::HashMap<ThreadId, usize>,
    log: VecDeque<LogEntry>,
    /// The nodes whose op ran, in the order they ran (at most [`MAX_LOG`]; none while nobody
    /// reads the log).
    ran: VecDeque<u64>,
    /// Servers that read this rank's log at their sync points ([`LogReaders`]). With none, the
    /// log keeps only the entries of queued nodes, which the queue's own walks read.
    readers: usize,
    /// The rank's counters (under the queue's lock: a run takes one lock to note what ran).
    stats: LazyStats,
}

/// What a rank recorded and ran since the last [`take_log`].
pub(crate) struct StepLog {
    /// The recorded ops, oldest first.
    pub entries: Vec<LogEntry>,
    /// The nodes whose op ran, in the order they ran.
    pub ran: Vec<u64>,
}

impl Queue {
    /// The log entry of node `s`, if the log still describes it.
    fn entry(&self, s: u64) -> Option<&LogEntry> {
        let first = self.log.front()?.seq;
        let i = usize::try_from(s.checked_sub(first)?).ok()?;
        self.log.get(i).filter(|e| e.seq == s)
    }

    /// The first `upto` queued nodes that are among `roots` or that those read, directly or not
    /// (by the log): `None` when one of them is a node the log no longer describes.
    fn queued_inputs(
        &self,
        upto: usize,
        roots: impl IntoIterator<Item = u64>,
    ) -> Option<hashbrown::HashSet<u64>> {
        let queued: hashbrown::HashSet<u64> =
            self.pending.iter().take(upto).map(|p| p.seq).collect();
        let mut found = hashbrown::HashSet::new();
        let mut stack: Vec<u64> = roots.into_iter().collect();
        while let Some(s) = stack.pop() {
            if !queued.contains(&s) || !found.insert(s) {
                continue;
            }
            stack.extend(self.entry(s)?.inputs.iter().copied());
        }
        Some(found)
    }

    /// Drops the log's entries of nodes older than the oldest queued one (all of them when
    /// none is queued): what a rank nobody reads keeps is what the dependency walks of
    /// `run_until` and `run_producers` read, the entries of queued nodes.
    fn forget_unqueued(&mut self) {
        let oldest = self.pending.front().map(|p| p.seq);
        while self
            .log
            .front()
            .is_some_and(|e| oldest.is_none_or(|o| e.seq < o))
        {
            self.log.pop_front();
        }
    }

    /// Takes the queued nodes in `set` off the queue, oldest first.
    fn take(&mut self, set: &hashbrown::HashSet<u64>) -> Vec<Queued> {
        let (picked, kept): (VecDeque<Queued>, VecDeque<Queued>) =
            self.pending.drain(..).partition(|p| set.contains(&p.seq));
        self.pending = kept;
        self.uncount(picked.into())
    }

    /// Takes the first `n` queued nodes off the queue.
    fn take_first(&mut self, n: usize) -> Vec<Queued> {
        let picked = self.pending.drain(..n).collect();
        self.uncount(picked)
    }

    /// `taken`, counted off their threads' queued nodes (one map update per run of nodes of
    /// one thread, which is most often all of them).
    fn uncount(&mut self, taken: Vec<Queued>) -> Vec<Queued> {
        for run in taken.chunk_by(|a, b| a.thread == b.thread) {
            let thread = run[0].thread;
            if let Some(c) = self.per_thread.get_mut(&thread) {
                *c -= run.len();
                if *c == 0 {
                    self.per_thread.remove(&thread);
                }
            }
        }
        taken
    }
}

/// One rank's queue of recorded nodes, and its log since the last sync point.
pub(crate) struct Recorder {
    next: AtomicU64,
    queue: Mutex<Queue>,
}

/// The calling thread's id, read once per thread (`thread::current()` costs a reference count
/// each call, and every recorded op asks).
fn this_thread() -> ThreadId {
    thread_local! {
        static ME: ThreadId = std::thread::current().id();
    }
    // A thread-local destructor that records (after `ME` is gone) asks the slow way.
    ME.try_with(|me| *me)
        .unwrap_or_else(|_| std::thread::current().id())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Recorder {
    fn new() -> Self {
        Recorder {
            next: AtomicU64::new(0),
            queue: Mutex::new(Queue {
                pending: VecDeque::new(),
                per_thread: hashbrown::HashMap::new(),
                log: VecDeque::new(),
                ran: VecDeque::new(),
                readers: 0,
                stats: LazyStats::default(),
            }),
        }
    }

    /// Runs, oldest first, the queued nodes up to sequence number `seq` that the calling thread
    /// recorded, and those they and `seq` read (directly or not, by the log) that other threads
    /// recorded. Another thread's other nodes stay queued for it: a node runs on the thread that
    /// recorded it unless a value it computes is needed sooner elsewhere, so an inner backend
    /// that keeps a stream per thread (Burn's fusion) sees each thread's ops on its own stream.
    /// When the log no longer describes a node involved, everything up to `seq` runs.
    fn run_until(&self, seq: u64, why: ForceReason) {
        let me = this_thread();
        let picked = {
            let mut q = lock(&self.queue);
            let upto = q.pending.iter().take_while(|p| p.seq <= seq).count();
            if q.pending.iter().take(upto).all(|p| p.thread == me) {
                q.take_first(upto)
            } else {
                let roots = q
                    .pending
                    .iter()
                    .take(upto)
                    .filter(|p| p.thread == me)
                    .map(|p| p.seq)
                    .chain([seq]);
                match q.queued_inputs(upto, roots) {
                    Some(needed) => q.take(&needed),
                    None => q.take_first(upto),
                }
            }
        };
        self.run_nodes(picked, why);
    }

    /// Runs `nodes` in turn (a node nobody holds is skipped), and counts them for `why`.
    fn run_nodes(&self, nodes: Vec<Queued>, why: ForceReason) {
        let mut ran = Vec::with_capacity(nodes.len());
        let mut skipped = 0;
        for p in nodes {
            match p.node.upgrade() {
                Some(n) => {
                    if n.run() {
                        ran.push(p.seq);
                    }
                }
                None => skipped += 1,
            }
        }
        self.count(ran, skipped, why);
    }

    /// Runs the queued producers of node `seq` (itself and the queued nodes it reads, directly
    /// or not, by the log), oldest first, and leaves the calling thread's other queued nodes up
    /// to `seq` queued, when the bytes of the distinct recorded values those read or produce are
    /// at most `max_bytes`; otherwise runs what [`Self::run_until`] runs. The rule of the
    /// `hoist-producers` pass (`passes/hoist_producers.rs`), applied as a gradient is forced. A
    /// queued node the log no longer describes cannot be told apart, so it runs in order.
    fn run_producers(&self, seq: u64, max_bytes: u64, why: ForceReason) {
        let me = this_thread();
        let picked = {
            let mut q = lock(&self.queue);
            let upto = q.pending.iter().take_while(|p| p.seq <= seq).count();
            q.queued_inputs(upto, [seq]).and_then(|producers| {
                let mut seen: hashbrown::HashSet<u64> = hashbrown::HashSet::new();
                let mut bytes = 0u64;
                let mut deferred = 0;
                for p in q.pending.iter().take(upto) {
                    if producers.contains(&p.seq) || p.thread != me {
                        continue;
                    }
                    deferred += 1;
                    let e = q.entry(p.seq)?;
                    for v in std::iter::once(p.seq).chain(e.inputs.iter().copied()) {
                        if let Some(ve) = q.entry(v)
                            && seen.insert(v)
                        {
                            let b = super::record::entry_type(ve)
                                .checked_bytes()
                                .unwrap_or(u64::MAX);
                            bytes = bytes.saturating_add(b);
                        }
                    }
                }
                (deferred > 0 && bytes <= max_bytes).then(|| q.take(&producers))
            })
        };
        match picked {
            Some(picked) => self.run_nodes(picked, why),
            None => self.run_until(seq, why),
        }
    }

    /// Notes nodes that ran and were skipped for `why`.
    fn count(&self, ran: Vec<u64>, skipped: u64, why: ForceReason) {
        if ran.is_empty() && skipped == 0 {
            return;
        }
        let mut q = lock(&self.queue);
        let executed = ran.len() as u64;
        if q.readers > 0 {
            for s in ran {
                if q.ran.len() == MAX_LOG {
                    q.ran.pop_front();
                }
                q.ran.push_back(s);
            }
        }
        let st = &mut q.stats;
        st.executed += executed;
        st.skipped += skipped;
        match why {
            ForceReason::Value(what) => {
                st.forced_by_value += 1;
                *st.forced_by.entry(what).or_default() += 1;
            }
            ForceReason::Metadata => st.forced_by_metadata += 1,
            ForceReason::Sync => st.forced_by_sync += 1,
            ForceReason::Bound => st.forced_by_bound += 1,
        }
    }

    /// Numbers, builds and logs a node in `state`, and queues it when that state is pending.
    /// The node is built under the queue's lock, so no thread can take it off the queue
    /// half-made, and numbers are queued in order. The node, its closure and later its value
    /// share one allocation; what does not depend on the closure's type is [`Self::enqueue`].
    fn push<P, F>(&self, rec: Record, state: Stage<P, F>) -> Arc<DynNode<P>>
    where
        P: Clone + Send + 'static,
        F: FnOnce() -> P + Send + 'static,
    {
        let pending = matches!(state, Stage::Pending(_));
        let Record {
            op,
            kind,
            device,
            shape,
            dtype,
            inputs,
            flops,
            drawn: _,
        } = rec;
        let (node, upto) = {
            let mut q = lock(&self.queue);
            let seq = self.next.fetch_add(1, Ordering::Relaxed);
            let node = Arc::new(Node {
                seq,
                op,
                device,
                shape: shape.as_ref().map(copy_shape),
                dtype,
                state: Mutex::new(state),
            });
            let weak = pending.then(|| Arc::downgrade(&node) as Weak<dyn Pending>);
            let entry = LogEntry {
                seq,
                op,
                kind,
                inputs,
                shape,
                dtype,
                flops,
            };
            let own = Self::enqueue(&mut q, entry, weak);
            // Past the bound, the older part of this thread's own queued nodes runs, up to its
            // own node half a window back: a number counted back over every thread's nodes
            // could name another thread's node, which would then run on this thread (on its
            // fusion stream, in Burn's case).
            let window = lazy_window();
            let upto = (own > window)
                .then(|| {
                    let me = this_thread();
                    let mine = q.pending.iter().filter(|p| p.thread == me);
                    mine.map(|p| p.seq).nth(own - window / 2 - 1)
                })
                .flatten();
            (node, upto)
        };
        if let Some(upto) = upto {
            self.run_until(upto, ForceReason::Bound);
        }
        node
    }

    /// Queues the node of `entry` (when `node` is given: it is pending) and logs it; the
    /// calling thread's queued nodes on this rank after it (0 when not queued).
    fn enqueue(q: &mut Queue, entry: LogEntry, node: Option<Weak<dyn Pending>>) -> usize {
        let seq = entry.seq;
        let own = match node {
            Some(node) => {
                let me = this_thread();
                q.pending.push_back(Queued {
                    seq,
                    thread: me,
                    node,
                });
                let own = q.per_thread.entry(me).or_default();
                *own += 1;
                *own
            }
            None => 0,
        };
        if q.readers == 0 {
            // Nodes dropped before their turn would be skipped when their turn came; at the
            // front of the queue they would hold the log below from another thread that
            // never comes back (a worker that made tensors and ended), so they go now.
            let dead = q
                .pending
                .iter()
                .take_while(|p| p.node.strong_count() == 0)
                .count();
            if dead > 0 {
                q.take_first(dead);
                q.stats.skipped += dead as u64;
            }
            q.forget_unqueued();
        }
        if q.log.len() == MAX_LOG {
            q.log.pop_front();
        }
        q.log.push_back(entry);
        own
    }
}

/// The recorder of `rank`: ranks below [`RANKS`] from a fixed table (one atomic load), any
/// other from a map of recorders that live as long as the process (a rank of a large job that
/// runs one rank per process), so two ranks never share one.
pub(crate) fn recorder(rank: u32) -> &'static Recorder {
    static RECORDERS: [OnceLock<Recorder>; RANKS] = [const { OnceLock::new() }; RANKS];
    static HIGH: OnceLock<Mutex<hashbrown::HashMap<u32, &'static Recorder>>> = OnceLock::new();
    if let Some(r) = RECORDERS.get(rank as usize) {
        return r.get_or_init(Recorder::new);
    }
    let mut high = lock(HIGH.get_or_init(Default::default));
    high.entry(rank)
        .or_insert_with(|| Box::leak(Box::new(Recorder::new())))
}

/// The ops `rank` recorded since the last call, oldest first, and the order they ran in (at
/// most the last 65,536 of each).
pub(crate) fn take_log(rank: u32) -> StepLog {
    let mut q = lock(&recorder(rank).queue);
    // The buffers change hands (a deque that wrapped around is straightened in place): the
    // entries are not moved one by one under the lock, and the next step's log starts at the
    // size this one reached.
    let (logged, ran) = (q.log.len(), q.ran.len());
    StepLog {
        entries: std::mem::replace(&mut q.log, VecDeque::with_capacity(logged)).into(),
        ran: std::mem::replace(&mut q.ran, VecDeque::with_capacity(ran)).into(),
    }
}

/// The ranks whose logs a communication server takes at its sync points ([`take_log`]), for
/// as long as it holds this. A rank no server reads keeps no log beyond its queued nodes (a
/// program that records without a server, an evaluation loop or one device alone, holds no
/// history of its ops), and its log starts afresh when a server begins to read it.
pub(crate) struct LogReaders(Vec<u32>);

impl LogReaders {
    /// Starts reading the logs of `ranks`.
    pub(crate) fn new(ranks: impl IntoIterator<Item = u32>) -> Self {
        let ranks: Vec<u32> = ranks.into_iter().collect();
        for &r in &ranks {
            let mut q = lock(&recorder(r).queue);
            if q.readers == 0 {
                // What the rank recorded before: no step of this server's.
                q.forget_unqueued();
                q.ran.clear();
            }
            q.readers += 1;
        }
        LogReaders(ranks)
    }
}

impl Drop for LogReaders {
    fn drop(&mut self) {
        for &r in &self.0 {
            let mut q = lock(&recorder(r).queue);
            q.readers -= 1;
            if q.readers == 0 {
                q.forget_unqueued();
                q.log.shrink_to_fit();
                q.ran = VecDeque::new();
            }
        }
    }
}

/// Runs everything the calling thread recorded on `rank` so far, and what that reads
/// (`Backend::sync`).
pub(crate) fn flush(rank: u32) {
    recorder(rank).run_until(u64::MAX, ForceReason::Sync);
}

/// Runs what this thread has queued on `rank` (and the queued inputs it needs), counted as a
/// forcing for a value that `why` needs.
pub(crate) fn force_queued(rank: u32, why: &'static str) {
    recorder(rank).run_until(u64::MAX, ForceReason::Value(why));
}

/// The lazy recorder's counters of `rank` so far.
pub fn lazy_stats(rank: u32) -> LazyStats {
    let r = recorder(rank);
    let mut st = lock(&r.queue).stats.clone();
    st.recorded = r.next.load(Ordering::Relaxed);
    st
}

impl LazyStats {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &LazyStats) -> LazyStats {
        let mut forced_by = self.forced_by.clone();
        for (k, v) in &before.forced_by {
            if let Some(x) = forced_by.get_mut(k) {
                *x -= v;
            }
        }
        forced_by.retain(|_, v| *v > 0);
        LazyStats {
            recorded: self.recorded - before.recorded,
            executed: self.executed - before.executed,
            skipped: self.skipped - before.skipped,
            forced_by_value: self.forced_by_value - before.forced_by_value,
            forced_by,
            forced_by_metadata: self.forced_by_metadata - before.forced_by_metadata,
            forced_by_sync: self.forced_by_sync - before.forced_by_sync,
            forced_by_bound: self.forced_by_bound - before.forced_by_bound,
        }
    }
}

mod tensor;

pub use tensor::CTensor;
use tensor::Stage;
pub(crate) use tensor::{AnyDevice, Input};
use tensor::{DynNode, Node};

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burn_backend::TensorMetadata;
    use burn_std::{DType, Shape};

    use super::{CTensor, Record, recorder};
    use crate::backend::lazy::Input;
    use crate::backend::rules::{Rule, inputs};

    /// A tensor primitive that counts its clones.
    #[derive(Debug)]
    struct Buf(Vec<f32>, Arc<AtomicUsize>);

    impl Clone for Buf {
        fn clone(&self) -> Self {
            self.1.fetch_add(1, Ordering::Relaxed);
            Buf(self.0.clone(), Arc::clone(&self.1))
        }
    }

    impl TensorMetadata for Buf {
        fn dtype(&self) -> DType {
            DType::F32
        }
        fn shape(&self) -> Shape {
            Shape::new([self.0.len()])
        }
    }

    /// The record of an elementwise op `op` on 4 f32 elements reading `read`.
    fn record<const N: usize>(op: &'static str, read: [Input; N]) -> Record {
        Rule::elementwise(Some(Shape::new([4])), Some(DType::F32)).record(
            op,
            Arc::new(()),
            inputs(read),
        )
    }

    /// An op that consumes the last handle of a computed node gets its value moved out, not a
    /// clone (the inner backend then holds its buffer alone and can work in place); a handle
    /// that is not the last gets a clone.
    #[test]
    fn the_last_handle_of_a_computed_node_moves_its_value_out() {
        const RANK: u32 = 4093;
        let clones = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&clones);
        let a = CTensor::lazy(RANK, record("fill", []), move || Buf(vec![1.0; 4], counter));
        let b = CTensor::lazy(RANK, record("double", [a.input()]), move || {
            let mut v = a.into_inner();
            v.0.iter_mut().for_each(|x| *x *= 2.0);
            v
        });
        let kept = b.clone();
        let out = b.into_inner();
        assert_eq!(out.0, vec![2.0; 4]);
        assert_eq!(
            clones.load(Ordering::Relaxed),
            1,
            "only the shared handle clones"
        );
        let last = kept.into_inner();
        assert_eq!(last.0, vec![2.0; 4]);
        assert_eq!(
            clones.load(Ordering::Relaxed),
            1,
            "the last handle's value was cloned"
        );
        let st = super::lazy_stats(RANK);
        assert_eq!((st.recorded, st.executed, st.skipped), (2, 2, 0));
    }

    /// `n` chained ops on `rank` (each doubles the last), read at the end.
    fn chain(rank: u32, n: usize) -> Vec<f32> {
        let clones = Arc::new(AtomicUsize::new(0));
        let mut t = CTensor::lazy(rank, record("fill", []), || Buf(vec![1.0; 4], clones));
        for _ in 0..n {
            let prev = t;
            t = CTensor::lazy(rank, record("double", [prev.input()]), move || {
                let mut v = prev.into_inner();
                v.0.iter_mut().for_each(|x| *x *= 2.0);
                v
            });
        }
        t.into_inner().0
    }

    fn log_len(rank: u32) -> (usize, usize) {
        let q = super::lock(&recorder(rank).queue);
        (q.log.len(), q.ran.len())
    }

    /// A rank no server reads keeps no history of its ops, however many it records (an
    /// evaluation loop, one device without a server); a server's sync points get every op
    /// recorded since it started, and none from before.
    #[test]
    fn a_rank_keeps_a_log_only_while_a_server_reads_it() {
        const RANK: u32 = 4091;
        assert_eq!(chain(RANK, 10_000), vec![f32::INFINITY; 4]);
        let (logged, ran) = log_len(RANK);
        assert!(logged <= super::lazy_window() + 1, "{logged} entries kept");
        assert_eq!(ran, 0);
        let readers = super::LogReaders::new([RANK]);
        chain(RANK, 9);
        let log = super::take_log(RANK);
        assert_eq!(
            log.entries.len(),
            10,
            "the fill and 9 ops since the server started"
        );
        assert_eq!(log.ran.len(), 10);
        chain(RANK, 5);
        drop(readers);
        assert_eq!(log_len(RANK), (0, 0), "nothing queued, nothing kept");
    }

    /// Ops another thread recorded and dropped unread (a worker that made tensors and ended)
    /// do not keep a rank no server reads logging from them on.
    #[test]
    fn ops_a_finished_thread_dropped_unread_do_not_hold_the_log() {
        const RANK: u32 = 4089;
        std::thread::spawn(|| {
            let clones = Arc::new(AtomicUsize::new(0));
            let t = CTensor::lazy(RANK, record("fill", []), || Buf(vec![1.0; 4], clones));
            drop(CTensor::lazy(
                RANK,
                record("double", [t.input()]),
                move || t.into_inner(),
            ));
        })
        .join()
        .unwrap();
        chain(RANK, 1_000);
        let (logged, _) = log_len(RANK);
        assert!(logged <= super::lazy_window() + 1, "{logged} entries kept");
        assert_eq!(super::lazy_stats(RANK).skipped, 2);
    }

    /// Past the bound a thread runs older nodes of its own only: another thread's node queued
    /// among them, half a window back, stays queued for that thread (run here, it would land on
    /// this thread's stream of a fusing backend).
    #[test]
    fn past_the_bound_a_thread_runs_only_its_own_nodes() {
        const RANK: u32 = 4087;
        let window = super::lazy_window();
        let (ran, clones) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let fill = || {
            let c = Arc::clone(&clones);
            CTensor::lazy(RANK, record("fill", []), move || Buf(vec![1.0; 4], c))
        };
        let mut mine: Vec<_> = (0..window + 1 - window / 2).map(|_| fill()).collect();
        let (r, c) = (Arc::clone(&ran), Arc::clone(&clones));
        let other = std::thread::spawn(move || {
            CTensor::lazy(RANK, record("fill", []), move || {
                r.fetch_add(1, Ordering::Relaxed);
                Buf(vec![2.0; 4], c)
            })
        })
        .join()
        .unwrap();
        mine.extend((0..window / 2).map(|_| fill()));
        assert!(
            super::lazy_stats(RANK).executed > 0,
            "the bound ran older nodes"
        );
        assert_eq!(
            ran.load(Ordering::Relaxed),
            0,
            "the other thread's node ran here"
        );
        assert_eq!(other.into_inner().0, vec![2.0; 4]);
    }

    #[test]
    fn every_rank_has_a_recorder_of_its_own() {
        let low = recorder(3) as *const _;
        let high = recorder(3 + super::RANKS as u32) as *const _;
        assert_ne!(low, high, "ranks 256 apart share a recorder");
        assert_eq!(high, recorder(3 + super::RANKS as u32) as *const _);
        assert_ne!(high, recorder(4 + super::RANKS as u32) as *const _);
    }
}

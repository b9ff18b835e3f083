//! The per-rank state of a running communication server and its gradient path.
//!
//! Per rank, a step's `submit_gradient_sync` calls are recorded in ready order. At
//! `submit_sync_collective` the rank builds the segment's graph (a gradient and a `grad_sync`
//! per submitted tensor, one `sync`), takes its plan from the rank's plan cache (compiled once per
//! distinct segment: bucketing, fused pack/unpack, async collectives, overlap schedule), runs it on
//! the rank's communicator, and writes every reduced gradient back through Burn's `TensorRef`
//! before returning, as Burn requires. From the second step on, a step follows a plan during
//! backward (the previous step's, or the one [`super::follow`] predicts): a bucket is packed and
//! launched as its last gradient arrives.
//!
//! The hooks return nothing, so a failure (a rank that never arrives, mismatched segments, a bad
//! gradient) aborts the group, so that no other rank waits for this one, and then panics with
//! the typed error's message on the calling rank.
use std::any::{Any, TypeId};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockWriteGuard};
use std::time::Instant;

use burn_backend::Backend;
use burn_backend::distributed::{DistributedParams, TensorRef};
use hashbrown::HashMap;

use super::Collective;
use super::options::CollectiveOptions;
use super::record::StepRecord;
use super::replicas::ReplicaState;
use super::step_clock::StepClock;
use super::user_collectives::UserQueue;
use crate::codegen::plan::Plan;
use crate::graph::builder::add_gradient_sync;
use crate::graph::{Graph, Op, ReduceOp, TensorType};
use crate::runtime::cache::PlanCache;
use crate::runtime::comm::Communicator;
use crate::runtime::exec::ExecReport;
use crate::runtime::exec::{ExecOptions, Execution, Workspace};
use crate::runtime::{Grad, HostBuffer};
use crate::trace::{SpanKind, TraceSpan};

/// The step's gradient path: `submit`, the sync point, following a plan.
mod step;

/// Gradient syncs completed in this process, all backends and ranks together.
pub(super) static SYNCS_TOTAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One gradient submitted this step.
pub(super) struct Submitted<I: Backend> {
    pub(super) tref: TensorRef<Collective<I>>,
    pub(super) name: String,
    pub(super) ty: TensorType,
    /// Its data, unless it was handed to the live execution.
    pub(super) data: Option<Grad>,
    /// The recorded node its tensor was when submitted.
    pub(super) seq: Option<u64>,
}

/// A step following a plan (the previous step's, or a predicted one): buckets are packed and
/// launched as their last gradient arrives, during backward.
pub(super) struct Live {
    pub(super) plan: Arc<Plan>,
    pub(super) exec: Execution,
    /// Slot-indexed gradients.
    pub(super) grads: Vec<Grad>,
    pub(super) ready: Vec<bool>,
    /// Slot → index in `RankState::submitted`.
    pub(super) source: Vec<Option<usize>>,
    /// A gradient arrived out of the plan's order: launch nothing more.
    pub(super) diverged: bool,
    /// The plan's segment graph, when the step follows a predicted plan rather than the
    /// previous step's ([`super::follow`]).
    pub(super) predicted: Option<Graph>,
    /// Launches nothing until the user's all-reduces queued before its first gradient are
    /// launched ([`Session::hold_for_user`]).
    pub(super) held: bool,
    /// It still was when the sync point came (its buckets launched there).
    pub(super) held_to_sync: bool,
}

pub(super) struct RankState<I: Backend> {
    pub(super) submitted: Vec<Submitted<I>>,
    pub(super) index: HashMap<String, usize>,
    /// Parameters Burn registered for this step's sync (their gradients must all arrive).
    pub(super) registered: Vec<String>,
    /// The plan the previous step compiled to; the next step follows it while it can.
    pub(super) expected: Option<Arc<Plan>>,
    /// Its segment graph as recorded (compiled again only when someone inspects it).
    pub(super) expected_segment: Option<Graph>,
    /// The last synced step as recorded: every op, the gradients, their syncs (its graph is
    /// built when someone asks, [`recorded_step_graph`](super::recorded_step_graph)).
    pub(super) last_step: Option<StepRecord>,
    /// The ops of the last synced step that ran by its sync point, in the order they ran
    /// (record sequence numbers), and every op it recorded (sequence numbers in record order):
    /// kept as they come, mapped to positions only when someone asks
    /// ([`executed_step_order`](super::executed_step_order)), so a step pays no map for them.
    pub(super) last_ran: (Vec<u64>, Vec<u64>),
    pub(super) live: Option<Live>,
    pub(super) cache: PlanCache,
    pub(super) workspace: Workspace,
    /// Workspace of the plans that reduce what a diverged step left over.
    pub(super) leftover_workspace: Workspace,
    /// Under zero-fill, the (name, type) list the expected plan was compiled from, in order.
    pub(super) expected_entries: Vec<(String, TensorType)>,
    /// Inside a [`no_sync`] scope: gradients accumulate here instead of being reduced.
    pub(super) no_sync: bool,
    /// Gradients accumulated by backward passes under [`no_sync`], added to the next synced
    /// backward's gradient of the same parameter.
    pub(super) accumulated: HashMap<String, (TensorType, HostBuffer)>,
    /// Zero-filled gradients (all steps), and the names zero-filled in the last step.
    pub(super) zero_filled: u64,
    pub(super) last_zero_filled: Vec<String>,
    /// Gradients copied into their host bucket from the inner backend's own memory (all steps).
    pub(super) read_into_buckets: u64,
    /// Whether this step leaves its gradients as they are ([`SingleRank::Skip`]); decided at
    /// its first gradient.
    pub(super) step_local: Option<bool>,
    /// Steps that did (all steps).
    pub(super) local_steps: u64,
    /// Steps whose buckets launched during backward / steps that ran everything at the sync.
    pub(super) eager_steps: u64,
    pub(super) flushed_steps: u64,
    /// Steps that followed a plan but held their buckets to the sync point for the user's
    /// all-reduces issued before backward.
    pub(super) held_steps: u64,
    /// What `mark_distributed` replicated on this rank.
    pub(super) replicas: ReplicaState,
    /// The link probe ran ([`CollectiveOptions::probe_link`]).
    pub(super) probed: bool,
    /// Plans from measured steps ([`CollectiveOptions::measured_plans`]).
    pub(super) planner: super::planner::Planner,
    /// The segments this rank synced and what followed what ([`super::follow`]).
    pub(super) history: super::follow::History,
    /// The plans (by hash) every rank agreed on ([`crate::runtime::agree`]): a plan is a pure
    /// function of its segment and options, so the ranks agree on it once.
    pub(super) agreed: hashbrown::HashSet<u64>,
    /// Inside a [`join`](super::join) scope (uneven inputs): the rank's rounds.
    pub(super) join: Option<super::join::JoinState>,
}

pub(super) struct Session<I: Backend> {
    /// A rank failed and aborted the group.
    pub(super) failed: std::sync::atomic::AtomicBool,
    /// Threads working for each rank (`rank_threads`).
    pub(super) threads: super::rank_threads::ThreadCounts,
    /// Time zero of traces.
    pub(super) epoch: Instant,
    pub(super) trace: Mutex<Vec<TraceSpan>>,
    pub(super) world: usize,
    pub(super) reduce: ReduceOp,
    pub(super) options: CollectiveOptions,
    /// By rank; `None` for the ranks of other processes.
    pub(super) comms: Vec<Option<Box<dyn Communicator>>>,
    pub(super) ranks: Vec<Mutex<RankState<I>>>,
    /// By rank: the user's all-reduces (locked apart from the rank state, and never while a
    /// lazy tensor is forced).
    pub(super) user: Vec<Mutex<UserQueue>>,
    /// By rank, with [`CollectiveOptions::record_collectives`]: what each communicator was asked.
    pub(super) calls: Vec<Option<crate::runtime::recording::CallLog>>,
    /// What each rank did on the device.
    pub(super) device: Vec<DeviceCounts>,
    /// By rank: what its steps measured (locked briefly, never while forcing a tensor).
    pub(super) clocks: Vec<Mutex<StepClock>>,
    /// This process's ranks, whose recorders keep a log of their ops for this server's sync
    /// points while it lives.
    pub(super) _logs: super::lazy::LogReaders,
}

/// A rank's device work so far (the device fields of [`SyncStats`]).
#[derive(Default)]
pub(super) struct DeviceCounts {
    /// Buckets packed on the device.
    pub(super) packs: std::sync::atomic::AtomicU64,
    /// Collectives the communicator reduced in place on the device.
    pub(super) collectives: std::sync::atomic::AtomicU64,
    /// Reduced gradients handed back as views of their bucket.
    pub(super) views: std::sync::atomic::AtomicU64,
}

/// The running servers, by inner backend. Read by every hook call of every rank (each
/// gradient's), written when a server starts or closes: readers do not take turns.
type Sessions = RwLock<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>;

fn sessions() -> &'static Sessions {
    static S: OnceLock<Sessions> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// The running servers, to change (a panic while the lock was held left at worst a server
/// registered or not).
pub(super) fn sessions_mut()
-> RwLockWriteGuard<'static, HashMap<TypeId, Arc<dyn Any + Send + Sync>>> {
    sessions().write().unwrap_or_else(|e| e.into_inner())
}

/// The communication server running for `Collective<I>`, if one is.
pub(super) fn running<I: Backend>() -> Option<Arc<Session<I>>> {
    let any = sessions()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&TypeId::of::<I>())
        .cloned();
    any.and_then(|a| a.downcast::<Session<I>>().ok())
}

/// The inner backends whose communication server was closed and not started again.
pub(super) fn closed() -> &'static Mutex<hashbrown::HashSet<TypeId>> {
    static C: OnceLock<Mutex<hashbrown::HashSet<TypeId>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

pub(super) fn session<I: Backend>(what: &str) -> Arc<Session<I>> {
    match running::<I>() {
        Some(s) => s,
        None if lock(closed()).contains(&TypeId::of::<I>()) => panic!(
            "collective-fusion: {what} after close_communication_server (this backend's communication server was closed while a rank still used it; start it again first)"
        ),
        None => panic!(
            "collective-fusion: {what} before start_communication_server (no communication server is running for this backend)"
        ),
    }
}

pub(super) fn param_name(p: &DistributedParams) -> String {
    super::params::name_of(p.param_id)
}

impl<I: Backend> super::rank_threads::RankServer for Session<I> {
    fn abort_for_panic(&self, rank: usize, reason: &str) {
        self.threads.panicked(rank);
        if !self.failed.load(std::sync::atomic::Ordering::SeqCst) {
            self.abort_group(rank, reason);
        }
    }
    fn thread_started(&self, rank: usize) {
        self.threads.started(rank);
    }
    fn thread_ended(&self, rank: usize) {
        self.threads.ended(rank);
    }
}

impl<I: Backend> Session<I> {
    /// Marks the group failed and aborts `rank`'s communicator with `reason`: every other rank's
    /// collectives fail with it.
    pub(super) fn abort_group(&self, rank: usize, reason: &str) {
        self.failed.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(Some(c)) = self.comms.get(rank) {
            c.abort(reason);
        }
    }

    /// Fails the whole group with `msg`, then panics on this rank.
    pub(super) fn fail(&self, rank: usize, msg: String) -> ! {
        self.abort_group(rank, &msg);
        let prefix = format!("rank {rank}: ");
        let msg = msg.strip_prefix(&prefix).unwrap_or(&msg);
        let gone = self.threads.gone();
        if gone.is_empty() {
            panic!("collective-fusion: rank {rank}: {msg}");
        }
        panic!(
            "collective-fusion: rank {rank}: {msg} (no thread works for rank(s) {gone:?} any more: the last one ended, as a loop that runs out of data early does; `join` lets ranks with uneven inputs finish)"
        );
    }

    /// The communicator of `rank`, which must be one of this process's.
    pub(super) fn comm(&self, rank: usize) -> &dyn Communicator {
        match self.comms.get(rank) {
            Some(Some(c)) => c.as_ref(),
            _ => {
                let here: Vec<usize> = (0..self.comms.len())
                    .filter(|r| self.comms[*r].is_some())
                    .collect();
                panic!(
                    "collective-fusion: rank {rank} is not a rank of this process (this process has rank(s) {here:?} of {})",
                    self.world
                )
            }
        }
    }

    pub(super) fn state(&self, rank: usize, what: &str) -> MutexGuard<'_, RankState<I>> {
        match self.ranks.get(rank) {
            Some(r) => lock(r),
            None => panic!(
                "collective-fusion: {what} on rank {rank}, but the communication server has {} ranks",
                self.world
            ),
        }
    }

    /// `rank`'s clock.
    pub(super) fn clock(&self, rank: usize) -> MutexGuard<'_, StepClock> {
        lock(&self.clocks[rank])
    }

    /// Adds a run's collective timings to the rank's clock and its spans to the trace, when
    /// tracing.
    pub(super) fn record(&self, rank: usize, report: &ExecReport) {
        if let Some(c) = self.clocks.get(rank) {
            let mut c = lock(c);
            c.collectives(&report.timings);
            c.copies(&report.spans);
        }
        if let Some(d) = self.device.get(rank) {
            for (c, n) in [
                (&d.packs, report.device_packs),
                (&d.collectives, report.device_collectives),
                (&d.views, report.view_grads),
            ] {
                c.fetch_add(u64::from(n), std::sync::atomic::Ordering::Relaxed);
            }
        }
        if !self.options.trace {
            return;
        }
        let mut t = lock(&self.trace);
        for s in &report.spans {
            t.push(self.span(rank, s.kind, s.name.clone(), s.start, s.end));
        }
    }

    pub(super) fn span(
        &self,
        rank: usize,
        cat: SpanKind,
        name: String,
        start: Instant,
        end: Instant,
    ) -> TraceSpan {
        let us = |t: Instant| t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6;
        TraceSpan {
            rank,
            stream: cat.stream().to_string(),
            cat,
            name,
            start_us: us(start),
            dur_us: (us(end) - us(start)).max(0.0),
        }
    }

    pub(super) fn opts(&self) -> ExecOptions {
        ExecOptions {
            timeout: self.options.timeout,
        }
    }

    /// `rank`'s user all-reduces.
    pub(super) fn user_queue(&self, rank: usize, what: &str) -> MutexGuard<'_, UserQueue> {
        match self.user.get(rank) {
            Some(q) => lock(q),
            None => panic!(
                "collective-fusion: {what} on rank {rank}, but the communication server has {} ranks",
                self.world
            ),
        }
    }

    /// The segment graph of `entries` (the gradient sync's reduce op) and its plan, from the
    /// rank's plan cache; a compile error fails the step on every rank.
    pub(super) fn compile_segment(
        &self,
        rank: usize,
        cache: &mut PlanCache,
        entries: &[(String, TensorType)],
    ) -> (Graph, Arc<Plan>) {
        self.compile_segment_with(rank, cache, entries, self.reduce, "the gradient sync")
    }

    /// [`Session::compile_segment`] with the reduce op `reduce`, for `what` (in the error).
    pub(super) fn compile_segment_with(
        &self,
        rank: usize,
        cache: &mut PlanCache,
        entries: &[(String, TensorType)],
        reduce: ReduceOp,
        what: &str,
    ) -> (Graph, Arc<Plan>) {
        let g = segment(self.world, entries, reduce);
        match cache.get_or_compile(&g, &self.options.config) {
            Ok(p) => (g, p),
            Err(e) => self.fail(rank, format!("compiling {what}: {e}")),
        }
    }
}

/// The graph of a sync segment over `world` ranks: a gradient and a `grad_sync` per entry, in
/// ready order, then one `sync`.
pub(super) fn segment(world: usize, entries: &[(String, TensorType)], reduce: ReduceOp) -> Graph {
    let mut g = Graph::new("sync");
    let group = g.add_group(world as u32);
    let mut syncs = Vec::with_capacity(entries.len());
    for (i, (name, ty)) in entries.iter().enumerate() {
        let src = g.add_node(
            Op::Input {
                name: format!("{name}.grad"),
            },
            [(*ty).clone()],
            &[],
        );
        syncs.push(add_gradient_sync(
            &mut g, name, ty, src, i as u32, reduce, group,
        ));
    }
    g.add_node(Op::Sync, [], &syncs);
    g
}

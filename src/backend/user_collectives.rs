//! The user's collectives: `DistributedBackend::all_reduce` on `Collective<I>`, lazy.
//!
//! `all_reduce` returns at once: its result is a recorded node whose value, when first needed
//! (a read, an op that runs on it, the queue forced for another reason), waits for the
//! collective. `sync_collective` (which Burn's `CollectiveTensor::resolve` calls) waits for every
//! collective the rank issued. A device tensor is reduced in place where the communicator
//! reduces device memory (NCCL), read into host memory on the communicator's thread otherwise.
//!
//! **Coalescing** ([`CollectiveOptions::coalesce_user_collectives`], on by default). An
//! all-reduce is not launched at the call but queued; the rank's queue is launched when a value
//! is needed, at `sync_collective`, `mark_distributed` and a sync point, and those issued before
//! a backward pass before its first gradient bucket, so every rank issues its collectives in
//! the same order. All-reduces issued back to back with no use in between thus launch
//! together: the queue is compiled as a sync segment by the same passes as the gradients (bucketed, packed
//! on the device where the tensors are, one collective per bucket), so ten scalar metrics are
//! one collective. Ranks may need a value at different points (rank 0 logs a metric between
//! two all-reduces, the others do not), so before launching the ranks exchange how many
//! all-reduces each has queued (one small all-reduce) and all launch the smallest count,
//! repeating until what the rank needs is launched. The cost: that exchange, and no overlap
//! between the call and the first need of a value. Off, each all-reduce is launched alone at
//! the call.
//!
//! **Inside backward** a rank never waits for another (Burn's autodiff ends each backward by
//! locking every thread's graph). A step that follows a plan and starts backward with
//! all-reduces queued holds its buckets back ([`Session::hold_for_user`]): its first gradient
//! starts the count exchange, each later gradient looks for the result ([`Session::poll_user`]),
//! and once the all-reduces queued before backward are launched the held buckets follow. A
//! flush (a value needed, the sync point) finishes the exchange and releases the held buckets
//! before any later round, so every rank issues the same sequence of collectives whichever
//! gradient the counts arrived at.
//!
//! Requires: every rank issues the same collectives in the same order (as for any collective).
//! Guarantees: a failed collective (a timeout, a mismatch, an aborted group) fails the group
//! and panics, with the typed error's message, on the thread that needs its value or waits for
//! it; ranks that issued different numbers of all-reduces fail naming both counts; the autodiff
//! backward of an all-reduce is another all-reduce, lazy alike.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use burn_backend::distributed::{CollectiveTensor, ReduceOperation};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DeviceId, TensorMetadata};
use hashbrown::HashSet;
use smallvec::SmallVec;

use super::distributed::graph_dtype;
use super::host_io::{from_host, read_host};
use super::lazy::Record;
use super::session::{Session, lock};
use super::{CTensor, Collective};
use crate::codegen::plan::Plan;
use crate::graph::{ComputeKind, ReduceOp, TensorType};
use crate::runtime::Grad;
use crate::runtime::agree::PendingCounts;
use crate::runtime::cache::PlanCache;
use crate::runtime::comm::{CollectiveDesc, Communicator, wait_bound};
use crate::runtime::exec::{ExecOptions, ExecReport, Execution, NoHooks, UserAllReduce, Workspace};

/// A rank's user all-reduces: those queued and not launched, and those launched and not yet
/// waited for by `sync_collective`.
#[derive(Default)]
pub(super) struct UserQueue {
    /// All-reduces issued so far.
    issued: u64,
    queued: Vec<Queued>,
    outstanding: Vec<Arc<UserReduce>>,
    /// Plans of coalesced launches, by their segment graph.
    cache: PlanCache,
    /// Graph hashes of the plans the ranks agreed on.
    agreed: HashSet<u64>,
    /// How many of `queued` were queued before the live step's first gradient: that step's
    /// buckets launch after them ([`Session::hold_for_user`]).
    hold: usize,
    /// A count exchange started inside backward and not yet finished.
    round: Option<PendingCounts>,
    /// A finished exchange whose launch waits for a plan agreement (which only a flush does).
    counted: Option<Vec<u64>>,
    /// An all-reduce was issued inside this step's backward ([`Session::meet_after_backward`]).
    in_backward: bool,
}

/// An all-reduce queued for a coalesced launch.
struct Queued {
    cell: Arc<UserReduce>,
    grad: Grad,
    op: ReduceOp,
    ty: TensorType,
}

/// A coalesced launch: one plan over several all-reduces, running.
struct Group {
    state: Mutex<GroupState>,
}

enum GroupState {
    Running {
        plan: Arc<Plan>,
        exec: Box<Execution>,
        grads: Vec<Grad>,
        ws: Workspace,
    },
    /// The reduced tensors by slot, each taken once.
    Done(Vec<Option<Grad>>),
    Failed(String),
}

impl Group {
    /// Waits for every collective of the group (once) and unpacks; the report of the run.
    fn complete(
        &self,
        comm: &dyn Communicator,
        opts: ExecOptions,
    ) -> Result<Option<ExecReport>, String> {
        let mut st = lock(&self.state);
        let report = if let GroupState::Running { .. } = &*st {
            let GroupState::Running {
                plan,
                mut exec,
                mut grads,
                mut ws,
            } = std::mem::replace(&mut *st, GroupState::Failed(String::new()))
            else {
                unreachable!("matched above")
            };
            let ready = vec![true; grads.len()];
            let run = exec
                .run(
                    &plan,
                    comm,
                    &mut grads,
                    &ready,
                    &mut NoHooks,
                    opts,
                    &mut ws,
                    true,
                )
                .and_then(|()| exec.finish());
            match run {
                Ok(r) => {
                    *st = GroupState::Done(grads.into_iter().map(Some).collect());
                    Some(r)
                }
                Err(e) => {
                    *st = GroupState::Failed(e.to_string());
                    None
                }
            }
        } else {
            None
        };
        match &*st {
            GroupState::Failed(m) => Err(m.clone()),
            _ => Ok(report),
        }
    }
}

/// Where one user all-reduce is.
enum Stage {
    /// In the rank's queue, not launched.
    Queued,
    /// Launched alone.
    InFlight(UserAllReduce),
    /// Launched in a coalesced group, as its slot.
    InGroup(Arc<Group>, usize),
    Done(Grad),
    Failed(String),
    Taken,
}

/// One user all-reduce, shared by its result node and the rank's queue.
pub(super) struct UserReduce {
    what: String,
    stage: Mutex<Stage>,
}

impl UserReduce {
    fn lock(&self) -> MutexGuard<'_, Stage> {
        lock(&self.stage)
    }

    fn queued(&self) -> bool {
        matches!(*self.lock(), Stage::Queued)
    }

    /// Waits for it (once, after it was launched); the error's message if it failed. A group's
    /// run report goes to `record`.
    fn wait(
        &self,
        comm: &dyn Communicator,
        timeout: Duration,
        record: &dyn Fn(&ExecReport),
    ) -> Result<(), String> {
        let mut st = self.lock();
        match std::mem::replace(&mut *st, Stage::Taken) {
            Stage::InFlight(f) => {
                *st = match f.wait(wait_bound(timeout)) {
                    Ok(g) => Stage::Done(g),
                    Err(e) => Stage::Failed(e.to_string()),
                }
            }
            Stage::InGroup(group, slot) => {
                drop(st);
                let done = group.complete(comm, ExecOptions { timeout });
                st = self.lock();
                *st = match done {
                    Ok(report) => {
                        if let Some(r) = report {
                            record(&r);
                        }
                        match &mut *lock(&group.state) {
                            GroupState::Done(g) => match g.get_mut(slot).and_then(Option::take) {
                                Some(g) => Stage::Done(g),
                                None => Stage::Failed(format!("{} was taken twice", self.what)),
                            },
                            _ => Stage::Failed(format!("{} never completed", self.what)),
                        }
                    }
                    Err(m) => Stage::Failed(m),
                }
            }
            Stage::Queued => {
                *st = Stage::Queued;
                return Err(format!("{} was never launched", self.what));
            }
            other => *st = other,
        }
        match &*st {
            Stage::Failed(m) => Err(m.clone()),
            _ => Ok(()),
        }
    }

    /// The reduced tensor, once [`UserReduce::wait`] succeeded (taken once).
    fn take(&self) -> Result<Grad, String> {
        match std::mem::replace(&mut *self.lock(), Stage::Taken) {
            Stage::Done(g) => Ok(g),
            Stage::Failed(m) => Err(m),
            _ => Err(format!("{} was taken twice", self.what)),
        }
    }

    fn finished(&self) -> bool {
        matches!(*self.lock(), Stage::Taken)
    }
}

impl<I: Backend> Session<I> {
    /// Launches `rank`'s queued all-reduces: all of them, or (`until`) as many as it takes to
    /// launch that one. Each round the ranks exchange their queue lengths and all launch the
    /// smallest, as one plan per run of the same reduce op. A round started inside backward
    /// ([`Session::poll_user`]) finishes first. Waits; never call it inside backward but where
    /// a value is needed (see [`Session::agree_once`]).
    pub(super) fn flush_user(&self, rank: usize, until: Option<&UserReduce>) {
        let Some(qm) = self.user.get(rank) else {
            return;
        };
        let mut q = lock(qm);
        loop {
            let counts = match (q.counted.take(), q.round.take()) {
                (Some(c), _) => c,
                (None, Some(round)) => match round.wait(self.options.timeout) {
                    Ok(c) => c,
                    Err(e) => self.fail(rank, e.to_string()),
                },
                (None, None) => {
                    if q.queued.is_empty() || !until.is_none_or(UserReduce::queued) {
                        return;
                    }
                    let n = q.queued.len() as u64;
                    q.round = Some(self.start_round(rank, n));
                    continue;
                }
            };
            if self.launch_round(rank, &mut q, counts, true) == Some(true) {
                // The step held for them launches its buckets now, before any later round:
                // every rank does so at this same place in its sequence of collectives.
                drop(q);
                self.release_held(rank);
                q = lock(qm);
            }
        }
    }

    /// Inside backward, never waiting: takes the result of the round in flight if it is in and
    /// launches its all-reduces (unless their plan is yet to be agreed on, which waits for a
    /// flush), then starts the next round while some of those held for remain. Whether every
    /// all-reduce the live step holds for is launched.
    pub(super) fn poll_user(&self, rank: usize) -> bool {
        let Some(qm) = self.user.get(rank) else {
            return true;
        };
        let mut q = lock(qm);
        loop {
            if q.counted.is_some() {
                return false;
            }
            if let Some(round) = q.round.take() {
                let Some(result) = round.try_take() else {
                    q.round = Some(round);
                    return false;
                };
                let counts = match result {
                    Ok(c) => c,
                    Err(e) => self.fail(rank, e.to_string()),
                };
                match self.launch_round(rank, &mut q, counts, false) {
                    None => return false,
                    Some(true) => return true,
                    Some(false) => {}
                }
            }
            if q.hold == 0 {
                return true;
            }
            let n = q.queued.len() as u64;
            q.round = Some(self.start_round(rank, n));
        }
    }

    /// At the first gradient of a step that follows a plan: whether its buckets must wait for
    /// the all-reduces queued before it (issued first, so launched first on every rank). If
    /// so, the ranks' count exchange starts here and [`Session::poll_user`] or a flush
    /// finishes it.
    pub(super) fn hold_for_user(&self, rank: usize) -> bool {
        let Some(qm) = self.user.get(rank) else {
            return false;
        };
        {
            let mut q = lock(qm);
            if q.queued.is_empty() {
                return false;
            }
            q.hold = q.queued.len();
            if q.round.is_none() && q.counted.is_none() {
                let n = q.queued.len() as u64;
                q.round = Some(self.start_round(rank, n));
            }
        }
        !self.poll_user(rank)
    }

    /// Launches what the live step held back (its buckets complete so far), once every
    /// all-reduce it held for is launched.
    fn release_held(&self, rank: usize) {
        let mut guard = self.state(rank, "all_reduce");
        let st = &mut *guard;
        if let Some(live) = st.live.as_mut().filter(|l| l.held) {
            live.held = false;
            self.advance_live(rank, live, &mut st.workspace, false);
        }
    }

    /// At the sync point, before the flush: whether the live step is still held.
    pub(super) fn note_held(&self, rank: usize) {
        if let Some(live) = self.state(rank, "submit_sync_collective").live.as_mut() {
            live.held_to_sync = live.held;
        }
    }

    /// At the end of a sync point, when ranks share this process and the step issued an
    /// all-reduce inside backward (a differentiable all-reduce, as a synchronized batch norm
    /// has): waits until every rank got here. Such a step waits for the other ranks inside
    /// backward, holding its autodiff graph; Burn ends each backward by locking every thread's
    /// graph, so a rank that started its next backward before another rank's cleanup of the
    /// previous one ended could wait for it forever. Here every rank is past that cleanup.
    pub(super) fn meet_after_backward(&self, rank: usize) {
        let Some(qm) = self.user.get(rank) else {
            return;
        };
        let waited = std::mem::take(&mut lock(qm).in_backward);
        if waited && self.comms.iter().filter(|c| c.is_some()).count() > 1 {
            let timeout = self.options.timeout;
            if let Err(e) = crate::runtime::agree::barrier(self.comm(rank), timeout) {
                self.fail(rank, e.to_string());
            }
        }
    }

    fn start_round(&self, rank: usize, n: u64) -> PendingCounts {
        match crate::runtime::agree::start_gather_counts(self.comm(rank), n) {
            Ok(p) => p,
            Err(e) => self.fail(rank, e.to_string()),
        }
    }

    /// Launches one round's all-reduces (the smallest count of `counts` from the front of the
    /// queue). Without `may_agree`, launches nothing when a plan is yet to be agreed on and
    /// keeps `counts` for a flush (`None`); else whether this round launched the last
    /// all-reduce a live step held for.
    fn launch_round(
        &self,
        rank: usize,
        q: &mut UserQueue,
        counts: Vec<u64>,
        may_agree: bool,
    ) -> Option<bool> {
        let n = q.queued.len() as u64;
        let (low, m) = counts
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|(_, c)| *c)
            .unwrap_or((rank, n));
        if m == 0 {
            self.fail(
                rank,
                format!(
                    "rank {rank} has {n} all_reduce(s) to launch, but rank {low} has none: the ranks issued different collectives"
                ),
            );
        }
        let m = (m as usize).min(q.queued.len());
        // Runs of one reduce op, each launched as one plan.
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for i in 0..m {
            match runs.last_mut() {
                Some(r) if q.queued[r.start].op == q.queued[i].op => r.end = i + 1,
                _ => runs.push(i..i + 1),
            }
        }
        let plans: Vec<_> = runs
            .iter()
            .map(|r| self.user_plan(rank, &mut q.cache, &q.queued[r.clone()]))
            .collect();
        if !may_agree && plans.iter().any(|(_, p)| !q.agreed.contains(&p.graph_hash)) {
            q.counted = Some(counts);
            return None;
        }
        let mut batch = q.queued.drain(..m);
        let runs: Vec<Vec<Queued>> = runs
            .iter()
            .map(|r| batch.by_ref().take(r.len()).collect())
            .collect();
        drop(batch);
        for (run, (entries, plan)) in runs.into_iter().zip(plans) {
            self.launch_group(rank, q, run, &entries, plan);
        }
        let held = q.hold;
        q.hold = held.saturating_sub(m);
        Some(held > 0 && q.hold == 0)
    }

    /// The plan of a run of all-reduces of one op, and its entries (cached per composition).
    fn user_plan(
        &self,
        rank: usize,
        cache: &mut PlanCache,
        run: &[Queued],
    ) -> (Vec<(String, TensorType)>, Arc<Plan>) {
        let entries: Vec<(String, TensorType)> = run
            .iter()
            .enumerate()
            .map(|(i, x)| (format!("all_reduce.{i}"), x.ty.clone()))
            .collect();
        let (_, plan) =
            self.compile_segment_with(rank, cache, &entries, run[0].op, "the user all-reduces");
        (entries, plan)
    }

    /// Launches `run` (all-reduces of one op) as `plan`, agreed on once per composition.
    fn launch_group(
        &self,
        rank: usize,
        q: &mut UserQueue,
        run: Vec<Queued>,
        entries: &[(String, TensorType)],
        plan: Arc<Plan>,
    ) {
        let comm = self.comm(rank);
        self.agree_once(rank, &mut q.agreed, &plan);
        let mut ws = Workspace::agreed_on(&plan);
        let mut by_slot: Vec<Grad> = (0..plan.slots.len()).map(|_| Grad::default()).collect();
        let mut cells: Vec<(Arc<UserReduce>, usize)> = Vec::with_capacity(run.len());
        for (i, item) in run.into_iter().enumerate() {
            let name = &entries[i].0;
            let Some(slot) = plan.slots.iter().position(|s| s.param == *name) else {
                self.fail(
                    rank,
                    format!("the user all-reduce plan has no slot for {name}"),
                );
            };
            by_slot[slot] = item.grad;
            cells.push((item.cell, slot));
        }
        let opts = self.opts();
        let launched = Execution::new(&plan, comm, &mut ws, opts).and_then(|mut exec| {
            let ready = vec![true; by_slot.len()];
            exec.run(
                &plan,
                comm,
                &mut by_slot,
                &ready,
                &mut NoHooks,
                opts,
                &mut ws,
                false,
            )
            .map(|()| exec)
        });
        let exec = match launched {
            Ok(e) => e,
            Err(e) => self.fail(rank, e.to_string()),
        };
        let group = Arc::new(Group {
            state: Mutex::new(GroupState::Running {
                plan,
                exec: Box::new(exec),
                grads: by_slot,
                ws,
            }),
        });
        for (cell, slot) in cells {
            *cell.lock() = Stage::InGroup(group.clone(), slot);
        }
    }

    /// Waits for `cell` (launching the rank's queue first if it is still in it).
    fn wait_user(&self, rank: usize, cell: &UserReduce) -> Result<(), String> {
        self.flush_user(rank, Some(cell));
        cell.wait(self.comm(rank), self.options.timeout, &|r| {
            self.record(rank, r)
        })
    }
}

/// `DistributedBackend::all_reduce` for `Collective<I>`.
pub(super) fn all_reduce<I: Backend>(
    s: Arc<Session<I>>,
    tensor: FloatTensor<Collective<I>>,
    op: ReduceOperation,
    device_ids: Vec<DeviceId>,
) -> CollectiveTensor<Collective<I>> {
    let rank = tensor.rank as usize;
    super::rank_threads::works_for(&s, rank);
    if device_ids.len() != s.world {
        s.fail(
            rank,
            format!(
                "all_reduce over {} devices, but the communication server has {} ranks",
                device_ids.len(),
                s.world
            ),
        );
    }
    let Some(dtype) = graph_dtype(tensor.dtype()) else {
        s.fail(
            rank,
            format!(
                "all_reduce of a {:?} tensor: only float tensors are reduced",
                tensor.dtype()
            ),
        );
    };
    let shape = tensor.shape();
    let input = tensor.seq();
    // Runs what produces the tensor (queued on the device; a host backend computes it now), and
    // only that: the thread's other queued nodes, the results of its earlier all-reduces among
    // them, stay queued, so all-reduces issued back to back still launch together.
    let inner = tensor.inner_hoisted("all_reduce", u64::MAX);
    let device = I::float_device(&inner);
    let grad = match s
        .options
        .device_buckets
        .then(|| super::device::device_grad::<I>(&inner))
        .flatten()
    {
        Some(g) => Grad::Device(g),
        None => match read_host::<I>(inner.clone()) {
            Ok(b) => Grad::Host(b),
            Err(e) => s.fail(rank, format!("all_reduce: reading the tensor: {e}")),
        },
    };
    let op = match op {
        ReduceOperation::Sum => ReduceOp::Sum,
        ReduceOperation::Mean => ReduceOp::Mean,
    };
    let dims: Vec<u64> = shape.iter().map(|d| *d as u64).collect();
    let ty = TensorType::new(dtype, &dims);
    // Inside backward: Burn registered this step's parameters (it does so when backward
    // starts, before any gradient) or their gradients started to arrive (under `no_sync` too).
    let in_backward = {
        let st = s.state(rank, "all_reduce");
        !st.registered.is_empty() || !st.index.is_empty()
    };
    let cell = {
        let mut q = s.user_queue(rank, "all_reduce");
        q.in_backward |= in_backward;
        q.issued += 1;
        q.outstanding.retain(|c| !c.finished());
        let what = format!(
            "all_reduce #{} ({} of {ty}) on rank {rank}",
            q.issued,
            op.name()
        );
        let cell = if s.options.coalesce_user_collectives {
            let cell = Arc::new(UserReduce {
                what,
                stage: Mutex::new(Stage::Queued),
            });
            q.queued.push(Queued {
                cell: cell.clone(),
                grad,
                op,
                ty,
            });
            cell
        } else {
            let desc = CollectiveDesc {
                // Launched alone, in the user range of launch indices: never matched with a
                // bucket or an agreement exchange.
                collective: crate::runtime::comm::Purpose::user_launch(q.issued),
                bucket: None,
                op,
                dtype,
                count: shape.num_elements() as u64,
                params: Vec::new(),
            };
            match UserAllReduce::launch(s.comm(rank), grad, desc) {
                Ok(f) => Arc::new(UserReduce {
                    what,
                    stage: Mutex::new(Stage::InFlight(f)),
                }),
                Err(e) => s.fail(rank, e.to_string()),
            }
        };
        q.outstanding.push(cell.clone());
        cell
    };
    let rec = Record {
        op: "all_reduce",
        kind: ComputeKind::Opaque,
        device: Arc::new(device.clone()),
        shape: Some(shape.clone()),
        dtype: Some(tensor.dtype()),
        inputs: input.into_iter().collect::<SmallVec<[u64; 3]>>(),
        flops: 0,
        // Every rank gets the same reduced values, whatever each contributed.
        drawn: false,
    };
    let out = CTensor::lazy(rank as u32, rec, move || {
        if let Err(e) = s.wait_user(rank, &cell) {
            s.fail(rank, e);
        }
        let reduced = match cell.take() {
            Ok(g) => g,
            Err(e) => s.fail(rank, e),
        };
        let buf = match reduced {
            Grad::Host(b) => b,
            Grad::Device(g) => {
                match super::device::tensor_from::<I>(&inner, g).map_err(|g| g.read()) {
                    Ok(p) => return p,
                    Err(Ok(b)) => b,
                    Err(Err(e)) => s.fail(rank, format!("all_reduce: {e}")),
                }
            }
        };
        I::float_from_data(from_host(buf, shape), &device)
    });
    CollectiveTensor::new(out)
}

/// `DistributedBackend::sync_collective` for `Collective<I>`: launches the rank's queued
/// all-reduces and waits for every one it issued; a failed one fails the group and panics here.
pub(super) fn sync<I: Backend>(s: &Session<I>, rank: usize) {
    s.flush_user(rank, None);
    let outstanding = std::mem::take(&mut s.user_queue(rank, "sync_collective").outstanding);
    for c in outstanding {
        if let Err(e) = c.wait(s.comm(rank), s.options.timeout, &|r| s.record(rank, r)) {
            s.fail(rank, e);
        }
    }
}

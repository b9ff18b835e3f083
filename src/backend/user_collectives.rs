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
//! is needed, at `sync_collective`, and before any other collective of the rank (a gradient
//! bucket, a sync point, `mark_distributed`), so collectives keep the order each rank issued
//! them in. All-reduces issued back to back with no use in between thus launch together: the
//! queue is compiled as a sync segment by the same passes as the gradients (bucketed, packed
//! on the device where the tensors are, one collective per bucket), so ten scalar metrics are
//! one collective. Ranks may need a value at different points (rank 0 logs a metric between
//! two all-reduces, the others do not), so before launching the ranks exchange how many
//! all-reduces each has queued (one small all-reduce) and all launch the smallest count,
//! repeating until what the rank needs is launched. The cost: that exchange, and no overlap
//! between the call and the first need of a value. Off, each all-reduce is launched alone at
//! the call.
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

use super::distributed::{from_host, graph_dtype, read_host};
use super::lazy::Record;
use super::session::{Session, lock};
use super::{CTensor, Collective};
use crate::codegen::plan::Plan;
use crate::graph::{ComputeKind, ReduceOp, TensorType};
use crate::runtime::Grad;
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
    /// Whether `rank` has all-reduces queued, not launched yet.
    pub(super) fn user_queued(&self, rank: usize) -> bool {
        self.user
            .get(rank)
            .is_some_and(|q| !lock(q).queued.is_empty())
    }

    /// Launches `rank`'s queued all-reduces: all of them, or (`until`) as many as it takes to
    /// launch that one. Each round the ranks exchange their queue lengths and all launch the
    /// smallest, as one plan per run of the same reduce op. Never inside backward (see
    /// [`Session::agree_once`]).
    pub(super) fn flush_user(&self, rank: usize, until: Option<&UserReduce>) {
        let Some(q) = self.user.get(rank) else {
            return;
        };
        let mut q = lock(q);
        let comm = self.comm(rank);
        while !q.queued.is_empty() && until.is_none_or(UserReduce::queued) {
            let n = q.queued.len() as u64;
            let counts = match crate::runtime::agree::gather_counts(comm, n, self.options.timeout) {
                Ok(c) => c,
                Err(e) => self.fail(rank, e.to_string()),
            };
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
            let batch: Vec<Queued> = q.queued.drain(..m as usize).collect();
            let mut runs: Vec<Vec<Queued>> = Vec::new();
            for item in batch {
                match runs.last_mut() {
                    Some(r) if r[0].op == item.op => r.push(item),
                    _ => runs.push(vec![item]),
                }
            }
            for run in runs {
                self.launch_group(rank, &mut q, run);
            }
        }
    }

    /// Launches `run` (all-reduces of one op) as one plan: the segment of its tensors, compiled
    /// and agreed on once per composition.
    fn launch_group(&self, rank: usize, q: &mut UserQueue, run: Vec<Queued>) {
        let comm = self.comm(rank);
        let entries: Vec<(String, TensorType)> = run
            .iter()
            .enumerate()
            .map(|(i, x)| (format!("all_reduce.{i}"), x.ty.clone()))
            .collect();
        let (_, plan) = self.compile_segment_with(
            rank,
            &mut q.cache,
            &entries,
            run[0].op,
            "the user all-reduces",
        );
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
    // Runs what produces the tensor (queued on the device; a host backend computes it now).
    let inner = tensor.inner_for("all_reduce");
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
    let cell = {
        let mut q = s.user_queue(rank, "all_reduce");
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

//! `DistributedBackend` for `Collective<I>`: Burn's gradient-sync hooks, the user's collectives,
//! and what a running server reports ([`SyncStats`], the expected plan, the recorded step).
//! The state and the gradient path are in [`session`](super::session); the zero-fill sync in
//! [`zero_fill`](super::zero_fill); the user's all-reduces in
//! [`user_collectives`](super::user_collectives).
use std::any::TypeId;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedConfig, DistributedParams, ReduceOperation,
    TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DeviceId};
use hashbrown::HashMap;

use super::options::CollectiveOptions;
use super::rank_threads::works_for;
use super::record::StepRecord;
use super::replicas::ReplicaState;
use super::session::{
    DeviceCounts, RankState, Session, closed, lock, param_name, session, sessions_mut,
};
use super::step_clock::StepClock;
use super::{Collective, CollectiveDevice};
use crate::codegen::plan::Plan;
use crate::graph::{DType, Graph, ReduceOp};
use crate::measure::{LinkFit, MeasuredStep};
use crate::runtime::cache::PlanCache;
use crate::runtime::comm::CollectiveDesc;
use crate::runtime::exec::Workspace;
use crate::runtime::transport::StartError;
use crate::trace::{SpanKind, TraceSpan};

/// How many gradient syncs (one per rank per step) completed in this process so far.
pub fn gradient_syncs_total() -> u64 {
    super::session::SYNCS_TOTAL.load(std::sync::atomic::Ordering::Relaxed)
}

pub(super) fn graph_dtype(d: burn_std::DType) -> Option<DType> {
    Some(match d {
        burn_std::DType::F32 => DType::F32,
        burn_std::DType::F64 => DType::F64,
        burn_std::DType::F16 => DType::F16,
        burn_std::DType::BF16 => DType::BF16,
        _ => return None,
    })
}

/// How the gradient sync of a rank ran so far (for tests and reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncStats {
    /// Steps whose buckets were packed and launched during backward, following the previous
    /// step's plan.
    pub eager_steps: u64,
    /// Steps that reduced some or all gradients at the sync point (the first step, and steps
    /// whose gradient order changed).
    pub flushed_steps: u64,
    /// Steps that followed a plan but launched their buckets only at the sync point: the
    /// user's all-reduces issued before backward launch first, and the ranks' exchange of
    /// how many each has queued had not come back before backward ended (a rank far behind),
    /// or their plan was yet to be agreed on (the first time a set of them is issued).
    pub held_steps: u64,
    /// Steps of a group of one rank that left their gradients as backward made them
    /// ([`SingleRank::Skip`](super::SingleRank::Skip)): no read, no bucket, no collective.
    pub local_steps: u64,
    /// Plans compiled.
    pub compiled: u64,
    /// Gradients this rank zero-filled under [`UnusedParameters::ZeroFill`](super::UnusedParameters::ZeroFill) (all steps). Each
    /// is a parameter the other ranks reduced and updated while this rank, which has no
    /// gradient for it, did not.
    pub zero_filled: u64,
    /// Buckets packed and unpacked on the gradients' device (by the CubeCL kernels on their
    /// buffers, or by `Dispatch`'s own ops; see [`CollectiveOptions::device_buckets`]); the
    /// rest were packed in host memory.
    pub device_buckets: u64,
    /// Collectives the communicator reduced in place in device memory (NCCL on the gradients'
    /// GPU: nothing crossed to the host): device-packed buckets, and device copies of the
    /// gradients that have an all-reduce of their own. Every other collective went through
    /// host memory.
    pub device_collectives: u64,
    /// Reduced gradients handed back as views of their device bucket instead of copies
    /// ([`CompileConfig::gradient_as_bucket_view`](crate::config::CompileConfig::gradient_as_bucket_view)).
    pub view_grads: u64,
    /// Plans compiled from measured steps ([`CollectiveOptions::measured_plans`]), the first
    /// included.
    pub measured_plans: u64,
    /// Of those, the ones compiled because the measured profile drifted.
    pub replans: u64,
    /// Bytes of host buckets this rank keeps from one step to the next, for the steps that
    /// follow (one copy of the gradients packed on the host, as DDP keeps its buckets; none
    /// for the buckets packed on a device, which go once unpacked).
    pub host_bucket_bytes: u64,
    /// Host buckets this rank allocated so far. A step allocates none when this rank holds a
    /// buffer of each of its buckets' dtype and length: from the previous step of its plan, or
    /// from the plan it switched from (steps that alternate between gradient lists).
    pub host_bucket_allocations: u64,
    /// Gradients copied into their host bucket straight from the memory of Burn's CPU backend
    /// that computed them (NdArray, Flex; row-major gradients of their bucket's dtype, in a step
    /// that follows a plan) as they were submitted: one copy each, where any other gradient
    /// reduced on the host is read into a host buffer first. All steps; a copy made before its
    /// step left the plan it followed counts too.
    pub gradients_read_into_buckets: u64,
}

/// The sync statistics of `rank` of the running communication server for `Collective<I>`.
pub fn sync_stats<I: Backend>(rank: usize) -> SyncStats {
    use std::sync::atomic::Ordering::Relaxed;
    let s = session::<I>("sync_stats");
    let st = s.state(rank, "sync_stats");
    SyncStats {
        eager_steps: st.eager_steps,
        flushed_steps: st.flushed_steps,
        held_steps: st.held_steps,
        local_steps: st.local_steps,
        compiled: st.cache.misses(),
        zero_filled: st.zero_filled,
        device_buckets: s.device[rank].packs.load(Relaxed),
        device_collectives: s.device[rank].collectives.load(Relaxed),
        view_grads: s.device[rank].views.load(Relaxed),
        measured_plans: st.planner.plans,
        replans: st.planner.replans,
        host_bucket_bytes: st.workspace.held_bytes() + st.leftover_workspace.held_bytes(),
        host_bucket_allocations: st.workspace.allocations() + st.leftover_workspace.allocations(),
        gradients_read_into_buckets: st.read_into_buckets,
    }
}

/// What `rank` measured of its last synced step: when each gradient was ready, when each
/// collective was launched, ran and was waited for, the sync point and its end (see
/// [`crate::measure`]). `None` before the first synced step.
pub fn measured_step<I: Backend>(rank: usize) -> Option<MeasuredStep> {
    let s = session::<I>("measured_step");
    s.clock(rank).last.clone()
}

/// The link fitted to the collectives `rank` ran in its recent steps (alpha and bus bandwidth
/// of the cost model). `None` until collectives of two sizes have run, and on a group of one.
pub fn measured_link<I: Backend>(rank: usize) -> Option<LinkFit> {
    let s = session::<I>("measured_link");
    s.clock(rank).link.fit()
}

/// The parameters `rank` zero-filled in its last step (see [`UnusedParameters::ZeroFill`](super::UnusedParameters::ZeroFill)).
pub fn last_zero_filled<I: Backend>(rank: usize) -> Vec<String> {
    let s = session::<I>("last_zero_filled");
    s.state(rank, "last_zero_filled").last_zero_filled.clone()
}

/// A gradient-accumulation scope of one rank (see [`no_sync`]); the scope ends when it drops.
#[must_use = "the scope ends when the guard drops"]
pub struct NoSync<I: Backend> {
    rank: usize,
    session: Arc<Session<I>>,
}

/// Starts a gradient-accumulation scope on `device`'s rank, like DDP's `no_sync()`: backward
/// passes inside it do not communicate, their gradients accumulate locally (in the order of the
/// passes), and the first backward pass after the scope adds the accumulated gradients to its
/// own, reduces the sums across ranks and writes them back. So a training loop runs its
/// micro-batches under the scope, drops their gradients, and steps the optimizer with the
/// gradients of the last micro-batch's backward, run after the scope ended; those are the
/// reduced sums over every rank's micro-batches.
pub fn no_sync<I: Backend>(device: &CollectiveDevice<I::Device>) -> NoSync<I> {
    let session = session::<I>("no_sync");
    let rank = device.rank as usize;
    session.state(rank, "no_sync").no_sync = true;
    NoSync { rank, session }
}

impl<I: Backend> Drop for NoSync<I> {
    fn drop(&mut self) {
        lock(&self.session.ranks[self.rank]).no_sync = false;
    }
}

/// The plan the next step of `rank` will follow and its optimized graph in text form (what logs
/// and snapshots show).
pub fn expected_plan<I: Backend>(rank: usize) -> Option<(Arc<Plan>, String)> {
    let s = session::<I>("expected_plan");
    let st = s.state(rank, "expected_plan");
    let plan = st.expected.clone()?;
    let mut optimized = st.expected_segment.clone()?;
    crate::passes::compile(&mut optimized, &s.expected_config(&st)).ok()?;
    Some((plan, crate::graph::print::print(&optimized)))
}

/// The graph of the last step `rank` synchronized, as recorded: every op since the previous sync
/// point (a `compute` node each, with data edges), each gradient as the result of the op that
/// produced it, its `grad_sync`, and the sync point. Compile it with [`crate::passes::compile`]
/// to see how the compiler buckets and schedules that step; print it with
/// [`crate::graph::print::print`].
pub fn recorded_step_graph<I: Backend>(rank: usize) -> Option<Graph> {
    let s = session::<I>("recorded_step_graph");
    let st = s.state(rank, "recorded_step_graph");
    st.last_step.as_ref().map(StepRecord::graph)
}

/// The order in which the ops of the last step `rank` synchronized ran, up to its sync point:
/// positions in record order, the order in which [`recorded_step_graph`] numbers its `compute`
/// nodes. Ops that ran eagerly as they were recorded, and ops that had not run by the sync point,
/// are absent. With `hoist-producers` on (the default), each gradient's producers run before the
/// ops it does not read, as that pass orders the recorded graph.
pub fn executed_step_order<I: Backend>(rank: usize) -> Option<Vec<usize>> {
    let s = session::<I>("executed_step_order");
    let st = s.state(rank, "executed_step_order");
    st.last_step.as_ref()?;
    let (ran, recorded) = &st.last_ran;
    let at: HashMap<u64, usize> = recorded.iter().enumerate().map(|(i, s)| (*s, i)).collect();
    Some(ran.iter().filter_map(|s| at.get(s).copied()).collect())
}

/// This process's communicators for `devices`, as `options.transport` says.
fn communicators<D: 'static>(
    devices: &[CollectiveDevice<D>],
    options: &CollectiveOptions,
) -> Result<(usize, crate::runtime::transport::ByRank), StartError> {
    let given: Vec<u32> = devices.iter().map(|d| d.rank).collect();
    let cuda_index = |rank: u32| -> Option<usize> {
        let d = devices.iter().find(|d| d.rank == rank)?;
        super::device::cuda_index(&d.inner as &dyn std::any::Any)
    };
    crate::runtime::transport::communicators(
        (&options.transport, options.tcp),
        &given,
        &cuda_index,
        std::any::type_name::<D>(),
        options.timeout,
    )
}

impl<I: Backend> Collective<I> {
    /// What [`DistributedBackend::start_communication_server`] does, with a start-up failure
    /// (a rank that never joins, an unreachable rank 0, NCCL that cannot start, options in the
    /// environment that do not parse) returned as a typed error instead of a panic: Burn's
    /// trait method cannot return one, so it panics with this error's message.
    ///
    /// # Errors
    /// [`StartError`], naming the rank, address or variable at fault.
    pub fn try_start_communication_server(
        devices: &[CollectiveDevice<I::Device>],
        config: DistributedConfig,
    ) -> Result<(), StartError> {
        if let Some(d) = devices.iter().find(|d| I::ad_enabled(&d.inner)) {
            return Err(StartError::InnerAutodiff {
                rank: d.rank,
                device: format!("{:?}", d.inner),
            });
        }
        let options = CollectiveOptions::take::<I>()?;
        let (world, mut comms) = communicators(devices, &options)?;
        let calls = comms
            .iter_mut()
            .map(|slot| {
                if !options.record_collectives {
                    return None;
                }
                let recording = crate::runtime::recording::Recording::new(slot.take()?);
                let log = recording.log();
                *slot = Some(Box::new(recording));
                Some(log)
            })
            .collect();
        let reduce = match config.all_reduce_op {
            ReduceOperation::Sum => ReduceOp::Sum,
            ReduceOperation::Mean => ReduceOp::Mean,
        };
        let session = Session::<I> {
            failed: std::sync::atomic::AtomicBool::new(false),
            threads: super::rank_threads::ThreadCounts::new(world),
            epoch: Instant::now(),
            trace: Mutex::new(Vec::new()),
            world,
            reduce,
            comms,
            device: (0..world).map(|_| DeviceCounts::default()).collect(),
            ranks: (0..world)
                .map(|_| {
                    Mutex::new(RankState {
                        submitted: Vec::new(),
                        index: HashMap::new(),
                        registered: Vec::new(),
                        expected: None,
                        expected_segment: None,
                        last_step: None,
                        last_ran: (Vec::new(), Vec::new()),
                        live: None,
                        cache: PlanCache::new(),
                        workspace: Workspace::default(),
                        leftover_workspace: Workspace::default(),
                        expected_entries: Vec::new(),
                        no_sync: false,
                        accumulated: HashMap::new(),
                        zero_filled: 0,
                        last_zero_filled: Vec::new(),
                        read_into_buckets: 0,
                        step_local: None,
                        local_steps: 0,
                        eager_steps: 0,
                        flushed_steps: 0,
                        held_steps: 0,
                        replicas: ReplicaState::default(),
                        probed: false,
                        planner: Default::default(),
                        history: Default::default(),
                        agreed: Default::default(),
                        join: None,
                    })
                })
                .collect(),
            user: (0..world).map(|_| Mutex::default()).collect(),
            clocks: (0..world)
                .map(|_| Mutex::new(StepClock::new(world)))
                .collect(),
            calls,
            options,
            _logs: super::lazy::LogReaders::new(devices.iter().map(|d| d.rank)),
        };
        sessions_mut().insert(TypeId::of::<I>(), Arc::new(session));
        lock(closed()).remove(&TypeId::of::<I>());
        super::params::register_hook::<Collective<I>>(super::replicas::replicate::<I>);
        super::sync_batch_norm::register_group::<CollectiveDevice<I::Device>, I>(
            super::sync_batch_norm::collective_group::<I>,
        );
        Ok(())
    }
}

impl<I: Backend> DistributedBackend for Collective<I> {
    /// Starts this process's ranks' communicators (see
    /// [`Collective::try_start_communication_server`]).
    ///
    /// # Panics
    /// On a start-up failure, with the typed error's message.
    fn start_communication_server(devices: &[Self::Device], config: DistributedConfig) {
        Self::try_start_communication_server(devices, config)
            .unwrap_or_else(|e| panic!("collective-fusion: {e}"))
    }

    fn close_communication_server(_device: &Self::Device) {
        let Some(s) = super::session::running::<I>() else {
            return;
        };
        // A rank may still be finishing its last step: its buckets were launched during backward
        // and completed with the other ranks', so they returned and the server is being closed,
        // while it has yet to reach its sync point. Let it (bounded by the timeout).
        let deadline = Instant::now() + s.options.timeout;
        while Instant::now() < deadline
            && !s.failed.load(std::sync::atomic::Ordering::SeqCst)
            && s.ranks.iter().any(|r| {
                let st = lock(r);
                !st.submitted.is_empty() || st.live.is_some()
            })
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        sessions_mut().remove(&TypeId::of::<I>());
        lock(closed()).insert(TypeId::of::<I>());
        if s.failed.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        // Gradients submitted after a rank's last sync point were never reduced: say so rather
        // than drop them silently.
        let late: Vec<String> = s
            .ranks
            .iter()
            .enumerate()
            .filter_map(|(r, st)| {
                let st = lock(st);
                let names: Vec<&str> = st.submitted.iter().map(|x| x.name.as_str()).collect();
                (!names.is_empty()).then(|| format!("rank {r}: {}", names.join(", ")))
            })
            .collect();
        if !late.is_empty() {
            for (r, c) in s.comms.iter().enumerate() {
                if let Some(c) = c {
                    c.abort(&format!("rank {r}: communication server closed"));
                }
            }
            panic!(
                "collective-fusion: close_communication_server: gradients were submitted after the last sync point and never reduced ({})",
                late.join("; ")
            );
        }
    }

    fn register_sync_parameters(device: &Self::Device, params: Vec<DistributedParams>) {
        let s = session::<I>("register_sync_parameters");
        let rank = device.rank as usize;
        works_for(&s, rank);
        if let Some(r) = s.ranks.get(rank) {
            lock(r).registered = params.iter().map(param_name).collect();
        }
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        let s = session::<I>("submit_gradient_sync");
        // SAFETY: Burn keeps the pointer valid until submit_sync_collective returns.
        let rank = unsafe { &*tensor.0 }.rank as usize;
        works_for(&s, rank);
        let start = Instant::now();
        // The user's all-reduces issued before launch first, without waiting here: the ranks'
        // exchange of queue lengths runs while backward goes on (`Session::hold_for_user`).
        let forced = s.submit(tensor, param_name(&params));
        super::hook_times::submitted(rank, start.elapsed(), forced);
    }

    // Out of line, so that a profile names the sync point (`scripts/step-instructions.sh`).
    #[inline(never)]
    fn submit_sync_collective(device: &Self::Device) {
        let s = session::<I>("submit_sync_collective");
        works_for(&s, device.rank as usize);
        let start = Instant::now();
        let parts = s.sync_point(device);
        super::hook_times::synced(device.rank as usize, start.elapsed(), parts);
    }

    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        super::user_collectives::all_reduce(session::<I>("all_reduce"), tensor, op, device_ids)
    }

    fn sync_collective(device: &Self::Device) {
        let s = session::<I>("sync_collective");
        works_for(&s, device.rank as usize);
        super::user_collectives::sync(&s, device.rank as usize);
    }
}

/// Every collective `rank`'s communicator was asked for so far, in order, when the server
/// records them ([`CollectiveOptions::record_collectives`]); `None` when it does not or the rank
/// is not one of this process's.
pub fn recorded_collectives<I: Backend>(rank: usize) -> Option<Vec<CollectiveDesc>> {
    let s = session::<I>("recorded_collectives");
    s.calls.get(rank)?.as_ref().map(|l| l.calls())
}

/// Adds a span of the caller's own work (forward, backward, optimizer) on `rank`'s compute
/// stream to the trace of the running communication server, when it traces.
pub fn trace_span<I: Backend>(rank: usize, name: &str, start: Instant, end: Instant) {
    let s = session::<I>("trace_span");
    if s.options.trace {
        let span = s.span(rank, SpanKind::Compute, name.to_string(), start, end);
        lock(&s.trace).push(span);
    }
}

/// Takes the spans traced so far (times in microseconds since the server started).
pub fn take_trace<I: Backend>() -> Vec<TraceSpan> {
    std::mem::take(&mut *lock(&session::<I>("take_trace").trace))
}

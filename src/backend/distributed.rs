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
use burn_backend::{Backend, DeviceId, TensorData};
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
use crate::runtime::HostBuffer;
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

pub(super) fn to_host(data: &TensorData) -> Result<HostBuffer, String> {
    let err = |e| format!("reading gradient data: {e:?}");
    Ok(match data.dtype {
        burn_std::DType::F32 => HostBuffer::F32(data.to_vec::<f32>().map_err(err)?),
        burn_std::DType::F64 => HostBuffer::F64(data.to_vec::<f64>().map_err(err)?),
        burn_std::DType::F16 => HostBuffer::F16(data.to_vec::<half::f16>().map_err(err)?),
        burn_std::DType::BF16 => HostBuffer::BF16(data.to_vec::<half::bf16>().map_err(err)?),
        d => return Err(format!("gradients of dtype {d:?} cannot be all-reduced")),
    })
}

/// A float tensor of `I` read into host memory (on a device backend, after the work queued
/// before it).
pub(super) fn read_host<I: Backend>(p: I::FloatTensorPrimitive) -> Result<HostBuffer, String> {
    if let Some(buf) = ndarray_host(&p) {
        return Ok(buf);
    }
    let data = cubecl::future::block_on(I::float_into_data(p)).map_err(|e| e.to_string())?;
    to_host(&data)
}

/// Writes a reduced member of a host bucket over an NdArray tensor's own memory, in row-major
/// order, where nothing else shares that memory (Burn's gradient, whose old values nobody reads
/// again) and the member is of the tensor's dtype and length: the copy back into the gradient
/// that DDP makes, with no buffer of its own. False, nothing written, otherwise (another
/// backend's tensor, storage that is borrowed or shared, a layout that is not row-major, a member
/// to cast back).
pub(super) fn ndarray_write(p: &mut dyn std::any::Any, g: &crate::runtime::Handed<'_>) -> bool {
    use burn_ndarray::NdArrayTensor;
    // A macro, not a function: the storage type is not nameable from here.
    macro_rules! write {
        ($storage:expr, $t:ty) => {{
            let Some(v) = g.wire_slice::<$t>() else {
                return false;
            };
            if !$storage.is_unique() || $storage.len() != v.len() {
                return false;
            }
            match $storage.ensure_owned().as_slice_mut() {
                Some(s) => {
                    s.copy_from_slice(v);
                    true
                }
                None => false,
            }
        }};
    }
    match p.downcast_mut::<NdArrayTensor>() {
        Some(NdArrayTensor::F32(s)) => write!(s, f32),
        Some(NdArrayTensor::F64(s)) => write!(s, f64),
        _ => false,
    }
}

/// An NdArray tensor's values in row-major order, copied straight out of its array: what
/// `float_into_data` gives, without its two slow steps for a gradient (one that other handles
/// still share, as a synced gradient is, is read element by element through a dynamic-rank
/// iterator, then copied again out of the bytes). A row-major array is one `memcpy`; any other
/// layout (a transposed weight gradient) is copied a last-axis lane at a time. `None` for
/// another backend's tensor or a dtype that is not a float.
fn ndarray_host(p: &dyn std::any::Any) -> Option<HostBuffer> {
    use burn_ndarray::NdArrayTensor;
    // A macro, not a function: the storage and view types are not nameable from here.
    macro_rules! row_major {
        ($storage:expr) => {{
            let v = $storage.view();
            match v.as_slice() {
                // Row-major and contiguous (a 0-d array always is): one copy.
                Some(s) => s.to_vec(),
                None => {
                    let mut out = Vec::with_capacity(v.len());
                    for lane in v.rows() {
                        match lane.as_slice() {
                            Some(s) => out.extend_from_slice(s),
                            None => out.extend(lane.iter().copied()),
                        }
                    }
                    out
                }
            }
        }};
    }
    Some(match p.downcast_ref::<NdArrayTensor>()? {
        NdArrayTensor::F32(s) => HostBuffer::F32(row_major!(s)),
        NdArrayTensor::F64(s) => HostBuffer::F64(row_major!(s)),
        _ => return None,
    })
}

pub(super) fn from_host(buf: HostBuffer, shape: burn_std::Shape) -> TensorData {
    match buf {
        HostBuffer::F32(v) => TensorData::new(v, shape),
        HostBuffer::F64(v) => TensorData::new(v, shape),
        HostBuffer::F16(v) => TensorData::new(v, shape),
        HostBuffer::BF16(v) => TensorData::new(v, shape),
    }
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
        &options.transport,
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
        let forced = s.submit(tensor, &params);
        super::hook_times::submitted(rank, start.elapsed(), forced);
    }

    // Out of line, so that a profile names the sync point (`scripts/step-instructions.sh`).
    #[inline(never)]
    fn submit_sync_collective(device: &Self::Device) {
        let s = session::<I>("submit_sync_collective");
        works_for(&s, device.rank as usize);
        let start = Instant::now();
        s.note_held(device.rank as usize);
        s.flush_user(device.rank as usize, None);
        let parts = s.sync(device);
        s.meet_after_backward(device.rank as usize);
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

#[cfg(test)]
mod tests {
    use super::{ndarray_host, ndarray_write, to_host};
    use burn_backend::tensor::FloatTensor;
    use burn_backend::{Backend, TensorData};
    use burn_ndarray::{NdArray, NdArrayDevice};

    /// What Burn's own read gives, through `TensorData`.
    fn burns<B: Backend>(p: FloatTensor<B>) -> crate::runtime::HostBuffer {
        let data = cubecl::future::block_on(B::float_into_data(p)).unwrap();
        to_host(&data).unwrap()
    }

    /// Tensors of `B` in many layouts: row-major, transposed, permuted, sliced, empty, a scalar.
    fn layouts<B: Backend>(d: &B::Device) -> Vec<(&'static str, FloatTensor<B>)> {
        let values: Vec<f32> = (0..2 * 3 * 4).map(|i| i as f32 * 0.5 - 3.0).collect();
        let base = || B::float_from_data(TensorData::new(values.clone(), [2, 3, 4]), d);
        let f64s = TensorData::new(vec![1.0f64, -2.5, 3.0, 4.0, 5.0, 6.0], [2, 3]);
        let cut = |a: isize, b: isize| burn_std::Slice::new(a, Some(b), 1);
        let all = |n: isize| cut(0, n);
        let scalar = TensorData::new(vec![-0.0f32], Vec::<usize>::new());
        vec![
            ("row-major", base()),
            ("transposed", B::float_swap_dims(base(), 1, 2)),
            ("permuted", B::float_permute(base(), &[2, 0, 1])),
            (
                "a slice",
                B::float_slice(base(), &[all(2), all(3), cut(1, 3)]),
            ),
            (
                "a slice of the first axis",
                B::float_slice(base(), &[cut(1, 2), all(3), all(4)]),
            ),
            (
                "empty",
                B::float_slice(base(), &[all(2), cut(0, 0), all(4)]),
            ),
            ("a scalar", B::float_from_data(scalar, d)),
            (
                "f64, transposed",
                B::float_swap_dims(B::float_from_data(f64s, d), 0, 1),
            ),
        ]
    }

    #[test]
    fn the_ndarray_read_gives_burns_values_in_every_layout() {
        for (what, p) in layouts::<NdArray>(&NdArrayDevice::Cpu) {
            // A second handle, as a synced gradient has (Burn keeps its own).
            let held = p.clone();
            let fast = ndarray_host(&p).expect("an NdArray float tensor");
            assert!(fast.bits_eq(&burns::<NdArray>(p)), "{what}");
            drop(held);
        }
    }

    #[test]
    fn another_backends_tensor_is_left_to_burn() {
        assert!(ndarray_host(&1.0f32).is_none());
    }

    /// A reduced member is written over a tensor's own memory only where that memory is the
    /// tensor's alone and row-major, and the member of its dtype: the tensor then reads as the
    /// member; anywhere else nothing is written, and the tensor (and every handle to it) reads
    /// as before.
    #[test]
    fn a_member_is_written_in_place_only_over_memory_nothing_else_shares() {
        use crate::codegen::layout::BucketLayout;
        use crate::graph::DType;
        use crate::runtime::{Handed, HostBuffer};
        let d = NdArrayDevice::Cpu;
        // Tensors not row-major, and row-major.
        let mut written = [0, 0];
        for (what, p) in layouts::<NdArray>(&d) {
            let before = burns::<NdArray>(p.clone());
            let n = before.len();
            let dtype = before.dtype();
            // Member 1 of a bucket, behind a member of 3 elements (an offset, alignment padding).
            let layout = BucketLayout::of_sizes(&[3, n as u64], dtype, dtype, None, 16);
            let values: Vec<f64> = (0..layout.numel).map(|i| i as f64 * 0.25 - 7.0).collect();
            let bucket = HostBuffer::from_f64(dtype, &values).unwrap();
            let member = Handed::Member {
                layout: &layout,
                member: 1,
                bucket: &bucket,
            };
            let want = crate::runtime::host::unpack_member(&layout, 1, &bucket).unwrap();
            let row_major = match &p {
                burn_ndarray::NdArrayTensor::F32(s) => s.view().is_standard_layout(),
                burn_ndarray::NdArrayTensor::F64(s) => s.view().is_standard_layout(),
                _ => false,
            };
            written[usize::from(row_major)] += 1;
            // Shared: a second handle (a gradient some later op still reads).
            let (mut shared, held) = (p.clone(), p.clone());
            assert!(!ndarray_write(&mut shared, &member), "{what}: shared");
            assert!(burns::<NdArray>(held).bits_eq(&before), "{what}: shared");
            assert!(burns::<NdArray>(shared).bits_eq(&before), "{what}: shared");
            // A member to cast back (an f32 gradient in a bf16 bucket).
            let cast = BucketLayout::of_sizes(&[n as u64], dtype, DType::BF16, None, 0);
            let bf16 = HostBuffer::zeros(DType::BF16, n).unwrap();
            let to_cast = Handed::Member {
                layout: &cast,
                member: 0,
                bucket: &bf16,
            };
            let mut alone = p;
            assert!(!ndarray_write(&mut alone, &to_cast), "{what}: cast");
            // Alone: written where row-major.
            let wrote = ndarray_write(&mut alone, &member);
            assert_eq!(wrote, row_major, "{what}");
            let after = burns::<NdArray>(alone);
            assert!(after.bits_eq(if wrote { &want } else { &before }), "{what}");
        }
        assert!(written[0] >= 2 && written[1] >= 4, "{written:?}");
        assert!(!ndarray_write(
            &mut 1.0f32,
            &Handed::Grad(Default::default())
        ));
    }
}

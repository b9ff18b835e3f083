//! `DistributedBackend` for `Collective<I>`: Burn's gradient-sync hooks, compiled.
//!
//! Per rank, a step's `submit_gradient_sync` calls are recorded in ready order. At
//! `submit_sync_collective` the rank builds the segment's graph (a gradient and a `grad_sync`
//! per submitted tensor, one `sync`), takes its plan from the rank's plan cache (compiled once per
//! distinct segment: bucketing, fused pack/unpack, async collectives, overlap schedule), runs it on
//! the rank's in-process communicator, and writes every reduced gradient back through Burn's
//! `TensorRef` before returning, as Burn requires.
//!
//! The hooks return nothing, so a failure (a rank that never arrives, mismatched segments, a bad
//! gradient) aborts the group, so that no other rank waits for this one, and then panics with
//! the typed error's message on the calling rank.

use std::any::{Any, TypeId};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedConfig, DistributedParams, ReduceOperation,
    TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DeviceId, TensorData, TensorMetadata};
use hashbrown::HashMap;

use super::options::{CollectiveOptions, Transport, UnusedParameters};
use super::record::{SubmittedGradient, step_graph};
use super::replicas::ReplicaState;
use super::user_collectives::UserReduce;
use super::{CTensor, Collective, CollectiveDevice};
use crate::codegen::plan::Plan;
use crate::graph::{DType, Graph, Op, ReduceOp, TensorType, Value};
use crate::runtime::cache::PlanCache;
use crate::runtime::comm::Communicator;
use crate::runtime::exec::ExecReport;
use crate::runtime::exec::{ExecOptions, Execution, NoHooks, Workspace, execute_in};
use crate::runtime::rendezvous::RendezvousConfig;
use crate::runtime::{Grad, HostBuffer, InProcessGroup};
use crate::trace::TraceSpan;

/// Gradient syncs completed in this process, all backends and ranks together.
static SYNCS_TOTAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many gradient syncs (one per rank per step) completed in this process so far.
pub fn gradient_syncs_total() -> u64 {
    SYNCS_TOTAL.load(std::sync::atomic::Ordering::Relaxed)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a rank tells the others at a zero-fill sync.
#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    /// Gradients the expected plan does not know: name, dtype, dimensions.
    extras: Vec<(String, String, Vec<u64>)>,
    /// Parameters of the expected plan this rank zero-filled.
    zero: Vec<String>,
}

/// One gradient submitted this step.
struct Submitted<I: Backend> {
    tref: TensorRef<Collective<I>>,
    name: String,
    ty: TensorType,
    /// Its data, unless it was handed to the live execution.
    data: Option<Grad>,
    /// The recorded node its tensor was when submitted.
    seq: Option<u64>,
}

/// A step following the previous step's plan: buckets are packed and launched as their last
/// gradient arrives, during backward.
struct Live {
    plan: Arc<Plan>,
    exec: Execution,
    /// Slot-indexed gradients.
    grads: Vec<Grad>,
    ready: Vec<bool>,
    /// Slot → index in `RankState::submitted`.
    source: Vec<Option<usize>>,
    /// A gradient arrived out of the plan's order: launch nothing more.
    diverged: bool,
}

pub(super) struct RankState<I: Backend> {
    submitted: Vec<Submitted<I>>,
    index: HashMap<String, usize>,
    /// Parameters Burn registered for this step's sync (their gradients must all arrive).
    registered: Vec<String>,
    /// The plan the previous step compiled to; the next step follows it while it can.
    expected: Option<Arc<Plan>>,
    /// Its segment graph as recorded (compiled again only when someone inspects it).
    expected_segment: Option<Graph>,
    /// The graph of the last synced step: every recorded op, the gradients, their syncs.
    last_step: Option<Graph>,
    live: Option<Live>,
    cache: PlanCache,
    workspace: Workspace,
    /// Workspace of the plans that reduce what a diverged step left over.
    leftover_workspace: Workspace,
    pub(super) user_collectives: u32,
    /// User all-reduces launched and not yet waited for by `sync_collective`.
    pub(super) user_pending: Vec<Arc<UserReduce>>,
    /// Under zero-fill, the (name, type) list the expected plan was compiled from, in order.
    expected_entries: Vec<(String, TensorType)>,
    /// Inside a [`no_sync`] scope: gradients accumulate here instead of being reduced.
    no_sync: bool,
    /// Gradients accumulated by backward passes under [`no_sync`], added to the next synced
    /// backward's gradient of the same parameter.
    accumulated: HashMap<String, (TensorType, HostBuffer)>,
    /// Zero-filled gradients (all steps), and the names zero-filled in the last step.
    zero_filled: u64,
    last_zero_filled: Vec<String>,
    /// Steps whose buckets launched during backward / steps that ran everything at the sync.
    eager_steps: u64,
    flushed_steps: u64,
    /// What `mark_distributed` replicated on this rank.
    pub(super) replicas: ReplicaState,
}

pub(super) struct Session<I: Backend> {
    /// A rank failed and aborted the group.
    failed: std::sync::atomic::AtomicBool,
    /// Time zero of traces.
    epoch: Instant,
    trace: Mutex<Vec<TraceSpan>>,
    pub(super) world: usize,
    reduce: ReduceOp,
    pub(super) options: CollectiveOptions,
    /// By rank; `None` for the ranks of other processes.
    comms: Vec<Option<Box<dyn Communicator>>>,
    ranks: Vec<Mutex<RankState<I>>>,
    /// What each rank did on the device.
    device: Vec<DeviceCounts>,
}

/// A rank's device work so far (the device fields of [`SyncStats`]).
#[derive(Default)]
struct DeviceCounts {
    /// Buckets packed on the device.
    packs: std::sync::atomic::AtomicU64,
    /// Collectives the communicator reduced in place on the device.
    collectives: std::sync::atomic::AtomicU64,
    /// Reduced gradients handed back as views of their bucket.
    views: std::sync::atomic::AtomicU64,
}

type Sessions = Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>;

fn sessions() -> &'static Sessions {
    static S: OnceLock<Sessions> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// The communication server running for `Collective<I>`, if one is.
pub(super) fn running<I: Backend>() -> Option<Arc<Session<I>>> {
    let any = lock(sessions()).get(&TypeId::of::<I>()).cloned();
    any.and_then(|a| a.downcast::<Session<I>>().ok())
}

fn session<I: Backend>(what: &str) -> Arc<Session<I>> {
    match running::<I>() {
        Some(s) => s,
        None => panic!(
            "collective-fusion: {what} before start_communication_server (no communication server is running for this backend)"
        ),
    }
}

fn param_name(p: &DistributedParams) -> String {
    super::params::name_of(p.param_id)
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
    let data = cubecl::future::block_on(I::float_into_data(p)).map_err(|e| e.to_string())?;
    to_host(&data)
}

pub(super) fn from_host(buf: HostBuffer, shape: burn_std::Shape) -> TensorData {
    match buf {
        HostBuffer::F32(v) => TensorData::new(v, shape),
        HostBuffer::F64(v) => TensorData::new(v, shape),
        HostBuffer::F16(v) => TensorData::new(v, shape),
        HostBuffer::BF16(v) => TensorData::new(v, shape),
    }
}

impl<I: Backend> Session<I> {
    /// Fails the whole group with `msg`, then panics on this rank.
    pub(super) fn fail(&self, rank: usize, msg: String) -> ! {
        self.failed.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(Some(c)) = self.comms.get(rank) {
            c.abort(&msg);
        }
        let prefix = format!("rank {rank}: ");
        let msg = msg.strip_prefix(&prefix).unwrap_or(&msg);
        panic!("collective-fusion: rank {rank}: {msg}");
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

    /// Adds a run's spans to the trace, when tracing.
    fn record(&self, rank: usize, report: &ExecReport) {
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
            let cat = match s.name.split(' ').next().unwrap_or("") {
                "pack" => "pack",
                "unpack" => "unpack",
                "all_reduce" => "all-reduce",
                "wait" => "wait",
                _ => "compute",
            };
            t.push(self.span(rank, s.stream, cat, s.name.clone(), s.start, s.end));
        }
    }

    fn span(
        &self,
        rank: usize,
        stream: &str,
        cat: &str,
        name: String,
        start: Instant,
        end: Instant,
    ) -> TraceSpan {
        let us = |t: Instant| t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6;
        TraceSpan {
            rank,
            stream: stream.to_string(),
            cat: cat.to_string(),
            name,
            start_us: us(start),
            dur_us: (us(end) - us(start)).max(0.0),
        }
    }

    fn opts(&self) -> ExecOptions {
        ExecOptions {
            timeout: self.options.timeout,
        }
    }

    /// The segment graph of `entries` and its plan, from the rank's plan cache; a compile error
    /// fails the step on every rank.
    fn compile_segment(
        &self,
        rank: usize,
        cache: &mut PlanCache,
        entries: &[(String, TensorType)],
    ) -> (Graph, Arc<Plan>) {
        let refs: Vec<(&str, &TensorType)> = entries.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let g = self.segment(&refs);
        match cache.get_or_compile(&g, &self.options.config) {
            Ok(p) => (g, p),
            Err(e) => self.fail(rank, format!("compiling the gradient sync: {e}")),
        }
    }

    /// The graph of a sync segment: a gradient and a `grad_sync` per entry, in ready order.
    fn segment(&self, entries: &[(&str, &TensorType)]) -> Graph {
        let mut g = Graph::new("sync");
        let group = g.add_group(self.world as u32);
        let mut syncs = Vec::with_capacity(entries.len());
        for (i, (name, ty)) in entries.iter().enumerate() {
            let src = g.add_node(
                Op::Input {
                    name: format!("{name}.grad"),
                },
                [(*ty).clone()],
                &[],
            );
            let grad = g.add_node(
                Op::Gradient {
                    param: name.to_string(),
                },
                [(*ty).clone()],
                &[Value::of(src)],
            );
            let sync = g.add_node(
                Op::GradSync {
                    param: name.to_string(),
                    ready: i as u32,
                    reduce: self.reduce,
                    group,
                },
                [(*ty).clone()],
                &[Value::of(grad)],
            );
            syncs.push(Value::of(sync));
        }
        g.add_node(Op::Sync, [], &syncs);
        g
    }

    fn submit(&self, tref: TensorRef<Collective<I>>, params: &DistributedParams) {
        // SAFETY: Burn keeps the pointer valid until submit_sync_collective returns.
        let t: &CTensor<I::FloatTensorPrimitive> = unsafe { &*tref.0 };
        let rank = t.rank as usize;
        let mut guard = self.state(rank, "submit_gradient_sync");
        let st = &mut *guard;
        let name = param_name(params);
        let Some(dtype) = graph_dtype(t.dtype()) else {
            self.fail(
                rank,
                format!(
                    "gradient of {name} has dtype {:?}, which is not a float",
                    t.dtype()
                ),
            );
        };
        let dims: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
        let ty = TensorType::new(dtype, &dims);
        if st.index.contains_key(&name) {
            self.fail(
                rank,
                format!("the gradient of {name} was submitted twice in one step"),
            );
        }
        let seq = t.seq();
        let i = st.submitted.len();
        st.index.insert(name.clone(), i);
        let inner = t.inner_for("gradient sync");
        let on_device = self.options.device_buckets
            && !self.options.check_finite
            && !st.no_sync
            && !st.accumulated.contains_key(&name);
        let grad = match on_device
            .then(|| super::device::device_grad(&inner))
            .flatten()
        {
            Some(g) => Grad::Device(g),
            None => {
                let mut buf = match read_host::<I>(inner) {
                    Ok(h) => h,
                    Err(e) => self.fail(rank, format!("reading the gradient of {name}: {e}")),
                };
                if self.options.check_finite
                    && let Some((at, v)) = buf.first_non_finite()
                {
                    self.fail(
                        rank,
                        format!("the gradient of {name} ({ty}) has {v} at element {at}"),
                    );
                }
                if st.no_sync {
                    // Accumulate locally; the gradient Burn holds stays this backward's own.
                    match st.accumulated.get_mut(&name) {
                        Some((t, acc)) if *t == ty => {
                            acc.accumulate(&buf);
                        }
                        Some((t, _)) => {
                            let t = t.clone();
                            self.fail(
                                rank,
                                format!(
                                    "the gradient of {name} is {ty}, but earlier backward passes under no_sync accumulated {t}"
                                ),
                            )
                        }
                        None => {
                            st.accumulated.insert(name.clone(), (ty.clone(), buf));
                        }
                    }
                    return;
                }
                if let Some((t, mut acc)) = st.accumulated.remove(&name) {
                    if t != ty {
                        self.fail(
                            rank,
                            format!(
                                "the gradient of {name} is {ty}, but the backward passes under no_sync accumulated {t}"
                            ),
                        );
                    }
                    // The micro-batches in order: the accumulated ones, then this one.
                    acc.accumulate(&buf);
                    buf = acc;
                }
                Grad::Host(buf)
            }
        };
        // The first gradient of a step starts following the previous step's plan.
        if st.live.is_none()
            && i == 0
            && let Some(plan) = st.expected.clone()
        {
            st.live = Some(self.start_live(rank, st, plan));
        }
        let mut data = Some(grad);
        if let Some(live) = st.live.as_mut().filter(|l| !l.diverged) {
            let next = live.exec.next_gradient(&live.plan);
            match next.map(|s| (s, &live.plan.slots[s as usize])) {
                Some((slot, s)) if s.param == name && s.ty == ty => {
                    live.grads[slot as usize] = data.take().unwrap_or_default();
                    live.ready[slot as usize] = true;
                    live.source[slot as usize] = Some(i);
                    // Pack and launch every bucket this gradient completes; never wait here.
                    self.advance_live(rank, live, &mut st.workspace, false);
                }
                _ => live.diverged = true,
            }
        }
        st.submitted.push(Submitted {
            tref,
            name,
            ty,
            data,
            seq,
        });
    }

    /// Runs a live execution as far as its gradients allow (`to_end`: to the end, waiting for
    /// its collectives); an error fails the step on every rank.
    fn advance_live(&self, rank: usize, live: &mut Live, ws: &mut Workspace, to_end: bool) {
        if let Err(e) = live.exec.run(
            &live.plan,
            self.comm(rank),
            &mut live.grads,
            &live.ready,
            &mut NoHooks,
            self.opts(),
            ws,
            to_end,
        ) {
            self.fail(rank, e.to_string());
        }
    }

    /// Starts running `plan` (the expected plan) for this step.
    fn start_live(&self, rank: usize, st: &mut RankState<I>, plan: Arc<Plan>) -> Live {
        match Execution::new(&plan, self.comm(rank), &mut st.workspace, self.opts()) {
            Ok(exec) => {
                let n = plan.slots.len();
                Live {
                    exec,
                    grads: (0..n).map(|_| Grad::default()).collect(),
                    ready: vec![false; n],
                    source: vec![None; n],
                    diverged: false,
                    plan,
                }
            }
            Err(e) => self.fail(rank, e.to_string()),
        }
    }

    /// Runs the rest of a live execution, waiting for its collectives, and records its spans;
    /// returns the slot-indexed reduced gradients and their submission indices.
    fn complete_live(
        &self,
        rank: usize,
        mut live: Live,
        ws: &mut Workspace,
    ) -> (Vec<Grad>, Vec<Option<usize>>) {
        self.advance_live(rank, &mut live, ws, true);
        match live.exec.finish() {
            Ok(report) => self.record(rank, &report),
            Err(e) => self.fail(rank, e.to_string()),
        }
        (live.grads, live.source)
    }

    fn sync(&self, device: &CollectiveDevice<I::Device>) {
        let rank = device.rank as usize;
        let mut guard = self.state(rank, "submit_sync_collective");
        let st = &mut *guard;
        let log = super::lazy::take_log(device.rank);
        if st.no_sync {
            // A backward pass under no_sync: its gradients were accumulated, nothing to reduce.
            st.submitted.clear();
            st.index.clear();
            st.registered.clear();
            return;
        }
        if !st.accumulated.is_empty() {
            let mut names: Vec<&str> = st.accumulated.keys().map(String::as_str).collect();
            names.sort_unstable();
            let msg = format!(
                "gradients accumulated under no_sync were not submitted by the backward pass that synchronizes them: {}",
                names.join(", ")
            );
            self.fail(rank, msg);
        }
        let reduced = if self.options.unused == UnusedParameters::ZeroFill {
            self.reduce_zero_fill(rank, st)
        } else {
            self.reduce_following(rank, st)
        };
        // Write back in place, through the pointers Burn gave us; only now, so a failed step
        // leaves every gradient as it was.
        for (sub, g) in st.submitted.iter().zip(reduced) {
            let Some(g) = g else { continue };
            // SAFETY: Burn keeps the pointer valid until this hook returns; nothing else
            // touches the gradient meanwhile.
            let t: &mut CTensor<I::FloatTensorPrimitive> = unsafe { &mut *sub.tref.0 };
            let buf = match g {
                Grad::Host(buf) => buf,
                Grad::Device(g) => {
                    // The reduced gradient, in a new buffer of the tensor's own device.
                    let like = t.inner_for("gradient write-back");
                    match super::device::tensor_from(&like, g).map_err(|g| g.read()) {
                        Ok(p) => {
                            t.set(p);
                            continue;
                        }
                        Err(Ok(buf)) => buf,
                        Err(Err(e)) => self.fail(rank, format!("{}: {e}", sub.name)),
                    }
                }
            };
            let data = from_host(buf, t.shape());
            let dev = t.device(|p| I::float_device(p));
            t.set(I::float_from_data(data, &dev));
        }
        let grads: Vec<SubmittedGradient<'_>> = st
            .submitted
            .iter()
            .map(|x| SubmittedGradient {
                name: &x.name,
                ty: &x.ty,
                seq: x.seq,
            })
            .collect();
        st.last_step = Some(step_graph(self.world as u32, self.reduce, &grads, &log));
        st.submitted.clear();
        st.index.clear();
        st.registered.clear();
        SYNCS_TOTAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The default sync: every registered gradient must have arrived; the step follows the
    /// previous step's plan as far as its gradients came in that plan's order, and reduces the
    /// rest with a plan of its own. Returns the reduced gradients by submission index.
    fn reduce_following(&self, rank: usize, st: &mut RankState<I>) -> Vec<Option<Grad>> {
        let missing: Vec<&str> = st
            .registered
            .iter()
            .filter(|n| !st.index.contains_key(*n))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            let shown: Vec<&str> = missing.iter().take(8).copied().collect();
            let msg = format!(
                "the gradients of {} registered parameter(s) never arrived before the sync point: {}{}",
                missing.len(),
                shown.join(", "),
                if missing.len() > shown.len() {
                    ", …"
                } else {
                    ""
                }
            );
            self.fail(rank, msg);
        }
        if st.submitted.is_empty() {
            return Vec::new();
        }
        let opts = self.opts();
        let comm = self.comm(rank);
        // Reduced gradients by submission index.
        let mut reduced: Vec<Option<Grad>> = (0..st.submitted.len()).map(|_| None).collect();
        if let Some(mut live) = st.live.take() {
            let complete = !live.diverged
                && live.ready.iter().all(|r| *r)
                && live.plan.slots.len() == st.submitted.len();
            if complete {
                let (grads, source) = self.complete_live(rank, live, &mut st.workspace);
                st.eager_steps += 1;
                for (slot, buf) in grads.into_iter().enumerate() {
                    if let Some(i) = source[slot] {
                        reduced[i] = Some(buf);
                    }
                }
            } else {
                // Finish what was launched (every rank launched the same), give the rest back.
                let done = match live.exec.drain(
                    &live.plan,
                    comm,
                    &mut live.grads,
                    opts,
                    &mut st.workspace,
                ) {
                    Ok(d) => d,
                    Err(e) => self.fail(rank, e.to_string()),
                };
                if let Ok(report) = live.exec.finish() {
                    self.record(rank, &report);
                }
                let mut is_done = vec![false; live.grads.len()];
                for s in done {
                    is_done[s as usize] = true;
                }
                for (slot, buf) in live.grads.into_iter().enumerate() {
                    if let Some(i) = live.source[slot] {
                        if is_done[slot] {
                            reduced[i] = Some(buf);
                        } else {
                            st.submitted[i].data = Some(buf);
                        }
                    }
                }
            }
        }
        // Whatever is not reduced yet: compile (cached) and run its own plan, in ready order.
        let left: Vec<usize> = (0..st.submitted.len())
            .filter(|i| reduced[*i].is_none())
            .collect();
        if !left.is_empty() {
            let owned: Vec<(String, TensorType)> = left
                .iter()
                .map(|i| (st.submitted[*i].name.clone(), st.submitted[*i].ty.clone()))
                .collect();
            let (_, plan) = self.compile_segment(rank, &mut st.cache, &owned);
            let mut grads: Vec<Grad> = Vec::with_capacity(plan.slots.len());
            let mut source = Vec::with_capacity(plan.slots.len());
            for s in &plan.slots {
                let i = left[owned.iter().position(|(n, _)| *n == s.param).unwrap_or(0)];
                grads.push(st.submitted[i].data.take().unwrap_or_default());
                source.push(i);
            }
            let ws = if left.len() == st.submitted.len() {
                &mut st.workspace
            } else {
                &mut st.leftover_workspace
            };
            match execute_in(&plan, comm, &mut grads, &mut NoHooks, opts, ws) {
                Ok(report) => self.record(rank, &report),
                Err(e) => self.fail(rank, e.to_string()),
            }
            for (buf, i) in grads.into_iter().zip(source) {
                reduced[i] = Some(buf);
            }
            st.flushed_steps += 1;
        }
        // The next step follows this step's order.
        if st.expected.is_none() || !left.is_empty() {
            let owned: Vec<(String, TensorType)> = st
                .submitted
                .iter()
                .map(|s| (s.name.clone(), s.ty.clone()))
                .collect();
            let (g, plan) = self.compile_segment(rank, &mut st.cache, &owned);
            st.expected = Some(plan);
            st.expected_segment = Some(g);
        }
        reduced
    }

    /// The zero-fill sync ([`UnusedParameters::ZeroFill`]). Every rank runs the previous step's
    /// plan to the end, zeros standing in for gradients that did not arrive here; then the
    /// ranks exchange manifests (gradients that plan does not know, names they zero-filled) and
    /// all run one plan for the union of the unknown ones, zero-filling likewise. The next
    /// step's plan, the same on every rank: this plan's entries, less those zero-filled on every
    /// rank, then the union.
    fn reduce_zero_fill(&self, rank: usize, st: &mut RankState<I>) -> Vec<Option<Grad>> {
        let opts = self.opts();
        let comm = self.comm(rank);
        let n = st.submitted.len();
        let mut reduced: Vec<Option<Grad>> = (0..n).map(|_| None).collect();
        let mut zero: Vec<String> = Vec::new();
        let zeros = |ty: &TensorType, name: &str| {
            HostBuffer::zeros(ty.dtype, ty.numel() as usize)
                .map(Grad::Host)
                .ok_or_else(|| {
                    format!("cannot zero-fill the gradient of {name}: {ty} is not a float type")
                })
        };
        if let Some(plan) = st.expected.clone() {
            let mut live = match st.live.take() {
                Some(l) => l,
                None => self.start_live(rank, st, plan.clone()),
            };
            let launched_early = live.ready.iter().any(|r| *r);
            for (slot, s) in plan.slots.iter().enumerate() {
                if live.ready[slot] {
                    continue;
                }
                live.grads[slot] = match st.index.get(&s.param).copied() {
                    Some(i) if st.submitted[i].ty == s.ty => {
                        live.source[slot] = Some(i);
                        st.submitted[i].data.take().unwrap_or_default()
                    }
                    Some(i) => self.fail(
                        rank,
                        format!(
                            "the gradient of {} is {}, but it was {} in the previous step",
                            s.param, st.submitted[i].ty, s.ty
                        ),
                    ),
                    None => {
                        zero.push(s.param.clone());
                        zeros(&s.ty, &s.param).unwrap_or_else(|e| self.fail(rank, e))
                    }
                };
                live.ready[slot] = true;
            }
            let (grads, source) = self.complete_live(rank, live, &mut st.workspace);
            if launched_early {
                st.eager_steps += 1;
            }
            for (slot, buf) in grads.into_iter().enumerate() {
                if let Some(i) = source[slot] {
                    reduced[i] = Some(buf);
                }
            }
        }
        // The manifests.
        let extras: Vec<usize> = (0..n).filter(|i| reduced[*i].is_none()).collect();
        let manifest = Manifest {
            extras: extras
                .iter()
                .map(|i| {
                    let s = &st.submitted[*i];
                    (
                        s.name.clone(),
                        s.ty.dtype.name().to_string(),
                        s.ty.shape.to_vec(),
                    )
                })
                .collect(),
            zero: zero.clone(),
        };
        let bytes = serde_json::to_vec(&manifest).unwrap_or_default();
        let all = match crate::runtime::agree::all_gather_bytes(comm, &bytes, opts.timeout) {
            Ok(a) => a,
            Err(e) => self.fail(rank, format!("exchanging gradient manifests: {e}")),
        };
        let mut union: Vec<(String, TensorType)> = Vec::new();
        let mut owner: HashMap<String, (usize, TensorType)> = HashMap::new();
        let mut zero_count: HashMap<String, usize> = HashMap::new();
        for (r, bytes) in all.iter().enumerate() {
            let Manifest {
                extras,
                zero: zeroed,
            } = match serde_json::from_slice(bytes) {
                Ok(m) => m,
                Err(e) => self.fail(rank, format!("the gradient manifest of rank {r}: {e}")),
            };
            for name in zeroed {
                *zero_count.entry(name).or_default() += 1;
            }
            for (name, dtype, dims) in extras {
                let Some(dtype) = DType::from_name(&dtype) else {
                    self.fail(
                        rank,
                        format!("rank {r} sent the gradient of {name} with dtype {dtype}"),
                    );
                };
                let ty = TensorType::new(dtype, &dims);
                match owner.get(&name) {
                    Some((r0, t0)) if *t0 != ty => self.fail(
                        rank,
                        format!("the gradient of {name} is {t0} on rank {r0} but {ty} on rank {r}"),
                    ),
                    Some(_) => {}
                    None => {
                        owner.insert(name.clone(), (r, ty.clone()));
                        union.push((name, ty));
                    }
                }
            }
        }
        if !union.is_empty() {
            let (_, plan) = self.compile_segment(rank, &mut st.cache, &union);
            let mut grads: Vec<Grad> = Vec::with_capacity(plan.slots.len());
            let mut source = Vec::with_capacity(plan.slots.len());
            for s in &plan.slots {
                match st.index.get(&s.param).copied() {
                    Some(i) if reduced[i].is_none() => {
                        grads.push(st.submitted[i].data.take().unwrap_or_default());
                        source.push(Some(i));
                    }
                    _ => {
                        zero.push(s.param.clone());
                        grads.push(zeros(&s.ty, &s.param).unwrap_or_else(|e| self.fail(rank, e)));
                        source.push(None);
                    }
                }
            }
            match execute_in(
                &plan,
                comm,
                &mut grads,
                &mut NoHooks,
                opts,
                &mut st.leftover_workspace,
            ) {
                Ok(report) => self.record(rank, &report),
                Err(e) => self.fail(rank, e.to_string()),
            }
            for (buf, i) in grads.into_iter().zip(source) {
                if let Some(i) = i {
                    reduced[i] = Some(buf);
                }
            }
            st.flushed_steps += 1;
        }
        let unused_everywhere: Vec<&String> = zero_count
            .iter()
            .filter(|(_, c)| **c == self.world)
            .map(|(n, _)| n)
            .collect();
        if !union.is_empty() || !unused_everywhere.is_empty() {
            let mut entries: Vec<(String, TensorType)> = st
                .expected_entries
                .iter()
                .filter(|(n, _)| !unused_everywhere.contains(&n))
                .cloned()
                .collect();
            entries.extend(union);
            if entries.is_empty() {
                st.expected = None;
                st.expected_segment = None;
            } else {
                let (g, plan) = self.compile_segment(rank, &mut st.cache, &entries);
                st.expected = Some(plan);
                st.expected_segment = Some(g);
            }
            st.expected_entries = entries;
        }
        if !zero.is_empty() {
            tracing::debug!(rank, params = ?zero, "zero-filled gradients of unused parameters");
        }
        st.zero_filled += zero.len() as u64;
        st.last_zero_filled = zero;
        reduced
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
    /// Plans compiled.
    pub compiled: u64,
    /// Gradients this rank zero-filled under [`UnusedParameters::ZeroFill`] (all steps). Each
    /// is a parameter the other ranks reduced and updated while this rank, which has no
    /// gradient for it, did not.
    pub zero_filled: u64,
    /// Buckets packed and unpacked by the CubeCL kernels on the gradients' device buffers
    /// (see [`CollectiveOptions::device_buckets`]); the rest were packed in host memory.
    pub device_buckets: u64,
    /// Collectives the communicator reduced in place in device memory (NCCL on the gradients'
    /// GPU: nothing crossed to the host): device-packed buckets, and device copies of the
    /// gradients that have an all-reduce of their own. Every other collective went through
    /// host memory.
    pub device_collectives: u64,
    /// Reduced gradients handed back as views of their device bucket instead of copies
    /// ([`CompileConfig::gradient_as_bucket_view`]).
    pub view_grads: u64,
}

/// The sync statistics of `rank` of the running communication server for `Collective<I>`.
pub fn sync_stats<I: Backend>(rank: usize) -> SyncStats {
    use std::sync::atomic::Ordering::Relaxed;
    let s = session::<I>("sync_stats");
    let st = s.state(rank, "sync_stats");
    SyncStats {
        eager_steps: st.eager_steps,
        flushed_steps: st.flushed_steps,
        compiled: st.cache.misses(),
        zero_filled: st.zero_filled,
        device_buckets: s.device[rank].packs.load(Relaxed),
        device_collectives: s.device[rank].collectives.load(Relaxed),
        view_grads: s.device[rank].views.load(Relaxed),
    }
}

/// The parameters `rank` zero-filled in its last step (see [`UnusedParameters::ZeroFill`]).
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
    crate::passes::compile(&mut optimized, &s.options.config).ok()?;
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
    st.last_step.clone()
}

/// The group's size and this process's communicators by rank, as `options.transport` says; a
/// start-up failure panics with the typed error's message.
fn communicators<D: 'static>(
    devices: &[CollectiveDevice<D>],
    options: &CollectiveOptions,
) -> (usize, Vec<Option<Box<dyn Communicator>>>) {
    let given: Vec<u32> = devices.iter().map(|d| d.rank).collect();
    let one_rank = |cfg: &RendezvousConfig, transport: &str| {
        if given != [cfg.rank as u32] {
            panic!(
                "collective-fusion: start_communication_server over {transport} takes this process's one device, of rank {} (RANK), got devices of ranks {given:?}",
                cfg.rank
            );
        }
    };
    let fail = |e: &dyn std::fmt::Display| -> ! {
        panic!("collective-fusion: start_communication_server: {e}")
    };
    let place = |world: usize, rank: usize, c: Box<dyn Communicator>| {
        let mut v: Vec<Option<Box<dyn Communicator>>> = (0..world).map(|_| None).collect();
        v[rank] = Some(c);
        (world, v)
    };
    let every_rank = || {
        let world = devices.len();
        let mut ranks = given.clone();
        ranks.sort_unstable();
        if ranks != (0..world as u32).collect::<Vec<_>>() {
            panic!(
                "collective-fusion: start_communication_server needs the ranks 0..{world} once each, got {given:?}"
            );
        }
        world
    };
    match &options.transport {
        Transport::InProcess => {
            let world = every_rank();
            let comms = InProcessGroup::ranks(world, options.timeout)
                .into_iter()
                .map(|c| Some(Box::new(c) as Box<dyn Communicator>))
                .collect();
            (world, comms)
        }
        Transport::Tcp(cfg) => {
            one_rank(cfg, "TCP");
            match crate::runtime::tcp::TcpComm::connect(cfg, options.timeout) {
                Ok(c) => place(cfg.world, cfg.rank, Box::new(c)),
                Err(e) => fail(&e),
            }
        }
        #[cfg(feature = "cuda")]
        Transport::NcclLocal => {
            let world = every_rank();
            let mut gpus = vec![0usize; world];
            for d in devices {
                let inner = &d.inner as &dyn Any;
                let cuda = inner
                    .downcast_ref::<cubecl::cuda::CudaDevice>()
                    .or_else(
                        || match inner.downcast_ref::<burn_dispatch::DispatchDevice>() {
                            Some(burn_dispatch::DispatchDevice::Cuda(c)) => Some(c),
                            _ => None,
                        },
                    );
                match cuda {
                    Some(c) => gpus[d.rank as usize] = c.index,
                    None => panic!(
                        "collective-fusion: start_communication_server over in-process NCCL needs a CUDA device per rank (Collective<Cuda>); rank {} is on {}",
                        d.rank,
                        std::any::type_name::<D>()
                    ),
                }
            }
            match crate::runtime::nccl::NcclComm::group(&gpus, options.timeout) {
                Ok(comms) => (
                    world,
                    comms
                        .into_iter()
                        .map(|c| Some(Box::new(c) as Box<dyn Communicator>))
                        .collect(),
                ),
                Err(e) => fail(&e),
            }
        }
        #[cfg(feature = "cuda")]
        Transport::Nccl(cfg) => {
            one_rank(cfg, "NCCL");
            match crate::runtime::nccl::NcclComm::join(cfg, options.timeout) {
                Ok(c) => place(cfg.world, cfg.rank, Box::new(c)),
                Err(e) => fail(&e),
            }
        }
    }
}

impl<I: Backend> DistributedBackend for Collective<I> {
    fn start_communication_server(devices: &[Self::Device], config: DistributedConfig) {
        let options = CollectiveOptions::take::<I>().unwrap_or_else(|e| {
            panic!("collective-fusion: start_communication_server: the environment: {e}")
        });
        let (world, comms) = communicators(devices, &options);
        let reduce = match config.all_reduce_op {
            ReduceOperation::Sum => ReduceOp::Sum,
            ReduceOperation::Mean => ReduceOp::Mean,
        };
        let session = Session::<I> {
            failed: std::sync::atomic::AtomicBool::new(false),
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
                        live: None,
                        cache: PlanCache::new(),
                        workspace: Workspace::default(),
                        leftover_workspace: Workspace::default(),
                        user_collectives: 0,
                        user_pending: Vec::new(),
                        expected_entries: Vec::new(),
                        no_sync: false,
                        accumulated: HashMap::new(),
                        zero_filled: 0,
                        last_zero_filled: Vec::new(),
                        eager_steps: 0,
                        flushed_steps: 0,
                        replicas: ReplicaState::default(),
                    })
                })
                .collect(),
            options,
        };
        lock(sessions()).insert(TypeId::of::<I>(), Arc::new(session));
        super::params::register_hook::<Collective<I>>(super::replicas::replicate::<I>);
    }

    fn close_communication_server(_device: &Self::Device) {
        let Some(s) = lock(sessions())
            .get(&TypeId::of::<I>())
            .cloned()
            .and_then(|a| a.downcast::<Session<I>>().ok())
        else {
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
        lock(sessions()).remove(&TypeId::of::<I>());
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
        if let Some(r) = s.ranks.get(rank) {
            lock(r).registered = params.iter().map(param_name).collect();
        }
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        session::<I>("submit_gradient_sync").submit(tensor, &params);
    }

    fn submit_sync_collective(device: &Self::Device) {
        session::<I>("submit_sync_collective").sync(device);
    }

    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        super::user_collectives::all_reduce(session::<I>("all_reduce"), tensor, op, device_ids)
    }

    fn sync_collective(device: &Self::Device) {
        super::user_collectives::sync(&session::<I>("sync_collective"), device.rank as usize);
    }
}

/// Adds a span of the caller's own work (forward, backward, optimizer) on `rank`'s compute
/// stream to the trace of the running communication server, when it traces.
pub fn trace_span<I: Backend>(rank: usize, name: &str, start: Instant, end: Instant) {
    let s = session::<I>("trace_span");
    if s.options.trace {
        let span = s.span(rank, "compute", "compute", name.to_string(), start, end);
        lock(&s.trace).push(span);
    }
}

/// Takes the spans traced so far (times in microseconds since the server started).
pub fn take_trace<I: Backend>() -> Vec<TraceSpan> {
    std::mem::take(&mut *lock(&session::<I>("take_trace").trace))
}

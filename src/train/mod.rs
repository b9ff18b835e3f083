//! A real data-parallel training run: `Autodiff<Collective<I>>` with `I` Burn's NdArray (CPU
//! ranks, the default), wgpu or CUDA backend, one thread per local rank, burn-nn models, SGD,
//! synthetic data. What the `run` command drives; its trace shows where each rank's step time
//! goes (forward, backward, optimizer on the compute stream; pack, all-reduce, wait and unpack
//! of every bucket).
//!
//! It is the `run` command's driver and the models the tests and benchmarks train, public for
//! them: an example of `Collective<B>` under Burn's own modules and optimizer, not a training
//! framework. A real job uses its own loop, or burn-train's learner, over `Collective<B>`.

use std::time::Instant;

use burn_autodiff::Autodiff;
use burn_backend::Backend;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::module::{Module, ModuleVisitor, Param};
use burn_core::tensor::{Tensor, TensorData};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::loss::{MseLoss, Reduction};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};

use crate::backend::{
    BufferSync, Collective, CollectiveDevice, CollectiveOptions, JoinOptions, JoinReport,
    LazyStats, SyncStats, Transport, join_with, lazy_stats, mark_distributed, measured_link,
    measured_step, recorded_step_graph, sync_buffers, sync_stats, take_trace, trace_span,
};
use crate::config::CompileConfig;
use crate::graph::print::print;
use crate::graph::{ComputeKind, Graph, Op};
use crate::measure::{LinkFit, MeasuredStep};
use crate::passes::{CompileError, compile};
use crate::trace::TraceSpan;

mod compare;
pub mod memory;
mod nets;
pub mod overhead;

pub use compare::{PolicyComparison, PolicyRun, StepGap, compare_policies};
pub use nets::{Block, Blocks, ConvNet, INPUTS, Mlp, Net, OUTPUTS, ResBlock, ResNet, RunModel};

/// The autodiff backend the ranks train on, over inner backend `I`.
type B<I> = Autodiff<Collective<I>>;
type Dev<I> = CollectiveDevice<<I as burn_backend::BackendTypes>::Device>;

/// Which of Burn's backends the ranks run inside `Collective`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunBackend {
    /// NdArray on the CPU: gradients in host memory.
    NdArray,
    /// wgpu (Vulkan, Metal, DX12; Mesa's software driver without a GPU), every rank on the
    /// default adapter: gradients stay in device buffers, buckets packed by the CubeCL kernels.
    Wgpu,
    /// CUDA (feature `cuda`): rank `r` of this process on GPU `r` for in-process ranks (all on
    /// GPU 0 with the in-process transport), `LOCAL_RANK`'s GPU with one rank per process.
    Cuda,
    /// Burn's runtime-selected backend, `burn::Dispatch`, on one of its devices.
    Dispatch(DispatchOn),
}

/// The device `Dispatch` runs on (a backend of its own chosen at run time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DispatchOn {
    /// Its NdArray device.
    NdArray,
    /// Its wgpu device (the default adapter).
    Wgpu,
    /// Its CUDA device (feature `cuda`), GPUs chosen as for [`RunBackend::Cuda`].
    Cuda,
}

impl RunBackend {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            RunBackend::NdArray => "ndarray",
            RunBackend::Wgpu => "wgpu",
            RunBackend::Cuda => "cuda",
            RunBackend::Dispatch(DispatchOn::NdArray) => "dispatch (ndarray)",
            RunBackend::Dispatch(DispatchOn::Wgpu) => "dispatch (wgpu)",
            RunBackend::Dispatch(DispatchOn::Cuda) => "dispatch (cuda)",
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Ranks (threads), with the in-process transport; with a multi-process transport the group
    /// size comes from its configuration and this process runs its one rank.
    pub world: u32,
    /// Model.
    pub model: RunModel,
    /// Training steps.
    pub steps: usize,
    /// Samples per rank per step.
    pub batch: usize,
    /// The inner backend.
    pub backend: RunBackend,
    /// Seed of this process's model initialization (processes seeded differently start
    /// different, until marking the model gives every rank rank 0's weights).
    pub seed: u64,
    /// How the gradient sync compiles and runs.
    pub collective: CollectiveOptions,
    /// How the ranks' buffers (BatchNorm's running statistics) are made alike before each
    /// step's forward pass ([`sync_buffers`]; a model without buffers communicates nothing).
    pub buffers: BufferSync,
    /// `RunModel::ResNet`'s norms as [`SyncBatchNorm`](crate::backend::SyncBatchNorm)
    /// (statistics over every rank's batch) instead of Burn's `BatchNorm`.
    pub sync_norm: bool,
    /// Uneven inputs: when above 0, rank `r` of `w` trains `steps - (w - 1 - r) × uneven` steps
    /// (the last rank all of them) inside a [`join_with`] scope, and every rank ends with the
    /// weights of the last to train ([`JoinReport`]).
    pub uneven: usize,
    /// With [`uneven`](Self::uneven): how the scope divides a step some ranks sat out.
    pub join: JoinOptions,
}

/// One step, as rank 0 saw it.
#[derive(Clone, Debug)]
pub struct StepRecord {
    /// Wall time of the step on rank 0 (forward, backward with sync, optimizer), seconds.
    pub secs: f64,
    /// Backward including the gradient sync, seconds.
    pub backward_secs: f64,
    /// Loss on rank 0's batch.
    pub loss: f32,
}

/// The outcome of a run.
#[derive(Clone, Debug)]
pub struct RunReport {
    /// Per step.
    pub steps: Vec<StepRecord>,
    /// Parameters and their bytes.
    pub params: usize,
    /// Gradient bytes per step.
    pub bytes: u64,
    /// Every rank's sync statistics.
    pub stats: Vec<SyncStats>,
    /// Every rank's lazy-recording counters over the run.
    pub lazy: Vec<LazyStats>,
    /// Rank 0's last recorded step, compiled (absent if no step was synchronized).
    pub step: Option<RecordedStep>,
    /// The trace (empty unless `collective.trace`).
    pub trace: Vec<TraceSpan>,
    /// Whether every rank of this process ended with the same weights.
    pub ranks_agree: bool,
    /// Ranks in the group.
    pub world: u32,
    /// The ranks this process ran (the first one's numbers are the ones reported).
    pub local_ranks: Vec<u32>,
    /// FNV-1a over the bits of the first local rank's final weights: equal digests, equal
    /// weights, across processes and runs.
    pub weights_digest: u64,
    /// What the first local rank measured of its last step.
    pub measured: Option<MeasuredStep>,
    /// What the first local rank measured of each synced step, in order.
    pub measured_steps: Vec<MeasuredStep>,
    /// The same for each other local rank (in `local_ranks` order).
    pub peer_measured_steps: Vec<Vec<MeasuredStep>>,
    /// The link the first local rank fitted (a group of more than one rank).
    pub link: Option<LinkFit>,
    /// With [`RunOptions::uneven`]: what each local rank's join scope saw (in `local_ranks`
    /// order); empty otherwise.
    pub joins: Vec<JoinReport>,
    /// The run's steps ([`RunOptions::steps`]).
    pub steps_run: usize,
    /// The run's [`RunOptions::uneven`].
    pub uneven: usize,
}

impl RunReport {
    /// The steps rank `rank` trained on inputs of its own (fewer than the run's under
    /// [`RunOptions::uneven`]).
    pub fn steps_of(&self, rank: usize) -> usize {
        uneven_steps(self.steps_run, self.uneven, self.world as usize, rank)
    }
}

/// The steps rank `rank` of `world` trains with `uneven` ([`RunOptions::uneven`]): `steps`
/// less `uneven` for each rank after it (none below zero).
fn uneven_steps(steps: usize, uneven: usize, world: usize, rank: usize) -> usize {
    steps.saturating_sub(world.saturating_sub(1 + rank) * uneven)
}

/// FNV-1a (64-bit) over the bits of `w`.
pub fn weights_digest(w: &[f32]) -> u64 {
    use std::hash::Hasher as _;
    let mut h = crate::graph::Fnv64::default();
    for x in w {
        h.write(&x.to_bits().to_le_bytes());
    }
    h.finish()
}

/// A recorded step, compiled with the run's options.
#[derive(Clone, Debug)]
pub struct RecordedStep {
    /// Recorded ops (compute nodes).
    pub ops: usize,
    /// Of which matrix products and convolutions.
    pub heavy_ops: usize,
    /// Their estimated floating-point operations.
    pub flops: u64,
    /// Collectives the compiler formed.
    pub buckets: usize,
    /// Ops scheduled after the first collective's launch: the compute it can overlap.
    pub ops_after_first_launch: usize,
    /// The recorded graph in text form, before compilation (what `profile --model FILE` reads).
    pub text: String,
}

impl RecordedStep {
    /// Compiles `graph` with `config` and summarizes it.
    pub fn of(recorded: Graph, config: &CompileConfig) -> Result<Self, CompileError> {
        let text = print(&recorded);
        let mut graph = recorded;
        compile(&mut graph, config)?;
        // The compiler verified the graph, so it has a schedule.
        let order = graph.topo_order().unwrap_or_default();
        let (mut ops, mut heavy_ops, mut flops, mut buckets, mut after) = (0, 0, 0, 0, 0);
        for id in order {
            match graph.op(id) {
                Op::Compute { kind, flops: f, .. } => {
                    ops += 1;
                    flops += f;
                    if matches!(kind, ComputeKind::Matmul | ComputeKind::Conv) {
                        heavy_ops += 1;
                    }
                    if buckets > 0 {
                        after += 1;
                    }
                }
                Op::AllReduceStart { .. } | Op::AllReduce { .. } => buckets += 1,
                _ => {}
            }
        }
        Ok(RecordedStep {
            ops,
            heavy_ops,
            flops,
            buckets,
            ops_after_first_launch: after,
            text,
        })
    }
}

/// Every float parameter's values of `model`, in visiting order (to compare replicas), as f32
/// whatever the parameter's own float type (f16, bf16 and f32 exactly; f64 rounded; a quantized
/// parameter dequantized).
pub fn module_weights<Bk: burn_backend::Backend, M: Module<Bk>>(model: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl<Bk: burn_backend::Backend> ModuleVisitor<Bk> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Bk, D>>) {
            let data = param.val().dequantize().into_data().convert::<f32>();
            match data.to_vec::<f32>() {
                Ok(v) => self.0.extend(v),
                Err(e) => unreachable!("data converted to f32 reads as f32: {e:?}"),
            }
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

fn weights<I: Backend, M: Module<B<I>>>(model: &M) -> Vec<f32> {
    module_weights::<B<I>, M>(model)
}

/// Rows `[from, to)` of step `step`'s deterministic synthetic regression batch: `inputs`
/// features and `outputs` targets per row, values in `[-0.5, 0.5)`.
pub fn synthetic_batch<Bk: burn_backend::Backend>(
    step: usize,
    rows: (usize, usize),
    inputs: usize,
    outputs: usize,
    dev: &<Bk as burn_backend::BackendTypes>::Device,
) -> (Tensor<Bk, 2>, Tensor<Bk, 2>) {
    let (from, to) = rows;
    let x: Vec<f32> = (from * inputs..to * inputs)
        .map(|i| (((i * 37 + step * 11) % 97) as f32 / 97.0) - 0.5)
        .collect();
    let y: Vec<f32> = (from * outputs..to * outputs)
        .map(|i| (((i * 53 + step * 7) % 89) as f32 / 89.0) - 0.5)
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [to - from, inputs]), dev),
        Tensor::from_data(TensorData::new(y, [to - from, outputs]), dev),
    )
}

fn batch<I: Backend>(
    step: usize,
    from: usize,
    to: usize,
    dev: &Dev<I>,
) -> (Tensor<B<I>, 2>, Tensor<B<I>, 2>) {
    synthetic_batch::<B<I>>(step, (from, to), INPUTS, OUTPUTS, dev)
}

/// Trains `M` over inner backend `I`, local rank `r` on `device(r)`.
fn run_model<I: Backend, M: Net<B<I>>>(
    opts: &RunOptions,
    device: impl Fn(u32) -> I::Device,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<RunReport, String> {
    let (world, local): (u32, Vec<u32>) = match &opts.collective.transport {
        Transport::InProcess => (opts.world, (0..opts.world).collect()),
        // Needs CUDA devices: starting the server says so for these NdArray ones.
        #[cfg(feature = "cuda")]
        Transport::NcclLocal => (opts.world, (0..opts.world).collect()),
        Transport::Tcp(cfg) => (cfg.world as u32, vec![cfg.rank as u32]),
        #[cfg(feature = "cuda")]
        Transport::Nccl(cfg) => (cfg.world as u32, vec![cfg.rank as u32]),
    };
    let first = local[0];
    let steps_of = |rank: usize| uneven_steps(opts.steps, opts.uneven, world as usize, rank);
    if opts.uneven > 0 {
        if opts.sync_norm {
            return Err("--uneven with --sync-bn: each norm is a collective in forward and backward, which a rank that ran out of inputs does not take part in".into());
        }
        if steps_of(0) == 0 {
            return Err(format!(
                "--uneven {}: rank 0 of {world} would train none of the {} steps; every rank trains at least one (more --steps or a smaller --uneven)",
                opts.uneven, opts.steps
            ));
        }
    }
    let devices: Vec<Dev<I>> = local
        .iter()
        .map(|r| CollectiveDevice::new(device(*r), *r))
        .collect();
    opts.collective.clone().install::<I>();
    let lazy_before: Vec<LazyStats> = local.iter().map(|r| lazy_stats(*r)).collect();
    Collective::<I>::try_start_communication_server(
        &devices,
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    )
    .map_err(|e| e.to_string())?;
    <B<I> as Backend>::seed(&devices[0], opts.seed);
    let init = M::init(&devices[0], opts.model);
    // Parameters initialize lazily: materialize them before the ranks copy them.
    let w0 = weights::<I, M>(&init);
    let params = w0.len();
    type RankResult = Result<
        (
            Vec<StepRecord>,
            Vec<f32>,
            Vec<MeasuredStep>,
            Option<JoinReport>,
        ),
        String,
    >;
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .map(|d| {
                // A copy of its own for each rank: `fork` alone would share each BatchNorm's
                // running statistics between the ranks (one `RunningState`), where ranks that are
                // processes hold their own; `from_inner` makes new ones.
                let model = M::from_inner(init.valid()).fork(d);
                s.spawn(move || {
                    let rank = d.rank as usize;
                    // Marking is collective: the ranks check that their models agree and take
                    // rank 0's weights.
                    let mut model =
                        mark_distributed::<B<I>, M>(model).map_err(|e| e.to_string())?;
                    let mut optim = SgdConfig::new().init::<B<I>, M>();
                    let mut records = Vec::with_capacity(opts.steps);
                    let mut measured: Vec<MeasuredStep> = Vec::new();
                    let scope = (opts.uneven > 0).then(|| join_with::<I>(d, opts.join));
                    for step in 0..steps_of(rank) {
                        let t0 = Instant::now();
                        model = sync_buffers::<B<I>, M>(model, opts.buffers)
                            .map_err(|e| e.to_string())?;
                        let buffers_done = Instant::now();
                        let (x, y) =
                            batch::<I>(step, rank * opts.batch, (rank + 1) * opts.batch, d);
                        let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
                        let lv = loss.clone().into_data().to_vec::<f32>().unwrap_or_default();
                        let t1 = Instant::now();
                        let grads = loss.backward();
                        let t2 = Instant::now();
                        let grads = GradientsParams::from_grads(grads, &model);
                        model = optim.step(0.01, model, grads);
                        let t3 = Instant::now();
                        trace_span::<I>(rank, "buffers", t0, buffers_done);
                        trace_span::<I>(rank, "forward", buffers_done, t1);
                        trace_span::<I>(rank, "backward", t1, t2);
                        trace_span::<I>(rank, "optimizer", t2, t3);
                        records.push(StepRecord {
                            secs: (t3 - t0).as_secs_f64(),
                            backward_secs: (t2 - t1).as_secs_f64(),
                            loss: lv.first().copied().unwrap_or(f32::NAN),
                        });
                        tracing::info!(rank, step = step + 1, "step done");
                        if let Some(m) = measured_step::<I>(rank)
                            && measured.last() != Some(&m)
                        {
                            measured.push(m);
                        }
                        if rank == first as usize {
                            progress(step + 1);
                        }
                    }
                    let joined = match scope {
                        Some(scope) => {
                            let (m, report) = scope
                                .finish_model::<B<I>, M>(model)
                                .map_err(|e| e.to_string())?;
                            model = m;
                            Some(report)
                        }
                        None => None,
                    };
                    Ok((records, weights::<I, M>(&model), measured, joined))
                })
            })
            .collect();
        handles
            .into_iter()
            // Burn's hooks return nothing, so a failed collective panics on its rank's thread
            // with the typed error's message: the run's error.
            .map(|h| h.join().unwrap_or_else(|p| Err(panic_message(p.as_ref()))))
            .collect()
    });
    let stats = local.iter().map(|r| sync_stats::<I>(*r as usize)).collect();
    let lazy = local
        .iter()
        .zip(&lazy_before)
        .map(|(r, before)| lazy_stats(*r).since(before))
        .collect();
    let step = recorded_step_graph::<I>(first as usize)
        .and_then(|g| RecordedStep::of(g, &opts.collective.config).ok());
    let trace = take_trace::<I>();
    let measured = measured_step::<I>(first as usize);
    let link = measured_link::<I>(first as usize);
    Collective::<I>::close_communication_server(&devices[0]);
    let results = results.into_iter().collect::<Result<Vec<_>, String>>()?;
    let ranks_agree = results.iter().all(|(_, w, _, _)| *w == results[0].1);
    let joins = results.iter().filter_map(|r| r.3.clone()).collect();
    let weights_digest = weights_digest(&results[0].1);
    let mut ranks = results.into_iter();
    let (steps, measured_steps) = ranks.next().map(|r| (r.0, r.2)).unwrap_or_default();
    let peer_measured_steps = ranks.map(|r| r.2).collect();
    Ok(RunReport {
        world,
        local_ranks: local,
        weights_digest,
        steps,
        params,
        bytes: params as u64 * 4,
        stats,
        lazy,
        step,
        trace,
        ranks_agree,
        measured,
        measured_steps,
        peer_measured_steps,
        link,
        joins,
        steps_run: opts.steps,
        uneven: opts.uneven,
    })
}

/// The message a panic carried.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a rank panicked".to_string())
}

/// Trains `opts.model` on `opts.world` ranks of `opts.backend`; `progress` is told each step
/// rank 0 finishes. Runs one at a time per process (the communication server is per backend
/// type). A backend this build lacks (`cuda` without the feature) is an error naming it.
pub fn run(opts: &RunOptions, progress: &(dyn Fn(usize) + Sync)) -> Result<RunReport, String> {
    fn on<I: Backend>(
        opts: &RunOptions,
        device: impl Fn(u32) -> I::Device,
        progress: &(dyn Fn(usize) + Sync),
    ) -> Result<RunReport, String> {
        match opts.model {
            RunModel::Mlp { .. } => run_model::<I, Mlp<B<I>>>(opts, device, progress),
            RunModel::ConvNet => run_model::<I, ConvNet<B<I>>>(opts, device, progress),
            RunModel::ResNet { .. } if opts.sync_norm => run_model::<
                I,
                ResNet<B<I>, crate::backend::SyncBatchNorm<B<I>>>,
            >(opts, device, progress),
            RunModel::ResNet { .. } => run_model::<I, ResNet<B<I>>>(opts, device, progress),
            RunModel::Blocks { .. } => run_model::<I, Blocks<B<I>>>(opts, device, progress),
        }
    }
    // In-process NCCL: a GPU per rank. One rank per process: the launcher's local rank. Other
    // in-process ranks share GPU 0 (a host communicator).
    #[cfg(feature = "cuda")]
    if matches!(
        opts.backend,
        RunBackend::Cuda | RunBackend::Dispatch(DispatchOn::Cuda)
    ) && crate::runtime::nccl::device_count() == 0
    {
        return Err(format!(
            "the {} backend: no CUDA device here (the CUDA driver cannot be loaded, or it sees no GPU)",
            opts.backend.name()
        ));
    }
    #[cfg(feature = "cuda")]
    let gpu = |r: u32| match &opts.collective.transport {
        Transport::NcclLocal => r as usize,
        Transport::Nccl(cfg) | Transport::Tcp(cfg) => cfg.local_rank,
        Transport::InProcess => 0,
    };
    match opts.backend {
        RunBackend::NdArray => on::<NdArray>(opts, |_| NdArrayDevice::Cpu, progress),
        RunBackend::Dispatch(on_device) => {
            use burn_dispatch::{Dispatch, DispatchDevice};
            let device: Box<dyn Fn(u32) -> DispatchDevice + Sync> = match on_device {
                #[cfg(feature = "dispatch-ndarray")]
                DispatchOn::NdArray => Box::new(|_| DispatchDevice::NdArray(NdArrayDevice::Cpu)),
                #[cfg(not(feature = "dispatch-ndarray"))]
                DispatchOn::NdArray => {
                    return Err(
                        "--dispatch-device ndarray needs a build with the `dispatch-ndarray` feature"
                            .into(),
                    );
                }
                DispatchOn::Wgpu => {
                    Box::new(|_| DispatchDevice::Wgpu(burn_wgpu::WgpuDevice::DefaultDevice))
                }
                #[cfg(feature = "cuda")]
                DispatchOn::Cuda => {
                    Box::new(move |r| DispatchDevice::Cuda(burn_cuda::CudaDevice::new(gpu(r))))
                }
                #[cfg(not(feature = "cuda"))]
                DispatchOn::Cuda => {
                    return Err(
                        "--dispatch-device cuda needs a build with `--features cuda`".into(),
                    );
                }
            };
            on::<Dispatch>(opts, device, progress)
        }
        RunBackend::Wgpu => {
            on::<burn_wgpu::Wgpu>(opts, |_| burn_wgpu::WgpuDevice::DefaultDevice, progress)
        }
        #[cfg(feature = "cuda")]
        RunBackend::Cuda => {
            on::<burn_cuda::Cuda>(opts, |r| burn_cuda::CudaDevice::new(gpu(r)), progress)
        }
        #[cfg(not(feature = "cuda"))]
        RunBackend::Cuda => Err("--backend cuda needs a build with `--features cuda`".into()),
    }
}

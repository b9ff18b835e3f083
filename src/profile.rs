//! Profiling by simulation: one training step of a model under each bucketing policy, side by
//! side, against a lower bound, and the trace of the chosen policy's step.
//!
//! The lower bound no schedule can beat under the cost model: communication cannot finish before
//! the last gradient exists plus that gradient's own all-reduce, nor before the first gradient
//! exists plus all gradients reduced as one collective:
//! `bound = max(compute + t(last gradient), t_first_ready + t(all bytes))`. Its exposed
//! communication is `bound - compute`.

use std::fmt;

use crate::config::{BucketPolicy, CompileConfig};
use crate::cost::{
    CostModel, SimSpan, StepFacts, StepTimes, simulate, simulate_measured, simulate_spans,
};
use crate::graph::builder::{BuildOptions, build_step_graph};
use crate::graph::print::fmt_bytes;
use crate::graph::{DType, Graph, Op, ReduceOp, TensorType};
use crate::measure::{LinkFit, MeasuredCopy, MeasuredProfile, MeasuredStep};
use crate::model::ModelProfile;
use crate::passes::{CompileError, compile};
use crate::trace::TraceSpan;

/// Why a profile could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// Compiling a policy's graph failed.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// A graph had a cycle.
    #[error(transparent)]
    Cycle(#[from] crate::graph::CycleError),
}

/// Whether `text` is a step in the graph text form (what `run --step-graph` writes) rather than
/// a model profile.
pub fn is_graph_text(text: &str) -> bool {
    text.trim_start().starts_with("graph ")
}

/// A recorded step read from graph text (`name` for messages): parsed, then verified (passes
/// assume a valid graph, so text from a file is verified in every build), and it must have a
/// `grad_sync` to bucket.
pub fn recorded_step(name: &str, text: &str) -> Result<Graph, String> {
    let g = crate::graph::parse::parse(text).map_err(|e| format!("{name}: {e}"))?;
    crate::graph::verify::verify(&g, &crate::graph::verify::VerifyOptions::default())
        .map_err(|e| format!("{name}: {e}"))?;
    if !g.node_ids().any(|n| matches!(g.op(n), Op::GradSync { .. })) {
        return Err(format!(
            "{name}: the graph has no grad_sync to bucket (a compiled graph?); profile the recorded step that `run --step-graph` writes"
        ));
    }
    Ok(g)
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct ProfileOptions {
    /// Ranks.
    pub world: u32,
    /// Samples per rank.
    pub batch: u64,
    /// Reduction.
    pub reduce: ReduceOp,
    /// Compiler options (bucket caps, overlap, cost model); the policy is set per row.
    pub config: CompileConfig,
}

/// One policy's simulated step.
#[derive(Clone, Debug)]
pub struct PolicyRow {
    /// The policy.
    pub policy: BucketPolicy,
    /// Collectives launched.
    pub collectives: usize,
    /// Where the time went.
    pub times: StepTimes,
}

/// The bound of the module doc.
#[derive(Clone, Copy, Debug)]
pub struct LowerBound {
    /// Compute of the step.
    pub compute: f64,
    /// Bound on the step time.
    pub step: f64,
    /// Bound on what communication adds to the step (`step - compute`).
    pub exposed: f64,
}

/// All policies side by side.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// Model name.
    pub model: String,
    /// Parameters.
    pub tensors: usize,
    /// Gradient bytes.
    pub bytes: u64,
    /// The options.
    pub options: ProfileOptions,
    /// One row per policy: per-param, ddp, cost.
    pub rows: Vec<PolicyRow>,
    /// The bound.
    pub bound: LowerBound,
    /// The policy whose trace was asked for (marked in the table).
    pub selected: BucketPolicy,
    /// A recorded step (its compute is as recorded; the batch size does not apply).
    pub recorded: bool,
}

/// What a profile simulates: a model profile's step, or a step recorded by `Collective<B>`
/// (`run --step-graph`, `recorded_step_graph`) in the graph text form.
#[derive(Clone, Copy, Debug)]
pub enum StepSource<'a> {
    /// A model profile: compute from its per-layer FLOPs at the batch size.
    Profile(&'a ModelProfile),
    /// A recorded step: compute from its ops' flop estimates, as recorded (the batch size does
    /// not apply); its groups are resized to the profile's world.
    Recorded {
        /// Name shown in the table.
        name: &'a str,
        /// The step graph, before compilation.
        graph: &'a Graph,
    },
}

impl StepSource<'_> {
    /// The uncompiled step graph.
    pub fn step_graph(&self, opts: &ProfileOptions) -> Graph {
        match self {
            StepSource::Profile(p) => build_step_graph(
                p,
                &BuildOptions {
                    world: opts.world,
                    batch: opts.batch,
                    reduce: opts.reduce,
                },
            ),
            StepSource::Recorded { graph, .. } => {
                let mut g = (*graph).clone();
                let ids: Vec<_> = g.groups().iter().map(|gr| gr.id).collect();
                for id in ids {
                    g.set_group_size(id, opts.world);
                }
                g
            }
        }
    }

    /// The name shown in the table.
    pub fn name(&self) -> &str {
        match self {
            StepSource::Profile(p) => &p.model,
            StepSource::Recorded { name, .. } => name,
        }
    }

    /// Gradients and their bytes.
    fn gradients(&self) -> (usize, u64) {
        match self {
            StepSource::Profile(p) => (p.params.len(), p.total_bytes()),
            StepSource::Recorded { graph, .. } => graph
                .node_ids()
                .filter(|n| matches!(graph.op(*n), Op::Gradient { .. }))
                .fold((0, 0), |(n, b), id| {
                    (n + 1, b + graph.node(id).results[0].bytes())
                }),
        }
    }
}

/// The step graph of `profile` compiled with `policy`.
pub fn compiled_graph(
    profile: &ModelProfile,
    opts: &ProfileOptions,
    policy: BucketPolicy,
) -> Result<Graph, CompileError> {
    compiled_step(StepSource::Profile(profile), opts, policy)
}

/// The step graph of `source` compiled with `policy`.
pub fn compiled_step(
    source: StepSource<'_>,
    opts: &ProfileOptions,
    policy: BucketPolicy,
) -> Result<Graph, CompileError> {
    let mut g = source.step_graph(opts);
    let mut cfg = opts.config.clone();
    cfg.bucket.policy = policy;
    compile(&mut g, &cfg)?;
    Ok(g)
}

/// The lower bound of the module doc, from the unoptimized step graph.
pub fn lower_bound(graph: &Graph, cost: &CostModel, world: u32) -> LowerBound {
    let mut t = 0.0;
    let mut first_ready = None;
    let mut last_bytes = 0;
    let mut total_bytes = 0;
    if let Ok(order) = graph.topo_order() {
        for id in order {
            match graph.op(id) {
                Op::Compute { flops, .. } => t += cost.compute_secs(*flops),
                Op::Gradient { .. } => {
                    first_ready.get_or_insert(t);
                    let b = graph.node(id).results[0].bytes();
                    last_bytes = b;
                    total_bytes += b;
                }
                _ => {}
            }
        }
    }
    let step = (t + cost.all_reduce_secs(last_bytes, world))
        .max(first_ready.unwrap_or(t) + cost.all_reduce_secs(total_bytes, world));
    LowerBound {
        compute: t,
        step,
        exposed: step - t,
    }
}

/// Simulates every policy. `progress` is told what starts (the command shows it when a model
/// takes more than a moment).
pub fn compare(
    profile: &ModelProfile,
    opts: &ProfileOptions,
    selected: BucketPolicy,
    progress: impl FnMut(&str),
) -> Result<Comparison, ProfileError> {
    compare_step(StepSource::Profile(profile), opts, selected, progress)
}

/// [`compare`] for any step source.
pub fn compare_step(
    source: StepSource<'_>,
    opts: &ProfileOptions,
    selected: BucketPolicy,
    mut progress: impl FnMut(&str),
) -> Result<Comparison, ProfileError> {
    let base = source.step_graph(opts);
    let bound = lower_bound(&base, &opts.config.cost, opts.world);
    let mut rows = Vec::new();
    for policy in [
        BucketPolicy::PerParam,
        BucketPolicy::Ddp,
        BucketPolicy::Cost,
    ] {
        progress(policy.name());
        let g = compiled_step(source, opts, policy)?;
        let times = simulate(&g, &opts.config.cost)?;
        rows.push(PolicyRow {
            policy,
            collectives: times.collectives,
            times,
        });
    }
    let (tensors, bytes) = source.gradients();
    Ok(Comparison {
        model: source.name().to_string(),
        tensors,
        bytes,
        options: opts.clone(),
        rows,
        bound,
        selected,
        recorded: matches!(source, StepSource::Recorded { .. }),
    })
}

/// What the simulator predicts for a step a rank measured, under `policy`: the measured
/// backward from its first gradient compiled with `config` under the measured link (`link`,
/// the run's; `config`'s system's without one) and simulated with the step's facts. Its
/// `total` is the predicted time from the first gradient to the end of the sync, its
/// `at_sync()` the time the step spends at its sync point; compare them with [`MeasuredStep`]'s. Gradient types are
/// taken as `f32` of the measured bytes (what the cost model reads of them is their size).
///
/// What goes in, all measured in that step (`peers`: the same step on the other ranks this
/// process holds, when it holds several, lined up by `start_us`):
/// - the compute: the time before each gradient and after the last one
///   ([`MeasuredProfile::segment_until`]), less the packs the rank ran in it and the time the
///   collectives beside it took ([`MeasuredStep::interference_us`]; the compiled plan's own
///   packs and interference are simulated);
/// - the copy bandwidth of the step's packs and unpacks after its sync point, or of all of
///   them when none ran there (else `config`'s system's);
/// - the fixed cost of a collective while the backward passes take every core and after
///   ([`MeasuredStep::alpha_split_us`] as [`MeasuredProfile::alphas_us`] plans it: a side
///   without collectives in this step takes the other's; the system's `alpha_busy_us` and
///   `alpha_us`), and when that ends ([`MeasuredStep::cores_free_us`],
///   [`StepFacts::busy_until`]): on CPU ranks communication shares the cores with compute.
///   The plan is compiled under it too, as the backend's measured plans are;
/// - when the last rank had each gradient ([`StepFacts::peer_ready`]): a collective waits
///   for every rank, and ranks that share cores are not in step;
/// - the hand-back after the last collective ([`StepFacts::handback`]).
pub fn predict_measured(
    step: &MeasuredStep,
    peers: &[MeasuredStep],
    link: Option<LinkFit>,
    reduce: ReduceOp,
    config: &CompileConfig,
    policy: BucketPolicy,
) -> Result<StepTimes, ProfileError> {
    let first = step.gradients.first().map_or(step.sync_us, |g| g.ready_us);
    let interference = step.interference_us().unwrap_or(0.0);
    // The compute before each gradient, without the packs that ran in it and the time the
    // collectives beside it took (the compiled plan's own are simulated).
    let not_backward_before = |t: f64| -> f64 {
        step.copies
            .iter()
            .filter(|c| !c.unpack && c.end_us <= t)
            .map(|c| c.us)
            .sum::<f64>()
            + step.interfered_before_us(t, interference)
    };
    let start = first - not_backward_before(first);
    let profile = MeasuredProfile {
        ready_us: step
            .gradients
            .iter()
            .map(|g| (g.ready_us - not_backward_before(g.ready_us) - start).max(0.0))
            .collect(),
        ..MeasuredProfile::from_step(step, peers, link)
    };
    let entries: Vec<(String, TensorType)> = step
        .gradients
        .iter()
        .map(|g| {
            (
                g.param.clone(),
                TensorType::new(DType::F32, &[g.bytes.div_ceil(4).max(1)]),
            )
        })
        .collect();
    let last = step.gradients.last().map_or(step.sync_us, |g| g.ready_us);
    let tail =
        (step.sync_us - not_backward_before(step.sync_us)) - (last - not_backward_before(last));
    let mut g = profile.segment_until(step.world, reduce, &entries, tail.max(0.0));
    let mut cfg = config.clone();
    cfg.bucket.policy = policy;
    let mut system = profile.system_profile(step.world, &config.cost.system);
    // The copies after the sync point, where the ones the prediction is about run (without
    // compute beside them, faster than the packs during the backward); else all of them.
    let after_sync: Vec<&MeasuredCopy> = step
        .copies
        .iter()
        .filter(|c| c.end_us > step.sync_us)
        .collect();
    let copies: Vec<&MeasuredCopy> = if after_sync.is_empty() {
        step.copies.iter().collect()
    } else {
        after_sync
    };
    let (bytes, us) = copies
        .iter()
        .fold((0u64, 0.0f64), |(b, t), c| (b + c.bytes, t + c.us));
    if bytes > 0 && us > 0.0 {
        // A copy reads and writes its bytes (`CostModel::copy_secs`).
        system.mem_gbs = 2.0 * bytes as f64 / us / 1e3;
    }
    cfg.cost = CostModel::new(system);
    compile(&mut g, &cfg)?;
    let mut facts = StepFacts {
        handback: step.handback_us / 1e6,
        busy_until: Some(((step.cores_free_us(peers) - first) / 1e6).max(0.0)),
        ..StepFacts::default()
    };
    for p in peers {
        for pg in &p.gradients {
            let t = ((p.start_us + pg.ready_us - step.start_us - first) / 1e6).max(0.0);
            let e = facts.peer_ready.entry(pg.param.clone()).or_insert(0.0);
            *e = e.max(t);
        }
    }
    Ok(simulate_measured(&g, &cfg.cost, &facts)?)
}

/// The simulated step of `graph` as trace spans of rank 0 (every rank runs the same schedule in
/// the simulation).
pub fn simulated_trace(
    graph: &Graph,
    cost: &CostModel,
) -> Result<(StepTimes, Vec<TraceSpan>), crate::graph::CycleError> {
    let (times, spans) = simulate_spans(graph, cost)?;
    Ok((
        times,
        spans
            .into_iter()
            .map(|s: SimSpan| TraceSpan {
                rank: 0,
                stream: s.cat.stream().to_string(),
                cat: s.cat,
                name: s.name,
                start_us: s.start * 1e6,
                dur_us: (s.end - s.start) * 1e6,
            })
            .collect(),
    ))
}

fn ms(s: f64) -> String {
    format!("{:.3} ms", s * 1e3)
}

impl Comparison {
    /// The row of a policy.
    pub fn row(&self, p: BucketPolicy) -> Option<&PolicyRow> {
        self.rows.iter().find(|r| r.policy == p)
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        let sys = &o.config.cost.system;
        writeln!(
            f,
            "model {} · {} tensors, {} · world {} · {} · link {} (α {} µs, busbw {} GB/s, {} TFLOP/s)",
            self.model,
            self.tensors,
            fmt_bytes(self.bytes),
            o.world,
            if self.recorded {
                "recorded step".to_string()
            } else {
                format!("batch {}", o.batch)
            },
            sys.name,
            sys.alpha_us,
            sys.busbw_gbs,
            sys.compute_tflops
        )?;
        writeln!(
            f,
            "buckets: cap {} · first {} · overlap {}",
            fmt_bytes(o.config.bucket.cap_bytes),
            fmt_bytes(o.config.bucket.first_bucket_bytes),
            if o.config.overlap { "on" } else { "off" }
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<11} {:>6} {:>11} {:>10} {:>10} {:>10} {:>8} {:>10} {:>8} {:>11} {:>7}",
            "policy",
            "colls",
            "compute",
            "copies",
            "comm",
            "waits",
            "overlap",
            "exposed",
            "vs ddp",
            "step",
            "÷bound"
        )?;
        let ddp_exposed = self.row(BucketPolicy::Ddp).map(|r| r.times.exposed());
        for r in &self.rows {
            let t = &r.times;
            let mark = if r.policy == self.selected { "*" } else { " " };
            let vs = match ddp_exposed {
                Some(d) if d > 0.0 => format!("{:+.0}%", 100.0 * (t.exposed() / d - 1.0)),
                _ => "-".to_string(),
            };
            writeln!(
                f,
                "{:<11} {:>6} {:>11} {:>10} {:>10} {:>10} {:>7.0}% {:>10} {:>8} {:>11} {:>7.3}",
                format!("{}{mark}", r.policy.name()),
                r.collectives,
                ms(t.compute),
                ms(t.copies),
                ms(t.comm),
                ms(t.waits),
                t.overlap_pct(),
                ms(t.exposed()),
                vs,
                ms(t.total),
                t.total / self.bound.step,
            )?;
        }
        writeln!(
            f,
            "{:<11} {:>6} {:>11} {:>10} {:>10} {:>10} {:>8} {:>10} {:>8} {:>11} {:>7.3}",
            "bound",
            "-",
            ms(self.bound.compute),
            "-",
            "-",
            "-",
            "-",
            ms(self.bound.exposed),
            "-",
            ms(self.bound.step),
            1.0,
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "waits = time the compute stream waits for communication; overlap = 1 − waits/comm"
        )?;
        writeln!(
            f,
            "exposed = step − compute = waits + pack/unpack copies: what communication adds to the step"
        )?;
        writeln!(
            f,
            "bound = max(compute + all-reduce of the last gradient, first gradient ready + one all-reduce of all gradients)"
        )
    }
}

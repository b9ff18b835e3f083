//! The cost model and the step simulator.
//!
//! Collectives follow the alpha-beta model of a ring all-reduce, `alpha + bytes * 2(n-1)/n /
//! busbw`, with `busbw` the bus bandwidth as nccl-tests reports it. Compute costs its FLOPs at a
//! sustained throughput; bucket packs and unpacks read and write their bytes at the device's copy
//! bandwidth. System profiles live in `profiles/links.json` (bundled) with their sources; any file
//! of the same schema can be loaded.
//!
//! [`simulate`] plays a scheduled graph on two streams (compute and communication) and reports
//! where the time went. It is what the cost-model bucketing policy optimises against.

use serde::Deserialize;
use thiserror::Error;

use crate::graph::{CycleError, Graph, Op};
use crate::trace::SpanKind;

/// The bundled system profiles.
pub const BUNDLED_LINKS: &str = include_str!("../profiles/links.json");

/// One system: a link between ranks and the device on each rank.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct SystemProfile {
    /// Short name (`h200-nvlink`).
    pub name: String,
    /// What the system is.
    pub description: String,
    /// Ranks the profile describes.
    pub world: u32,
    /// Fixed cost of one all-reduce, microseconds.
    pub alpha_us: f64,
    /// Fixed cost of one all-reduce that starts while the step's compute still runs, where it
    /// differs from `alpha_us`, microseconds. Where communication shares the cores with
    /// compute (CPU ranks) a collective costs more during the backward pass than after it; a
    /// measured profile says how much ([`crate::measure::MeasuredStep::alpha_split_us`]).
    /// Absent: `alpha_us` throughout.
    #[serde(default)]
    pub alpha_busy_us: Option<f64>,
    /// Compute time one all-reduce that starts while the step's compute still runs takes from
    /// that compute, microseconds: where communication and compute share the cores (CPU ranks,
    /// more threads than cores), the communicator's thread runs on time the backward needed,
    /// so each collective under the backward delays the rest of it. Absent: none (a GPU's
    /// compute does not wait for the communicator's thread).
    #[serde(default)]
    pub interference_us: Option<f64>,
    /// Where a collective stops paying `alpha_busy_us`, microseconds after the end of this
    /// rank's compute (negative: before it). Ranks that share cores are seldom in step: the
    /// cores come free once enough of the process's ranks are done with their backward passes,
    /// which may be before this rank's last gradient or after it (a measured profile says when,
    /// [`crate::measure::MeasuredStep::cores_free_us`]). Absent: 0, the end of this rank's
    /// compute.
    #[serde(default)]
    pub busy_shift_us: Option<f64>,
    /// All-reduce bus bandwidth at large sizes, GB/s (10^9 bytes per second).
    pub busbw_gbs: f64,
    /// Sustained compute throughput of one device, TFLOP/s.
    pub compute_tflops: f64,
    /// Device copy bandwidth, GB/s.
    pub mem_gbs: f64,
    /// Where the numbers come from.
    #[serde(default)]
    pub sources: Vec<String>,
}

#[derive(Deserialize)]
struct ProfileFile {
    profiles: Vec<SystemProfile>,
}

/// A system profile could not be found or read.
#[derive(Debug, Error)]
pub enum LinkError {
    /// Neither bundled nor a readable file.
    #[error(
        "link profile '{name}' is not bundled ({known}) and could not be read as a file: {source}"
    )]
    NotFound {
        /// What was asked for.
        name: String,
        /// Bundled names.
        known: String,
        /// The file error.
        source: std::io::Error,
    },
    /// The file is not of the schema, or holds a bad number.
    #[error("link profile file '{name}': {message}")]
    Invalid {
        /// File name.
        name: String,
        /// What is wrong.
        message: String,
    },
}

fn parse_profiles(name: &str, text: &str) -> Result<Vec<SystemProfile>, LinkError> {
    let f: ProfileFile = serde_json::from_str(text).map_err(|e| LinkError::Invalid {
        name: name.to_string(),
        message: e.to_string(),
    })?;
    for p in &f.profiles {
        // Plausible ranges, wide: a number outside is a typo or a unit mix-up, and would
        // otherwise give a report of absurd times rather than an error.
        let checks: [(&str, f64, f64, f64, &str); 5] = [
            ("world", f64::from(p.world), 1.0, 1e6, "ranks"),
            ("alpha_us", p.alpha_us, 0.0, 1e7, "µs"),
            ("busbw_gbs", p.busbw_gbs, 1e-6, 1e6, "GB/s"),
            ("compute_tflops", p.compute_tflops, 1e-9, 1e6, "TFLOP/s"),
            ("mem_gbs", p.mem_gbs, 1e-6, 1e6, "GB/s"),
        ];
        let busy = p
            .alpha_busy_us
            .map(|a| ("alpha_busy_us", a, 0.0, 1e7, "µs"));
        let interference = p
            .interference_us
            .map(|a| ("interference_us", a, 0.0, 1e7, "µs"));
        let shift = p
            .busy_shift_us
            .map(|a| ("busy_shift_us", a, -1e7, 1e7, "µs"));
        for (field, v, lo, hi, unit) in checks
            .into_iter()
            .chain(busy)
            .chain(interference)
            .chain(shift)
        {
            if !(v.is_finite() && v >= lo && v <= hi) {
                return Err(LinkError::Invalid {
                    name: name.to_string(),
                    message: format!(
                        "profile '{}': {field} is {v}, outside [{lo}, {hi}] {unit}",
                        p.name
                    ),
                });
            }
        }
    }
    Ok(f.profiles)
}

impl SystemProfile {
    /// The first profile of a profile file's text (`name` for messages), checked.
    pub fn from_json(name: &str, text: &str) -> Result<Self, LinkError> {
        parse_profiles(name, text)?
            .into_iter()
            .next()
            .ok_or_else(|| LinkError::Invalid {
                name: name.to_string(),
                message: "the file holds no profile".into(),
            })
    }

    /// All bundled profiles.
    pub fn bundled() -> Vec<SystemProfile> {
        parse_profiles("profiles/links.json", BUNDLED_LINKS)
            .expect("the bundled profiles file is valid (checked by a test)")
    }

    /// A bundled profile by name, or the first profile of a file given by path.
    pub fn load(name_or_path: &str) -> Result<Self, LinkError> {
        let bundled = Self::bundled();
        if let Some(p) = bundled.iter().find(|p| p.name == name_or_path) {
            return Ok(p.clone());
        }
        let text = std::fs::read_to_string(name_or_path).map_err(|source| LinkError::NotFound {
            name: name_or_path.to_string(),
            known: bundled
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            source,
        })?;
        Self::from_json(name_or_path, &text)
    }
}

/// Predicts the time of compute, copies and collectives.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// The system.
    pub system: SystemProfile,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            system: SystemProfile::load("h200-nvlink").expect("bundled profile exists"),
        }
    }
}

impl CostModel {
    /// A model of the given system.
    pub fn new(system: SystemProfile) -> Self {
        CostModel { system }
    }

    /// Seconds for one ring all-reduce of `bytes` over `ranks` ranks (0 for a single rank),
    /// started once the step's compute is over.
    pub fn all_reduce_secs(&self, bytes: u64, ranks: u32) -> f64 {
        self.all_reduce_secs_at(bytes, ranks, false)
    }

    /// [`CostModel::all_reduce_secs`] for an all-reduce that starts while the step's compute
    /// still runs (`busy`) or after it: the fixed cost is the system's `alpha_busy_us` for
    /// the first where it has one.
    pub fn all_reduce_secs_at(&self, bytes: u64, ranks: u32, busy: bool) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let n = f64::from(ranks);
        let alpha = match self.system.alpha_busy_us {
            Some(a) if busy => a,
            _ => self.system.alpha_us,
        };
        alpha * 1e-6 + bytes as f64 * 2.0 * (n - 1.0) / n / (self.system.busbw_gbs * 1e9)
    }

    /// Until when a collective pays the busy alpha, seconds from the start of a step whose
    /// compute is over at `compute_end`: then, moved by the system's `busy_shift_us`. A
    /// horizon within a nanosecond of the step's start is its start (the cores free from the
    /// first: the end and the shift are sums of microseconds that need not cancel exactly).
    pub fn busy_horizon(&self, compute_end: f64) -> f64 {
        let h = compute_end + self.system.busy_shift_us.unwrap_or(0.0) * 1e-6;
        if h < 1e-9 { 0.0 } else { h }
    }

    /// Seconds of compute an all-reduce over `ranks` ranks takes from the compute beside it:
    /// the system's `interference_us` when it starts while the step's compute still runs
    /// (`busy`), else none.
    pub fn interference_secs(&self, ranks: u32, busy: bool) -> f64 {
        match self.system.interference_us {
            Some(t) if busy && ranks > 1 => t * 1e-6,
            _ => 0.0,
        }
    }

    /// Seconds for `flops` of compute.
    pub fn compute_secs(&self, flops: u64) -> f64 {
        flops as f64 / (self.system.compute_tflops * 1e12)
    }

    /// Seconds to copy `bytes` on the device (read and write).
    pub fn copy_secs(&self, bytes: u64) -> f64 {
        2.0 * bytes as f64 / (self.system.mem_gbs * 1e9)
    }
}

/// Where the time of one simulated step went. All times in seconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// End of the step: the compute stream passes the sync point.
    pub total: f64,
    /// Busy time of compute kernels.
    pub compute: f64,
    /// Busy time of bucket packs and unpacks (on the compute stream).
    pub copies: f64,
    /// Busy time of the communication stream.
    pub comm: f64,
    /// Host work after the last collective ([`StepFacts::handback`]).
    pub host: f64,
    /// The compute stream finished its last compute op: the sync point, where a step that
    /// waits on communication starts to wait.
    pub compute_end: f64,
    /// Packs and unpacks after [`StepTimes::compute_end`].
    pub tail_copies: f64,
    /// Compute-stream time the collectives under the compute took from it
    /// ([`SystemProfile::interference_us`]).
    pub interference: f64,
    /// Time the compute stream waited for communication: `total - compute - copies - host -
    /// interference`.
    pub waits: f64,
    /// Number of collectives launched.
    pub collectives: usize,
    /// Duration of the last collective to finish.
    pub last_collective: f64,
}

impl StepTimes {
    /// Exposed communication: what communication adds to the step, `total - compute`, the
    /// compute stream's waits plus the bucket copies, which exist only for communication. It is
    /// the quantity the lower bound bounds, so the two compare directly.
    pub fn exposed(&self) -> f64 {
        (self.total - self.compute).max(0.0)
    }

    /// What the step spends at its sync point, after [`StepTimes::compute_end`]: the waits for
    /// collectives that were not done, the last packs and unpacks, the hand-back. What a
    /// measured step's `exposed_us` is.
    pub fn at_sync(&self) -> f64 {
        (self.total - self.compute_end).max(0.0)
    }

    /// Share of communication time hidden behind compute, in percent (100 when there is none):
    /// `1 - waits / comm`.
    pub fn overlap_pct(&self) -> f64 {
        if self.comm <= 0.0 {
            100.0
        } else {
            (100.0 * (1.0 - self.waits / self.comm)).clamp(0.0, 100.0)
        }
    }
}

/// Plays the graph's schedule on a compute stream and a communication stream.
///
/// Compute, packs and unpacks run in schedule order on the compute stream. A collective (or its
/// start) is issued when the compute stream reaches it and runs on the communication stream after
/// the previous collective. A blocking `all_reduce` or a `grad_sync` blocks the compute stream
/// until it finishes; a `grad_sync` is treated as Burn's default per-parameter sync: launched when
/// the gradient is ready, waited for at the sync point.
pub fn simulate(graph: &Graph, model: &CostModel) -> Result<StepTimes, CycleError> {
    simulate_inner(graph, model, None, &StepFacts::default())
}

/// What a simulation of a measured step knows beyond its graph and its system: facts of that
/// step the cost model does not derive. [`simulate`] assumes none (every rank in step with
/// this one, nothing after the last collective).
#[derive(Clone, Debug, Default)]
pub struct StepFacts {
    /// When the last rank had each gradient, seconds from the start of the simulated step, by
    /// parameter. A collective needs every rank: none of its members' collective starts before
    /// this, however early this rank launched it (ranks that share cores, or a straggler, make
    /// the others wait).
    pub peer_ready: hashbrown::HashMap<String, f64>,
    /// Host work after the last collective, seconds: handing the reduced gradients back to the
    /// tensors they came from. Exposed: nothing runs beside it.
    pub handback: f64,
    /// Until when, seconds from the start of the simulated step, a collective pays the busy
    /// alpha ([`SystemProfile::alpha_busy_us`]); `None`: the model's
    /// [`CostModel::busy_horizon`] of this rank's compute. Where ranks share cores it is when
    /// their backward passes stop taking every core
    /// ([`crate::measure::MeasuredStep::cores_free_us`]), which a rank's own compute does not
    /// tell.
    pub busy_until: Option<f64>,
}

/// [`simulate`] with the facts of a measured step.
pub fn simulate_measured(
    graph: &Graph,
    model: &CostModel,
    facts: &StepFacts,
) -> Result<StepTimes, CycleError> {
    simulate_inner(graph, model, None, facts)
}

/// A span of simulated time on one stream.
#[derive(Clone, Debug, PartialEq)]
pub struct SimSpan {
    /// What it is (and so its stream, [`SpanKind::stream`]).
    pub cat: SpanKind,
    /// Label.
    pub name: String,
    /// Start, seconds from the start of the step.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// [`simulate`], also returning every span of both streams (for traces).
pub fn simulate_spans(
    graph: &Graph,
    model: &CostModel,
) -> Result<(StepTimes, Vec<SimSpan>), CycleError> {
    let mut spans = Vec::new();
    let st = simulate_inner(graph, model, Some(&mut spans), &StepFacts::default())?;
    Ok((st, spans))
}

/// When the compute of `graph`'s step is over, seconds from its start: the time of its compute
/// nodes, packs and unpacks left out (what [`CostModel::all_reduce_secs_at`] calls busy).
pub fn busy_until(graph: &Graph, model: &CostModel) -> f64 {
    graph
        .node_ids()
        .filter_map(|id| match graph.op(id) {
            Op::Compute { flops, .. } => Some(model.compute_secs(*flops)),
            _ => None,
        })
        .sum()
}

fn simulate_inner(
    graph: &Graph,
    model: &CostModel,
    mut spans: Option<&mut Vec<SimSpan>>,
    facts: &StepFacts,
) -> Result<StepTimes, CycleError> {
    let mut record = |cat, name: String, start: f64, end: f64| {
        if let Some(s) = spans.as_deref_mut()
            && end > start
        {
            s.push(SimSpan {
                cat,
                name,
                start,
                end,
            });
        }
    };
    let label = |id| -> String {
        match graph.op(id) {
            Op::Compute { name, .. } => name.clone(),
            Op::BucketPack { bucket, .. } => format!("pack b{bucket}"),
            Op::BucketUnpack { bucket, .. } => format!("unpack b{bucket}"),
            Op::AllReduce {
                bucket: Some(b), ..
            }
            | Op::AllReduceStart {
                bucket: Some(b), ..
            }
            | Op::AllReduceDone { bucket: Some(b) } => format!("all-reduce b{b}"),
            Op::GradSync { param, .. } => format!("all-reduce {param}"),
            _ => {
                let ops = graph.operands(id);
                match ops.first().map(|v| graph.op(v.node)) {
                    Some(Op::Gradient { param }) => format!("all-reduce {param}"),
                    _ => "all-reduce".to_string(),
                }
            }
        }
    };
    let order = graph.topo_order()?;
    let mut finish = vec![0.0f64; graph.node_bound()];
    let mut t_compute = 0.0f64;
    let mut t_comm = 0.0f64;
    let mut st = StepTimes::default();
    let ranks = |g| graph.group_size(g).unwrap_or(1);
    let bytes_in = |id| -> u64 {
        graph
            .operands(id)
            .iter()
            .map(|v| graph.ty(*v).bytes())
            .sum()
    };
    // When every rank has a node's inputs: a gradient when the last rank had it, anything
    // else when all its operands were.
    let mut everyone = vec![0.0f64; graph.node_bound()];
    // A collective that starts before the busy horizon (the facts', or the end of the step's
    // compute moved by the system's shift) pays the system's busy alpha (see
    // `SystemProfile::alpha_busy_us`).
    let compute_until = busy_until(graph, model);
    let busy_until = facts
        .busy_until
        .unwrap_or_else(|| model.busy_horizon(compute_until));
    // Compute still to run after the node at hand: a collective that starts before
    // `t_compute + remaining` runs beside compute (and takes some of its time, see
    // `SystemProfile::interference_us`).
    let mut remaining = compute_until;
    let mut launch = |bytes: u64, n: u32, t_compute: f64, at: f64, st: &mut StepTimes| -> f64 {
        let start = t_compute.max(t_comm).max(at);
        let d = model.all_reduce_secs_at(bytes, n, start < busy_until);
        t_comm = start + d;
        st.comm += d;
        st.collectives += 1;
        st.last_collective = d;
        t_comm
    };
    for &id in &order {
        let at = match graph.op(id) {
            Op::Gradient { param } => facts.peer_ready.get(param).copied().unwrap_or(0.0),
            _ => graph
                .operands(id)
                .iter()
                .map(|v| everyone[v.node.index()])
                .fold(0.0, f64::max),
        };
        everyone[id.index()] = at;
        match graph.op(id) {
            Op::Compute { flops, .. } => {
                let d = model.compute_secs(*flops);
                remaining -= d;
                record(SpanKind::Compute, label(id), t_compute, t_compute + d);
                t_compute += d;
                st.compute += d;
                st.compute_end = t_compute;
                st.tail_copies = 0.0;
            }
            // Views of the reduced bucket: nothing is copied.
            Op::BucketUnpack { views: true, .. } => {}
            Op::BucketPack { .. } | Op::BucketUnpack { .. } => {
                let d = model.copy_secs(bytes_in(id));
                let cat = if matches!(graph.op(id), Op::BucketPack { .. }) {
                    SpanKind::Pack
                } else {
                    SpanKind::Unpack
                };
                record(cat, label(id), t_compute, t_compute + d);
                t_compute += d;
                st.copies += d;
                st.tail_copies += d;
            }
            Op::AllReduce { group, .. } => {
                let issued = t_compute;
                t_compute = launch(bytes_in(id), ranks(*group), t_compute, at, &mut st);
                record(
                    SpanKind::AllReduce,
                    label(id),
                    t_compute - st.last_collective,
                    t_compute,
                );
                record(
                    SpanKind::Wait,
                    format!("wait {}", label(id)),
                    issued,
                    t_compute,
                );
            }
            Op::GradSync { group, .. } | Op::AllReduceStart { group, .. } => {
                let end = launch(bytes_in(id), ranks(*group), t_compute, at, &mut st);
                finish[id.index()] = end;
                let start = end - st.last_collective;
                record(SpanKind::AllReduce, label(id), start, end);
                // Run beside the compute, it takes some of the compute's time.
                let d = model.interference_secs(ranks(*group), start < t_compute + remaining);
                if d > 0.0 {
                    record(
                        SpanKind::Compute,
                        format!("interference of {}", label(id)),
                        t_compute,
                        t_compute + d,
                    );
                    t_compute += d;
                    st.interference += d;
                }
            }
            Op::AllReduceDone { .. } | Op::Sync => {
                let before = t_compute;
                for v in graph.operands(id) {
                    t_compute = t_compute.max(finish[v.node.index()]);
                }
                let what = if matches!(graph.op(id), Op::Sync) {
                    "wait sync".to_string()
                } else {
                    format!("wait {}", label(id))
                };
                record(SpanKind::Wait, what, before, t_compute);
            }
            Op::Parameter { .. } | Op::Input { .. } | Op::Gradient { .. } => {}
        }
        if !matches!(
            graph.op(id),
            Op::GradSync { .. } | Op::AllReduceStart { .. }
        ) {
            finish[id.index()] = t_compute;
        }
    }
    if facts.handback > 0.0 {
        let end = t_compute + facts.handback;
        record(SpanKind::Compute, "hand-back".to_string(), t_compute, end);
        t_compute = end;
        st.host = facts.handback;
    }
    st.total = t_compute;
    st.waits = (st.total - st.compute - st.copies - st.host - st.interference).max(0.0);
    Ok(st)
}

//! What a running step measured, and the link fitted to it.
//!
//! A rank of the Burn backend reads the clock once per gradient (when its value exists, at
//! `submit_gradient_sync`) and a few times per collective (launch, the communicator's span, the
//! compute stream's wait); nothing is synchronised for it. A step's measurements are a
//! [`MeasuredStep`]; the collectives of many steps fit the alpha-beta link of the cost model
//! ([`LinkSamples::fit`]). Times are microseconds from the start of the step: the end of the
//! previous sync on that rank (for the first step, its first gradient).
//!
//! A [`MeasuredProfile`] (one rank's ready times and link) is what the backend compiles its
//! plans from once a step has been measured: [`MeasuredProfile::segment`] is the sync segment
//! with the measured time before each gradient as compute, [`MeasuredProfile::system_profile`]
//! the cost model's system.
//!
//! Plain data: no device, no Burn; the backend fills it, `run` prints it, the cost model reads it.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use crate::cost::SystemProfile;
use crate::graph::builder::add_gradient_sync;
use crate::graph::{ComputeKind, Graph, NodeId, Op, ReduceOp, TensorType, Value};

/// One gradient of a measured step.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredGradient {
    /// Its parameter.
    pub param: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// When its value existed, µs from the start of the step.
    pub ready_us: f64,
}

/// One collective of a measured step, µs from the start of the step.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredCollective {
    /// Plan collective id.
    pub collective: u32,
    /// Bytes each rank contributed.
    pub bytes: u64,
    /// This rank launched it.
    pub launch_us: f64,
    /// The communication stream was free for it and it had been launched: from here to `end_us`
    /// is this rank's view of its duration (on the last rank to join, the link's cost).
    pub start_us: f64,
    /// Its result was on this rank.
    pub end_us: f64,
    /// How long the compute stream waited for it (the part not overlapped).
    pub wait_us: f64,
    /// CPU time this rank's communicator thread spent on it ([`CommSpan::cpu_us`](crate::runtime::comm::CommSpan::cpu_us)).
    pub cpu_us: f64,
}

impl MeasuredCollective {
    /// This rank's view of how long it took.
    pub fn duration_us(&self) -> f64 {
        (self.end_us - self.start_us).max(0.0)
    }
}

/// One pack or unpack of a measured step: host (or device) copy work for communication.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredCopy {
    /// The bucket's bytes.
    pub bytes: u64,
    /// An unpack (else a pack).
    pub unpack: bool,
    /// When it ended, µs from the start of the step.
    pub end_us: f64,
    /// How long it took, µs.
    pub us: f64,
}

/// One synced step as a rank measured it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MeasuredStep {
    /// Ranks in the group.
    pub world: u32,
    /// When the step started, µs from an epoch every rank of this process shares (the
    /// process's first measured step): the ranks of one process line their steps up by it.
    pub start_us: f64,
    /// Gradients in the order they were submitted (ready order).
    pub gradients: Vec<MeasuredGradient>,
    /// Collectives in the order this rank finished waiting for them.
    pub collectives: Vec<MeasuredCollective>,
    /// The packs and unpacks it ran, in the order they ended.
    pub copies: Vec<MeasuredCopy>,
    /// The backward pass reached the sync point.
    pub sync_us: f64,
    /// The hand-back at the end of the sync: from the moment every collective was done to the
    /// sync's return, writing the reduced gradients back into the tensors they came from
    /// (host work the step spends per gradient, whatever the plan).
    pub handback_us: f64,
    /// The sync returned: every gradient reduced and written back.
    pub end_us: f64,
    /// Ranks of this process per CPU core: each rank's backward runs on a thread of its own,
    /// so from one up the cores are all taken by the backward and a communicator thread's
    /// work takes time from it ([`MeasuredStep::interference_us`]).
    pub ranks_per_core: f64,
}

impl MeasuredStep {
    /// Exposed communication: what the step spent at its sync point (the collectives not
    /// hidden behind backward, the last packs and unpacks, the write-back).
    pub fn exposed_us(&self) -> f64 {
        (self.end_us - self.sync_us).max(0.0)
    }

    /// The part of [`Self::exposed_us`] spent waiting for collectives: the union of the waits
    /// inside the sync point. The rest of it is host work at the sync point (packs, unpacks
    /// and the write-back of the reduced gradients), which the simulator does not model.
    pub fn waited_at_sync_us(&self) -> f64 {
        let mut spans: Vec<(f64, f64)> = self
            .collectives
            .iter()
            .map(|c| {
                (
                    (c.end_us - c.wait_us).max(self.sync_us),
                    c.end_us.min(self.end_us),
                )
            })
            .filter(|(a, b)| b > a)
            .collect();
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut total, mut reach) = (0.0, f64::NEG_INFINITY);
        for (a, b) in spans {
            let a = a.max(reach);
            if b > a {
                total += b - a;
                reach = b;
            }
        }
        total.min(self.exposed_us())
    }

    /// Busy time of the communication stream.
    pub fn comm_us(&self) -> f64 {
        self.collectives
            .iter()
            .map(MeasuredCollective::duration_us)
            .sum()
    }
}

impl MeasuredStep {
    /// The fixed cost of one collective as this step's collectives paid it beyond `link`'s
    /// bandwidth term, µs: the median over the collectives that began while the backward ran
    /// (before the sync point), and over those that began after it; `None` for a side
    /// without collectives. Each collective is timed from the moment every rank had launched
    /// it (this rank and `peers`, the same step on other ranks of this process, lined up by
    /// `start_us`; peers whose collectives do not line up are left out) and this rank's
    /// communication stream was free, to its end, so the wait for a late rank is not in it.
    pub fn alpha_split_us(&self, peers: &[MeasuredStep], link: &LinkFit) -> [Option<f64>; 2] {
        let peers: Vec<&MeasuredStep> = peers
            .iter()
            .filter(|p| p.collectives.len() == self.collectives.len())
            .collect();
        let n = f64::from(self.world.max(1));
        let wire = 2.0 * (n - 1.0) / n;
        let mut sides: [Vec<f64>; 2] = Default::default();
        let mut free = f64::NEG_INFINITY;
        for (i, c) in self.collectives.iter().enumerate() {
            let joined = peers
                .iter()
                .map(|p| p.start_us + p.collectives[i].launch_us - self.start_us)
                .fold(c.launch_us, f64::max);
            let begin = joined.max(free).min(c.end_us);
            free = c.end_us;
            let bandwidth_us = c.bytes as f64 * wire / (link.busbw_gbs * 1e3);
            let side = usize::from(begin >= self.sync_us);
            sides[side].push((c.end_us - begin - bandwidth_us).max(0.0));
        }
        sides.map(median)
    }
}

impl MeasuredStep {
    /// The compute time one collective that began under the backward (before the sync point)
    /// took from it, µs: where the ranks' backward passes take every core
    /// ([`MeasuredStep::ranks_per_core`] at least one), each rank's communicator thread runs on
    /// time some backward needed, so one collective costs the backward the median CPU time the
    /// communicator spent on it times the ranks per core; with cores to spare, nothing. `None`
    /// without collectives under the backward.
    pub fn interference_us(&self) -> Option<f64> {
        let cpu = median(
            self.collectives
                .iter()
                .filter(|c| c.start_us < self.sync_us)
                .map(|c| c.cpu_us)
                .collect(),
        )?;
        Some(if self.ranks_per_core >= 1.0 {
            cpu * self.ranks_per_core
        } else {
            0.0
        })
    }

    /// The compute time the collectives that began before `t` (µs into the step) under the
    /// backward took from it, at `interference_us` each.
    pub fn interfered_before_us(&self, t: f64, interference_us: f64) -> f64 {
        let n = self
            .collectives
            .iter()
            .filter(|c| c.start_us < t.min(self.sync_us))
            .count();
        n as f64 * interference_us
    }
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

impl fmt::Display for MeasuredStep {
    /// A short human summary (what `run` prints).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = self.gradients.first().map_or(0.0, |g| g.ready_us);
        let last = self.gradients.last().map_or(0.0, |g| g.ready_us);
        write!(
            f,
            "step {:.0} us: {} gradients ready from {:.0} to {:.0} us, sync point at {:.0} us; {} collectives, {:.0} us on the link, {:.0} us exposed",
            self.end_us,
            self.gradients.len(),
            first,
            last,
            self.sync_us,
            self.collectives.len(),
            self.comm_us(),
            self.exposed_us()
        )
    }
}

/// The alpha-beta link fitted to measured collectives: `alpha + bytes * 2(n-1)/n / busbw`, the
/// cost model's all-reduce (see [`crate::cost`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkFit {
    /// Fixed cost of one all-reduce, µs.
    pub alpha_us: f64,
    /// Bus bandwidth, GB/s (10^9 bytes per second).
    pub busbw_gbs: f64,
    /// Distinct sizes the fit used.
    pub sizes: usize,
    /// Samples behind it.
    pub samples: usize,
}

impl fmt::Display for LinkFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "alpha {:.1} us, bus bandwidth {:.3} GB/s ({} sizes, {} collectives)",
            self.alpha_us, self.busbw_gbs, self.sizes, self.samples
        )
    }
}

/// Collective durations by size, the last [`LinkSamples::WINDOW`] of each, to fit the link.
///
/// Each size's estimate is the minimum of its window: the noise of a shared machine and the
/// wait for a late rank only ever add time, so the fastest recent run of a size is the best
/// estimate of what the link needs for it, and the window lets a changed link show.
#[derive(Clone, Debug, Default)]
pub struct LinkSamples {
    world: u32,
    by_size: BTreeMap<u64, VecDeque<f64>>,
    samples: usize,
}

impl LinkSamples {
    /// Durations kept per size.
    pub const WINDOW: usize = 16;
    /// Sizes kept (the most recent ones when more were seen).
    pub const SIZES: usize = 64;

    /// Empty, for a group of `world` ranks.
    pub fn new(world: u32) -> Self {
        LinkSamples {
            world,
            ..Self::default()
        }
    }

    /// Adds one collective of `bytes` that took `us`.
    pub fn add(&mut self, bytes: u64, us: f64) {
        if !us.is_finite() || us < 0.0 {
            return;
        }
        if !self.by_size.contains_key(&bytes) && self.by_size.len() >= Self::SIZES {
            // Forget the size nearest the new one: the spread of sizes is what fits beta.
            let nearest = self
                .by_size
                .keys()
                .copied()
                .min_by_key(|b| b.abs_diff(bytes))
                .unwrap_or(bytes);
            self.by_size.remove(&nearest);
        }
        let w = self.by_size.entry(bytes).or_default();
        if w.len() == Self::WINDOW {
            w.pop_front();
        }
        w.push_back(us);
        self.samples += 1;
    }

    /// Adds every collective of a measured step.
    pub fn add_step(&mut self, step: &MeasuredStep) {
        for c in &step.collectives {
            self.add(c.bytes, c.duration_us());
        }
    }

    /// The link that explains the samples: least squares of each size's minimum against the
    /// ring's bytes on the wire, the intercept kept at or above zero. `None` with fewer than
    /// two sizes or a bandwidth that does not come out positive (every size as fast). A group
    /// of one rank has no link: `None`.
    pub fn fit(&self) -> Option<LinkFit> {
        if self.world < 2 {
            return None;
        }
        let n = f64::from(self.world);
        let wire = 2.0 * (n - 1.0) / n;
        let pts: Vec<(f64, f64)> = self
            .by_size
            .iter()
            .filter_map(|(b, w)| {
                let t = w.iter().copied().fold(f64::INFINITY, f64::min);
                t.is_finite().then_some((*b as f64 * wire, t))
            })
            .collect();
        if pts.len() < 2 {
            return None;
        }
        let k = pts.len() as f64;
        let (sx, sy) = pts.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
        let (mx, my) = (sx / k, sy / k);
        let sxx: f64 = pts.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
        let sxy: f64 = pts.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
        if sxx <= 0.0 {
            return None;
        }
        let (mut alpha, mut beta) = (my - sxy / sxx * mx, sxy / sxx);
        if alpha < 0.0 {
            // Through the origin instead.
            alpha = 0.0;
            let sxx0: f64 = pts.iter().map(|(x, _)| x * x).sum();
            beta = pts.iter().map(|(x, y)| x * y).sum::<f64>() / sxx0;
        }
        // beta is µs per wire byte; busbw in GB/s is 1e-3 / beta.
        (beta > 0.0 && beta.is_finite()).then(|| LinkFit {
            alpha_us: alpha,
            busbw_gbs: 1e-3 / beta,
            sizes: pts.len(),
            samples: self.samples,
        })
    }
}

/// What a plan is compiled from once a step has been measured: the gradients' ready times (µs
/// from the first, in ready order), the fitted link and the fixed cost of a collective as the
/// step's collectives paid it, as one rank (rank 0) measured them. Every rank compiles from the
/// same one, so every rank gets the same plan.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredProfile {
    /// Ready time of each gradient, in ready order.
    pub ready_us: Vec<f64>,
    /// The link, when there was one to fit.
    pub link: Option<LinkFit>,
    /// The fixed cost of one collective, µs, as the step paid it `[while the backward ran,
    /// after it]` ([`MeasuredStep::alpha_split_us`]); `None` for a side without collectives
    /// (see [`MeasuredProfile::alphas_us`]). The link's own alpha is its best case (the fit takes the
    /// fastest run of each size); where communication shares the cores with compute, a
    /// collective under the backward pays far more, and a plan made for the best case launches
    /// too many.
    pub alpha_split_us: [Option<f64>; 2],
    /// The compute time one collective under the backward takes from it, µs
    /// ([`MeasuredStep::interference_us`]); `None` when no collective ran under it. The ready
    /// times are without it: what the backward would take with no collective beside it, so
    /// that a plan is judged by the collectives it launches, not those of the plan measured.
    pub interference_us: Option<f64>,
}

/// Compute nodes of a measured segment count nanoseconds as their `flops`, at this rate
/// (TFLOP/s) in the measured system profile: one "flop" per nanosecond.
pub const MEASURED_TFLOPS: f64 = 1e-3;

impl MeasuredProfile {
    /// A step's ready times, from its first gradient (what comes before, the forward pass and
    /// the optimizer, cannot overlap a collective of the step and is no part of a plan), the
    /// link fit and, with a link, the step's alpha split (`peers`: the same step on other ranks
    /// of this process, see [`MeasuredStep::alpha_split_us`]).
    pub fn from_step(step: &MeasuredStep, peers: &[MeasuredStep], link: Option<LinkFit>) -> Self {
        let interference = step.interference_us();
        let itf = interference.unwrap_or(0.0);
        // Without the time the collectives before it took from the backward.
        let ready = |g: &MeasuredGradient| g.ready_us - step.interfered_before_us(g.ready_us, itf);
        let first = step.gradients.first().map_or(0.0, ready);
        MeasuredProfile {
            ready_us: step
                .gradients
                .iter()
                .map(|g| (ready(g) - first).max(0.0))
                .collect(),
            link,
            alpha_split_us: link.map_or([None; 2], |l| step.alpha_split_us(peers, &l)),
            interference_us: interference,
        }
    }

    /// The numbers [`MeasuredProfile::encode`] writes after the ready times.
    pub const TRAILER: usize = 5;

    /// As numbers (ready times, then alpha and bus bandwidth, zeros for no link, then the
    /// alpha split and the interference, -1 for one without), to share.
    pub fn encode(&self) -> Vec<f64> {
        let mut v = self.ready_us.clone();
        let l = self.link.map_or((0.0, 0.0), |l| (l.alpha_us, l.busbw_gbs));
        v.extend([l.0, l.1]);
        v.extend(self.alpha_split_us.map(|a| a.unwrap_or(-1.0)));
        v.push(self.interference_us.unwrap_or(-1.0));
        v
    }

    /// What [`MeasuredProfile::encode`] wrote, `None` when the length does not match.
    pub fn decode(v: &[f64]) -> Option<Self> {
        let n = v.len().checked_sub(Self::TRAILER)?;
        let (alpha_us, busbw_gbs) = (v[n], v[n + 1]);
        let side = |a: f64| (a.is_finite() && a >= 0.0).then_some(a);
        Some(MeasuredProfile {
            ready_us: v[..n].to_vec(),
            link: (busbw_gbs > 0.0 && busbw_gbs.is_finite() && alpha_us >= 0.0).then_some(
                LinkFit {
                    alpha_us,
                    busbw_gbs,
                    sizes: 0,
                    samples: 0,
                },
            ),
            alpha_split_us: [side(v[n + 2]), side(v[n + 3])],
            interference_us: side(v[n + 4]),
        })
    }

    /// Sides of the alpha split and the interference this profile lacks taken from `base` (a
    /// plan's earlier profile): a side that had no collectives this time did not change.
    pub fn keep_missing(&mut self, base: &MeasuredProfile) {
        if self.link.is_none() {
            self.link = base.link;
        }
        for (a, b) in self.alpha_split_us.iter_mut().zip(base.alpha_split_us) {
            *a = a.or(b);
        }
        self.interference_us = self.interference_us.or(base.interference_us);
    }

    /// The fixed cost of one collective, µs, `[during the backward, after it]`, as planned: each
    /// side as measured, a side without collectives taking the other side's, and the link's
    /// alpha where neither was measured (the split is timed from the last rank's launch; the
    /// fit's smallest sizes, seen in few collectives, may hold a wait for a late rank). `None`
    /// without a link.
    pub fn alphas_us(&self) -> Option<[f64; 2]> {
        let link = self.link?;
        let [busy, idle] = self.alpha_split_us;
        let or_other = |a: Option<f64>, b: Option<f64>| a.or(b).unwrap_or(link.alpha_us);
        Some([or_other(busy, idle), or_other(idle, busy)])
    }

    /// The predicted cost of one all-reduce of `bytes` over `world` ranks, µs, `[during the
    /// backward, after it]`; `None` without a link.
    fn link_us(&self, bytes: u64, world: u32) -> Option<[f64; 2]> {
        let link = self.link?;
        let n = f64::from(world.max(2));
        let wire = bytes as f64 * 2.0 * (n - 1.0) / n / (link.busbw_gbs * 1e3);
        Some(self.alphas_us()?.map(|a| a + wire))
    }

    /// How far this profile moved from `base`, as a fraction of the longer of base's backward
    /// pass (its last ready time) and base's link cost of one all-reduce of `bytes` (all the
    /// gradients): the largest change of a gradient's ready time, or of that link cost (during
    /// the backward or after it). Both move the step's timeline, so both are weighed against
    /// the same length: a link whose small all-reduce got twice as slow does not re-plan a
    /// step whose backward pass is a hundred times longer (the plan could win back at most
    /// that change), while a communication-bound step re-plans when its link moves. Infinite
    /// when the two do not describe the same gradients, only one has a link, or this one has a
    /// side of the alpha split that `base` lacked (what a collective costs under the backward
    /// is news to a plan made without it).
    pub fn drift(&self, base: &MeasuredProfile, bytes: u64, world: u32) -> f64 {
        let news = self
            .alpha_split_us
            .iter()
            .zip(&base.alpha_split_us)
            .chain([(&self.interference_us, &base.interference_us)])
            .any(|(a, b)| a.is_some() && b.is_none());
        if self.ready_us.len() != base.ready_us.len() || news {
            return f64::INFINITY;
        }
        let link = match (self.link_us(bytes, world), base.link_us(bytes, world)) {
            (None, None) => None,
            (Some(a), Some(b)) => Some((a, b)),
            _ => return f64::INFINITY,
        };
        let span = base
            .ready_us
            .last()
            .copied()
            .unwrap_or(0.0)
            .max(link.map_or(0.0, |(_, b)| b[0].max(b[1])))
            .max(1.0);
        let ready = self
            .ready_us
            .iter()
            .zip(&base.ready_us)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        let link = link.map_or(0.0, |(a, b)| (a[0] - b[0]).abs().max((a[1] - b[1]).abs()));
        ready.max(link) / span
    }

    /// The system profile of this measurement: the fitted link's bandwidth (`fallback`'s link
    /// without one), the fixed cost of a collective during the backward and after it as
    /// [`MeasuredProfile::alphas_us`] plans it, compute at [`MEASURED_TFLOPS`] (a measured
    /// segment's compute nodes carry nanoseconds), `fallback`'s copy bandwidth.
    pub fn system_profile(&self, world: u32, fallback: &SystemProfile) -> SystemProfile {
        let busbw_gbs = self.link.map_or(fallback.busbw_gbs, |l| l.busbw_gbs);
        let (busy, alpha_us) = match self.alphas_us() {
            Some([busy, idle]) => (Some(busy), idle),
            None => (None, fallback.alpha_us),
        };
        SystemProfile {
            name: "measured".into(),
            description: "the link and the step as this job measured them".into(),
            world,
            alpha_us,
            alpha_busy_us: busy,
            interference_us: self.interference_us,
            busbw_gbs,
            compute_tflops: MEASURED_TFLOPS,
            mem_gbs: fallback.mem_gbs,
            sources: Vec::new(),
        }
    }

    /// The sync segment of `entries` (parameter and gradient type, in ready order) with the
    /// measured time before each gradient as a `compute` node: `"until <param>, ready <t> us"`
    /// (the gradient's ready time in its label, for people), its `flops` the nanoseconds since
    /// the previous gradient.
    /// Each gradient is the result of its compute node, followed by its `grad_sync`; one `sync`
    /// ends it. Ready times missing (a profile of fewer gradients) count as no time.
    pub fn segment(&self, world: u32, reduce: ReduceOp, entries: &[(String, TensorType)]) -> Graph {
        self.segment_until(world, reduce, entries, 0.0)
    }

    /// [`MeasuredProfile::segment`] with `tail_us` of compute after the last gradient before
    /// the sync point (a `compute "until the sync point"` node ordered before the `sync`, when
    /// it is more than zero): the whole measured backward from its first gradient, to predict
    /// a step rather than to plan one.
    pub fn segment_until(
        &self,
        world: u32,
        reduce: ReduceOp,
        entries: &[(String, TensorType)],
        tail_us: f64,
    ) -> Graph {
        let mut g = Graph::new("measured");
        let group = g.add_group(world);
        let mut prev: Option<NodeId> = None;
        let mut last = 0.0f64;
        let mut syncs = Vec::with_capacity(entries.len());
        for (i, (name, ty)) in entries.iter().enumerate() {
            let at = self.ready_us.get(i).copied().unwrap_or(last).max(last);
            let ns = ((at - last) * 1e3).round().max(0.0) as u64;
            last = at;
            let operands: Vec<Value> = prev.map(Value::of).into_iter().collect();
            let compute = g.add_node(
                Op::Compute {
                    name: format!("until {name}, ready {at:.0} us"),
                    kind: ComputeKind::Opaque,
                    flops: ns,
                },
                [ty.clone()],
                &operands,
            );
            prev = Some(compute);
            syncs.push(add_gradient_sync(
                &mut g, name, ty, compute, i as u32, reduce, group,
            ));
        }
        let tail_ns = (tail_us * 1e3).round();
        let tail = (tail_ns >= 1.0).then(|| {
            let operands: Vec<Value> = prev.map(Value::of).into_iter().collect();
            g.add_node(
                Op::Compute {
                    name: format!("until the sync point, at {:.0} us", last + tail_us),
                    kind: ComputeKind::Opaque,
                    flops: tail_ns as u64,
                },
                [TensorType::new(crate::graph::DType::F32, &[])],
                &operands,
            )
        });
        let sync = g.add_node(Op::Sync, [], &syncs);
        if let Some(t) = tail {
            g.add_order(t, sync);
        }
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples drawn from a known link (alpha 50 us, 2 GB/s over 4 ranks) with noise that only
    /// adds time: the fit finds the link within a few percent.
    #[test]
    fn the_fit_recovers_a_known_link_from_noisy_samples() {
        let mut s = LinkSamples::new(4);
        let wire = 2.0 * 3.0 / 4.0;
        let mut noise = crate::runtime::synthetic::SplitMix64(7);
        for bytes in [4u64 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20] {
            for _ in 0..10 {
                let t = 50.0 + bytes as f64 * wire / 2e3;
                s.add(
                    bytes,
                    t * (1.0 + 0.3 * (noise.next_u64() % 1000) as f64 / 1000.0),
                );
            }
            // The clean run of each size.
            s.add(bytes, 50.0 + bytes as f64 * wire / 2e3);
        }
        let f = s.fit().unwrap();
        assert!((f.alpha_us - 50.0).abs() < 2.0, "{f}");
        assert!((f.busbw_gbs - 2.0).abs() < 0.02, "{f}");
        assert_eq!((f.sizes, f.samples), (5, 55));
    }

    fn profile(ready_us: &[f64], alpha_us: f64, busbw_gbs: f64) -> MeasuredProfile {
        MeasuredProfile {
            ready_us: ready_us.to_vec(),
            link: Some(LinkFit {
                alpha_us,
                busbw_gbs,
                sizes: 3,
                samples: 6,
            }),
            alpha_split_us: [None; 2],
            interference_us: None,
        }
    }

    /// Drift is measured against the step's length: a backward pass that grew re-plans, a link
    /// whose small all-reduce got four times slower does not when the backward pass dwarfs it,
    /// and does when communication is the step.
    #[test]
    fn drift_weighs_ready_times_and_the_link_against_the_step() {
        let base = profile(&[0.0, 5_000.0, 10_000.0], 20.0, 1.0);
        // 64 KiB over 2 ranks at 1 GB/s: about 85 us against a 10 ms backward pass.
        let small = 64 << 10;
        assert_eq!(base.drift(&base, small, 2), 0.0);
        let longer = profile(&[0.0, 20_000.0, 40_000.0], 20.0, 1.0);
        assert!((longer.drift(&base, small, 2) - 3.0).abs() < 1e-9);
        let slow_link = profile(&[0.0, 5_000.0, 10_000.0], 80.0, 0.25);
        assert!(slow_link.drift(&base, small, 2) < 0.05);
        // 1 GiB: the link (about 1.07 s) is the longer; four times slower is a drift of 3.
        let big = 1 << 30;
        let d = slow_link.drift(&base, big, 2);
        assert!((d - 3.0).abs() < 0.01, "{d}");
        // Different gradients, or a link on one side only: always re-plan.
        assert_eq!(
            profile(&[0.0], 20.0, 1.0).drift(&base, small, 2),
            f64::INFINITY
        );
        let no_link = MeasuredProfile {
            link: None,
            ..base.clone()
        };
        assert_eq!(no_link.drift(&base, small, 2), f64::INFINITY);
        assert_eq!(no_link.drift(&no_link, small, 2), 0.0);
        // A collective under the backward that got 2 ms dearer moves a 10 ms step by a fifth.
        let split = |busy: f64| MeasuredProfile {
            alpha_split_us: [Some(busy), Some(20.0)],
            interference_us: None,
            ..base.clone()
        };
        let d = split(3_000.0).drift(&split(1_000.0), small, 2);
        assert!((d - 0.2).abs() < 1e-9, "{d}");
        // A side measured for the first time always re-plans.
        assert_eq!(split(1_000.0).drift(&base, small, 2), f64::INFINITY);
        assert!(base.drift(&split(1_000.0), small, 2).is_finite());
    }

    /// The alpha a step's collectives paid during its backward and after it travels with the
    /// profile (a missing side as such) and becomes the system the plan is compiled under.
    #[test]
    fn the_alpha_split_is_shared_and_planned_with() {
        let mut p = profile(&[0.0, 10.0], 2.0, 1.5);
        p.alpha_split_us = [Some(900.0), None];
        let back = MeasuredProfile::decode(&p.encode()).expect("decodes");
        assert_eq!(back.ready_us, p.ready_us);
        assert_eq!(back.alpha_split_us, p.alpha_split_us);
        assert_eq!(
            back.link.map(|l| (l.alpha_us, l.busbw_gbs)),
            Some((2.0, 1.5))
        );
        let fallback = crate::cost::SystemProfile::load("h200-nvlink").unwrap();
        let sys = back.system_profile(2, &fallback);
        // The idle side was not measured: the busy side's, rather than the fit's.
        assert_eq!((sys.alpha_us, sys.alpha_busy_us), (900.0, Some(900.0)));
        // Neither side measured: the fit's alpha.
        let fit = profile(&[0.0, 10.0], 2.0, 1.5).system_profile(2, &fallback);
        assert_eq!((fit.alpha_us, fit.alpha_busy_us), (2.0, Some(2.0)));
        // A later profile without a busy side keeps the base's.
        let mut later = profile(&[0.0, 10.0], 2.0, 1.5);
        later.alpha_split_us = [None, Some(30.0)];
        later.keep_missing(&back);
        assert_eq!(later.alpha_split_us, [Some(900.0), Some(30.0)]);
        let sys = later.system_profile(2, &fallback);
        assert_eq!((sys.alpha_us, sys.alpha_busy_us), (30.0, Some(900.0)));
        let model = crate::cost::CostModel::new(sys);
        assert!(model.all_reduce_secs_at(8, 2, true) > 0.9e-3);
        assert!(model.all_reduce_secs_at(8, 2, false) < 0.1e-3);
    }

    /// The waits inside the sync point, overlaps counted once; the rest of the exposed time
    /// is host work.
    #[test]
    fn the_exposed_time_splits_into_waits_and_host_work() {
        let c = |end_us: f64, wait_us: f64| MeasuredCollective {
            collective: 0,
            bytes: 4,
            launch_us: 0.0,
            start_us: 0.0,
            end_us,
            wait_us,
            cpu_us: 0.0,
        };
        let step = MeasuredStep {
            world: 2,
            gradients: Vec::new(),
            // Waits [90, 110] (before the sync from 100 on), [105, 120] and [130, 135].
            collectives: vec![c(110.0, 20.0), c(120.0, 15.0), c(135.0, 5.0)],
            sync_us: 100.0,
            end_us: 150.0,
            ..MeasuredStep::default()
        };
        assert_eq!(step.exposed_us(), 50.0);
        assert_eq!(step.waited_at_sync_us(), 25.0);
    }

    #[test]
    fn no_fit_without_two_sizes_or_a_link() {
        let mut s = LinkSamples::new(2);
        s.add(1024, 10.0);
        s.add(1024, 12.0);
        assert_eq!(s.fit(), None);
        let mut one = LinkSamples::new(1);
        one.add(1024, 10.0);
        one.add(4096, 20.0);
        assert_eq!(one.fit(), None);
        // Larger is not slower: no positive bandwidth.
        let mut flat = LinkSamples::new(2);
        flat.add(1024, 20.0);
        flat.add(4096, 10.0);
        assert_eq!(flat.fit(), None);
    }

    #[test]
    fn the_window_forgets_old_durations_and_sizes_stay_bounded() {
        let mut s = LinkSamples::new(2);
        s.add(1 << 20, 1.0);
        for _ in 0..LinkSamples::WINDOW {
            s.add(1 << 20, 500.0);
        }
        s.add(1 << 10, 10.0);
        let f = s.fit().unwrap();
        // The 1 us run is out of the window: 1 MiB now costs 500 us.
        assert!(f.busbw_gbs < 3.0, "{f}");
        for b in 0..200u64 {
            s.add(b * 4096 + 1, 1.0 + b as f64);
        }
        assert!(s.by_size.len() <= LinkSamples::SIZES);
    }

    #[test]
    fn interference_is_the_communicators_cpu_per_collective_where_the_cores_are_taken() {
        let c = |start_us: f64, cpu_us: f64| MeasuredCollective {
            collective: 0,
            bytes: 0,
            launch_us: start_us,
            start_us,
            end_us: start_us + 10.0,
            wait_us: 0.0,
            cpu_us,
        };
        let g = |ready_us: f64| MeasuredGradient {
            param: format!("g{ready_us}"),
            bytes: 4,
            ready_us,
        };
        // Three gradients at 100, 300 and 600; collectives began at 150 and 400 under the
        // backward (20 and 40 us of the communicator's CPU) and one at 900, after the sync
        // point (700), which does not count.
        let step = MeasuredStep {
            world: 4,
            gradients: vec![g(100.0), g(300.0), g(600.0)],
            collectives: vec![c(150.0, 20.0), c(400.0, 40.0), c(900.0, 1000.0)],
            sync_us: 700.0,
            end_us: 1000.0,
            ranks_per_core: 2.0,
            ..MeasuredStep::default()
        };
        // The median of 20 and 40, times two ranks per core.
        assert_eq!(step.interference_us(), Some(60.0));
        // Cores to spare: the communicator takes nothing from the backward.
        let spare = MeasuredStep {
            ranks_per_core: 0.5,
            ..step.clone()
        };
        assert_eq!(spare.interference_us(), Some(0.0));
        let none_under = MeasuredStep {
            collectives: vec![c(900.0, 5.0)],
            ..step.clone()
        };
        assert_eq!(none_under.interference_us(), None);
        // The profile's ready times are without it: 300 less one collective's 60, 600 less
        // two; from the first gradient.
        let p = MeasuredProfile::from_step(&step, &[], None);
        assert_eq!(p.interference_us, Some(60.0));
        assert_eq!(p.ready_us, vec![0.0, 140.0, 380.0]);
        // Shared and read back.
        assert_eq!(MeasuredProfile::decode(&p.encode()), Some(p.clone()));
        let without = MeasuredProfile {
            interference_us: None,
            ..p.clone()
        };
        assert_eq!(
            MeasuredProfile::decode(&without.encode()),
            Some(without.clone())
        );
        // Appearing is news: it re-plans.
        assert!(p.drift(&without, 12, 4).is_infinite());
        assert!(p.drift(&p, 12, 4) == 0.0);
    }

    #[test]
    fn a_collective_is_timed_from_the_last_rank_s_launch_and_split_at_the_sync_point() {
        let c = |launch_us: f64, end_us: f64| MeasuredCollective {
            collective: 0,
            bytes: 0,
            launch_us,
            start_us: launch_us,
            end_us,
            wait_us: 0.0,
            cpu_us: 0.0,
        };
        let mine = MeasuredStep {
            world: 2,
            start_us: 0.0,
            // Launched at 100 (the peer at 300) and ended at 700; then one that ended 50 us
            // after it; then one launched at 990 and one at 1030, the sync point at 1000.
            collectives: vec![
                c(100.0, 700.0),
                c(650.0, 750.0),
                c(990.0, 1030.0),
                c(1030.0, 1040.0),
            ],
            sync_us: 1000.0,
            end_us: 1100.0,
            ..MeasuredStep::default()
        };
        let peer = MeasuredStep {
            // Started 100 us later: launched the first at 200 + 100 = 300 on this rank's clock,
            // the second at 700 (after this rank's first ended), the rest early.
            start_us: 100.0,
            collectives: vec![c(200.0, 0.0), c(600.0, 0.0), c(0.0, 0.0), c(0.0, 0.0)],
            ..mine.clone()
        };
        let link = LinkFit {
            alpha_us: 1.0,
            busbw_gbs: 1.0,
            sizes: 2,
            samples: 2,
        };
        // From the last launch (or the stream free): 700 - 300, 750 - 700, 1030 - 990 began
        // before the sync point (median 50), 1040 - 1030 after it.
        assert_eq!(
            mine.alpha_split_us(std::slice::from_ref(&peer), &link),
            [Some(50.0), Some(10.0)]
        );
        // Alone, the first counts from its own launch: [600, 50, 40] → 50; a peer with another
        // number of collectives is left out.
        let odd = MeasuredStep {
            collectives: vec![c(0.0, 0.0)],
            ..peer
        };
        assert_eq!(mine.alpha_split_us(&[odd], &link), [Some(50.0), Some(10.0)]);
        assert_eq!(
            MeasuredStep::default().alpha_split_us(&[], &link),
            [None, None]
        );
    }
}

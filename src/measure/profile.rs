//! What a plan is compiled from once a step has been measured, as rank 0 shares it.

use super::{LinkFit, MeasuredGradient, MeasuredStep};
use crate::cost::SystemProfile;
use crate::graph::builder::add_gradient_sync;
use crate::graph::{ComputeKind, Graph, NodeId, Op, ReduceOp, TensorType, Value};

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
    /// The fixed cost of one collective, µs, as the step paid it `[while the backward passes
    /// took every core, after]` ([`MeasuredStep::alpha_split_us`]); `None` for a side without
    /// collectives (see [`MeasuredProfile::alphas_us`]). The link's own alpha is its best case (the fit takes the
    /// fastest run of each size); where communication shares the cores with compute, a
    /// collective under the backward pays far more, and a plan made for the best case launches
    /// too many.
    pub alpha_split_us: [Option<f64>; 2],
    /// The compute time one collective under the backward takes from it, µs
    /// ([`MeasuredStep::interference_us`]); `None` when no collective ran under it. The ready
    /// times are without it: what the backward would take with no collective beside it, so
    /// that a plan is judged by the collectives it launches, not those of the plan measured.
    pub interference_us: Option<f64>,
    /// When the backward passes of the measured rank's process stopped taking every core, µs
    /// on the ready times' clock ([`MeasuredStep::cores_free_us`], without the interference
    /// before it); `None` where it was not measured. A collective that starts after it pays
    /// the idle side of the alpha split: the same line the split was measured with.
    pub cores_free_us: Option<f64>,
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
        // A moment of the step without the time the collectives before it took from the
        // backward.
        let unslowed = |t: f64| t - step.interfered_before_us(t, itf);
        let ready = |g: &MeasuredGradient| unslowed(g.ready_us);
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
            cores_free_us: (!step.gradients.is_empty())
                .then(|| (unslowed(step.cores_free_us(peers)) - first).max(0.0)),
        }
    }

    /// The numbers [`MeasuredProfile::encode`] writes after the ready times.
    pub const TRAILER: usize = 6;

    /// As numbers (ready times, then alpha and bus bandwidth, zeros for no link, then the
    /// alpha split, the interference and the cores' horizon, -1 for one without), to share.
    pub fn encode(&self) -> Vec<f64> {
        let mut v = self.ready_us.clone();
        let l = self.link.map_or((0.0, 0.0), |l| (l.alpha_us, l.busbw_gbs));
        v.extend([l.0, l.1]);
        v.extend(self.alpha_split_us.map(|a| a.unwrap_or(-1.0)));
        v.push(self.interference_us.unwrap_or(-1.0));
        v.push(self.cores_free_us.unwrap_or(-1.0));
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
            cores_free_us: side(v[n + 5]),
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
        self.cores_free_us = self.cores_free_us.or(base.cores_free_us);
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
    /// [`MeasuredProfile::alphas_us`] plans it, the line between the two where the cores came
    /// free (as a shift from the last ready time, the end of the segment's compute), compute
    /// at [`MEASURED_TFLOPS`] (a measured segment's compute nodes carry nanoseconds),
    /// `fallback`'s copy bandwidth.
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
            busy_shift_us: busy
                .and(self.cores_free_us)
                .map(|free| free - self.ready_us.last().copied().unwrap_or(0.0)),
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
    use crate::measure::MeasuredCollective;

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
            cores_free_us: None,
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
        // One rank alone on its core computes until its last gradient: the cores free there,
        // on the same clock.
        assert_eq!(p.cores_free_us, Some(380.0));
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
}

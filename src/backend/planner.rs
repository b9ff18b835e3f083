//! The `cost` policy's plans from measured steps ([`MeasuredPlans`](super::MeasuredPlans)): at
//! a check step the ranks share rank 0's measured profile and compile the next steps' plan from
//! it, the first time, when it drifted, or when a rank left the plan.

use burn_backend::Backend;

use super::options::UnusedParameters;
use super::session::{RankState, Session};
use crate::config::BucketPolicy;
use crate::cost::CostModel;
use crate::graph::TensorType;
use crate::measure::{MeasuredProfile, MeasuredStep};

/// A rank's state of [`MeasuredPlans`](super::MeasuredPlans).
#[derive(Debug, Default)]
pub(super) struct Planner {
    /// Synced steps so far.
    pub(super) synced: u64,
    /// The profile the current plan was compiled from.
    pub(super) base: Option<MeasuredProfile>,
    /// This rank compiled a plan of its own since (a step left the measured plan).
    pub(super) stale: bool,
    /// Plans compiled from measured steps, and those of them a drift caused.
    pub(super) plans: u64,
    pub(super) replans: u64,
}

impl<I: Backend> Session<I> {
    /// The compiler options of a plan compiled from `profile`: the measured link and compute.
    fn measured_config(&self, profile: &MeasuredProfile) -> crate::config::CompileConfig {
        let mut config = self.options.config.clone();
        config.cost =
            CostModel::new(profile.system_profile(self.world as u32, &config.cost.system));
        config
    }

    /// The compiler options the expected plan was compiled with.
    pub(super) fn expected_config(&self, st: &RankState<I>) -> crate::config::CompileConfig {
        match &st.planner.base {
            Some(p) if !st.planner.stale => self.measured_config(p),
            _ => self.options.config.clone(),
        }
    }

    /// At a check step of [`MeasuredPlans`](super::MeasuredPlans), shares rank 0's measured
    /// profile and every rank's need of a plan, and compiles the next step's plan from that
    /// profile when this is the first check, some rank needs one, or the profile drifted. Every
    /// rank decides from the same shared numbers.
    pub(super) fn plan_from_measured(&self, rank: usize, st: &mut RankState<I>) {
        let Some(every) = self.options.measured_plans else {
            return;
        };
        // The step just ended: its gradients, in ready order.
        let grads = st.last_step.as_ref().map_or(&[][..], |r| &r.grads[..]);
        if self.world < 2
            || self.options.config.bucket.policy != BucketPolicy::Cost
            || self.options.unused == UnusedParameters::ZeroFill
            || grads.is_empty()
        {
            return;
        }
        st.planner.synced += 1;
        let n = st.planner.synced;
        // The first synced step runs before any plan is known (its collectives all start at
        // the sync point), so it cannot say what a collective costs under the backward; the
        // second, the first to run a measured plan, can.
        if n > 2 && !n.is_multiple_of(every.every_steps.max(1)) {
            return;
        }
        let entries: Vec<(String, TensorType)> = grads
            .iter()
            .map(|(n, t, _)| (n.clone(), t.clone()))
            .collect();
        // Only rank 0's profile is shared; the others send placeholders of its length.
        let mine = if rank == 0 {
            // The same step on the other ranks of this process (or their step before, which
            // the alpha split leaves out), to time each collective from the last launch.
            let peers: Vec<MeasuredStep> = (1..self.clocks.len())
                .filter_map(|r| self.clock(r).last.clone())
                .collect();
            let c = self.clock(rank);
            let mut p = match &c.last {
                Some(m) => MeasuredProfile::from_step(m, &peers, c.link.fit()),
                None => MeasuredProfile {
                    ready_us: Vec::new(),
                    link: None,
                    alpha_split_us: [None; 2],
                    interference_us: None,
                    cores_free_us: None,
                },
            };
            let last = p.ready_us.last().copied().unwrap_or(0.0);
            p.ready_us.resize(entries.len(), last);
            p.encode()
        } else {
            vec![0.0; entries.len() + MeasuredProfile::TRAILER]
        };
        let shared = crate::runtime::agree::share_from_root(
            self.comm(rank),
            &mine,
            st.planner.stale,
            self.options.timeout,
        );
        let (values, stale) = match shared {
            Ok(s) => s,
            Err(e) => self.fail(rank, format!("sharing the measured step: {e}")),
        };
        let Some(mut profile) = MeasuredProfile::decode(&values) else {
            return;
        };
        // A link that could not be fitted this time (sizes too close to tell α from β, noise
        // that made larger all-reduces look faster), or a side of the alpha split without
        // collectives this time, keeps the last one: a fit that comes and goes is no drift.
        // One that appears for the first time re-plans.
        if let Some(b) = &st.planner.base {
            profile.keep_missing(b);
        }
        let bytes: u64 = entries.iter().map(|(_, t)| t.bytes()).sum();
        let drifted = st
            .planner
            .base
            .as_ref()
            .is_some_and(|b| profile.drift(b, bytes, self.world as u32) > every.drift);
        if st.planner.base.is_some() && !drifted && !stale.contains(&true) {
            return;
        }
        let config = self.measured_config(&profile);
        tracing::debug!(
            rank,
            drifted,
            link = ?profile.link,
            alpha_split_us = ?profile.alpha_split_us,
            backward_us = profile.ready_us.last().copied().unwrap_or(0.0),
            "compiling the next steps' plan from the measured step"
        );
        let g = profile.segment(self.world as u32, self.reduce, &entries);
        let plan = match st.cache.get_or_compile(&g, &config) {
            Ok(p) => p,
            Err(e) => self.fail(rank, format!("compiling the measured gradient sync: {e}")),
        };
        st.planner.replans += u64::from(drifted);
        st.planner.plans += 1;
        st.planner.base = Some(profile);
        st.planner.stale = false;
        st.expected = Some(plan);
        st.expected_segment = Some(g);
    }
}

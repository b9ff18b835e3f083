//! Which plan a step follows during backward when a program's steps sync different gradient
//! lists: a GAN's generator and discriminator steps, a multi-task model training one head per
//! step, layers a schedule skips on some steps (on every rank alike).
//!
//! A step follows a plan while its gradients arrive in that plan's order: each bucket launches
//! as its last gradient arrives. Following only the previous step's plan, a program whose steps
//! alternate between two lists never overlaps anything: each step diverges from the plan of the
//! step before and reduces at its sync point. So a rank remembers, per gradient list it synced
//! (a *segment*), the plan it last ran with, and which segment the step after it synced; a step
//! follows the segment that came after the last one last time when that plan's first gradient
//! is the one that just arrived, else the previous step's plan, as before.
//!
//! Requires: every rank syncs the same segments in the same order (what a plan's agreement
//! already checks). Guarantees: every rank predicts the same plan from the same history, so
//! what a step launches during backward is the same on every rank; a wrong prediction costs
//! what a diverged step costs today (the rest reduced at the sync point), never a value; at
//! most [`SEGMENTS`] segments are remembered (past that the history starts again, on every
//! rank alike).

use std::sync::Arc;

use hashbrown::HashMap;

use crate::codegen::plan::Plan;
use crate::graph::{Fnv64, Graph, TensorType};

/// Segments a rank remembers before its history starts again.
pub(super) const SEGMENTS: usize = 32;

/// A rank's synced segments: the plan each last ran with, and what followed what.
#[derive(Default)]
pub(super) struct History {
    /// Segment key → the plan it last ran with, and its segment graph.
    plans: HashMap<u64, (Arc<Plan>, Graph)>,
    /// Segment key → the segment the step after it synced, last time.
    after: HashMap<u64, u64>,
    /// The last synced segment.
    last: Option<u64>,
}

/// The key of a gradient list (parameter names and types, in ready order).
pub(super) fn segment_key<'a>(entries: impl IntoIterator<Item = (&'a str, &'a TensorType)>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = Fnv64::default();
    for e in entries {
        e.hash(&mut h);
    }
    h.finish()
}

/// Whether `plan` expects `(name, ty)` as its first gradient.
fn starts_with(plan: &Plan, name: &str, ty: &TensorType) -> bool {
    plan.gradient_from(0, |_| true)
        .and_then(|s| plan.slots.get(s as usize))
        .is_some_and(|s| s.param == name && s.ty == *ty)
}

impl History {
    /// A step synced segment `key` with `plan` (compiled from `segment`): remembered, and as
    /// what came after the previous one. A segment that ran its remembered plan again costs a
    /// lookup (a program whose steps all sync one list pays nothing more).
    pub(super) fn synced(&mut self, key: u64, plan: &Arc<Plan>, segment: &Graph) {
        if self.plans.len() >= SEGMENTS && !self.plans.contains_key(&key) {
            *self = History::default();
        }
        if let Some(prev) = self.last {
            self.after.insert(prev, key);
        }
        if !self
            .plans
            .get(&key)
            .is_some_and(|(p, _)| Arc::ptr_eq(p, plan))
        {
            self.plans.insert(key, (Arc::clone(plan), segment.clone()));
        }
        self.last = Some(key);
    }

    /// The plan of the segment that came after the last synced one last time, and its segment
    /// graph, when its first gradient is `(name, ty)`.
    pub(super) fn predicted(&self, name: &str, ty: &TensorType) -> Option<&(Arc<Plan>, Graph)> {
        self.next().filter(|(plan, _)| starts_with(plan, name, ty))
    }

    /// The plan of the segment that came after the last synced one last time.
    pub(super) fn next_plan(&self) -> Option<Arc<Plan>> {
        self.next().map(|(p, _)| Arc::clone(p))
    }

    fn next(&self) -> Option<&(Arc<Plan>, Graph)> {
        self.plans.get(self.after.get(&self.last?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CompileConfig;
    use crate::graph::{DType, ReduceOp};
    use crate::runtime::cache::PlanCache;

    fn plan(cache: &mut PlanCache, names: &[&str]) -> (u64, Arc<Plan>, Graph) {
        let ty = TensorType::new(DType::F32, &[4]);
        let entries: Vec<(String, TensorType)> =
            names.iter().map(|n| (n.to_string(), ty.clone())).collect();
        let g = crate::backend::session::segment(2, &entries, ReduceOp::Mean);
        let p = cache
            .get_or_compile(&g, &CompileConfig::default())
            .expect("compiles");
        let key = segment_key(entries.iter().map(|(n, t)| (n.as_str(), t)));
        (key, p, g)
    }

    #[test]
    fn alternating_segments_predict_each_other_once_seen() {
        let mut cache = PlanCache::new();
        let ty = TensorType::new(DType::F32, &[4]);
        let (ka, pa, ga) = plan(&mut cache, &["d.w", "d.b"]);
        let (kb, pb, gb) = plan(&mut cache, &["g.w", "g.b"]);
        let mut h = History::default();
        assert!(h.predicted("d.w", &ty).is_none(), "nothing synced yet");
        h.synced(ka, &pa, &ga);
        assert!(h.predicted("d.w", &ty).is_none(), "nothing followed A yet");
        h.synced(kb, &pb, &gb);
        h.synced(ka, &pa, &ga);
        // After A came B last time: a step starting with B's first gradient follows B.
        let (p, _) = h.predicted("g.w", &ty).expect("B follows A");
        assert!(Arc::ptr_eq(p, &pb));
        // Not when the step starts otherwise, or with another type.
        assert!(h.predicted("d.w", &ty).is_none());
        assert!(
            h.predicted("g.w", &TensorType::new(DType::F32, &[5]))
                .is_none()
        );
        h.synced(kb, &pb, &gb);
        let (p, _) = h.predicted("d.w", &ty).expect("A follows B");
        assert!(Arc::ptr_eq(p, &pa));
    }

    #[test]
    fn the_history_starts_again_past_its_bound() {
        let mut cache = PlanCache::new();
        let mut h = History::default();
        let ty = TensorType::new(DType::F32, &[4]);
        let names: Vec<String> = (0..=SEGMENTS).map(|i| format!("p{i}")).collect();
        for n in &names {
            let (k, p, g) = plan(&mut cache, &[n.as_str()]);
            h.synced(k, &p, &g);
        }
        assert_eq!(h.plans.len(), 1, "started again at segment {SEGMENTS}");
        let (k, p, g) = plan(&mut cache, &["p0"]);
        h.synced(k, &p, &g);
        assert!(h.predicted("p0", &ty).is_none());
        assert_eq!(h.after.len(), 1);
    }
}

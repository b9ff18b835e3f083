//! The plan cache: a recorded step whose graph has the same structure as an earlier one (op
//! kinds and attributes, shapes, dtypes, edges; not node ids) reuses the earlier compiled plan,
//! so steps after the first pay for recording and one hash.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashbrown::HashMap;

use crate::codegen::plan::{LowerError, Plan, lower};
use crate::config::CompileConfig;
use crate::graph::{CycleError, Graph, GraphStructure, fnv64};
use crate::passes::{CompileError, compile};

/// Why a graph could not be compiled to a plan.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The graph has a cycle.
    #[error(transparent)]
    Cycle(#[from] CycleError),
    /// A pass or the verifier failed.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// Lowering failed.
    #[error(transparent)]
    Lower(#[from] LowerError),
}

/// What a cached plan was compiled from: the graph's structure and the configuration. A hit
/// compares both, not only their hashes.
#[derive(Clone, Debug)]
pub struct PlanKey {
    structure: GraphStructure,
    config: CompileConfig,
    hash: u64,
}

impl PlanKey {
    /// The key of `graph` (as recorded, before passes) under `config`.
    pub fn new(graph: &Graph, config: &CompileConfig) -> Result<Self, CycleError> {
        let structure = graph.structure()?;
        let hash = fnv64(&(&structure, config));
        Ok(PlanKey {
            structure,
            config: config.clone(),
            hash,
        })
    }
}

impl PartialEq for PlanKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.structure == other.structure && self.config == other.config
    }
}

// A configuration whose cost numbers are NaN equals nothing, itself included: its plans are
// compiled again, never confused. Profiles with NaN are refused when loaded.
impl Eq for PlanKey {}

impl Hash for PlanKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.hash.hash(h);
    }
}

/// Compiled plans by structure.
#[derive(Default)]
pub struct PlanCache {
    plans: HashMap<PlanKey, Arc<Plan>>,
    hits: u64,
    misses: u64,
}

impl PlanCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The plan for `graph` (as recorded, before passes) under `config`: cached, or compiled,
    /// lowered and cached now.
    pub fn get_or_compile(
        &mut self,
        graph: &Graph,
        config: &CompileConfig,
    ) -> Result<Arc<Plan>, PlanError> {
        let key = PlanKey::new(graph, config)?;
        if let Some(p) = self.plans.get(&key) {
            self.hits += 1;
            return Ok(Arc::clone(p));
        }
        self.misses += 1;
        let mut g = graph.clone();
        compile(&mut g, config)?;
        let plan = Arc::new(lower(&g)?);
        self.plans.insert(key, Arc::clone(&plan));
        Ok(plan)
    }

    /// Lookups answered from the cache.
    pub fn hits(&self) -> u64 {
        self.hits
    }

    /// Lookups that compiled.
    pub fn misses(&self) -> u64 {
        self.misses
    }

    /// Plans held.
    pub fn len(&self) -> usize {
        self.plans.len()
    }

    /// Whether it holds no plan.
    pub fn is_empty(&self) -> bool {
        self.plans.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::builder::{BuildOptions, build_step_graph};
    use crate::model::ModelProfile;

    #[test]
    fn a_key_compares_the_structure_and_the_config_not_their_hash() {
        let profile = ModelProfile::load("resnet50").unwrap();
        let step = |world| {
            build_step_graph(
                &profile,
                &BuildOptions {
                    world,
                    ..BuildOptions::default()
                },
            )
        };
        let config = CompileConfig::default();
        let a = PlanKey::new(&step(8), &config).unwrap();
        assert_eq!(a, PlanKey::new(&step(8), &config).unwrap());
        let mut other = PlanKey::new(&step(4), &config).unwrap();
        assert_ne!(a, other);
        // Even under a colliding hash, another structure is another key.
        other.hash = a.hash;
        assert_ne!(a, other);
        let mut slower = config.clone();
        slower.cost.system.busbw_gbs /= 2.0;
        let mut b = PlanKey::new(&step(8), &slower).unwrap();
        assert_ne!(a.hash, b.hash);
        b.hash = a.hash;
        assert_ne!(a, b);
    }
}

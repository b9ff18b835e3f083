//! The plan cache: a recorded step whose graph has the same structure as an earlier one (op
//! kinds and attributes, shapes, dtypes, edges; not node ids) reuses the earlier compiled plan,
//! so steps after the first pay for recording and one hash.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use hashbrown::HashMap;

use crate::codegen::plan::{LowerError, Plan, lower};
use crate::config::CompileConfig;
use crate::graph::{CycleError, Graph};
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

/// Compiled plans by structure.
#[derive(Default)]
pub struct PlanCache {
    plans: HashMap<(u64, u64), Arc<Plan>>,
    hits: u64,
    misses: u64,
}

/// A stable fingerprint of the options that change what a graph compiles to.
fn config_key(config: &CompileConfig) -> u64 {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    format!("{config:?}").hash(&mut h);
    h.finish()
}

struct Fnv(u64);
impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
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
        let key = (graph.structural_hash()?, config_key(config));
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

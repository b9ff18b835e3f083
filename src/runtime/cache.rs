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

/// Plans a [`PlanCache::new`] cache holds before it drops the least recently used.
pub const PLAN_CACHE_CAPACITY: usize = 64;

/// Compiled plans by structure, at most a capacity of them: past it, a new plan takes the
/// place of the one used least recently. A program's plans are few (one per gradient list it
/// syncs, one per composition of back-to-back user all-reduces, one per re-plan of the measured
/// planner), but a program whose compositions keep changing (user all-reduces of shapes that
/// follow the data, a planner that re-plans all run long) would otherwise grow it for as long
/// as it runs. A plan dropped here and met again is compiled again, to the same plan.
pub struct PlanCache {
    plans: HashMap<PlanKey, (Arc<Plan>, u64)>,
    capacity: usize,
    /// Lookups so far: the tick of an entry's last use.
    tick: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl Default for PlanCache {
    fn default() -> Self {
        Self::with_capacity(PLAN_CACHE_CAPACITY)
    }
}

impl PlanCache {
    /// An empty cache of [`PLAN_CACHE_CAPACITY`] plans.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache of `capacity` plans (at least one).
    pub fn with_capacity(capacity: usize) -> Self {
        PlanCache {
            plans: HashMap::new(),
            capacity: capacity.max(1),
            tick: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    /// The plan for `graph` (as recorded, before passes) under `config`: cached, or compiled,
    /// lowered and cached now.
    pub fn get_or_compile(
        &mut self,
        graph: &Graph,
        config: &CompileConfig,
    ) -> Result<Arc<Plan>, PlanError> {
        let key = PlanKey::new(graph, config)?;
        self.tick += 1;
        if let Some((p, used)) = self.plans.get_mut(&key) {
            self.hits += 1;
            *used = self.tick;
            return Ok(Arc::clone(p));
        }
        self.misses += 1;
        let mut g = graph.clone();
        compile(&mut g, config)?;
        let plan = Arc::new(lower(&g)?);
        if self.plans.len() >= self.capacity {
            // A miss compiles, which costs far more than this walk over the entries.
            let oldest = self.plans.iter().min_by_key(|(_, (_, used))| *used);
            if let Some(k) = oldest.map(|(k, _)| k.clone()) {
                self.plans.remove(&k);
                self.evictions += 1;
            }
        }
        self.plans.insert(key, (Arc::clone(&plan), self.tick));
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

    /// Plans dropped to make room for another.
    pub fn evictions(&self) -> u64 {
        self.evictions
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

    /// ResNet-50's step graph on `world` ranks.
    fn step(world: u32) -> Graph {
        let profile = ModelProfile::load("resnet50").unwrap();
        let options = BuildOptions {
            world,
            ..BuildOptions::default()
        };
        build_step_graph(&profile, &options)
    }

    /// Past its capacity the cache drops the plan used least recently, and compiles it again
    /// when it comes back.
    #[test]
    fn a_full_cache_drops_its_least_recently_used_plan() {
        let config = CompileConfig::default();
        let (two, four, eight) = (step(2), step(4), step(8));
        let mut cache = PlanCache::with_capacity(2);
        let a = cache.get_or_compile(&two, &config).unwrap();
        let b = cache.get_or_compile(&four, &config).unwrap();
        // `two` is used again, so `four` is the least recently used when `eight` comes.
        assert!(Arc::ptr_eq(
            &a,
            &cache.get_or_compile(&two, &config).unwrap()
        ));
        cache.get_or_compile(&eight, &config).unwrap();
        assert_eq!((cache.len(), cache.evictions()), (2, 1));
        assert_eq!((cache.hits(), cache.misses()), (1, 3));
        assert!(Arc::ptr_eq(
            &a,
            &cache.get_or_compile(&two, &config).unwrap()
        ));
        assert_eq!(cache.hits(), 2, "the plan used last stayed");
        let again = cache.get_or_compile(&four, &config).unwrap();
        assert_eq!(
            (cache.misses(), cache.evictions()),
            (4, 2),
            "four was dropped"
        );
        assert!(!Arc::ptr_eq(&b, &again));
        assert_eq!(
            format!("{b}"),
            format!("{again}"),
            "compiled again to the same plan"
        );
    }

    #[test]
    fn a_key_compares_the_structure_and_the_config_not_their_hash() {
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

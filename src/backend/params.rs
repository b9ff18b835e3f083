//! Stable parameter identity: the name every process gives a parameter.
//!
//! Burn's `ParamId` is a random number per process, so a name built from it means nothing to
//! another process. [`mark_distributed`] walks the module in its deterministic order and names
//! each float parameter by its module path (`0.weight`, `encoder.layers.3.bias`: the field and
//! container names Burn's mapper reports), or by its position in the walk where Burn reports no
//! path. A process that builds the same model names its parameters alike, so those names can be
//! compared across processes: they are what graphs, plans, the plan agreement, errors and traces
//! show.
//!
//! Requires: several models trained together in one step (a GAN's two networks) are marked with
//! distinct prefixes ([`mark_distributed_as`]), since their paths may coincide. Guarantees: the
//! name depends only on the module's structure and the prefix, not on what the process did
//! before (marking again before each micro-batch changes nothing; a model built again takes its
//! names over from the old one); a parameter nobody marked (Burn's own DDP learner marks by
//! itself) is named `param.<its id>`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use burn_backend::distributed::DistributedParamId;
use burn_core::module::{ModuleMapper, Param};
use burn_core::tensor::Tensor;
use burn_core::tensor::backend::AutodiffBackend;

#[derive(Default)]
struct Registry {
    by_id: HashMap<DistributedParamId, String>,
    by_name: HashMap<String, DistributedParamId>,
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Names parameter `id` `name`. A name belongs to the parameter marked with it last: a model
/// built again (a new model, new ids, the same paths) takes its names over.
fn assign(id: DistributedParamId, name: &str) {
    let mut r = registry();
    if r.by_id.get(&id).is_some_and(|n| n == name) {
        return;
    }
    if let Some(old) = r.by_name.remove(name) {
        r.by_id.remove(&old);
    }
    if let Some(old) = r.by_id.remove(&id) {
        r.by_name.remove(&old);
    }
    r.by_name.insert(name.to_string(), id);
    r.by_id.insert(id, name.to_string());
}

/// The name of parameter `id`: its stable key if a module walk named it, `param.<id>` otherwise.
pub(crate) fn name_of(id: DistributedParamId) -> String {
    if let Some(n) = registry().by_id.get(&id) {
        return n.clone();
    }
    // `DistributedParamId(123)` → `param.123`
    let dbg = format!("{id:?}");
    let digits: String = dbg.chars().filter(char::is_ascii_digit).collect();
    format!("param.{digits}")
}

/// Marks every float parameter of `module` as data-parallel, so that Burn's autodiff submits its
/// gradient for sync (what burn-train's `grad_sharded` does for its learner), and gives each a
/// name that is the same in every process that builds the same model (its module path).
pub fn mark_distributed<B, M>(module: M) -> M
where
    B: AutodiffBackend,
    M: burn_core::module::Module<B>,
{
    mark_distributed_as::<B, M>("", module)
}

/// [`mark_distributed`] with the names under `prefix` (`gen` gives `gen.0.weight`): for several
/// models trained in one step, whose module paths may coincide.
pub fn mark_distributed_as<B, M>(prefix: &str, module: M) -> M
where
    B: AutodiffBackend,
    M: burn_core::module::Module<B>,
{
    struct Sharder {
        path: Vec<String>,
        position: usize,
    }
    impl<B: AutodiffBackend> ModuleMapper<B> for Sharder {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let pid = DistributedParamId::from(id.val());
            let path: Vec<&str> = self
                .path
                .iter()
                .map(String::as_str)
                .filter(|p| !p.is_empty())
                .collect();
            let name = if path.is_empty() {
                format!("p{}", self.position)
            } else {
                path.join(".")
            };
            self.position += 1;
            assign(pid, &name);
            let tensor = tensor.set_distributed(pid);
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let path = if prefix.is_empty() {
        Vec::new()
    } else {
        vec![prefix.to_string()]
    };
    module.map(&mut Sharder { path, position: 0 })
}

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
//! before (marking again before each micro-batch changes nothing; a model built again, or one
//! per rank in one process, has the same names); a parameter nobody marked (Burn's own DDP learner marks by
//! itself) is named `param.<its id>`.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, RwLock};

use burn_backend::TensorPrimitive;
use burn_backend::distributed::DistributedParamId;
use burn_backend::tensor::FloatTensor;
use burn_core::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn_core::tensor::Tensor;
use burn_core::tensor::backend::AutodiffBackend;

use super::replicas::{BufferSync, ReplicaError, Replicate};

/// Parameter id → stable name. Ids are unique within a process, names are not: ranks that are
/// threads of one process and build their own models have parameters of the same names. Read
/// for every gradient of every rank, written when a model is marked: readers do not take
/// turns. (A panic while the lock was held left at worst a name unregistered.)
fn registry() -> &'static RwLock<HashMap<DistributedParamId, String>> {
    static REGISTRY: OnceLock<RwLock<HashMap<DistributedParamId, String>>> = OnceLock::new();
    REGISTRY.get_or_init(RwLock::default)
}

/// Names each parameter `id` `name`, under one lock.
fn assign<'a>(names: impl Iterator<Item = (DistributedParamId, &'a str)>) {
    let mut r = registry().write().unwrap_or_else(|e| e.into_inner());
    for (id, name) in names {
        if r.get(&id).is_none_or(|n| n != name) {
            r.insert(id, name.to_string());
        }
    }
}

/// The name of parameter `id`: its stable key if a module walk named it, `param.<id>` otherwise.
pub(crate) fn name_of(id: DistributedParamId) -> String {
    if let Some(n) = registry()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
    {
        return n.clone();
    }
    // `DistributedParamId(123)` → `param.123`
    let dbg = format!("{id:?}");
    let digits: String = dbg.chars().filter(char::is_ascii_digit).collect();
    format!("param.{digits}")
}

/// A marked float parameter, as the replication hook of its backend sees it.
pub(crate) struct Marked {
    /// Its stable name.
    pub name: String,
    /// Its `ParamId`.
    pub id: u64,
    /// Its value: the float primitive of the autodiff backend's inner backend.
    pub value: Box<dyn Any>,
    /// Whether it requires a gradient (a trained parameter, not a running statistic).
    pub requires_grad: bool,
    /// Whether its value was drawn by this marking: a lazily initialized parameter
    /// (`Param::uninitialized`, how Burn's modules build) that nothing had read before.
    pub initialized_now: bool,
}

/// What a backend does with a marked model's parameters: a new value for each parameter that
/// takes one (in walk order), `None` for each that keeps its own.
pub(crate) type ReplicaHook =
    fn(&[Marked], Replicate) -> Result<Vec<Option<Box<dyn Any>>>, ReplicaError>;

fn hooks() -> std::sync::MutexGuard<'static, HashMap<TypeId, ReplicaHook>> {
    static HOOKS: OnceLock<Mutex<HashMap<TypeId, ReplicaHook>>> = OnceLock::new();
    HOOKS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Makes `hook` what marking does with the parameters of models whose autodiff backend's inner
/// backend is `B` (`Collective<I>` registers its replication when its server starts).
pub(crate) fn register_hook<B: 'static>(hook: ReplicaHook) {
    hooks().insert(TypeId::of::<B>(), hook);
}

/// Marks every float parameter of `module` as data-parallel, so that Burn's autodiff submits its
/// gradient for sync (what burn-train's `grad_sharded` does for its learner), and gives each a
/// name that is the same in every process that builds the same model (its module path).
///
/// With a communication server running for the backend (`Collective<I>` over more than one
/// rank) marking is a collective: every rank marks its model at the same point, each on its
/// own thread, and the ranks check that their models have the same parameters and start from
/// rank 0's values (or verify that they already do; see
/// [`InitialWeights`](super::InitialWeights) and the `replicas` module). A training loop marks
/// its model once: Burn's optimizers mark each parameter they update again. A backward pass
/// consumes the mark, so a loop that runs several backward passes between updates (gradient
/// accumulation) or replaces parameters by other means marks again before each; marking
/// parameters already replicated communicates nothing, unless their values were drawn again
/// since (a lazily initialized model forked again): those are replicated again.
///
/// # Errors
/// [`ReplicaError`] when the ranks' models differ (naming the first differing parameter on
/// each side), when verified weights differ, or when the exchange fails (a rank that does not
/// mark within the timeout); every rank gets the error.
pub fn mark_distributed<B, M>(module: M) -> Result<M, ReplicaError>
where
    B: AutodiffBackend,
    M: burn_core::module::Module<B>,
{
    mark_distributed_as::<B, M>("", module)
}

/// [`mark_distributed`] with the names under `prefix` (`gen` gives `gen.0.weight`): for several
/// models trained in one step, whose module paths may coincide.
///
/// # Errors
/// As [`mark_distributed`].
pub fn mark_distributed_as<B, M>(prefix: &str, module: M) -> Result<M, ReplicaError>
where
    B: AutodiffBackend,
    M: burn_core::module::Module<B>,
{
    walk::<B, M>(prefix, module, Replicate::Marking)
}

/// Makes the ranks' buffers of `module` alike: its floats that take no gradient (BatchNorm's
/// running statistics), which each rank otherwise updates from its own batches. Every rank calls
/// it at the same point (it is a collective, like [`mark_distributed`]); afterwards every rank's
/// buffers are rank 0's ([`BufferSync::Broadcast`], what PyTorch DDP's default
/// `broadcast_buffers=True` does before each forward pass) or the mean of the ranks'
/// ([`BufferSync::Mean`], e.g. before an evaluation or a checkpoint), bit for bit alike.
/// Trained parameters are left as they are. A frozen parameter (one whose tensor does not
/// require a gradient) is a buffer to Burn's module walk too, and is sent with them: call this
/// on the part of a model that holds the statistics where a large part is frozen.
///
/// Burn keeps a running statistic's latest update aside until the next forward pass reads it;
/// the update is folded in first, so what is sent is the latest value and what the next forward
/// pass starts from is the one received. A statistic on another rank's device is taken as it is:
/// Burn's `fork` shares a running statistic between the copies of a model (one object, on the
/// device of the copy forked last), so the ranks of one process that fork one model hold one set
/// of statistics. Without a communication server, with one rank, or for a module without
/// buffers, the module comes back as it was and nothing is communicated (a training loop may
/// call it whatever the model). The values cross as the rank's own all-reduces (see
/// [`all_reduce`](super::all_reduce)), launched before it returns and waited for where a value
/// is first needed: on a device backend they never leave the device.
///
/// # Errors
/// [`ReplicaError::ModelsDiffer`] when the ranks' buffer lists differ (names, dtypes, shapes),
/// [`ReplicaError::BufferComm`] when their check fails (a rank that does not call it within the
/// timeout); every rank gets the error.
pub fn sync_buffers<B, M>(module: M, how: BufferSync) -> Result<M, ReplicaError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    // A model without buffers (a training loop may call this whatever the model) costs one
    // look at its floats.
    if !has_buffers::<B, M>(&module) {
        return Ok(module);
    }
    // Burn's `RunningState` keeps a thread's latest update aside until that thread's next read;
    // `valid` folds every pending update into the value a walk sees (the map of updates is
    // shared with `module`'s, and drained), so that the values sent are the latest and the next
    // forward pass starts from the ones received, not from the rank's own update kept aside.
    drop(module.valid());
    walk::<B, M>("", module, Replicate::Buffers(how))
}

/// Gives every rank's `module` rank `root`'s values: its trained parameters and its buffers, bit
/// for bit. Every rank calls it at the same point (a collective, like [`mark_distributed`]); the
/// ranks first check that their models have the same floats (names, dtypes, shapes). What
/// [`Join::finish_model`](super::Join::finish_model) does after uneven inputs, where the ranks
/// that trained last hold every update; also what a job that loaded a checkpoint on one rank
/// needs. The values cross as the rank's own all-reduces (root's values, the others' negative
/// zeros), launched before it returns. Without a communication server or with one rank the
/// module comes back as it was.
///
/// # Errors
/// [`ReplicaError::ModelsDiffer`] when the ranks' float lists differ,
/// [`ReplicaError::Unsupported`] when `root` is not a rank of the server,
/// [`ReplicaError::Exchange`] when the check fails (a rank that does not call it within the
/// timeout); every rank gets the error.
pub fn replicate_from<B, M>(module: M, root: usize) -> Result<M, ReplicaError>
where
    B: AutodiffBackend,
    M: burn_core::module::Module<B>,
{
    walk::<B, M>("", module, Replicate::FromRank(root))
}

/// Whether `module` holds a float that takes no gradient.
fn has_buffers<B: AutodiffBackend, M: burn_core::module::Module<B>>(module: &M) -> bool {
    struct Look(bool);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Look {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 |= !param.val().is_require_grad();
        }
    }
    let mut look = Look(false);
    module.visit(&mut look);
    look.0
}

/// Walks `module`'s floats under `prefix` and gives each the value the backend's replication
/// hook returns for `what` (marking the floats as data-parallel when `what` is a marking).
fn walk<B, M>(prefix: &str, module: M, what: Replicate) -> Result<M, ReplicaError>
where
    B: AutodiffBackend,
    M: burn_core::module::Module<B>,
{
    let mut sharder = Sharder {
        path: prefix.to_string(),
        entered: Vec::new(),
        position: 0,
        marked: Vec::new(),
        mark: matches!(what, Replicate::Marking),
    };
    let module = module.map(&mut sharder);
    if sharder.mark {
        assign(
            sharder
                .marked
                .iter()
                .map(|m| (DistributedParamId::from(m.id), m.name.as_str())),
        );
    }
    let hook = hooks().get(&TypeId::of::<B::InnerBackend>()).copied();
    let Some(hook) = hook else {
        return Ok(module);
    };
    let values = hook(&sharder.marked, what)?;
    if values.iter().all(Option::is_none) {
        return Ok(module);
    }
    Ok(module.map(&mut Replace {
        values: values.into_iter(),
    }))
}

/// Collects a module's floats with their module paths, marking each as data-parallel if `mark`.
struct Sharder {
    /// The module path walked into, its non-empty names joined by `.`.
    path: String,
    /// `path`'s length before each module entered, innermost last.
    entered: Vec<usize>,
    position: usize,
    marked: Vec<Marked>,
    mark: bool,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Sharder {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.entered.push(self.path.len());
        if !name.is_empty() {
            if !self.path.is_empty() {
                self.path.push('.');
            }
            self.path.push_str(name);
        }
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        if let Some(len) = self.entered.pop() {
            self.path.truncate(len);
        }
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let initialized_now = !param.is_initialized();
        let (id, tensor, mapper) = param.consume();
        let pid = DistributedParamId::from(id.val());
        let name = if self.path.is_empty() {
            format!("p{}", self.position)
        } else {
            self.path.clone()
        };
        self.position += 1;
        self.marked.push(Marked {
            name,
            id: id.val(),
            value: Box::new(tensor.clone().inner().into_primitive().tensor()),
            requires_grad: tensor.is_require_grad(),
            initialized_now,
        });
        let tensor = if self.mark {
            tensor.set_distributed(pid)
        } else {
            tensor
        };
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// Puts the values the hook returned in place, in the same walk order.
struct Replace {
    values: std::vec::IntoIter<Option<Box<dyn Any>>>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Replace {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(Some(value)) = self.values.next() else {
            return param;
        };
        let Ok(value) = value.downcast::<FloatTensor<B::InnerBackend>>() else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let grad = tensor.is_require_grad();
        let mut tensor =
            Tensor::<B, D>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(*value)));
        if grad {
            tensor = tensor.require_grad();
        }
        let tensor = tensor.set_distributed(DistributedParamId::from(id.val()));
        Param::from_mapped_value(id, tensor, mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Collective, CollectiveDevice};
    use burn_autodiff::Autodiff;
    use burn_core::module::{Module, ModuleVisitor};
    use burn_ndarray::{NdArray, NdArrayDevice};
    use burn_nn::transformer::{TransformerEncoder, TransformerEncoderConfig};
    use burn_nn::{Linear, LinearConfig};

    type B = Autodiff<Collective<NdArray>>;

    /// The registry's name of every float parameter of `module`, in walk order.
    fn names<M: Module<B>>(module: &M) -> Vec<String> {
        struct Names(Vec<String>);
        impl ModuleVisitor<B> for Names {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0
                    .push(name_of(DistributedParamId::from(param.id.val())));
            }
        }
        let mut v = Names(Vec::new());
        module.visit(&mut v);
        v.0
    }

    /// Nested modules give dotted paths, a sibling's path does not keep the one walked before
    /// it, a prefix goes first, and a parameter with no path is named by its position.
    #[test]
    fn names_are_module_paths_under_the_prefix() {
        let d = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
        let encoder: TransformerEncoder<B> = TransformerEncoderConfig::new(8, 16, 2, 2).init(&d);
        let encoder = mark_distributed_as::<B, _>("gen", encoder).expect("marking");
        let n = names(&encoder);
        assert!(n.iter().all(|n| n.starts_with("gen.layers.")), "{n:?}");
        for want in [
            "gen.layers.0.mha.query.weight",
            "gen.layers.0.pwff.linear_outer.bias",
            "gen.layers.1.mha.output.weight",
            "gen.layers.1.norm_2.gamma",
        ] {
            assert!(n.iter().any(|n| n == want), "{want} in {n:?}");
        }
        let unique: std::collections::BTreeSet<_> = n.iter().collect();
        assert_eq!(unique.len(), n.len(), "unique: {n:?}");

        let layers: Vec<Linear<B>> = (0..2).map(|_| LinearConfig::new(3, 2).init(&d)).collect();
        let layers = mark_distributed::<B, _>(layers).expect("marking");
        assert_eq!(names(&layers), ["0.weight", "0.bias", "1.weight", "1.bias"]);

        let bare = Param::from_tensor(Tensor::<B, 1>::zeros([4], &d));
        assert_eq!(
            names(&mark_distributed::<B, _>(bare).expect("marking")),
            ["p0"]
        );
    }
}

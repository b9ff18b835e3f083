//! `DistributedBackend` for `Collective<I>`: Burn's gradient-sync hooks, compiled.
//!
//! Per rank, a step's `submit_gradient_sync` calls are recorded in ready order. At
//! `submit_sync_collective` the rank builds the segment's graph (a gradient and a `grad_sync`
//! per submitted tensor, one `sync`), takes its plan from the rank's plan cache (compiled once per
//! distinct segment: bucketing, fused pack/unpack, async collectives, overlap schedule), runs it on
//! the rank's in-process communicator, and writes every reduced gradient back through Burn's
//! `TensorRef` before returning, as Burn requires.
//!
//! The hooks return nothing, so a failure (a rank that never arrives, mismatched segments, a bad
//! gradient) aborts the group, so that no other rank waits for this one, and then panics with
//! the typed error's message on the calling rank.

use std::any::{Any, TypeId};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use burn_backend::distributed::{
    CollectiveTensor, DistributedBackend, DistributedConfig, DistributedParamId, DistributedParams,
    ReduceOperation, TensorRef,
};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DeviceId, TensorData, TensorMetadata};
use hashbrown::HashMap;

use super::{CTensor, Collective, CollectiveDevice};
use crate::config::CompileConfig;
use crate::graph::{DType, Graph, Op, ReduceOp, TensorType, Value};
use crate::runtime::cache::PlanCache;
use crate::runtime::comm::{CollectiveDesc, Communicator};
use crate::runtime::exec::{ExecOptions, NoHooks, Workspace, execute_in};
use crate::runtime::{HostBuffer, InProcessComm, InProcessGroup};

/// How `Collective<I>` compiles and runs its gradient sync.
#[derive(Clone, Debug)]
pub struct CollectiveOptions {
    /// Compiler options (bucketing policy and caps, overlap, reduce dtype, verification).
    pub config: CompileConfig,
    /// Bound on every wait for another rank.
    pub timeout: Duration,
}

impl Default for CollectiveOptions {
    fn default() -> Self {
        CollectiveOptions {
            config: CompileConfig::from_env().unwrap_or_default(),
            timeout: crate::runtime::inprocess::DEFAULT_TIMEOUT,
        }
    }
}

impl CollectiveOptions {
    /// Makes these the options of the next communication server started for `Collective<I>`
    /// (`start_communication_server` reads and clears them; without a call it uses the
    /// defaults, which read the `CF_*` environment variables).
    pub fn install<I: Backend>(self) {
        lock(next_options()).insert(TypeId::of::<I>(), self);
    }
}

fn next_options() -> &'static Mutex<HashMap<TypeId, CollectiveOptions>> {
    static NEXT: OnceLock<Mutex<HashMap<TypeId, CollectiveOptions>>> = OnceLock::new();
    NEXT.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct RankState<I: Backend> {
    pending: Vec<(TensorRef<Collective<I>>, DistributedParams)>,
    registered: usize,
    cache: PlanCache,
    workspace: Workspace,
    user_collectives: u32,
}

struct Session<I: Backend> {
    world: usize,
    reduce: ReduceOp,
    options: CollectiveOptions,
    comms: Vec<InProcessComm>,
    ranks: Vec<Mutex<RankState<I>>>,
}

type Sessions = Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>;

fn sessions() -> &'static Sessions {
    static S: OnceLock<Sessions> = OnceLock::new();
    S.get_or_init(Default::default)
}

fn session<I: Backend>(what: &str) -> Arc<Session<I>> {
    let any = lock(sessions()).get(&TypeId::of::<I>()).cloned();
    match any.and_then(|a| a.downcast::<Session<I>>().ok()) {
        Some(s) => s,
        None => panic!(
            "collective-fusion: {what} before start_communication_server (no communication server is running for this backend)"
        ),
    }
}

/// Marks every float parameter of `module` as data-parallel, so that Burn's autodiff submits its
/// gradient for sync (what burn-train's `grad_sharded` does for its learner).
pub fn mark_distributed<B, M>(module: M) -> M
where
    B: burn_core::tensor::backend::AutodiffBackend,
    M: burn_core::module::Module<B>,
{
    struct Sharder;
    impl<B: burn_core::tensor::backend::AutodiffBackend> burn_core::module::ModuleMapper<B>
        for Sharder
    {
        fn map_float<const D: usize>(
            &mut self,
            param: burn_core::module::Param<burn_core::tensor::Tensor<B, D>>,
        ) -> burn_core::module::Param<burn_core::tensor::Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let tensor = tensor.set_distributed(DistributedParamId::from(id.val()));
            burn_core::module::Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Sharder)
}

fn param_name(p: &DistributedParams) -> String {
    // `DistributedParamId(123)` → `param.123`
    let dbg = format!("{:?}", p.param_id);
    let digits: String = dbg.chars().filter(char::is_ascii_digit).collect();
    format!("param.{digits}")
}

fn graph_dtype(d: burn_std::DType) -> Option<DType> {
    Some(match d {
        burn_std::DType::F32 => DType::F32,
        burn_std::DType::F64 => DType::F64,
        burn_std::DType::F16 => DType::F16,
        burn_std::DType::BF16 => DType::BF16,
        _ => return None,
    })
}

fn to_host(data: &TensorData) -> Result<HostBuffer, String> {
    let err = |e| format!("reading gradient data: {e:?}");
    Ok(match data.dtype {
        burn_std::DType::F32 => HostBuffer::F32(data.to_vec::<f32>().map_err(err)?),
        burn_std::DType::F64 => HostBuffer::F64(data.to_vec::<f64>().map_err(err)?),
        burn_std::DType::F16 => HostBuffer::F16(data.to_vec::<half::f16>().map_err(err)?),
        burn_std::DType::BF16 => HostBuffer::BF16(data.to_vec::<half::bf16>().map_err(err)?),
        d => return Err(format!("gradients of dtype {d:?} cannot be all-reduced")),
    })
}

fn from_host(buf: HostBuffer, shape: burn_std::Shape) -> TensorData {
    match buf {
        HostBuffer::F32(v) => TensorData::new(v, shape),
        HostBuffer::F64(v) => TensorData::new(v, shape),
        HostBuffer::F16(v) => TensorData::new(v, shape),
        HostBuffer::BF16(v) => TensorData::new(v, shape),
    }
}

impl<I: Backend> Session<I> {
    /// Fails the whole group with `msg`, then panics on this rank.
    fn fail(&self, rank: usize, msg: String) -> ! {
        self.comms[rank].abort(&msg);
        panic!("collective-fusion: rank {rank}: {msg}");
    }

    fn sync(&self, device: &CollectiveDevice<I::Device>) {
        let rank = device.rank as usize;
        if rank >= self.world {
            panic!(
                "collective-fusion: submit_sync_collective on rank {rank}, but the communication server has {} ranks",
                self.world
            );
        }
        let mut st = lock(&self.ranks[rank]);
        let pending = std::mem::take(&mut st.pending);
        if pending.is_empty() {
            return;
        }
        // The segment: one gradient and one grad_sync per submitted tensor, in ready order.
        let mut g = Graph::new("sync");
        let group = g.add_group(self.world as u32);
        let mut grads = Vec::with_capacity(pending.len());
        let mut syncs = Vec::with_capacity(pending.len());
        let mut index = HashMap::new();
        for (i, (tref, params)) in pending.iter().enumerate() {
            // SAFETY: Burn keeps the pointer valid until submit_sync_collective returns.
            let t: &CTensor<I::FloatTensorPrimitive> = unsafe { &*tref.0 };
            let name = param_name(params);
            let Some(dtype) = graph_dtype(t.dtype()) else {
                self.fail(
                    rank,
                    format!(
                        "gradient of {name} has dtype {:?}, which is not a float",
                        t.dtype()
                    ),
                );
            };
            let dims: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
            let ty = TensorType::new(dtype, &dims);
            let src = g.add_node(
                Op::Input {
                    name: format!("{name}.grad"),
                },
                [ty.clone()],
                &[],
            );
            let grad = g.add_node(
                Op::Gradient {
                    param: name.clone(),
                },
                [ty.clone()],
                &[Value::of(src)],
            );
            let sync = g.add_node(
                Op::GradSync {
                    param: name.clone(),
                    ready: i as u32,
                    reduce: self.reduce,
                    group,
                },
                [ty],
                &[Value::of(grad)],
            );
            syncs.push(Value::of(sync));
            if index.insert(name.clone(), i).is_some() {
                self.fail(
                    rank,
                    format!("the gradient of {name} was submitted twice in one step"),
                );
            }
            let data = match cubecl::future::block_on(I::float_into_data(t.inner.clone())) {
                Ok(d) => d,
                Err(e) => self.fail(rank, format!("reading the gradient of {name}: {e}")),
            };
            match to_host(&data) {
                Ok(h) => grads.push(h),
                Err(e) => self.fail(rank, format!("{name}: {e}")),
            }
        }
        g.add_node(Op::Sync, [], &syncs);
        let plan = match st.cache.get_or_compile(&g, &self.options.config) {
            Ok(p) => p,
            Err(e) => self.fail(rank, format!("compiling the gradient sync: {e}")),
        };
        // Slots follow the plan's gradient order; map them from the submission order.
        let mut slot_grads: Vec<HostBuffer> = Vec::with_capacity(plan.slots.len());
        let mut slot_src = Vec::with_capacity(plan.slots.len());
        for s in &plan.slots {
            let i = index[&s.param];
            slot_grads.push(std::mem::take(&mut grads[i]));
            slot_src.push(i);
        }
        let opts = ExecOptions {
            timeout: self.options.timeout,
        };
        let ws = &mut st.workspace;
        if let Err(e) = execute_in(
            &plan,
            &self.comms[rank],
            &mut slot_grads,
            &mut NoHooks,
            opts,
            ws,
        ) {
            self.fail(rank, e.to_string());
        }
        // Write back in place, through the pointers Burn gave us.
        for (buf, i) in slot_grads.into_iter().zip(slot_src) {
            let tref = &pending[i].0;
            // SAFETY: as above; nothing else accesses the gradient while this hook runs.
            let t: &mut CTensor<I::FloatTensorPrimitive> = unsafe { &mut *tref.0 };
            let data = from_host(buf, t.shape());
            let dev = I::float_device(&t.inner);
            t.inner = I::float_from_data(data, &dev);
        }
        st.registered = 0;
    }
}

impl<I: Backend> DistributedBackend for Collective<I> {
    fn start_communication_server(devices: &[Self::Device], config: DistributedConfig) {
        let world = devices.len();
        let mut ranks: Vec<u32> = devices.iter().map(|d| d.rank).collect();
        ranks.sort_unstable();
        if ranks != (0..world as u32).collect::<Vec<_>>() {
            panic!(
                "collective-fusion: start_communication_server needs the ranks 0..{world} once each, got {:?}",
                devices.iter().map(|d| d.rank).collect::<Vec<_>>()
            );
        }
        let options = lock(next_options())
            .remove(&TypeId::of::<I>())
            .unwrap_or_default();
        let reduce = match config.all_reduce_op {
            ReduceOperation::Sum => ReduceOp::Sum,
            ReduceOperation::Mean => ReduceOp::Mean,
        };
        let session = Session::<I> {
            world,
            reduce,
            comms: InProcessGroup::ranks(world, options.timeout),
            ranks: (0..world)
                .map(|_| {
                    Mutex::new(RankState {
                        pending: Vec::new(),
                        registered: 0,
                        cache: PlanCache::new(),
                        workspace: Workspace::default(),
                        user_collectives: 0,
                    })
                })
                .collect(),
            options,
        };
        lock(sessions()).insert(TypeId::of::<I>(), Arc::new(session));
    }

    fn close_communication_server(_device: &Self::Device) {
        lock(sessions()).remove(&TypeId::of::<I>());
    }

    fn register_sync_parameters(device: &Self::Device, params: Vec<DistributedParams>) {
        let s = session::<I>("register_sync_parameters");
        let rank = device.rank as usize;
        if let Some(r) = s.ranks.get(rank) {
            lock(r).registered = params.len();
        }
    }

    fn submit_gradient_sync(tensor: TensorRef<Self>, params: DistributedParams) {
        let s = session::<I>("submit_gradient_sync");
        // SAFETY: Burn keeps the pointer valid until submit_sync_collective returns.
        let rank = unsafe { (*tensor.0).rank } as usize;
        match s.ranks.get(rank) {
            Some(r) => lock(r).pending.push((tensor, params)),
            None => panic!(
                "collective-fusion: a gradient on rank {rank} was submitted, but the communication server has {} ranks",
                s.world
            ),
        }
    }

    fn submit_sync_collective(device: &Self::Device) {
        session::<I>("submit_sync_collective").sync(device);
    }

    fn all_reduce(
        tensor: FloatTensor<Self>,
        op: ReduceOperation,
        device_ids: Vec<DeviceId>,
    ) -> CollectiveTensor<Self> {
        let s = session::<I>("all_reduce");
        let rank = tensor.rank as usize;
        if device_ids.len() != s.world {
            s.fail(
                rank,
                format!(
                    "all_reduce over {} devices, but the communication server has {} ranks",
                    device_ids.len(),
                    s.world
                ),
            );
        }
        let shape = tensor.shape();
        let data = match cubecl::future::block_on(I::float_into_data(tensor.inner.clone())) {
            Ok(d) => d,
            Err(e) => s.fail(rank, format!("all_reduce: reading the tensor: {e}")),
        };
        let buf = match to_host(&data) {
            Ok(b) => b,
            Err(e) => s.fail(rank, format!("all_reduce: {e}")),
        };
        let id = {
            let mut st = lock(&s.ranks[rank]);
            st.user_collectives += 1;
            st.user_collectives
        };
        let what = CollectiveDesc {
            // User all-reduces count down from the top so they never match a gradient bucket.
            collective: u32::MAX - id,
            bucket: None,
            op: match op {
                ReduceOperation::Sum => ReduceOp::Sum,
                ReduceOperation::Mean => ReduceOp::Mean,
            },
            dtype: buf.dtype(),
            count: buf.len() as u64,
            params: Vec::new(),
        };
        let reduced = s.comms[rank]
            .all_reduce(buf, what)
            .and_then(|p| p.wait(s.options.timeout));
        let out = match reduced {
            Ok((b, _)) => b,
            Err(e) => s.fail(rank, e.to_string()),
        };
        let dev = I::float_device(&tensor.inner);
        let t = I::float_from_data(from_host(out, shape), &dev);
        CollectiveTensor::new(CTensor::new(t, tensor.rank))
    }

    fn sync_collective(_device: &Self::Device) {
        // `all_reduce` completes before it returns: nothing is outstanding.
    }
}

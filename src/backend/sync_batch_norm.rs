//! A batch norm whose statistics are those of every rank's batch (PyTorch's `SyncBatchNorm`).
//!
//! Data-parallel training with Burn's `BatchNorm` normalizes each rank's rows by that rank's
//! batch alone: with small per-rank batches (detection, segmentation) the statistics are noisy
//! and the model trains as it would on the small batch, not on the global one. [`SyncBatchNorm`]
//! is Burn's `BatchNorm` (the same fields, the same record, the same biased variance in the
//! running statistics) whose training-mode statistics are computed over the rows of every rank.
//!
//! Each rank reduces its own rows to a per-channel mean, variance (Burn's two passes) and row
//! count, and puts them, in f32 whatever the input's float type, in its own row of a `[world, 2 ×
//! channels + 1]` tensor of zeros. One sum all-reduce of that tensor gives every rank every rank's
//! three statistics, bit for bit (adding zeros is exact), which each rank combines the same way,
//! in rank order (Chan et al.'s pairwise update: the rows of a rank spread around the global mean
//! by their own variance plus the square of their mean's distance from it, non-negative terms
//! that cancel nothing, where a one-pass sum of squares loses a channel whose mean is large against
//! its spread). Ranks may have different batch sizes. The all-reduce is differentiable (its
//! backward all-reduces the gradient of the statistics), so each rank's input gradient is that of
//! the sum of every rank's loss, and with the gradient sync's mean the parameters train as one
//! rank on the concatenated batch.
//!
//! The group is the input device's: for a `Collective` device, every rank of the communication
//! server running for it (found through [`register_group`], which the server's start calls),
//! or, on any `DistributedBackend`, the devices given to [`SyncBatchNorm::with_group`]. Without
//! a group of more than one rank (no server running, a world of one) the statistics are the
//! rank's own, as PyTorch's module does outside a process group; outside training (autodiff off)
//! the running statistics are used, as by `BatchNorm`.
//!
//! Requires: every rank of the group calls `forward` on its layers in the same order (each call
//! is a collective). Guarantees: in training every rank normalizes with the same mean and
//! variance, and every rank's running statistics take the same update.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_backend::{DeviceId, DeviceOps, TensorPrimitive};
use burn_core as burn;
use burn_core::config::Config;
use burn_core::module::{Initializer, Module, Param, RunningState};
use burn_core::tensor::backend::Backend;
use burn_core::tensor::{Tensor, s};
use burn_nn::BatchNorm;
use burn_std::DType;

use super::CollectiveDevice;
use super::session::running;

/// Configuration of a [`SyncBatchNorm`] (the fields and defaults of Burn's `BatchNormConfig`).
#[derive(Config, Debug)]
pub struct SyncBatchNormConfig {
    /// The number of features (channels).
    pub num_features: usize,
    /// A value added to the variance for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Weight of the batch's statistics in the update of the running ones.
    #[config(default = 0.1)]
    pub momentum: f64,
}

impl SyncBatchNormConfig {
    /// A new synchronized batch norm on `device`: gamma ones, beta zeros, running mean zeros,
    /// running variance ones, as Burn's `BatchNormConfig::init`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> SyncBatchNorm<B> {
        SyncBatchNorm {
            gamma: Initializer::Ones.init([self.num_features], device),
            beta: Initializer::Zeros.init([self.num_features], device),
            running_mean: RunningState::new(Tensor::zeros([self.num_features], device)),
            running_var: RunningState::new(Tensor::ones([self.num_features], device)),
            momentum: self.momentum,
            epsilon: self.epsilon,
            group: None,
        }
    }
}

/// What [`SyncBatchNorm::try_forward`] refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SyncBatchNormError {
    /// The input's rank (number of dimensions) is below 2.
    #[error(
        "SyncBatchNorm takes a tensor of rank >= 2 shaped [batch, channels, ...], got rank {0}"
    )]
    Rank(usize),
    /// The input's device is not one of the group given to [`SyncBatchNorm::with_group`].
    #[error("SyncBatchNorm: the input's device {device} is not in its group of {group} devices")]
    NotInGroup {
        /// The input's device.
        device: String,
        /// Devices in the group.
        group: usize,
    },
}

/// Burn's `BatchNorm` with training statistics over every rank's batch; see the module docs.
///
/// Input `[batch, channels, ...]`, as `BatchNorm`'s.
#[derive(Module, Debug)]
pub struct SyncBatchNorm<B: Backend> {
    /// The learnable scale.
    pub gamma: Param<Tensor<B, 1>>,
    /// The learnable shift.
    pub beta: Param<Tensor<B, 1>>,
    /// The running mean.
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// The running (biased) variance.
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Weight of the batch's statistics in the update of the running ones.
    pub momentum: f64,
    /// A value added to the variance for numerical stability.
    pub epsilon: f64,
    /// The group's device ids, when given ([`SyncBatchNorm::with_group`]); else the running
    /// communication server's ranks.
    #[module(skip)]
    group: Option<Vec<DeviceId>>,
}

impl<B: Backend> SyncBatchNorm<B> {
    /// The synchronized form of `norm`, with its parameters and running statistics (PyTorch's
    /// `convert_sync_batchnorm`, for one layer).
    pub fn from_batch_norm(norm: BatchNorm<B>) -> Self {
        SyncBatchNorm {
            gamma: norm.gamma,
            beta: norm.beta,
            running_mean: norm.running_mean,
            running_var: norm.running_var,
            momentum: norm.momentum,
            epsilon: norm.epsilon,
            group: None,
        }
    }

    /// Burn's `BatchNorm` with this layer's parameters and running statistics (for a model run
    /// where no group is, such as inference on `B` alone).
    pub fn into_batch_norm(self) -> BatchNorm<B> {
        BatchNorm {
            gamma: self.gamma,
            beta: self.beta,
            running_mean: self.running_mean,
            running_var: self.running_var,
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }

    /// Synchronizes over `devices` (one per rank, the same list on every rank, the caller's
    /// device among them) instead of the communication server's ranks: the way to use this
    /// module on a `DistributedBackend` other than `Collective`.
    pub fn with_group(mut self, devices: &[B::Device]) -> Self {
        self.group = Some(devices.iter().map(|d| d.id()).collect());
        self
    }
}

impl<B: DistributedBackend> SyncBatchNorm<B> {
    /// Normalizes `input` (`[batch, channels, ...]`) with the statistics of every rank's batch
    /// in training (autodiff on), updating the running statistics with them, or with the running
    /// statistics otherwise.
    ///
    /// # Panics
    /// Where [`SyncBatchNorm::try_forward`] returns an error, with its message (as Burn's
    /// `BatchNorm` panics on a tensor of rank below 2).
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        self.try_forward(input).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`SyncBatchNorm::forward`], with what it refuses as an error.
    ///
    /// # Errors
    /// [`SyncBatchNormError::Rank`] when `D < 2`; [`SyncBatchNormError::NotInGroup`] when the
    /// input's device is not one of the group given to [`SyncBatchNorm::with_group`].
    pub fn try_forward<const D: usize>(
        &self,
        input: Tensor<B, D>,
    ) -> Result<Tensor<B, D>, SyncBatchNormError> {
        if D < 2 {
            return Err(SyncBatchNormError::Rank(D));
        }
        let device = input.device();
        let dims = input.dims();
        let channels = dims[1];
        let mut per_channel = [1; D];
        per_channel[1] = channels;
        if !B::ad_enabled(&device) {
            let mean = self.running_mean.value().to_device(&device);
            let var = self.running_var.value().to_device(&device);
            let out = self.normalize(input, mean.reshape(per_channel), var.reshape(per_channel));
            return Ok(out);
        }
        let rows = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 1)
            .map(|(_, d)| *d)
            .product();
        let flat = input.clone().swap_dims(0, 1).reshape([channels, rows]);
        let (mean, var) = match self.group_of(&device)? {
            Some(group) if group.ids.len() > 1 => global_stats(flat, rows, &group),
            _ => {
                let mean = flat.clone().mean_dim(1);
                let var = (flat - mean.clone()).square().mean_dim(1);
                (mean.reshape([channels]), var.reshape([channels]))
            }
        };
        self.update_running(&device, mean.clone().detach(), var.clone().detach());
        Ok(self.normalize(input, mean.reshape(per_channel), var.reshape(per_channel)))
    }

    /// The group `device` trains in: the given one, or the running server's.
    fn group_of(&self, device: &B::Device) -> Result<Option<Group>, SyncBatchNormError> {
        let found = group_fns(TypeId::of::<B::Device>());
        let Some(ids) = &self.group else {
            return Ok(found.into_iter().find_map(|f| f(device as &dyn Any)));
        };
        let me = device.id();
        let rank =
            ids.iter()
                .position(|id| *id == me)
                .ok_or_else(|| SyncBatchNormError::NotInGroup {
                    device: format!("{device:?}"),
                    group: ids.len(),
                })?;
        Ok(Some(Group {
            rank,
            ids: ids.clone(),
            // A device of a `Collective` backend.
            lazy: !found.is_empty(),
        }))
    }

    fn update_running(&self, device: &B::Device, mean: Tensor<B, 1>, var: Tensor<B, 1>) {
        let blend = |state: &RunningState<Tensor<B, 1>>, batch: Tensor<B, 1>| {
            let old = state.value_sync().to_device(device);
            let new = old
                .mul_scalar(1.0 - self.momentum)
                .add(batch.mul_scalar(self.momentum));
            state.update(new.detach());
        };
        blend(&self.running_mean, mean);
        blend(&self.running_var, var);
    }

    fn normalize<const D: usize>(
        &self,
        x: Tensor<B, D>,
        mean: Tensor<B, D>,
        var: Tensor<B, D>,
    ) -> Tensor<B, D> {
        let shape = mean.dims();
        let std = var.add_scalar(self.epsilon).sqrt();
        x.sub(mean)
            .div(std)
            .mul(self.gamma.val().reshape(shape))
            .add(self.beta.val().reshape(shape))
    }
}

/// The mean and biased variance per channel of every rank's rows, from this rank's `flat`
/// (`[channels, rows]`), with one sum all-reduce over `group`. The statistics cross and are
/// combined in f32 whatever the input's float type (an f16 row count is exact only up to 2048).
fn global_stats<B: DistributedBackend>(
    flat: Tensor<B, 2>,
    rows: usize,
    group: &Group,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let [channels, _] = flat.dims();
    let device = flat.device();
    let float = flat.dtype();
    let width = 2 * channels + 1;
    let world = group.ids.len();
    let (mean, var) = if rows == 0 {
        // No rows here: nothing to add to the group's statistics (a mean of none is NaN). The
        // zeros still derive from the input, so that this rank's all-reduce is differentiated
        // (its backward is a collective too) whenever the other ranks' are.
        let zeros = flat.sum_dim(1);
        (zeros.clone(), zeros)
    } else {
        // Burn's `BatchNorm`'s two passes over the rank's rows.
        let mean = flat.clone().mean_dim(1);
        (mean.clone(), (flat - mean).square().mean_dim(1))
    };
    let f32 = |t: Tensor<B, 2>| t.reshape([1, channels]).cast(DType::F32);
    let count = Tensor::full([1, 1], rows as f64, (&device, DType::F32));
    let own = Tensor::cat(vec![f32(mean), f32(var), count], 1);
    // This rank's statistics in its own row; the others' rows are zeros, so the sum is every
    // rank's row as that rank computed it.
    let mut rows_of = Vec::with_capacity(3);
    let zeros = |n: usize| Tensor::zeros([n, width], (&device, DType::F32));
    if group.rank > 0 {
        rows_of.push(zeros(group.rank));
    }
    rows_of.push(own);
    if group.rank + 1 < world {
        rows_of.push(zeros(world - group.rank - 1));
    }
    let all = reduce_sum(Tensor::cat(rows_of, 0), group);
    let means = all.clone().slice(s![.., 0..channels]);
    let vars = all.clone().slice(s![.., channels..2 * channels]);
    let counts = all.slice(s![.., 2 * channels..width]);
    let total = counts.clone().sum_dim(0);
    let mean = (means.clone() * counts.clone()).sum_dim(0) / total.clone();
    // Each rank's rows spread around the global mean: their own variance plus the square of
    // their mean's distance from it.
    let spread = (vars + (means - mean.clone()).square()) * counts;
    let var = spread.sum_dim(0) / total;
    let back = |t: Tensor<B, 2>| t.reshape([channels]).cast(float);
    (back(mean), back(var))
}

/// The sum all-reduce of `t` over `group`: left lazy on a `Collective` device (its first use
/// waits for it), resolved at once on another backend.
fn reduce_sum<B: DistributedBackend>(t: Tensor<B, 2>, group: &Group) -> Tensor<B, 2> {
    let reduced = B::all_reduce(
        t.into_primitive().tensor(),
        ReduceOperation::Sum,
        group.ids.clone(),
    );
    let primitive = if group.lazy {
        // SAFETY: a `Collective` tensor that results from an all-reduce waits for it when it is
        // first needed.
        unsafe { reduced.assume_resolved() }
    } else {
        reduced.resolve()
    };
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// A device's rank and its group's device ids.
pub(crate) struct Group {
    /// The device's position in `ids`.
    pub(crate) rank: usize,
    /// One device id per rank, in rank order.
    pub(crate) ids: Vec<DeviceId>,
    /// Whether the device is a `Collective` one, whose all-reduce results wait when needed.
    pub(crate) lazy: bool,
}

/// Finds the group of a device (a `&dyn Any` of the registered device type) in a running
/// communication server; `None` when none is running for it.
pub(crate) type GroupFn = fn(&dyn Any) -> Option<Group>;

type Registry = HashMap<(TypeId, TypeId), GroupFn>;

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static GROUPS: OnceLock<Mutex<Registry>> = OnceLock::new();
    GROUPS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Makes `find` how [`SyncBatchNorm`] finds the group of a device of type `D` whose server is
/// that of backend `S` (several backends may share a device type).
pub(crate) fn register_group<D: 'static, S: 'static>(find: GroupFn) {
    registry().insert((TypeId::of::<D>(), TypeId::of::<S>()), find);
}

/// The group finders registered for devices of type `device`.
fn group_fns(device: TypeId) -> Vec<GroupFn> {
    registry()
        .iter()
        .filter(|((d, _), _)| *d == device)
        .map(|(_, f)| *f)
        .collect()
}

/// The group of a `Collective<I>` device: every rank of the server running for `I`.
pub(crate) fn collective_group<I: burn_backend::Backend>(device: &dyn Any) -> Option<Group> {
    let d = device.downcast_ref::<CollectiveDevice<I::Device>>()?;
    let world = running::<I>()?.world;
    Some(Group {
        rank: d.rank as usize,
        ids: d.group_ids(world),
        lazy: true,
    })
}

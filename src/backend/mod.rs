//! The Burn glue: `Collective<I>`, a Burn 0.21 backend over an inner backend `I` (NdArray here,
//! Burn's CubeCL backends on GPUs) that owns Burn's gradient-sync hooks.
//!
//! Tensor ops record lazily (`lazy.rs`; `ops/` is generated from Burn's op traits and forwards every op, required or
//! defaulted, to `I`; `op_table.rs` holds the record rules of the ops recorded lazily): a node
//! with its shape, dtype and flop estimate, run on `I` in record order when a value is needed; at
//! each sync point a rank's recorded ops become its step graph (`record.rs`,
//! [`recorded_step_graph`]). The distributed hooks are compiled. The first step records a
//! `grad_sync` per gradient in ready
//! order; `submit_sync_collective` builds the segment's graph, compiles it through the plan cache
//! (bucketing, fusion, async split, overlap scheduling) and runs the plan. Later steps follow that
//! plan while gradients arrive in its order: each bucket is packed and its all-reduce launched on
//! the communication thread the moment its last gradient arrives, overlapping the rest of
//! backward, and the sync point only waits and unpacks. A step whose order changes finishes what
//! it launched and reduces the rest with a plan of its own (every rank does the same, and a rank
//! that disagrees fails with a mismatch error instead of hanging). Reduced gradients are written
//! back through Burn's `TensorRef` pointers before the hook returns, and only once every bucket
//! is done, so a failed step leaves the gradients as they were.
//!
//! Ranks: [`CollectiveDevice`] carries the inner device and a rank, and every tensor carries its
//! rank, so N "devices" over one CPU train data-parallel in one process, one thread per rank, with
//! the in-process communicator.

mod api;
mod device;
mod distributed;
mod follow;
mod forward;
mod hook_times;
mod host_io;
mod join;
mod lazy;
mod op_table;
mod ops;
mod ops_grad;
mod options;
mod params;
mod planner;
mod rank_threads;
mod record;
mod replicas;
mod rules;
mod session;
mod settings;
mod step_clock;
mod sync_batch_norm;
mod user_collectives;
mod zero_fill;

use std::fmt;

use burn_backend::{Backend, BackendTypes, DTypeUsageSet, DeviceId, DeviceOps};
use burn_std::DType;

pub use api::{CollectiveTensor, DistributedContext, all_reduce};
pub use distributed::{
    NoSync, SyncStats, executed_step_order, expected_plan, gradient_syncs_total, last_zero_filled,
    measured_link, measured_step, no_sync, recorded_collectives, recorded_step_graph, sync_stats,
    take_trace, trace_span,
};
pub use hook_times::{HookTimes, hook_times};
pub use join::{Join, JoinError, JoinOptions, JoinReport, join, join_with};
pub use lazy::{CTensor, LazyStats, lazy_stats, lazy_window, set_lazy_window};
pub use options::{CollectiveOptions, MeasuredPlans, SingleRank, Transport, UnusedParameters};
pub use params::{mark_distributed, mark_distributed_as, replicate_from, sync_buffers};
pub use replicas::{BufferSync, InitialWeights, ReplicaError};
pub use sync_batch_norm::{
    SyncBatchNorm, SyncBatchNormConfig, SyncBatchNormError, SyncBatchNormRecord,
};

/// A Burn backend that compiles the gradient communication of data-parallel training.
#[derive(Clone, Copy, Default, Debug)]
pub struct Collective<I> {
    _inner: std::marker::PhantomData<I>,
}

/// A device of `Collective<I>`: the inner backend's device and this rank.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug, Hash)]
pub struct CollectiveDevice<D> {
    /// The inner backend's device.
    pub inner: D,
    /// The rank in the data-parallel group.
    pub rank: u32,
}

impl<D: DeviceOps> CollectiveDevice<D> {
    /// Rank `rank` on `inner`. An inner device with autodiff on (`DispatchDevice::autodiff`, as
    /// Burn's own `Dispatch` training code makes it) is taken without it: `Autodiff<Collective<B>>`
    /// differentiates, and a second autodiff graph under it would only cost time and memory.
    pub fn new(inner: D, rank: u32) -> Self {
        CollectiveDevice {
            inner: inner.inner().clone(),
            rank,
        }
    }
}

impl<D: DeviceOps> CollectiveDevice<D> {
    /// The device ids of every rank of a group of `world` on this device's inner device, in rank
    /// order: the group an all-reduce over a whole communication server names.
    pub(crate) fn group_ids(&self, world: usize) -> Vec<DeviceId> {
        (0..world)
            .map(|r| CollectiveDevice::new(self.inner.clone(), r as u32).id())
            .collect()
    }
}

impl<D: fmt::Debug> fmt::Display for CollectiveDevice<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} on {:?}", self.rank, self.inner)
    }
}

/// Bits of the device id's 16-bit index that hold the rank (the rest hold the inner device's
/// index): 256 ranks per process, 256 inner devices.
const RANK_BITS: u32 = 8;

impl<D: DeviceOps> burn_backend::Device for CollectiveDevice<D> {
    fn from_id(id: DeviceId) -> Self {
        let inner = D::from_id(DeviceId {
            type_id: id.type_id,
            index_id: id.index_id >> RANK_BITS,
        });
        CollectiveDevice {
            inner,
            rank: u32::from(id.index_id & ((1 << RANK_BITS) - 1)),
        }
    }

    fn to_id(&self) -> DeviceId {
        let inner = self.inner.to_id();
        DeviceId {
            type_id: inner.type_id,
            index_id: (inner.index_id << RANK_BITS) | (self.rank as u16 & ((1 << RANK_BITS) - 1)),
        }
    }
}

impl<D: DeviceOps> DeviceOps for CollectiveDevice<D> {}

impl<I: Backend> BackendTypes for Collective<I> {
    type Device = CollectiveDevice<I::Device>;
    type FloatTensorPrimitive = CTensor<I::FloatTensorPrimitive>;
    type FloatElem = I::FloatElem;
    type IntTensorPrimitive = CTensor<I::IntTensorPrimitive>;
    type IntElem = I::IntElem;
    type BoolTensorPrimitive = CTensor<I::BoolTensorPrimitive>;
    type BoolElem = I::BoolElem;
    type QuantizedTensorPrimitive = CTensor<I::QuantizedTensorPrimitive>;
}

impl<I: Backend> Backend for Collective<I> {
    fn name(device: &Self::Device) -> String {
        format!("collective<{}>", I::name(&device.inner))
    }

    fn seed(device: &Self::Device, seed: u64) {
        I::seed(&device.inner, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), burn_backend::ExecutionError> {
        lazy::flush(device.rank);
        I::sync(&device.inner)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        I::dtype_usage(&device.inner, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        I::device_count(type_id)
    }

    fn memory_cleanup(device: &Self::Device) {
        I::memory_cleanup(&device.inner)
    }

    fn ad_enabled(device: &Self::Device) -> bool {
        I::ad_enabled(&device.inner)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        I::supports_dtype(&device.inner, dtype)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut burn_backend::TensorData>,
    {
        I::staging(data, &device.inner)
    }

    /// Burn creates parameters inside this call (module initializers, `Param::from_data`,
    /// loading records) so that a CubeCL backend keeps them in its persistent memory pool. The
    /// ops `func` records would otherwise run later, outside the inner backend's scope, so on a
    /// backend with such a pool the rank's queue runs before the scope opens (what was queued
    /// earlier is not the caller's) and again before it closes: `func`'s tensors are allocated
    /// inside it, as with `I` alone. Elsewhere (NdArray) nothing is forced: a parameter first
    /// read inside a step stays lazy.
    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        if !device::has_persistent_memory(&device.inner) {
            return I::memory_persistent_allocations(&device.inner, input, func);
        }
        let rank = device.rank;
        lazy::force_queued(rank, "memory_persistent_allocations");
        I::memory_persistent_allocations(&device.inner, input, move |input| {
            let out = func(input);
            lazy::force_queued(rank, "memory_persistent_allocations");
            out
        })
    }
}

/// Whether `probe` (a first call on a wgpu device) ran: `false`, said on stderr, when it
/// panicked for want of an adapter and `CF_REQUIRE_WGPU` is unset; with it set (CI), the panic
/// goes on, so the wgpu tests cannot pass by skipping.
#[cfg(test)]
pub(crate) fn wgpu_probe<T>(probe: impl FnOnce() -> T + std::panic::UnwindSafe) -> bool {
    match std::panic::catch_unwind(probe) {
        Ok(_) => true,
        Err(_) if std::env::var_os("CF_REQUIRE_WGPU").is_none() => {
            eprintln!("skipped: no wgpu adapter");
            false
        }
        Err(p) => std::panic::resume_unwind(p),
    }
}

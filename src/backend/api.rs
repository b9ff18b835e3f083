//! A tensor-level distributed API for Burn 0.21 users, shaped like Burn 0.22's: a
//! [`DistributedContext`] guard that runs the communication server for its lifetime, and
//! [`all_reduce`] on a `Tensor` that returns a [`CollectiveTensor`] to resolve. Under `Autodiff`
//! the all-reduce is differentiable: its backward all-reduces the gradient with the same op.

use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_backend::{DeviceOps, TensorPrimitive};
use burn_core::tensor::Tensor;

/// Runs the communication server of backend `B` over `devices` while it lives.
pub struct DistributedContext<B: DistributedBackend> {
    device: B::Device,
}

impl<B: DistributedBackend> DistributedContext<B> {
    /// Starts the server for `devices` (one per rank) reducing gradients with `op`.
    pub fn start(devices: &[B::Device], op: ReduceOperation) -> Self {
        B::start_communication_server(devices, DistributedConfig { all_reduce_op: op });
        DistributedContext {
            device: devices[0].clone(),
        }
    }
}

impl<B: DistributedBackend> Drop for DistributedContext<B> {
    fn drop(&mut self) {
        B::close_communication_server(&self.device);
    }
}

/// An all-reduced tensor that may still be in flight.
pub struct CollectiveTensor<B: DistributedBackend, const D: usize> {
    inner: burn_backend::distributed::CollectiveTensor<B>,
}

impl<B: DistributedBackend, const D: usize> CollectiveTensor<B, D> {
    /// Waits for the collective and returns the reduced tensor.
    pub fn resolve(self) -> Tensor<B, D> {
        Tensor::from_primitive(TensorPrimitive::Float(self.inner.resolve()))
    }

    /// The reduced tensor without waiting.
    ///
    /// # Safety
    /// The caller must make sure the collective completed (a later `resolve`, or
    /// `sync_collective` on its device) before the data is read.
    pub unsafe fn assume_resolved(self) -> Tensor<B, D> {
        // SAFETY: forwarded to the caller.
        Tensor::from_primitive(TensorPrimitive::Float(unsafe {
            self.inner.assume_resolved()
        }))
    }
}

/// All-reduces `tensor` with `op` across the ranks of `devices` (every rank calls it, in the same
/// order relative to its other collectives).
pub fn all_reduce<B: DistributedBackend, const D: usize>(
    tensor: Tensor<B, D>,
    op: ReduceOperation,
    devices: &[<B as burn_backend::BackendTypes>::Device],
) -> CollectiveTensor<B, D> {
    let ids = devices.iter().map(|d| d.id()).collect();
    let primitive = tensor.into_primitive().tensor();
    CollectiveTensor {
        inner: B::all_reduce(primitive, op, ids),
    }
}

//! Gradients that stay in the inner backend's device buffers: when `I` is one of Burn's CubeCL
//! backends (wgpu; CUDA with the `cuda` feature) without its fusion layer, a submitted gradient
//! is kept as its tensor's handle ([`CubeGrad`]), its bucket is packed and unpacked by the CubeCL
//! kernels on those buffers, and the reduced gradient is written back as a new tensor of the same
//! runtime, device, shape and dtype. Any other inner backend keeps the host path.

use std::any::Any;

use burn_backend::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;

use super::distributed::graph_dtype;
use crate::runtime::cube::CubeGrad;
use crate::runtime::grad::DeviceGrad;

fn grad_of<R: CubeRuntime, P: 'static>(p: &P) -> Option<Box<dyn DeviceGrad>> {
    let t = (p as &dyn Any).downcast_ref::<CubeTensor<R>>()?.clone();
    let dtype = graph_dtype(t.dtype)?;
    // The kernels read a member as `len` consecutive elements from its handle.
    let t = if t.is_contiguous() {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    };
    let len = t.shape().num_elements();
    Some(Box::new(CubeGrad {
        client: t.client,
        handle: t.handle,
        len,
        dtype,
    }))
}

fn tensor_of<R: CubeRuntime, P: 'static>(
    like: &P,
    g: Box<dyn DeviceGrad>,
) -> Result<P, Box<dyn DeviceGrad>> {
    let Some(t) = (like as &dyn Any).downcast_ref::<CubeTensor<R>>() else {
        return Err(g);
    };
    if !g.as_any().is::<CubeGrad<R>>() {
        return Err(g);
    }
    let Ok(g) = g.into_any().downcast::<CubeGrad<R>>() else {
        unreachable!("checked just above")
    };
    let out = CubeTensor::new_contiguous(
        t.client.clone(),
        t.device.clone(),
        t.shape(),
        g.handle,
        t.dtype,
    );
    match (Box::new(out) as Box<dyn Any>).downcast::<P>() {
        Ok(p) => Ok(*p),
        // `like` is a `P` that is a `CubeTensor<R>`, so `out` is a `P` too.
        Err(_) => unreachable!("a CubeTensor<R> is the P it was downcast from"),
    }
}

/// The gradient `p` as a device gradient, when it is a tensor of a CubeCL runtime this crate
/// knows; a non-contiguous one is made contiguous first (a copy on the device).
pub(crate) fn device_grad<P: 'static>(p: &P) -> Option<Box<dyn DeviceGrad>> {
    #[cfg(feature = "cuda")]
    if let Some(g) = grad_of::<cubecl::cuda::CudaRuntime, P>(p) {
        return Some(g);
    }
    grad_of::<cubecl::wgpu::WgpuRuntime, P>(p)
}

/// A tensor like `like` (its runtime, device, shape and dtype) holding the device gradient `g`;
/// `Err(g)` when `g` is not of `like`'s runtime.
pub(crate) fn tensor_from<P: 'static>(
    like: &P,
    g: Box<dyn DeviceGrad>,
) -> Result<P, Box<dyn DeviceGrad>> {
    #[cfg(feature = "cuda")]
    let g = match tensor_of::<cubecl::cuda::CudaRuntime, P>(like, g) {
        Ok(p) => return Ok(p),
        Err(g) => g,
    };
    tensor_of::<cubecl::wgpu::WgpuRuntime, P>(like, g)
}

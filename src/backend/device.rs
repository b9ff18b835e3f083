//! Gradients that stay in the inner backend's device buffers: when `I` is one of Burn's CubeCL
//! backends (wgpu; CUDA with the `cuda` feature), with its fusion layer on (Burn's default,
//! `burn::backend::Wgpu`/`Cuda`) or off (a bare `CubeBackend`), a submitted gradient is kept as
//! its tensor's handle ([`CubeGrad`]), its bucket is packed and unpacked by the CubeCL kernels on
//! those buffers, and the reduced gradient is written back as a new tensor of the same runtime,
//! device, shape and dtype (for a fused backend: registered with its fusion client, as the fusion
//! layer registers data it is given). `burn::Dispatch` on a GPU device keeps its gradients as its
//! own tensors, packed with its ops ([`ops_grad`](super::ops_grad)); any other inner backend
//! keeps the host path.
//!
//! A fused gradient is resolved to its `CubeTensor` through the fusion client, which runs the
//! fused work queued before it (what any read of it would do) but copies nothing to the host.

use std::any::Any;

use burn_backend::{Backend, TensorMetadata};
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{FusionTensor, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};

use super::distributed::graph_dtype;
use super::ops_grad::OpsGrad;
use crate::runtime::cube::CubeGrad;
use crate::runtime::grad::DeviceGrad;

/// The CubeCL backend a fused tensor of runtime `R` resolves through. Its element types do not
/// matter here: a resolved tensor carries its own dtype.
type Cube<R> = CubeBackend<R, f32, i32, u32>;

/// `p` as a CubeCL tensor of runtime `R`: itself, or the tensor behind a fusion tensor of `R`.
fn cube_tensor<R: CubeRuntime, P: 'static>(p: &P) -> Option<CubeTensor<R>> {
    let any = p as &dyn Any;
    if let Some(t) = any.downcast_ref::<CubeTensor<R>>() {
        return Some(t.clone());
    }
    let t = any.downcast_ref::<FusionTensor<FusionCubeRuntime<R>>>()?;
    // A dtype the kernels cannot pack stays on the host path: do not drain the queue for it.
    graph_dtype(t.dtype)?;
    Some(t.client.resolve_tensor_float::<Cube<R>>(t.clone()))
}

fn grad_of<R: CubeRuntime, P: 'static>(p: &P) -> Option<Box<dyn DeviceGrad>> {
    let t = cube_tensor::<R, P>(p)?;
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

/// `out` as the `P` it is (`P` was checked to be `out`'s type by the caller's downcast).
fn as_p<T: 'static, P: 'static>(out: T) -> P {
    match (Box::new(out) as Box<dyn Any>).downcast::<P>() {
        Ok(p) => *p,
        Err(_) => unreachable!("the result has the type `like` was downcast to"),
    }
}

fn tensor_of<R: CubeRuntime, P: 'static>(
    like: &P,
    g: Box<dyn DeviceGrad>,
) -> Result<P, Box<dyn DeviceGrad>> {
    let any = like as &dyn Any;
    let bare = any.downcast_ref::<CubeTensor<R>>();
    let fused = any.downcast_ref::<FusionTensor<FusionCubeRuntime<R>>>();
    if (bare.is_none() && fused.is_none()) || !g.as_any().is::<CubeGrad<R>>() {
        return Err(g);
    }
    let Ok(g) = g.into_any().downcast::<CubeGrad<R>>() else {
        unreachable!("checked just above")
    };
    if let Some(t) = bare {
        let out = CubeTensor::new_contiguous(
            t.client.clone(),
            t.device.clone(),
            t.shape(),
            g.handle,
            t.dtype,
        );
        return Ok(as_p(out));
    }
    let Some(t) = fused else {
        unreachable!("one of the two, checked above")
    };
    let client = t.client.clone();
    let device = client.device().clone();
    let cube = CubeTensor::new_contiguous(g.client, device, t.shape.clone(), g.handle, t.dtype);
    // As the fusion layer takes data it is given: the handle registered, an init op recorded.
    let handle = <Cube<R> as BackendIr>::float_tensor_handle(cube);
    let desc = InitOperationIr::create(t.shape.clone(), t.dtype, || {
        client.register_tensor_handle(handle)
    });
    let out: FusionTensor<FusionCubeRuntime<R>> = client
        .register(
            OperationStreams::default(),
            OperationIr::Init(desc),
            NoOp::<Cube<R>>::new(),
        )
        .output();
    Ok(as_p(out))
}

/// The gradient `p` as a device gradient: when it is a tensor of a CubeCL runtime this crate
/// knows, fused or not, its handle (a non-contiguous one is made contiguous first, a copy on the
/// device); when `I` is `Dispatch` on a device other than NdArray's (wgpu, CUDA), its own tensor
/// ([`OpsGrad`]), packed with the backend's ops.
pub(crate) fn device_grad<I: Backend>(p: &I::FloatTensorPrimitive) -> Option<Box<dyn DeviceGrad>> {
    #[cfg(feature = "cuda")]
    if let Some(g) = grad_of::<cubecl::cuda::CudaRuntime, _>(p) {
        return Some(g);
    }
    if let Some(g) = grad_of::<cubecl::wgpu::WgpuRuntime, _>(p) {
        return Some(g);
    }
    let device = I::float_device(p);
    match (&device as &dyn Any).downcast_ref::<burn_dispatch::DispatchDevice>() {
        // NdArray's tensors are in host memory already: the host path reads them for free.
        #[cfg(feature = "dispatch-ndarray")]
        Some(burn_dispatch::DispatchDevice::NdArray(_)) => None,
        None => None,
        Some(_) => OpsGrad::<I>::new(p).map(|g| Box::new(g) as Box<dyn DeviceGrad>),
    }
}

/// A tensor like `like` (its runtime, device, shape and dtype; fused if it is) holding the device
/// gradient `g`; `Err(g)` when `g` is not of `like`'s backend.
pub(crate) fn tensor_from<I: Backend>(
    like: &I::FloatTensorPrimitive,
    g: Box<dyn DeviceGrad>,
) -> Result<I::FloatTensorPrimitive, Box<dyn DeviceGrad>> {
    #[cfg(feature = "cuda")]
    let g = match tensor_of::<cubecl::cuda::CudaRuntime, _>(like, g) {
        Ok(p) => return Ok(p),
        Err(g) => g,
    };
    let g = match tensor_of::<cubecl::wgpu::WgpuRuntime, _>(like, g) {
        Ok(p) => return Ok(p),
        Err(g) => g,
    };
    if !g.as_any().is::<OpsGrad<I>>() {
        return Err(g);
    }
    match g.into_any().downcast::<OpsGrad<I>>() {
        Ok(g) => Ok(g.into_tensor(like.shape())),
        Err(_) => unreachable!("checked just above"),
    }
}

/// Whether an inner device's backend keeps tensors created in
/// `Backend::memory_persistent_allocations` in a persistent memory pool: the CubeCL runtimes this
/// crate knows (wgpu, CUDA; fused or not), and `Dispatch` on them.
pub(crate) fn has_persistent_memory(device: &dyn Any) -> bool {
    if device.is::<cubecl::wgpu::WgpuDevice>() {
        return true;
    }
    #[cfg(feature = "cuda")]
    if device.is::<cubecl::cuda::CudaDevice>() {
        return true;
    }
    match device.downcast_ref::<burn_dispatch::DispatchDevice>() {
        Some(burn_dispatch::DispatchDevice::Wgpu(_)) => true,
        #[cfg(feature = "cuda")]
        Some(burn_dispatch::DispatchDevice::Cuda(_)) => true,
        _ => false,
    }
}

/// The CUDA device index of a rank's device, where it is a CUDA device (Burn's CUDA backend or
/// `Dispatch` on CUDA); `None` for any other device, or without the `cuda` feature.
pub(super) fn cuda_index(device: &dyn Any) -> Option<usize> {
    #[cfg(feature = "cuda")]
    {
        device
            .downcast_ref::<cubecl::cuda::CudaDevice>()
            .or_else(
                || match device.downcast_ref::<burn_dispatch::DispatchDevice>() {
                    Some(burn_dispatch::DispatchDevice::Cuda(c)) => Some(c),
                    _ => None,
                },
            )
            .map(|c| c.index)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None
    }
}

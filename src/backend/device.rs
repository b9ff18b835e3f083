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
//! fused work queued before it (what any read of it would do) but copies nothing to the host; it
//! is resolved when its bucket is packed, not when it is submitted ([`FusedGrad`]).

use std::any::Any;
use std::sync::OnceLock;

use burn_backend::{Backend, TensorMetadata};
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeRuntime};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{FusionTensor, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};

use super::distributed::graph_dtype;
use super::ops_grad::OpsGrad;
use crate::codegen::layout::BucketLayout;
use crate::graph::DType;
use crate::runtime::buffer::HostBuffer;
use crate::runtime::cube::CubeGrad;
use crate::runtime::grad::{DeviceBucket, DeviceGrad, Packed, Unpacked};
use crate::runtime::host::KernelError;

/// The CubeCL backend a fused tensor of runtime `R` resolves through. Its element types do not
/// matter here: a resolved tensor carries its own dtype.
type Cube<R> = CubeBackend<R, f32, i32, u32>;

/// A device gradient of runtime `R` for `p`: a bare CubeCL tensor's handle, or a fused tensor
/// kept as it is until a kernel needs its buffer ([`FusedGrad`]).
fn grad_of<R: CubeRuntime, P: 'static>(p: &P) -> Option<Box<dyn DeviceGrad>> {
    let any = p as &dyn Any;
    if let Some(t) = any.downcast_ref::<CubeTensor<R>>() {
        let dtype = graph_dtype(t.dtype)?;
        return Some(Box::new(cube_grad(t.clone(), dtype)));
    }
    let t = any.downcast_ref::<FusionTensor<FusionCubeRuntime<R>>>()?;
    // A dtype the kernels cannot pack stays on the host path.
    let dtype = graph_dtype(t.dtype)?;
    Some(Box::new(FusedGrad {
        tensor: t.clone(),
        len: t.shape.num_elements(),
        dtype,
        resolved: OnceLock::new(),
    }))
}

/// The CubeCL tensor `t` (of graph dtype `dtype`) as a device gradient.
fn cube_grad<R: CubeRuntime>(t: CubeTensor<R>, dtype: DType) -> CubeGrad<R> {
    // The kernels read a member as `len` consecutive elements from its handle.
    let t = if t.is_contiguous() {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    };
    let len = t.shape().num_elements();
    CubeGrad {
        client: t.client,
        handle: t.handle,
        len,
        dtype,
    }
}

/// A gradient of a fused backend (Burn's default `Wgpu`, `Cuda`), kept as its fusion tensor
/// until a kernel needs its buffer: packing its bucket, copying it, reading it.
///
/// Burn's fusion layer runs a device's ops on a thread of its own, and the tensor behind a fusion
/// tensor exists once that thread has run every op queued before it: resolving one waits for
/// that. Resolved as each gradient was submitted, that wait came once per gradient, on the
/// training thread, which queued nothing more for the device while it waited, and each wait cut
/// the fusion layer's queue short. Resolved when its bucket is packed, the wait comes once per
/// bucket: the first member's runs the queue, the others find it run.
struct FusedGrad<R: CubeRuntime> {
    tensor: FusionTensor<FusionCubeRuntime<R>>,
    len: usize,
    dtype: DType,
    resolved: OnceLock<CubeGrad<R>>,
}

impl<R: CubeRuntime> FusedGrad<R> {
    /// The tensor behind it, resolved on the first call.
    fn resolved(&self) -> &CubeGrad<R> {
        self.resolved.get_or_init(|| {
            let client = &self.tensor.client;
            let t = client.resolve_tensor_float::<Cube<R>>(self.tensor.clone());
            cube_grad(t, self.dtype)
        })
    }
}

/// `g` as a CubeCL gradient of runtime `R` (a fused one resolved), if it is one.
fn as_cube<R: CubeRuntime>(g: &dyn DeviceGrad) -> Option<&CubeGrad<R>> {
    let any = g.as_any();
    any.downcast_ref::<CubeGrad<R>>()
        .or_else(|| any.downcast_ref::<FusedGrad<R>>().map(FusedGrad::resolved))
}

impl<R: CubeRuntime> DeviceGrad for FusedGrad<R> {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }

    fn read(&self) -> Result<HostBuffer, KernelError> {
        self.resolved().read()
    }

    fn pack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        scale_div: Option<u32>,
    ) -> Result<Option<Box<dyn DeviceBucket>>, KernelError> {
        // In layout order: the first member's wait runs the queue for the rest.
        let Some(cube) = members
            .iter()
            .map(|m| as_cube::<R>(*m))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        let refs: Vec<&dyn DeviceGrad> = cube.iter().map(|g| *g as &dyn DeviceGrad).collect();
        self.resolved().pack(layout, &refs, scale_div)
    }

    fn copy_to_bucket(&self) -> Result<Option<Box<dyn DeviceBucket>>, KernelError> {
        self.resolved().copy_to_bucket()
    }

    fn unpack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        reduced: &Packed,
        views: bool,
    ) -> Result<Unpacked, KernelError> {
        self.resolved().unpack(layout, members, reduced, views)
    }
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
    if let Some(t) = fused
        && g.as_any().is::<FusedGrad<R>>()
    {
        // A submitted gradient handed back as it is: its own tensor.
        let Ok(g) = g.into_any().downcast::<FusedGrad<R>>() else {
            unreachable!("checked just above")
        };
        debug_assert_eq!(g.tensor.shape, t.shape);
        return Ok(as_p(g.tensor));
    }
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

#[cfg(test)]
mod tests {
    use burn_backend::ops::FloatTensorOps;
    use burn_std::Shape;
    use burn_wgpu::{Wgpu, WgpuDevice, WgpuRuntime};

    use super::*;
    use crate::backend::host_io::{from_host, read_host};
    use crate::runtime::host;

    /// A fused gradient is handed over unresolved (no wait for the fusion layer's thread at
    /// submission), packed and unpacked from its bucket with the host kernels' bits, and handed
    /// back as its own tensor when it comes back unreduced.
    #[test]
    fn a_fused_gradient_is_resolved_when_its_bucket_is_packed_not_when_submitted() {
        let device = WgpuDevice::DefaultDevice;
        type W = Wgpu<f32, i32, u32>;
        let d = device.clone();
        if !crate::backend::wgpu_probe(move || <WgpuRuntime as cubecl::Runtime>::client(&d)) {
            return;
        }
        let host: Vec<HostBuffer> = [5usize, 16, 33]
            .iter()
            .enumerate()
            .map(|(j, &n)| {
                let v: Vec<f32> = (0..n)
                    .map(|i| (i * 7 + j * 13) as f32 / 9.0 - 2.0)
                    .collect();
                HostBuffer::F32(v)
            })
            .collect();
        // Each gradient the result of an op still queued in the fusion layer.
        let tensors: Vec<_> = host
            .iter()
            .map(|b| {
                let t = W::float_from_data(from_host(b.clone(), Shape::new([b.len()])), &device);
                W::float_mul_scalar(t, 1.0f32.into())
            })
            .collect();
        let grads: Vec<Box<dyn DeviceGrad>> = tensors
            .iter()
            .map(|t| device_grad::<W>(t).expect("a fused wgpu gradient"))
            .collect();
        for g in &grads {
            let fused = g.as_any().downcast_ref::<FusedGrad<WgpuRuntime>>();
            let fused = fused.expect("kept as its fusion tensor");
            assert!(fused.resolved.get().is_none(), "resolved at submission");
        }
        let sizes: Vec<u64> = host.iter().map(|b| b.len() as u64).collect();
        let l = BucketLayout::of_sizes(&sizes, DType::F32, DType::F32, Some(2), 16);
        let refs: Vec<&dyn DeviceGrad> = grads.iter().map(|g| g.as_ref()).collect();
        let packed = grads[0].pack(&l, &refs, Some(2)).expect("packs");
        let packed = packed.expect("packed on the device");
        let expected = host::pack(&l, &host.iter().collect::<Vec<_>>(), Some(2)).expect("host");
        assert!(packed.read().expect("reads").bits_eq(&expected));
        let out = grads[1]
            .unpack(&l, &refs, &Packed::Host(expected.clone()), false)
            .expect("unpacks");
        let mut want = host.clone();
        let mut slots: Vec<&mut HostBuffer> = want.iter_mut().collect();
        host::unpack(&l, &expected, &mut slots).expect("host unpack");
        for ((g, t), w) in out.grads.into_iter().zip(&tensors).zip(&want) {
            let back = tensor_from::<W>(t, g)
                .ok()
                .expect("a tensor of the fused backend");
            assert!(read_host::<W>(back).expect("reads").bits_eq(w));
        }
        // Handed back unreduced: the submitted tensor itself.
        let first = grads.into_iter().next().expect("three");
        let back = tensor_from::<W>(&tensors[0], first)
            .ok()
            .expect("its own tensor");
        assert!(read_host::<W>(back).expect("reads").bits_eq(&host[0]));
    }
}

//! Device gradients of an inner backend whose device buffers this crate cannot reach, packed and
//! unpacked with the backend's own tensor ops: `burn::Dispatch` on a GPU, whose backend tensor
//! burn-dispatch 0.21 keeps private (`DispatchTensor::kind` is `pub(crate)`), so the CubeCL
//! kernels cannot be handed its buffers.
//!
//! Without this, each such gradient is read into host memory at submit, one device-to-host
//! transfer and one wait per gradient, on the thread running backward. With it a gradient stays
//! the backend's tensor ([`OpsGrad`]); a bucket is packed on the device by the backend's ops
//! (flatten, scale by 1/N, cast to the wire dtype, zero gaps, one concatenation), crosses to the
//! host once (read on the communicator's thread) and is unpacked on the device (one upload, a
//! slice per member, cast back).
//!
//! The arithmetic is the host path's ([`runtime::buffer`](crate::runtime::buffer)): an f32 or
//! f64 member is multiplied by the reciprocal of N in its own dtype, a half member is scaled in
//! f32 and rounded back to its dtype, then every member is cast to the wire dtype. Views are
//! not reported: whether a slice is a view is the backend's business.

use std::any::Any;

use burn_backend::{Backend, Scalar, TensorMetadata};
use burn_std::{FloatDType, Shape, Slice};

use super::distributed::graph_dtype;
use super::host_io::{from_host, read_host};
use crate::codegen::layout::BucketLayout;
use crate::graph::DType;
use crate::runtime::HostBuffer;
use crate::runtime::cube::device_error;
use crate::runtime::grad::{DeviceBucket, DeviceGrad, Packed, Unpacked};
use crate::runtime::host::{KernelError, check_flat, check_members, label};

/// A gradient of `I` kept as `I`'s own tensor, flattened to one dimension.
pub(super) struct OpsGrad<I: Backend> {
    t: I::FloatTensorPrimitive,
    dtype: DType,
    len: usize,
}

/// The bucket [`OpsGrad::pack`] makes: a flat tensor of the wire dtype.
struct OpsBucket<I: Backend>(OpsGrad<I>);

pub(super) fn float_dtype(d: DType) -> Option<FloatDType> {
    Some(match d {
        DType::F32 => FloatDType::F32,
        DType::F64 => FloatDType::F64,
        DType::F16 => FloatDType::F16,
        DType::BF16 => FloatDType::BF16,
        _ => return None,
    })
}

impl<I: Backend> OpsGrad<I> {
    /// `p` as a gradient of its backend, when its dtype is one a bucket carries.
    pub(super) fn new(p: &I::FloatTensorPrimitive) -> Option<Self> {
        let dtype = graph_dtype(p.dtype())?;
        let len = p.shape().num_elements();
        Some(OpsGrad {
            t: I::float_reshape(p.clone(), Shape::new([len])),
            dtype,
            len,
        })
    }

    /// The tensor, shaped as `shape`.
    pub(super) fn into_tensor(self, shape: Shape) -> I::FloatTensorPrimitive {
        I::float_reshape(self.t, shape)
    }

    /// This member scaled and cast as the host path does it, flat.
    fn scaled(&self, wire: FloatDType, scale_div: Option<u32>) -> I::FloatTensorPrimitive {
        let t = self.t.clone();
        let t = match (scale_div, self.dtype) {
            (None, _) => t,
            (Some(d), DType::F64) => I::float_mul_scalar(t, Scalar::Float(1.0 / f64::from(d))),
            (Some(d), DType::F32) => {
                I::float_mul_scalar(t, Scalar::Float(f64::from(1.0 / d as f32)))
            }
            // Half: scaled in f32, rounded back to its own dtype (`Element::scale_div`).
            (Some(d), own) => {
                let wide = I::float_cast(t, FloatDType::F32);
                let wide = I::float_mul_scalar(wide, Scalar::Float(f64::from(1.0 / d as f32)));
                match float_dtype(own) {
                    Some(own) => I::float_cast(wide, own),
                    None => unreachable!("`new` only takes float dtypes"),
                }
            }
        };
        if float_dtype(self.dtype) == Some(wire) {
            t
        } else {
            I::float_cast(t, wire)
        }
    }

    fn upload(&self, buf: HostBuffer) -> I::FloatTensorPrimitive {
        let len = buf.len();
        I::float_from_data(from_host(buf, Shape::new([len])), &I::float_device(&self.t))
    }
}

fn ours<'a, I: Backend>(members: &[&'a dyn DeviceGrad]) -> Option<Vec<&'a OpsGrad<I>>> {
    members
        .iter()
        .map(|m| m.as_any().downcast_ref::<OpsGrad<I>>())
        .collect()
}

impl<I: Backend> DeviceGrad for OpsGrad<I> {
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
        read_host::<I>(self.t.clone()).map_err(|e| {
            device_error(
                format!("reading a {}[{}] gradient", self.dtype, self.len),
                e,
            )
        })
    }

    fn pack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        scale_div: Option<u32>,
    ) -> Result<Option<Box<dyn DeviceBucket>>, KernelError> {
        let Some(ours) = ours::<I>(members) else {
            return Ok(None);
        };
        check_members(layout, ours.iter().map(|g| (g.len, g.dtype)))?;
        let Some((wire, wire_float)) =
            DType::from_name(&layout.wire_dtype).and_then(|d| Some((d, float_dtype(d)?)))
        else {
            return Err(KernelError::Dtype {
                bucket: label(layout),
                dtype: layout.wire_dtype.clone(),
            });
        };
        let device = I::float_device(&self.t);
        // A dtype the backend does not run (NdArray's halves; bf16 where the device has none)
        // is packed on the host, which reads the members.
        let runs = |d: DType| float_dtype(d).is_some_and(|f| I::supports_dtype(&device, f.into()));
        let halves = scale_div.is_some() && ours.iter().any(|g| g.dtype.size() == 2);
        if layout.numel == 0
            || !runs(wire)
            || !ours.iter().all(|g| runs(g.dtype))
            || (halves && !runs(DType::F32))
        {
            return Ok(None);
        }
        let zeros = |n: u64| I::float_zeros(Shape::new([n as usize]), &device, wire_float);
        let mut parts = Vec::with_capacity(2 * ours.len() + 1);
        let mut at = 0u64;
        for (g, l) in ours.iter().zip(&layout.members) {
            if l.offset < at {
                return Err(device_error(
                    format!("packing {}", label(layout)),
                    format!(
                        "member {:?} at {} overlaps the one before it",
                        l.param, l.offset
                    ),
                ));
            }
            if l.offset > at {
                parts.push(zeros(l.offset - at));
            }
            if l.numel > 0 {
                parts.push(g.scaled(wire_float, scale_div));
            }
            at = l.offset + l.numel;
        }
        if layout.numel > at {
            parts.push(zeros(layout.numel - at));
        }
        let flat = match parts.len() {
            1 => parts.pop().unwrap_or_else(|| unreachable!("one part")),
            _ => I::float_cat(parts, 0),
        };
        Ok(Some(Box::new(OpsBucket(OpsGrad::<I> {
            t: flat,
            dtype: wire,
            len: layout.numel as usize,
        }))))
    }

    fn unpack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        reduced: &Packed,
        _views: bool,
    ) -> Result<Unpacked, KernelError> {
        let what = || format!("unpacking {}", label(layout));
        let Some(ours) = ours::<I>(members) else {
            return Err(device_error(
                what(),
                "a member is not a tensor of the backend that packed the bucket",
            ));
        };
        check_members(layout, ours.iter().map(|g| (g.len, g.dtype)))?;
        check_flat(layout, reduced.len(), reduced.dtype())?;
        let flat = match reduced {
            Packed::Host(b) => self.upload(b.clone()),
            Packed::Device(d) => match d.as_any().downcast_ref::<OpsBucket<I>>() {
                Some(b) => b.0.t.clone(),
                None => self.upload(d.read()?),
            },
        };
        let wire = reduced.dtype();
        let grads = ours
            .iter()
            .zip(&layout.members)
            .map(|(g, l)| {
                let r = l.range();
                let t = I::float_slice(
                    flat.clone(),
                    &[Slice::new(r.start as isize, Some(r.end as isize), 1)],
                );
                let t = match float_dtype(g.dtype) {
                    Some(own) if g.dtype != wire => I::float_cast(t, own),
                    _ => t,
                };
                Box::new(OpsGrad::<I> {
                    t,
                    dtype: g.dtype,
                    len: g.len,
                }) as Box<dyn DeviceGrad>
            })
            .collect();
        Ok(Unpacked { grads, views: 0 })
    }
}

impl<I: Backend> DeviceBucket for OpsBucket<I> {
    fn dtype(&self) -> DType {
        self.0.dtype
    }

    fn len(&self) -> usize {
        self.0.len
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn read(&self) -> Result<HostBuffer, KernelError> {
        self.0.read()
    }

    fn into_grad(self: Box<Self>) -> Box<dyn DeviceGrad> {
        Box::new(self.0)
    }
}

#[cfg(test)]
mod tests {
    use burn_backend::tensor::FloatTensor;
    use burn_ndarray::{NdArray, NdArrayDevice};

    use super::*;
    use crate::runtime::host;

    fn member(dtype: DType, n: usize, seed: usize) -> HostBuffer {
        let v: Vec<f64> = (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f64 / 37.0 - 13.0)
            .collect();
        HostBuffer::from_f64(dtype, &v).expect("a float dtype")
    }

    fn tensor<B: Backend>(b: &HostBuffer, device: &B::Device) -> FloatTensor<B> {
        B::float_from_data(from_host(b.clone(), Shape::new([b.len()])), device)
    }

    /// On `B`'s `device`, the ops pack and unpack give the host kernels' bits, for every member
    /// dtype the device runs, casts to a narrower wire dtype, gaps and a tail of padding, with
    /// and without the 1/N scale; a dtype it does not run is left to the host. Returns how many
    /// cases ran on the backend.
    fn matches_the_host_kernels<B: Backend>(device: &B::Device, f64: bool) -> usize {
        let cases = [
            (DType::F32, DType::F32),
            (DType::F32, DType::BF16),
            (DType::F32, DType::F16),
            (DType::F64, DType::F64),
            (DType::F16, DType::F16),
            (DType::BF16, DType::BF16),
            (DType::F16, DType::F32),
        ];
        let lens = [5, 16, 0, 1, 33];
        let sizes = lens.map(|n: usize| n as u64);
        let mut ran = 0;
        for (dtype, wire) in cases {
            let runs = |d: DType| B::supports_dtype(device, float_dtype(d).expect("float").into());
            if !runs(dtype) || (dtype == DType::F64 && !f64) {
                continue;
            }
            for scale_div in [None, Some(3), Some(4)] {
                // Gaps between members and a tail of padding, as the planner lays them out.
                let l = BucketLayout::of_sizes(&sizes, dtype, wire, scale_div, 16);
                let host: Vec<HostBuffer> = lens
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| member(dtype, n, i))
                    .collect();
                let grads: Vec<OpsGrad<B>> = host
                    .iter()
                    .map(|b| OpsGrad::new(&tensor::<B>(b, device)).expect("a float tensor"))
                    .collect();
                let refs: Vec<&dyn DeviceGrad> = grads.iter().map(|g| g as _).collect();
                let what = format!("{dtype} members, {wire} wire, scale {scale_div:?}");
                let packed = grads[0].pack(&l, &refs, scale_div).expect("packs");
                let halves = scale_div.is_some() && dtype.size() == 2;
                let Some(packed) = packed else {
                    assert!(
                        !runs(wire) || (halves && !runs(DType::F32)),
                        "{what}: not packed"
                    );
                    continue;
                };
                ran += 1;
                let expected =
                    host::pack(&l, &host.iter().collect::<Vec<_>>(), scale_div).expect("host pack");
                let got = packed.read().expect("reads");
                assert!(
                    got.bits_eq(&expected),
                    "{what}: pack {got:?} vs {expected:?}"
                );

                let mut want = host.clone();
                let mut slots: Vec<&mut HostBuffer> = want.iter_mut().collect();
                host::unpack(&l, &expected, &mut slots).expect("host unpack");
                // From the device bucket, and from a host buffer (a host communicator's result).
                for reduced in [Packed::Device(packed), Packed::Host(expected)] {
                    let out = grads[0].unpack(&l, &refs, &reduced, true).expect("unpacks");
                    assert_eq!(out.views, 0);
                    for (i, (g, w)) in out.grads.iter().zip(&want).enumerate() {
                        let got = g.read().expect("reads");
                        assert!(got.bits_eq(w), "{what}: member {i} {got:?} vs {w:?}");
                    }
                }
            }
        }
        ran
    }

    #[test]
    fn pack_and_unpack_with_ndarrays_ops_match_the_host_kernels_bit_for_bit() {
        // f32 and f64, with and without scale: NdArray has no halves.
        assert_eq!(
            matches_the_host_kernels::<NdArray>(&NdArrayDevice::Cpu, true),
            6
        );
    }

    /// The shipped case: `Dispatch` on its wgpu device (Mesa's software Vulkan in CI, which
    /// sets `CF_REQUIRE_WGPU`).
    #[test]
    fn pack_and_unpack_with_dispatch_wgpu_ops_match_the_host_kernels_bit_for_bit() {
        use burn_dispatch::{Dispatch, DispatchDevice};
        let device = DispatchDevice::Wgpu(burn_wgpu::WgpuDevice::DefaultDevice);
        let d = device.clone();
        if !crate::backend::wgpu_probe(move || Dispatch::supports_dtype(&d, burn_std::DType::F32)) {
            return;
        }
        // No f64: Burn's wgpu fusion compiles none (a model's own f64 ops would not run there).
        let ran = matches_the_host_kernels::<Dispatch>(&device, false);
        eprintln!("{ran} cases ran on the device");
        assert!(ran >= 3, "only {ran} cases ran on the device");
    }

    #[test]
    fn a_member_that_is_not_the_layouts_is_an_error_naming_it() {
        let l = BucketLayout::of_sizes(&[4, 8], DType::F32, DType::F32, None, 16);
        let d = NdArrayDevice::Cpu;
        let a = OpsGrad::<NdArray>::new(&tensor::<NdArray>(&member(DType::F32, 4, 0), &d))
            .expect("f32");
        let b = OpsGrad::<NdArray>::new(&tensor::<NdArray>(&member(DType::F32, 9, 1), &d))
            .expect("f32");
        let err = a.pack(&l, &[&a, &b], None).err().expect("an error");
        let msg = err.to_string();
        assert!(msg.contains("member 1 (p1)") || msg.contains("p1"), "{msg}");
        assert!(msg.contains("f32[8]") && msg.contains("f32[9]"), "{msg}");
    }
}

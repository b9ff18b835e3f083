//! Gradients in and out of host memory: a float tensor of the inner backend read into a
//! [`HostBuffer`], and a reduced member of a host bucket written back over a gradient.
//!
//! The tensors of Burn's CPU backends, NdArray and Flex (`burn_flex::Flex`, Burn 0.21's own), are
//! read straight from their memory, one copy, or lent where they lie ([`with_host_slice`], for a
//! copy straight into a bucket), and a reduced member is written over a gradient's own memory
//! where nothing else shares it (DDP's copy back into the gradients, no buffer of its own). Any
//! other backend's tensor goes through Burn's `TensorData`, whose bytes are taken over where
//! they can be.

use std::any::Any;

use burn_backend::{Backend, TensorData};

use crate::runtime::{Handed, HostBuffer, HostSlice};

/// `data` as a host buffer: its bytes taken over when their allocation is one a `Vec` of its
/// element could own (its size and alignment), else copied.
pub(super) fn to_host(data: TensorData) -> Result<HostBuffer, String> {
    let err = |e| format!("reading gradient data: {e:?}");
    Ok(match data.dtype {
        burn_std::DType::F32 => HostBuffer::F32(data.into_vec::<f32>().map_err(err)?),
        burn_std::DType::F64 => HostBuffer::F64(data.into_vec::<f64>().map_err(err)?),
        burn_std::DType::F16 => HostBuffer::F16(data.into_vec::<half::f16>().map_err(err)?),
        burn_std::DType::BF16 => HostBuffer::BF16(data.into_vec::<half::bf16>().map_err(err)?),
        d => return Err(format!("gradients of dtype {d:?} cannot be all-reduced")),
    })
}

/// A float tensor of `I` read into host memory (on a device backend, after the work queued
/// before it).
pub(super) fn read_host<I: Backend>(p: I::FloatTensorPrimitive) -> Result<HostBuffer, String> {
    if let Some(buf) = with_host_slice(&p, |s| s.to_buffer()).or_else(|| ndarray_host(&p)) {
        return Ok(buf);
    }
    let data = cubecl::future::block_on(I::float_into_data(p)).map_err(|e| e.to_string())?;
    to_host(data)
}

/// Calls `f` with the values of a tensor of Burn's CPU backends (NdArray, Flex) where they lie,
/// when they lie in row-major order, contiguous: what `float_into_data` gives, with no copy (it
/// copies a tensor that other handles share, as a synced gradient is, and the caller copies
/// again out of its bytes). `None`, `f` not called, for another backend's tensor, another layout
/// (a transposed weight gradient) or a dtype that is not a float.
pub(super) fn with_host_slice<R>(p: &dyn Any, f: impl FnOnce(HostSlice<'_>) -> R) -> Option<R> {
    use burn_ndarray::NdArrayTensor;
    if let Some(t) = p.downcast_ref::<NdArrayTensor>() {
        return match t {
            NdArrayTensor::F32(s) => s.view().as_slice().map(|v| f(HostSlice::F32(v))),
            NdArrayTensor::F64(s) => s.view().as_slice().map(|v| f(HostSlice::F64(v))),
            _ => None,
        };
    }
    let t = p.downcast_ref::<burn_flex::FlexTensor>()?;
    match t.dtype() {
        burn_std::DType::F32 => t.as_slice::<f32>().map(|v| f(HostSlice::F32(v))),
        burn_std::DType::F64 => t.as_slice::<f64>().map(|v| f(HostSlice::F64(v))),
        burn_std::DType::F16 => t.as_slice::<half::f16>().map(|v| f(HostSlice::F16(v))),
        burn_std::DType::BF16 => t.as_slice::<half::bf16>().map(|v| f(HostSlice::BF16(v))),
        _ => None,
    }
}

/// Writes a reduced member of a host bucket over the memory of a tensor of a CPU backend (see
/// [`ndarray_write`], [`flex_write`]); false, nothing written, where it cannot.
pub(super) fn write_in_place(p: &mut dyn Any, g: &Handed<'_>) -> bool {
    ndarray_write(p, g) || flex_write(p, g)
}

/// Writes a reduced member over a Flex tensor's own storage, where its layout is row-major,
/// nothing else shares the storage and the member is of the tensor's dtype and length, as
/// [`ndarray_write`] does for NdArray. False, nothing written, otherwise.
fn flex_write(p: &mut dyn Any, g: &Handed<'_>) -> bool {
    let Some(t) = p.downcast_mut::<burn_flex::FlexTensor>() else {
        return false;
    };
    let Some((start, end)) = t.layout().contiguous_offsets() else {
        return false;
    };
    // A macro, not a function: the storage's element bounds are another crate's.
    macro_rules! write {
        ($t:ty) => {{
            let Some(v) = g.wire_slice::<$t>() else {
                return false;
            };
            if end - start != v.len() {
                return false;
            }
            match t.try_storage_mut::<$t>() {
                Some(s) => {
                    s[start..end].copy_from_slice(v);
                    true
                }
                None => false,
            }
        }};
    }
    match t.dtype() {
        burn_std::DType::F32 => write!(f32),
        burn_std::DType::F64 => write!(f64),
        burn_std::DType::F16 => write!(half::f16),
        burn_std::DType::BF16 => write!(half::bf16),
        _ => false,
    }
}

/// Writes a reduced member of a host bucket over an NdArray tensor's own memory, in row-major
/// order, where nothing else shares that memory (Burn's gradient, whose old values nobody reads
/// again) and the member is of the tensor's dtype and length: the copy back into the gradient
/// that DDP makes, with no buffer of its own. False, nothing written, otherwise (another
/// backend's tensor, storage that is borrowed or shared, a layout that is not row-major, a member
/// to cast back).
fn ndarray_write(p: &mut dyn Any, g: &Handed<'_>) -> bool {
    use burn_ndarray::NdArrayTensor;
    // A macro, not a function: the storage type is not nameable from here.
    macro_rules! write {
        ($storage:expr, $t:ty) => {{
            let Some(v) = g.wire_slice::<$t>() else {
                return false;
            };
            if !$storage.is_unique() || $storage.len() != v.len() {
                return false;
            }
            match $storage.ensure_owned().as_slice_mut() {
                Some(s) => {
                    s.copy_from_slice(v);
                    true
                }
                None => false,
            }
        }};
    }
    match p.downcast_mut::<NdArrayTensor>() {
        Some(NdArrayTensor::F32(s)) => write!(s, f32),
        Some(NdArrayTensor::F64(s)) => write!(s, f64),
        _ => false,
    }
}

/// An NdArray tensor's values in row-major order, copied straight out of its array: what
/// `float_into_data` gives, without its two slow steps for a gradient (one that other handles
/// still share, as a synced gradient is, is read element by element through a dynamic-rank
/// iterator, then copied again out of the bytes). A row-major array is one `memcpy`; any other
/// layout (a transposed weight gradient) is copied a last-axis lane at a time. `None` for
/// another backend's tensor or a dtype that is not a float.
fn ndarray_host(p: &dyn Any) -> Option<HostBuffer> {
    use burn_ndarray::NdArrayTensor;
    // A macro, not a function: the storage and view types are not nameable from here.
    macro_rules! row_major {
        ($storage:expr) => {{
            let v = $storage.view();
            match v.as_slice() {
                // Row-major and contiguous (a 0-d array always is): one copy.
                Some(s) => s.to_vec(),
                None => {
                    let mut out = Vec::with_capacity(v.len());
                    for lane in v.rows() {
                        match lane.as_slice() {
                            Some(s) => out.extend_from_slice(s),
                            None => out.extend(lane.iter().copied()),
                        }
                    }
                    out
                }
            }
        }};
    }
    Some(match p.downcast_ref::<NdArrayTensor>()? {
        NdArrayTensor::F32(s) => HostBuffer::F32(row_major!(s)),
        NdArrayTensor::F64(s) => HostBuffer::F64(row_major!(s)),
        _ => return None,
    })
}

pub(super) fn from_host(buf: HostBuffer, shape: burn_std::Shape) -> TensorData {
    match buf {
        HostBuffer::F32(v) => TensorData::new(v, shape),
        HostBuffer::F64(v) => TensorData::new(v, shape),
        HostBuffer::F16(v) => TensorData::new(v, shape),
        HostBuffer::BF16(v) => TensorData::new(v, shape),
    }
}

#[cfg(test)]
mod tests {
    use super::{ndarray_host, read_host, to_host, with_host_slice, write_in_place};
    use burn_backend::tensor::FloatTensor;
    use burn_backend::{Backend, TensorData};
    use burn_flex::{Flex, FlexDevice};
    use burn_ndarray::{NdArray, NdArrayDevice};

    /// What Burn's own read gives, through `TensorData`.
    fn burns<B: Backend>(p: FloatTensor<B>) -> crate::runtime::HostBuffer {
        let data = cubecl::future::block_on(B::float_into_data(p)).unwrap();
        to_host(data).unwrap()
    }

    /// Tensors of `B` in many layouts: row-major, transposed, permuted, sliced, empty, a scalar.
    fn layouts<B: Backend>(d: &B::Device) -> Vec<(&'static str, FloatTensor<B>)> {
        let values: Vec<f32> = (0..2 * 3 * 4).map(|i| i as f32 * 0.5 - 3.0).collect();
        let base = || B::float_from_data(TensorData::new(values.clone(), [2, 3, 4]), d);
        let f64s = TensorData::new(vec![1.0f64, -2.5, 3.0, 4.0, 5.0, 6.0], [2, 3]);
        let cut = |a: isize, b: isize| burn_std::Slice::new(a, Some(b), 1);
        let all = |n: isize| cut(0, n);
        let scalar = TensorData::new(vec![-0.0f32], Vec::<usize>::new());
        vec![
            ("row-major", base()),
            ("transposed", B::float_swap_dims(base(), 1, 2)),
            ("permuted", B::float_permute(base(), &[2, 0, 1])),
            (
                "a slice",
                B::float_slice(base(), &[all(2), all(3), cut(1, 3)]),
            ),
            (
                "a slice of the first axis",
                B::float_slice(base(), &[cut(1, 2), all(3), all(4)]),
            ),
            (
                "empty",
                B::float_slice(base(), &[all(2), cut(0, 0), all(4)]),
            ),
            ("a scalar", B::float_from_data(scalar, d)),
            (
                "f64, transposed",
                B::float_swap_dims(B::float_from_data(f64s, d), 0, 1),
            ),
        ]
    }

    #[test]
    fn the_ndarray_read_gives_burns_values_in_every_layout() {
        let mut direct = 0;
        for (what, p) in layouts::<NdArray>(&NdArrayDevice::Cpu) {
            // A second handle, as a synced gradient has (Burn keeps its own).
            let held = p.clone();
            let fast = ndarray_host(&p).expect("an NdArray float tensor");
            let burns = burns::<NdArray>(p.clone());
            assert!(fast.bits_eq(&burns), "{what}");
            // Where the values lie in row-major order they are also read where they lie.
            if let Some(there) = with_host_slice(&p, |s| s.to_buffer()) {
                assert!(there.bits_eq(&burns), "{what}, in its own memory");
                direct += 1;
            }
            assert!(
                read_host::<NdArray>(p).expect("reads").bits_eq(&burns),
                "{what}"
            );
            drop(held);
        }
        assert!(direct >= 4, "{direct} tensors read in their own memory");
    }

    /// Flex's row-major tensors are read from their storage, the others through Burn's read;
    /// both give Burn's values, f16 and bf16 included.
    #[test]
    fn the_flex_read_gives_burns_values_in_every_layout() {
        let tensors = flex_tensors();
        let mut direct = 0;
        for (what, p) in tensors {
            let held = p.clone();
            direct += usize::from(with_host_slice(&p, |_| ()).is_some());
            let read = read_host::<Flex>(p.clone()).expect("reads");
            assert!(read.bits_eq(&burns::<Flex>(p)), "{what}");
            drop(held);
        }
        assert!(direct >= 5, "{direct} tensors read from their storage");
    }

    /// [`layouts`] of Flex, and a row-major tensor of each half type.
    fn flex_tensors() -> Vec<(&'static str, burn_flex::FlexTensor)> {
        use burn_backend::ops::FloatTensorOps;
        let mut tensors = layouts::<Flex>(&FlexDevice);
        for (what, dtype) in [
            ("f16", burn_std::FloatDType::F16),
            ("bf16", burn_std::FloatDType::BF16),
        ] {
            let t = <Flex>::float_from_data(
                TensorData::new(vec![1.5f32, -0.25, 3.0, 65504.0, -0.0, 7.0], [2, 3]),
                &FlexDevice,
            );
            tensors.push((what, <Flex>::float_cast(t, dtype)));
        }
        tensors
    }

    #[test]
    fn another_backends_tensor_is_left_to_burn() {
        assert!(ndarray_host(&1.0f32).is_none());
        assert!(with_host_slice(&1.0f32, |_| ()).is_none());
        // An integer tensor of either backend is no gradient.
        let ints = TensorData::new(vec![1i64, 2, 3], [3]);
        use burn_backend::ops::IntTensorOps;
        let n =
            <NdArray as IntTensorOps<NdArray>>::int_from_data(ints.clone(), &NdArrayDevice::Cpu);
        assert!(with_host_slice(&n, |_| ()).is_none());
        let f = <Flex as IntTensorOps<Flex>>::int_from_data(ints, &FlexDevice);
        assert!(with_host_slice(&f, |_| ()).is_none());
    }

    #[test]
    fn an_ndarray_member_is_written_in_place_only_over_memory_nothing_else_shares() {
        writes_in_place_only_over_memory_nothing_else_shares::<NdArray>(
            layouts::<NdArray>(&NdArrayDevice::Cpu),
            |p| match p {
                burn_ndarray::NdArrayTensor::F32(s) => s.view().is_standard_layout(),
                burn_ndarray::NdArrayTensor::F64(s) => s.view().is_standard_layout(),
                _ => false,
            },
            [2, 4],
        );
    }

    #[test]
    fn a_flex_member_is_written_in_place_only_over_memory_nothing_else_shares() {
        // Flex's empty slice keeps its base's strides: not row-major to it.
        let row_major = |p: &burn_flex::FlexTensor| p.layout().contiguous_offsets().is_some();
        writes_in_place_only_over_memory_nothing_else_shares::<Flex>(
            flex_tensors(),
            row_major,
            [5, 5],
        );
    }

    /// A reduced member is written over a tensor's own memory only where that memory is the
    /// tensor's alone and row-major (`row_major`), and the member of its dtype: the tensor then
    /// reads as the member; anywhere else nothing is written, and the tensor (and every handle to
    /// it) reads as before.
    fn writes_in_place_only_over_memory_nothing_else_shares<B: Backend>(
        tensors: Vec<(&'static str, FloatTensor<B>)>,
        row_major: fn(&FloatTensor<B>) -> bool,
        at_least: [usize; 2],
    ) where
        FloatTensor<B>: 'static,
    {
        use crate::codegen::layout::BucketLayout;
        use crate::graph::DType;
        use crate::runtime::{Handed, HostBuffer};
        // Tensors not row-major, and row-major.
        let mut written = [0, 0];
        for (what, p) in tensors {
            let before = burns::<B>(p.clone());
            let n = before.len();
            let dtype = before.dtype();
            // Member 1 of a bucket, behind a member of 3 elements (an offset, alignment padding).
            let layout = BucketLayout::of_sizes(&[3, n as u64], dtype, dtype, None, 16);
            let values: Vec<f64> = (0..layout.numel).map(|i| i as f64 * 0.25 - 7.0).collect();
            let bucket = HostBuffer::from_f64(dtype, &values).unwrap();
            let member = Handed::Member {
                layout: &layout,
                member: 1,
                bucket: &bucket,
            };
            let want = crate::runtime::host::unpack_member(&layout, 1, &bucket).unwrap();
            let row_major = row_major(&p);
            written[usize::from(row_major)] += 1;
            // Shared: a second handle (a gradient some later op still reads).
            let (mut shared, held) = (p.clone(), p.clone());
            assert!(!write_in_place(&mut shared, &member), "{what}: shared");
            assert!(burns::<B>(held).bits_eq(&before), "{what}: shared");
            assert!(burns::<B>(shared).bits_eq(&before), "{what}: shared");
            // A member to cast back (a gradient in a bucket of bf16, or of f16 for a bf16 one).
            let wire = if dtype == DType::BF16 {
                DType::F16
            } else {
                DType::BF16
            };
            let cast = BucketLayout::of_sizes(&[n as u64], dtype, wire, None, 0);
            let narrow = HostBuffer::zeros(wire, n).unwrap();
            let to_cast = Handed::Member {
                layout: &cast,
                member: 0,
                bucket: &narrow,
            };
            let mut alone = p;
            assert!(!write_in_place(&mut alone, &to_cast), "{what}: cast");
            // Alone: written where row-major.
            let wrote = write_in_place(&mut alone, &member);
            assert_eq!(wrote, row_major, "{what}");
            let after = burns::<B>(alone);
            assert!(after.bits_eq(if wrote { &want } else { &before }), "{what}");
        }
        assert!(
            written[0] >= at_least[0] && written[1] >= at_least[1],
            "{written:?} tensors (not row-major, row-major)"
        );
        assert!(!write_in_place(
            &mut 1.0f32,
            &Handed::Grad(Default::default())
        ));
    }
}

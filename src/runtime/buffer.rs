//! Host tensors: a typed flat buffer per gradient or bucket, and the element arithmetic every
//! host path (pack, unpack, the in-process reduction) shares so that they agree bit for bit.

use half::{bf16, f16};

use crate::graph::DType;

/// A float element the host paths handle.
pub trait Element: Copy + Send + Sync + PartialEq + std::fmt::Debug + 'static {
    /// Its graph dtype.
    const DTYPE: DType;
    /// Zero.
    const ZERO: Self;
    /// `self + other`, rounded to this type.
    fn add(self, other: Self) -> Self;
    /// `self * (1 / div)`, the factor rounded to this type's arithmetic first (f32 for the half
    /// types), exactly as the pack kernel and NCCL's average prescale it.
    fn scale_div(self, div: u32) -> Self;
    /// Widening to f64 (exact for every supported type).
    fn to_f64(self) -> f64;
    /// Narrowing from f64, round to nearest even.
    fn from_f64(v: f64) -> Self;
    /// The typed elements of a buffer of this dtype.
    fn slice(b: &HostBuffer) -> Option<&[Self]>;
    /// The typed elements of a buffer of this dtype, mutable.
    fn slice_mut(b: &mut HostBuffer) -> Option<&mut [Self]>;
}

macro_rules! slices {
    ($variant:ident) => {
        fn slice(b: &HostBuffer) -> Option<&[Self]> {
            match b {
                HostBuffer::$variant(v) => Some(v),
                _ => None,
            }
        }
        fn slice_mut(b: &mut HostBuffer) -> Option<&mut [Self]> {
            match b {
                HostBuffer::$variant(v) => Some(v),
                _ => None,
            }
        }
    };
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    const ZERO: Self = 0.0;
    #[inline]
    fn add(self, other: Self) -> Self {
        self + other
    }
    #[inline]
    fn scale_div(self, div: u32) -> Self {
        self * (1.0 / div as f32)
    }
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    slices!(F32);
}

impl Element for f64 {
    const DTYPE: DType = DType::F64;
    const ZERO: Self = 0.0;
    #[inline]
    fn add(self, other: Self) -> Self {
        self + other
    }
    #[inline]
    fn scale_div(self, div: u32) -> Self {
        self * (1.0 / f64::from(div))
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn from_f64(v: f64) -> Self {
        v
    }
    slices!(F64);
}

macro_rules! half_element {
    ($t:ty, $d:expr, $variant:ident) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            const ZERO: Self = <$t>::ZERO;
            #[inline]
            fn add(self, other: Self) -> Self {
                <$t>::from_f32(self.to_f32() + other.to_f32())
            }
            #[inline]
            fn scale_div(self, div: u32) -> Self {
                <$t>::from_f32(self.to_f32() * (1.0 / div as f32))
            }
            #[inline]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            slices!($variant);
        }
    };
}
half_element!(f16, DType::F16, F16);
half_element!(bf16, DType::BF16, BF16);

/// A flat host tensor of one float dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum HostBuffer {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 64-bit floats.
    F64(Vec<f64>),
    /// IEEE half.
    F16(Vec<f16>),
    /// bfloat16.
    BF16(Vec<bf16>),
}

impl Default for HostBuffer {
    fn default() -> Self {
        HostBuffer::F32(Vec::new())
    }
}

/// Host values of one float dtype, borrowed where they lie (a gradient of a CPU backend read in
/// its own memory, or a [`HostBuffer`]'s elements).
#[derive(Clone, Copy, Debug)]
pub enum HostSlice<'a> {
    /// 32-bit floats.
    F32(&'a [f32]),
    /// 64-bit floats.
    F64(&'a [f64]),
    /// IEEE half.
    F16(&'a [f16]),
    /// bfloat16.
    BF16(&'a [bf16]),
}

impl HostSlice<'_> {
    /// Its dtype.
    pub fn dtype(&self) -> DType {
        match self {
            HostSlice::F32(_) => DType::F32,
            HostSlice::F64(_) => DType::F64,
            HostSlice::F16(_) => DType::F16,
            HostSlice::BF16(_) => DType::BF16,
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            HostSlice::F32(v) => v.len(),
            HostSlice::F64(v) => v.len(),
            HostSlice::F16(v) => v.len(),
            HostSlice::BF16(v) => v.len(),
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of its elements.
    pub fn to_buffer(&self) -> HostBuffer {
        match *self {
            HostSlice::F32(v) => HostBuffer::F32(v.to_vec()),
            HostSlice::F64(v) => HostBuffer::F64(v.to_vec()),
            HostSlice::F16(v) => HostBuffer::F16(v.to_vec()),
            HostSlice::BF16(v) => HostBuffer::BF16(v.to_vec()),
        }
    }
}

/// Calls `$body` with `$v` bound to the typed vector inside a [`HostBuffer`].
#[macro_export]
#[doc(hidden)]
macro_rules! with_host_buffer {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            $crate::runtime::HostBuffer::F32($v) => $body,
            $crate::runtime::HostBuffer::F64($v) => $body,
            $crate::runtime::HostBuffer::F16($v) => $body,
            $crate::runtime::HostBuffer::BF16($v) => $body,
        }
    };
}

impl HostBuffer {
    /// A zero-filled buffer, or `None` for a dtype the host paths do not reduce (integers).
    pub fn zeros(dtype: DType, len: usize) -> Option<HostBuffer> {
        Some(match dtype {
            DType::F32 => HostBuffer::F32(vec![0.0; len]),
            DType::F64 => HostBuffer::F64(vec![0.0; len]),
            DType::F16 => HostBuffer::F16(vec![f16::ZERO; len]),
            DType::BF16 => HostBuffer::BF16(vec![bf16::ZERO; len]),
            DType::I32 | DType::I64 | DType::Bool => return None,
        })
    }

    /// A buffer of negative zeros: what a rank that is not the root contributes when a sum
    /// all-reduce serves as a broadcast. `x + (-0.0)` is `x` bit for bit for every `x` that is
    /// not a NaN (both zeros and the infinities included) in every float format and any order
    /// of summation, so the sum is the root's buffer exactly (a NaN stays a NaN); `None` for
    /// integer dtypes.
    pub fn neg_zeros(dtype: DType, len: usize) -> Option<HostBuffer> {
        Some(match dtype {
            DType::F32 => HostBuffer::F32(vec![-0.0; len]),
            DType::F64 => HostBuffer::F64(vec![-0.0; len]),
            DType::F16 => HostBuffer::F16(vec![f16::NEG_ZERO; len]),
            DType::BF16 => HostBuffer::BF16(vec![bf16::NEG_ZERO; len]),
            DType::I32 | DType::I64 | DType::Bool => return None,
        })
    }

    /// Converts f64 values to a buffer of `dtype` (round to nearest even).
    pub fn from_f64(dtype: DType, values: &[f64]) -> Option<HostBuffer> {
        let mut b = HostBuffer::zeros(dtype, values.len())?;
        with_host_buffer!(&mut b, v => {
            for (d, s) in v.iter_mut().zip(values) {
                *d = Element::from_f64(*s);
            }
        });
        Some(b)
    }

    /// `self[i] += other[i]` for every element; `false` (and nothing changed) when the dtypes or
    /// lengths differ.
    pub fn accumulate(&mut self, other: &HostBuffer) -> bool {
        if self.dtype() != other.dtype() || self.len() != other.len() {
            return false;
        }
        fn add<E: Element>(a: &mut HostBuffer, b: &HostBuffer) {
            if let (Some(a), Some(b)) = (E::slice_mut(a), E::slice(b)) {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = x.add(*y);
                }
            }
        }
        match other.dtype() {
            DType::F32 => add::<f32>(self, other),
            DType::F64 => add::<f64>(self, other),
            DType::F16 => add::<f16>(self, other),
            DType::BF16 => add::<bf16>(self, other),
            DType::I32 | DType::I64 | DType::Bool => return false,
        }
        true
    }

    /// Its elements, borrowed.
    pub fn as_host_slice(&self) -> HostSlice<'_> {
        match self {
            HostBuffer::F32(v) => HostSlice::F32(v),
            HostBuffer::F64(v) => HostSlice::F64(v),
            HostBuffer::F16(v) => HostSlice::F16(v),
            HostBuffer::BF16(v) => HostSlice::BF16(v),
        }
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        match self {
            HostBuffer::F32(_) => DType::F32,
            HostBuffer::F64(_) => DType::F64,
            HostBuffer::F16(_) => DType::F16,
            HostBuffer::BF16(_) => DType::BF16,
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        with_host_buffer!(self, v => v.len())
    }

    /// Elements it can hold without allocating.
    pub fn capacity(&self) -> usize {
        with_host_buffer!(self, v => v.capacity())
    }

    /// Makes it `len` elements long, within its capacity when that suffices: the elements it
    /// keeps keep their values, new ones are zeros.
    pub fn resize(&mut self, len: usize) {
        with_host_buffer!(self, v => v.resize(len, Default::default()))
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values widened to f64.
    pub fn to_f64(&self) -> Vec<f64> {
        with_host_buffer!(self, v => v.iter().map(|x| x.to_f64()).collect())
    }

    /// The first element that is NaN or infinite, with its index (without copying the buffer).
    pub fn first_non_finite(&self) -> Option<(usize, f64)> {
        with_host_buffer!(self, v => v
            .iter()
            .enumerate()
            .map(|(i, x)| (i, x.to_f64()))
            .find(|(_, x)| !x.is_finite()))
    }

    /// Bit-exact equality (distinguishes -0.0 from 0.0 and compares NaN payloads).
    pub fn bits_eq(&self, other: &HostBuffer) -> bool {
        match (self, other) {
            (HostBuffer::F32(a), HostBuffer::F32(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            (HostBuffer::F64(a), HostBuffer::F64(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            (HostBuffer::F16(a), HostBuffer::F16(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            (HostBuffer::BF16(a), HostBuffer::BF16(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            _ => false,
        }
    }

    /// A buffer of `dtype` from little-endian bytes (what a device read returns); `None` for a
    /// dtype the host paths do not handle or a length that is not a whole number of elements.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Option<HostBuffer> {
        fn elems<const N: usize, T>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Option<Vec<T>> {
            if !bytes.len().is_multiple_of(N) {
                return None;
            }
            Some(
                bytes
                    .chunks_exact(N)
                    .map(|c| f(c.try_into().unwrap_or([0; N])))
                    .collect(),
            )
        }
        Some(match dtype {
            DType::F32 => HostBuffer::F32(elems(bytes, f32::from_le_bytes)?),
            DType::F64 => HostBuffer::F64(elems(bytes, f64::from_le_bytes)?),
            DType::F16 => HostBuffer::F16(elems(bytes, f16::from_le_bytes)?),
            DType::BF16 => HostBuffer::BF16(elems(bytes, bf16::from_le_bytes)?),
            DType::I32 | DType::I64 | DType::Bool => return None,
        })
    }

    /// The raw bytes, little-endian as in memory.
    pub fn as_bytes(&self) -> &[u8] {
        fn bytes<T>(v: &[T]) -> &[u8] {
            // SAFETY: every element type here is plain old data without padding.
            unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
        }
        with_host_buffer!(self, v => bytes(v))
    }

    /// The raw bytes, writable (every bit pattern is a valid element).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        fn bytes<T>(v: &mut [T]) -> &mut [u8] {
            // SAFETY: every element type here is plain old data without padding, and any bit
            // pattern is a valid value of it.
            unsafe {
                std::slice::from_raw_parts_mut(
                    v.as_mut_ptr().cast::<u8>(),
                    std::mem::size_of_val(v),
                )
            }
        }
        with_host_buffer!(self, v => bytes(v))
    }
}

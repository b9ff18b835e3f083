//! The value types of the graph IR: element types, tensor types, reductions, device groups,
//! the kinds of compute work, and the pack alignment rule. Re-exported by [`super`].
//!
//! This module never touches Burn or devices.

use std::fmt;

use smallvec::SmallVec;

/// Element type of a tensor. Serialized as its text-form name (`f32`, `bf16`, ...).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit IEEE float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// Boolean (a mask of a recorded step; never communicated).
    Bool,
}

impl DType {
    /// Bytes of one element.
    pub fn size(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F64 | DType::I64 => 8,
            DType::Bool => 1,
        }
    }

    /// Whether the type is a floating-point format (castable in a bucket pack).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// The spelling used by the text form (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::Bool => "bool",
        }
    }

    /// A one-byte code for wire formats (the plan agreement, the TCP transport); never 0.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
            DType::F64 => 4,
            DType::I64 => 5,
            DType::I32 => 6,
            DType::Bool => 7,
        }
    }

    /// The dtype of a [`code`](Self::code).
    pub fn from_code(c: u8) -> Option<DType> {
        Some(match c {
            1 => DType::F32,
            2 => DType::F16,
            3 => DType::BF16,
            4 => DType::F64,
            5 => DType::I64,
            6 => DType::I32,
            7 => DType::Bool,
            _ => return None,
        })
    }

    /// Parses the text-form spelling (the serialized form too).
    pub fn from_name(s: &str) -> Option<DType> {
        Some(match s {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            "f64" => DType::F64,
            "i64" => DType::I64,
            "i32" => DType::I32,
            "bool" => DType::Bool,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Shape and element type of one tensor value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first. An empty shape is a scalar.
    pub shape: SmallVec<[u64; 4]>,
}

impl TensorType {
    /// A tensor type from a dtype and dimensions.
    pub fn new(dtype: DType, shape: &[u64]) -> Self {
        TensorType {
            dtype,
            shape: SmallVec::from_slice(shape),
        }
    }

    /// Number of elements (`u64::MAX` when it does not fit: the verifier reports such a type).
    pub fn numel(&self) -> u64 {
        self.checked_numel().unwrap_or(u64::MAX)
    }

    /// Size in bytes (`u64::MAX` when it does not fit: the verifier reports such a type).
    pub fn bytes(&self) -> u64 {
        self.checked_bytes().unwrap_or(u64::MAX)
    }

    /// Number of elements, if it fits in 64 bits.
    pub fn checked_numel(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |a, d| a.checked_mul(*d))
    }

    /// Size in bytes, if it fits in 64 bits.
    pub fn checked_bytes(&self) -> Option<u64> {
        self.checked_numel()?.checked_mul(self.dtype.size())
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The reduction a collective applies across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (sum divided by the group size).
    Mean,
}

impl ReduceOp {
    /// Text-form spelling.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
        }
    }

    /// A one-byte code for wire formats; never 0.
    pub fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Mean => 2,
        }
    }

    /// The op of a [`code`](Self::code).
    pub fn from_code(c: u8) -> Option<ReduceOp> {
        match c {
            1 => Some(ReduceOp::Sum),
            2 => Some(ReduceOp::Mean),
            _ => None,
        }
    }
}

/// A device group a collective runs over; its size is declared in the graph header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(pub u32);

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// Rough class of a compute node, for cost estimates and fusion legality.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ComputeKind {
    /// Elementwise map (add, scale, cast, activation).
    Elementwise,
    /// A reduction over some axes (sum, norm statistics).
    Reduction,
    /// Matrix multiply (linear layers, attention).
    Matmul,
    /// Convolution.
    Conv,
    /// Anything else; never fused.
    Opaque,
}

impl ComputeKind {
    /// Text-form spelling.
    pub fn name(self) -> &'static str {
        match self {
            ComputeKind::Elementwise => "elementwise",
            ComputeKind::Reduction => "reduction",
            ComputeKind::Matmul => "matmul",
            ComputeKind::Conv => "conv",
            ComputeKind::Opaque => "opaque",
        }
    }

    /// Parses the text-form spelling (the serialized form too).
    pub fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "elementwise" => ComputeKind::Elementwise,
            "reduction" => ComputeKind::Reduction,
            "matmul" => ComputeKind::Matmul,
            "conv" => ComputeKind::Conv,
            "opaque" => ComputeKind::Opaque,
            _ => return None,
        })
    }
}

/// The default member alignment of a `bucket_pack`, in bytes: one 128-bit vector load, so
/// vectorized kernels and NCCL see aligned members.
pub const PACK_ALIGN_BYTES: u32 = 16;

/// The largest member alignment a `bucket_pack` may ask for (64 KiB).
pub const MAX_PACK_ALIGN_BYTES: u32 = 1 << 16;

/// Whether `n` bytes is a member alignment a `bucket_pack` may have: a power of two up to
/// [`MAX_PACK_ALIGN_BYTES`].
pub fn pack_align_ok(n: u64) -> bool {
    n.is_power_of_two() && n <= u64::from(MAX_PACK_ALIGN_BYTES)
}

//! The pieces record rules are made of: what is known of an input without running anything
//! ([`Meta`]), what a rule says of a recorded op's result ([`Rule`]), and Burn's shape arithmetic
//! on shapes that may be unknown (`None`: unknown, computed when asked).
//!
//! The rules themselves, one function per lazily recorded op, are in `op_table.rs`.

use burn_std::{DType, Shape};
use smallvec::SmallVec;

use super::lazy::{AnyDevice, Input, Record};
use crate::graph::ComputeKind;

/// What is known of a tensor argument without computing it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Meta {
    /// Its shape, when known.
    pub shape: Option<Shape>,
    /// Its dtype, when known.
    pub dtype: Option<DType>,
}

/// What a rule knows of a recorded op: its result's shape and dtype (`None`: unknown, computed
/// when asked), the kind of work and an estimate of its floating-point operations.
#[derive(Clone, Debug)]
pub(crate) struct Rule {
    /// The result's shape.
    pub shape: Option<Shape>,
    /// The result's dtype.
    pub dtype: Option<DType>,
    /// The kind of work, for the cost model.
    pub kind: ComputeKind,
    /// Estimated floating-point operations.
    pub flops: u64,
}

impl Rule {
    /// An elementwise op with this result: one flop per element.
    pub fn elementwise(shape: Option<Shape>, dtype: Option<DType>) -> Rule {
        let flops = numel(&shape);
        Rule {
            shape,
            dtype,
            kind: ComputeKind::Elementwise,
            flops,
        }
    }

    /// An elementwise op whose result is shaped and typed like `m`.
    pub fn like(m: &Meta) -> Rule {
        Rule::elementwise(m.shape.as_ref().map(copy_shape), m.dtype)
    }

    /// A reduction of `input` to this result: one flop per input element.
    pub fn reduction(shape: Option<Shape>, dtype: Option<DType>, input: &Meta) -> Rule {
        Rule {
            shape,
            dtype,
            kind: ComputeKind::Reduction,
            flops: numel(&input.shape),
        }
    }

    /// A change of layout or view (reshape, permute): no arithmetic.
    pub fn layout(shape: Option<Shape>, dtype: Option<DType>) -> Rule {
        Rule {
            shape,
            dtype,
            kind: ComputeKind::Opaque,
            flops: 0,
        }
    }

    /// The same result with another kind of work and flop estimate.
    pub fn costing(self, kind: ComputeKind, flops: u64) -> Rule {
        Rule {
            kind,
            flops,
            ..self
        }
    }

    /// The record of op `op` on `device` reading nodes `inputs`.
    pub fn record(self, op: &'static str, device: AnyDevice, inputs: Inputs) -> Record {
        Record {
            op,
            kind: self.kind,
            device,
            shape: self.shape,
            dtype: self.dtype,
            inputs: inputs.seqs,
            flops: self.flops,
            drawn: inputs.drawn,
        }
    }
}

/// Broadcast of two shapes.
pub fn broadcast(a: Option<Shape>, b: Option<Shape>) -> Option<Shape> {
    let (a, b) = (a?, b?);
    // The common case, operands of one shape, without building a new one.
    if a == b {
        return Some(a);
    }
    a.broadcast(&b).ok()
}

/// Three-way broadcast (`mask_where`).
pub fn broadcast3(a: Option<Shape>, b: Option<Shape>, c: Option<Shape>) -> Option<Shape> {
    broadcast(broadcast(a, b), c)
}

/// Batched matrix product.
pub fn matmul(a: Option<Shape>, b: Option<Shape>) -> Option<Shape> {
    burn_std::calculate_matmul_output(&a?, &b?).ok()
}

/// `shapes` concatenated along `dim` (unknown when one of them is, or they do not fit).
pub fn cat(shapes: &[Meta], dim: usize) -> Option<Shape> {
    let known: Option<Vec<&Shape>> = shapes.iter().map(|m| m.shape.as_ref()).collect();
    Shape::cat(known?, dim).ok()
}

/// Dims `d1` and `d2` swapped.
pub fn swap(a: Option<Shape>, d1: usize, d2: usize) -> Option<Shape> {
    a?.swapped(d1, d2).ok()
}

/// Dims reordered by `axes`.
pub fn permute(a: Option<Shape>, axes: &[usize]) -> Option<Shape> {
    a?.permuted(axes).ok()
}

/// Dim `dim` reduced to 1.
pub fn reduce_dim(a: Option<Shape>, dim: usize) -> Option<Shape> {
    a?.reduce(dim).ok()
}

/// Dim `dim` of `a` replaced by the length of the one-dimensional `indices`.
pub fn select(a: Option<Shape>, dim: usize, indices: Option<Shape>) -> Option<Shape> {
    let (mut a, indices) = (a?, indices?);
    if indices.num_dims() != 1 || dim >= a.num_dims() {
        return None;
    }
    a[dim] = indices[0];
    Some(a)
}

/// The input and weight shapes of an `N`-d convolution, if both are known and of rank
/// `N + 2`.
fn conv_operands<const N: usize>(
    x: Option<Shape>,
    weight: Option<Shape>,
) -> Option<(Shape, Shape)> {
    let (x, w) = (x?, weight?);
    (x.num_dims() == N + 2 && w.num_dims() == N + 2).then_some((x, w))
}

/// Convolution: `[batch, c_in, spatial..] * [c_out, c_in / groups, kernel..]` gives
/// `[batch, c_out, (size + 2 padding - dilation (kernel - 1) - 1) / stride + 1 ..]`.
pub fn conv<const N: usize>(
    x: Option<Shape>,
    weight: Option<Shape>,
    options: &burn_backend::ops::ConvOptions<N>,
) -> Option<Shape> {
    let (x, w) = conv_operands::<N>(x, weight)?;
    let mut dims = vec![x[0], w[0]];
    for i in 0..N {
        let span = options.dilation[i].checked_mul(w[i + 2].checked_sub(1)?)? + 1;
        let padded = x[i + 2] + 2 * options.padding[i];
        dims.push(padded.checked_sub(span)? / options.stride[i].max(1) + 1);
    }
    Some(Shape::from(dims))
}

/// Transposed convolution: `[batch, c_in, spatial..] * [c_in, c_out / groups, kernel..]`
/// gives `[batch, c_out, (size - 1) stride + dilation (kernel - 1) + padding_out + 1
/// - 2 padding ..]`.
pub fn conv_transpose<const N: usize>(
    x: Option<Shape>,
    weight: Option<Shape>,
    options: &burn_backend::ops::ConvTransposeOptions<N>,
) -> Option<Shape> {
    let (x, w) = conv_operands::<N>(x, weight)?;
    let mut dims = vec![x[0], w[1] * options.groups.max(1)];
    for i in 0..N {
        let full = x[i + 2].checked_sub(1)? * options.stride[i]
            + options.dilation[i] * w[i + 2].checked_sub(1)?
            + options.padding_out[i]
            + 1;
        dims.push(full.checked_sub(2 * options.padding[i])?);
    }
    Some(Shape::from(dims))
}

/// What an op records of its tensor inputs: the nodes among them, and whether any derives
/// from a random draw (then so does the result).
#[derive(Clone, Debug, Default)]
pub(crate) struct Inputs {
    /// The node numbers among the inputs.
    pub seqs: SmallVec<[u64; 3]>,
    /// Whether an input derives from a random draw.
    pub drawn: bool,
}

/// What an op records of its inputs.
pub(crate) fn inputs(inputs: impl IntoIterator<Item = Input>) -> Inputs {
    let mut out = Inputs::default();
    for i in inputs {
        // A push, not `extend`: `SmallVec::extend` costs several times as much per op.
        if let Some(seq) = i.seq {
            out.seqs.push(seq);
        }
        out.drawn |= i.drawn;
    }
    out
}

/// A copy of `s`: the dimensions copied as one block (`Shape::clone` goes element by element
/// through `SmallVec`'s generic `extend`; this runs on every recorded op).
pub(crate) fn copy_shape(s: &Shape) -> Shape {
    Shape::new_raw(smallvec::SmallVec::from_slice(s))
}

/// Elements of a shape (0 when unknown).
pub fn numel(s: &Option<Shape>) -> u64 {
    s.as_ref().map_or(0, |s| s.num_elements() as u64)
}

/// `2 · out · k` for a matrix product whose left operand is `[.., m, k]`.
pub fn matmul_flops(out: &Option<Shape>, lhs: &Option<Shape>) -> u64 {
    let k = lhs.as_ref().and_then(|l| l.last().copied()).unwrap_or(0);
    2 * numel(out) * k as u64
}

/// `2 · elements · (weight elements per output channel)` for a convolution over
/// `elements` outputs (a transposed convolution: inputs) and a weight `[c, c' / g, k..]`.
pub fn conv_flops(elements: &Option<Shape>, weight: &Option<Shape>) -> u64 {
    let per = weight
        .as_ref()
        .map_or(0, |w| w.iter().skip(1).product::<usize>() as u64);
    2 * numel(elements) * per
}

/// A full reduction: one element.
pub fn scalar() -> Option<Shape> {
    Some(Shape::new([1]))
}

/// The last two dims swapped (`transpose`).
pub fn transpose(a: Option<Shape>) -> Option<Shape> {
    let a = a?;
    let n = a.num_dims();
    if n < 2 {
        return None;
    }
    a.swapped(n - 2, n - 1).ok()
}

/// `[.., k] · [k, n]` gives `[.., n]` (`linear`, whose weight is `[d_input, d_output]`).
pub fn linear(x: Option<Shape>, weight: Option<Shape>) -> Option<Shape> {
    let (mut x, w) = (x?, weight?);
    let last = x.num_dims().checked_sub(1)?;
    if w.num_dims() != 2 || x[last] != w[0] {
        return None;
    }
    x[last] = w[1];
    Some(x)
}

/// The input of a transposed convolution, from its output gradient and weight: the shape whose
/// transposed convolution has `out`'s spatial size (`conv_transpose*_x_backward`).
pub fn conv_transpose_input<const N: usize>(
    out: Option<Shape>,
    weight: Option<Shape>,
    options: &burn_backend::ops::ConvTransposeOptions<N>,
) -> Option<Shape> {
    let (o, w) = conv_operands::<N>(out, weight)?;
    let mut dims = vec![o[0], w[0]];
    for i in 0..N {
        let span = options.dilation[i] * w[i + 2].checked_sub(1)? + options.padding_out[i] + 1;
        let full = (o[i + 2] + 2 * options.padding[i]).checked_sub(span)?;
        dims.push(full / options.stride[i].max(1) + 1);
    }
    Some(Shape::from(dims))
}

/// `indices`' shape with the embedding width (`weights`' last dim) appended.
pub fn embedding(weights: Option<Shape>, indices: Option<Shape>) -> Option<Shape> {
    let (w, i) = (weights?, indices?);
    let mut dims: Vec<usize> = i.iter().copied().collect();
    dims.push(*w.last()?);
    Some(Shape::from(dims))
}

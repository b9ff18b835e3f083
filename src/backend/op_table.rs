//! The record rules: one function per op that `Collective<I>` records lazily instead of running
//! at once. This table is the source of truth: `scripts/gen_backend_ops.py` makes every op
//! named here a recorded node in `ops.rs`, and every other op of Burn's traits an eager call of
//! the inner backend (CI fails when `ops.rs` is stale).
//!
//! A rule gets what is known of each tensor argument ([`Meta`], by value; `Option<Meta>` for an
//! optional tensor) and a reference to every other argument, in the op's own order, and says
//! what the result will be ([`Rule`]): its shape and dtype when they can be known without running
//! anything (`None` otherwise: asking then forces the node), its kind of work and flops (what the
//! step graph and the cost model see). Debug builds check every rule against the tensor the
//! inner backend computed.
//!
//! To record a new op lazily: add its function here (the op's Burn name, its arguments as
//! above), run `scripts/gen_backend_ops.py`, and test its result against the inner backend.

#![allow(clippy::ptr_arg)]

use burn_backend::ops::{ConvOptions, ConvTransposeOptions};
use burn_backend::{Scalar, TensorData};
use burn_std::{BoolDType, DType, FloatDType, IntDType, Shape, Slice, SliceOps};
use core::ops::Range;

use super::rules::{self, Meta, Rule};
use crate::graph::ComputeKind;

// Creation of filled tensors: recorded like any op, so that they reach the inner backend in
// program order, where a fusing backend fuses a fill with the ops after it as it does without
// `Collective` (run at once, a fill would reach it before the queued ops it follows).

/// A tensor of `shape` and `dtype` filled with one value.
fn fill(shape: &Shape, dtype: DType) -> Rule {
    Rule::elementwise(Some(shape.clone()), Some(dtype))
}

pub(crate) fn float_zeros<D>(shape: &Shape, _device: &D, dtype: &FloatDType) -> Rule {
    fill(shape, (*dtype).into())
}

pub(crate) fn float_ones<D>(shape: &Shape, _device: &D, dtype: &FloatDType) -> Rule {
    fill(shape, (*dtype).into())
}

pub(crate) fn float_full<D>(
    shape: &Shape,
    _fill_value: &Scalar,
    _device: &D,
    dtype: &FloatDType,
) -> Rule {
    fill(shape, (*dtype).into())
}

pub(crate) fn int_zeros<D>(shape: &Shape, _device: &D, dtype: &IntDType) -> Rule {
    fill(shape, (*dtype).into())
}

pub(crate) fn int_ones<D>(shape: &Shape, _device: &D, dtype: &IntDType) -> Rule {
    fill(shape, (*dtype).into())
}

pub(crate) fn int_full<D>(
    shape: &Shape,
    _fill_value: &Scalar,
    _device: &D,
    dtype: &IntDType,
) -> Rule {
    fill(shape, (*dtype).into())
}

pub(crate) fn bool_zeros<D>(shape: &Shape, _device: &D, dtype: &BoolDType) -> Rule {
    fill(shape, (*dtype).into())
}

pub(crate) fn bool_ones<D>(shape: &Shape, _device: &D, dtype: &BoolDType) -> Rule {
    fill(shape, (*dtype).into())
}

/// The integers of `range` from its start, `step` (not 0) apart: as many as
/// `range.step_by(step)` yields, Burn's own arithmetic.
fn arange(range: &Range<i64>, step: usize, dtype: &IntDType) -> Rule {
    let span = range.end.saturating_sub(range.start).max(0) as u64;
    let len = span.div_ceil(step as u64) as usize;
    Rule::elementwise(Some(Shape::new([len])), Some((*dtype).into()))
}

pub(crate) fn int_arange<D>(range: &Range<i64>, _device: &D, dtype: &IntDType) -> Rule {
    arange(range, 1, dtype)
}

pub(crate) fn int_arange_step<D>(
    range: &Range<i64>,
    step: &usize,
    _device: &D,
    dtype: &IntDType,
) -> Rule {
    // Burn's backends panic on a step of 0 when called; recorded, the op would run later or
    // never, so the call panics here, as without `Collective`.
    assert!(*step > 0, "int_arange_step: a step of 0 over {range:?}");
    arange(range, *step, dtype)
}

// Tensors made from host data (float, int and bool): recorded for the same reason (the data is
// kept until the node runs). Run at once, an upload reached the inner backend ahead of the ops
// queued before it, and Burn 0.21's fusion layer computed some such orders wrong or panicked
// where the same ops in program order were right (`docs/burn.md`, random programs): a float
// upload made a `select` after an `argmax` pick the wrong index; an index upload ahead of an
// `exp` made its fuser panic; a mask upload gave wrong values.

pub(crate) fn float_from_data<D>(data: &TensorData, _device: &D) -> Rule {
    fill(&data.shape, data.dtype)
}

pub(crate) fn int_from_data<D>(data: &TensorData, _device: &D) -> Rule {
    fill(&data.shape, data.dtype)
}

pub(crate) fn bool_from_data<D>(data: &TensorData, _device: &D) -> Rule {
    fill(&data.shape, data.dtype)
}

// Elementwise, shaped like the input.

pub(crate) fn float_recip(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_exp(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_log(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_log1p(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_sqrt(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_abs(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_cos(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_sin(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_tan(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_cosh(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_sinh(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_tanh(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_acos(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_acosh(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_asin(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_asinh(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_atan(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_atanh(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_round(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_floor(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_ceil(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_trunc(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_erf(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_neg(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_sign(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_add_scalar(lhs: Meta, _rhs: &Scalar) -> Rule {
    Rule::like(&lhs)
}

pub(crate) fn float_sub_scalar(lhs: Meta, _rhs: &Scalar) -> Rule {
    Rule::like(&lhs)
}

pub(crate) fn float_mul_scalar(lhs: Meta, _rhs: &Scalar) -> Rule {
    Rule::like(&lhs)
}

pub(crate) fn float_div_scalar(lhs: Meta, _rhs: &Scalar) -> Rule {
    Rule::like(&lhs)
}

pub(crate) fn float_remainder_scalar(lhs: Meta, _rhs: &Scalar) -> Rule {
    Rule::like(&lhs)
}

pub(crate) fn float_powi_scalar(lhs: Meta, _rhs: &Scalar) -> Rule {
    Rule::like(&lhs)
}

pub(crate) fn float_powi_scalar_impl(lhs: Meta, _rhs: &Scalar) -> Rule {
    Rule::like(&lhs)
}

pub(crate) fn float_powf_scalar(tensor: Meta, _value: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_powf_scalar_impl(tensor: Meta, _value: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_clamp_min(tensor: Meta, _min: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_clamp_max(tensor: Meta, _max: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_clamp(tensor: Meta, _min: &Scalar, _max: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_cumsum(tensor: Meta, _dim: &usize) -> Rule {
    Rule::like(&tensor).costing(ComputeKind::Reduction, rules::numel(&tensor.shape))
}

pub(crate) fn float_cumprod(tensor: Meta, _dim: &usize) -> Rule {
    Rule::like(&tensor).costing(ComputeKind::Reduction, rules::numel(&tensor.shape))
}

pub(crate) fn float_mask_fill(tensor: Meta, _mask: Meta, _value: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_mask_where(tensor: Meta, mask: Meta, value: Meta) -> Rule {
    Rule::elementwise(
        rules::broadcast3(tensor.shape, mask.shape, value.shape),
        tensor.dtype,
    )
}

pub(crate) fn float_cast(tensor: Meta, dtype: &FloatDType) -> Rule {
    Rule::elementwise(tensor.shape, Some(DType::from(*dtype)))
}

// Elementwise on two operands, broadcast.

pub(crate) fn float_add(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

pub(crate) fn float_sub(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

pub(crate) fn float_mul(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

pub(crate) fn float_div(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

pub(crate) fn float_remainder(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

pub(crate) fn float_powf(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

pub(crate) fn float_atan2(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

pub(crate) fn float_powi(lhs: Meta, rhs: Meta) -> Rule {
    Rule::elementwise(rules::broadcast(lhs.shape, rhs.shape), lhs.dtype)
}

// Comparisons: a bool tensor of the dtype asked for.

pub(crate) fn float_equal(lhs: Meta, rhs: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(
        rules::broadcast(lhs.shape, rhs.shape),
        Some(DType::from(*out_dtype)),
    )
}

pub(crate) fn float_equal_elem(lhs: Meta, _rhs: &Scalar, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(lhs.shape, Some(DType::from(*out_dtype)))
}

pub(crate) fn float_not_equal(lhs: Meta, rhs: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(
        rules::broadcast(lhs.shape, rhs.shape),
        Some(DType::from(*out_dtype)),
    )
}

pub(crate) fn float_not_equal_elem(lhs: Meta, _rhs: &Scalar, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(lhs.shape, Some(DType::from(*out_dtype)))
}

pub(crate) fn float_greater(lhs: Meta, rhs: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(
        rules::broadcast(lhs.shape, rhs.shape),
        Some(DType::from(*out_dtype)),
    )
}

pub(crate) fn float_greater_elem(lhs: Meta, _rhs: &Scalar, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(lhs.shape, Some(DType::from(*out_dtype)))
}

pub(crate) fn float_greater_equal(lhs: Meta, rhs: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(
        rules::broadcast(lhs.shape, rhs.shape),
        Some(DType::from(*out_dtype)),
    )
}

pub(crate) fn float_greater_equal_elem(lhs: Meta, _rhs: &Scalar, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(lhs.shape, Some(DType::from(*out_dtype)))
}

pub(crate) fn float_lower(lhs: Meta, rhs: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(
        rules::broadcast(lhs.shape, rhs.shape),
        Some(DType::from(*out_dtype)),
    )
}

pub(crate) fn float_lower_elem(lhs: Meta, _rhs: &Scalar, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(lhs.shape, Some(DType::from(*out_dtype)))
}

pub(crate) fn float_lower_equal(lhs: Meta, rhs: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(
        rules::broadcast(lhs.shape, rhs.shape),
        Some(DType::from(*out_dtype)),
    )
}

pub(crate) fn float_lower_equal_elem(lhs: Meta, _rhs: &Scalar, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(lhs.shape, Some(DType::from(*out_dtype)))
}

pub(crate) fn float_is_nan(tensor: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(tensor.shape, Some(DType::from(*out_dtype)))
}

pub(crate) fn float_is_inf(tensor: Meta, out_dtype: &BoolDType) -> Rule {
    Rule::elementwise(tensor.shape, Some(DType::from(*out_dtype)))
}

// Layout: no arithmetic.

/// Recorded (its node lives on the target device and rank), so that the optimizer's move of
/// every gradient to its parameter's device, usually where it already is, does not run the queue.
pub(crate) fn float_to_device<D>(tensor: Meta, _device: &D) -> Rule {
    Rule::layout(tensor.shape, tensor.dtype)
}

pub(crate) fn int_to_device<D>(tensor: Meta, _device: &D) -> Rule {
    Rule::layout(tensor.shape, tensor.dtype)
}

pub(crate) fn bool_to_device<D>(tensor: Meta, _device: &D) -> Rule {
    Rule::layout(tensor.shape, tensor.dtype)
}

pub(crate) fn float_swap_dims(tensor: Meta, dim1: &usize, dim2: &usize) -> Rule {
    Rule::layout(rules::swap(tensor.shape, *dim1, *dim2), tensor.dtype)
}

pub(crate) fn float_transpose(tensor: Meta) -> Rule {
    Rule::layout(rules::transpose(tensor.shape), tensor.dtype)
}

pub(crate) fn float_permute(tensor: Meta, axes: &[usize]) -> Rule {
    Rule::layout(rules::permute(tensor.shape, axes), tensor.dtype)
}

pub(crate) fn float_reshape(tensor: Meta, shape: &Shape) -> Rule {
    Rule::layout(Some(shape.clone()), tensor.dtype)
}

// Index and mask tensors are most often reshaped right after their upload (an embedding's
// tokens, a loss's targets); recorded, the reshape does not run the queue the upload is in.

pub(crate) fn int_reshape(tensor: Meta, shape: &Shape) -> Rule {
    Rule::layout(Some(shape.clone()), tensor.dtype)
}

pub(crate) fn bool_reshape(tensor: Meta, shape: &Shape) -> Rule {
    Rule::layout(Some(shape.clone()), tensor.dtype)
}

pub(crate) fn float_expand(tensor: Meta, shape: &Shape) -> Rule {
    Rule::layout(Some(shape.clone()), tensor.dtype)
}

/// A copy of the part `slices` selects (Burn's `Tensor` checks them before the backend sees
/// them; a shape the slices do not fit is left unknown, computed when asked).
pub(crate) fn float_slice(tensor: Meta, slices: &[Slice]) -> Rule {
    let shape = tensor.shape.and_then(|s| s.slice(slices).ok());
    Rule::layout(shape, tensor.dtype)
}

/// `tensor` with the part `slices` selects replaced by `value`: shaped like `tensor`.
pub(crate) fn float_slice_assign(tensor: Meta, _slices: &[Slice], _value: Meta) -> Rule {
    Rule::layout(tensor.shape, tensor.dtype)
}

/// `tensors` end to end along `dim`, typed like the first.
pub(crate) fn float_cat(tensors: Vec<Meta>, dim: &usize) -> Rule {
    let dtype = tensors.first().and_then(|m| m.dtype);
    Rule::layout(rules::cat(&tensors, *dim), dtype)
}

// Reductions.

pub(crate) fn float_sum(tensor: Meta) -> Rule {
    Rule::reduction(rules::scalar(), tensor.dtype, &tensor)
}

pub(crate) fn float_mean(tensor: Meta) -> Rule {
    Rule::reduction(rules::scalar(), tensor.dtype, &tensor)
}

pub(crate) fn float_prod(tensor: Meta) -> Rule {
    Rule::reduction(rules::scalar(), tensor.dtype, &tensor)
}

pub(crate) fn float_max(tensor: Meta) -> Rule {
    Rule::reduction(rules::scalar(), tensor.dtype, &tensor)
}

pub(crate) fn float_min(tensor: Meta) -> Rule {
    Rule::reduction(rules::scalar(), tensor.dtype, &tensor)
}

pub(crate) fn float_max_abs(tensor: Meta) -> Rule {
    Rule::reduction(rules::scalar(), tensor.dtype, &tensor)
}

pub(crate) fn float_sum_dim(tensor: Meta, dim: &usize) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        tensor.dtype,
        &tensor,
    )
}

pub(crate) fn float_mean_dim(tensor: Meta, dim: &usize) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        tensor.dtype,
        &tensor,
    )
}

pub(crate) fn float_prod_dim(tensor: Meta, dim: &usize) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        tensor.dtype,
        &tensor,
    )
}

pub(crate) fn float_max_dim(tensor: Meta, dim: &usize) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        tensor.dtype,
        &tensor,
    )
}

pub(crate) fn float_min_dim(tensor: Meta, dim: &usize) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        tensor.dtype,
        &tensor,
    )
}

pub(crate) fn float_max_abs_dim(tensor: Meta, dim: &usize) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        tensor.dtype,
        &tensor,
    )
}

pub(crate) fn float_argmax(tensor: Meta, dim: &usize, out_dtype: &IntDType) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        Some(DType::from(*out_dtype)),
        &tensor,
    )
}

pub(crate) fn float_argmin(tensor: Meta, dim: &usize, out_dtype: &IntDType) -> Rule {
    Rule::reduction(
        rules::reduce_dim(tensor.shape.clone(), *dim),
        Some(DType::from(*out_dtype)),
        &tensor,
    )
}

// Indexing: cross-entropy's gather, embeddings' select, and their backward.

pub(crate) fn float_gather(_dim: &usize, tensor: Meta, indices: Meta) -> Rule {
    Rule::elementwise(indices.shape, tensor.dtype)
}

pub(crate) fn float_scatter_add(_dim: &usize, tensor: Meta, _indices: Meta, _value: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn float_select(tensor: Meta, dim: &usize, indices: Meta) -> Rule {
    Rule::elementwise(
        rules::select(tensor.shape, *dim, indices.shape),
        tensor.dtype,
    )
}

pub(crate) fn float_select_add(tensor: Meta, _dim: &usize, _indices: Meta, _value: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn embedding(weights: Meta, indices: Meta) -> Rule {
    Rule::elementwise(
        rules::embedding(weights.shape, indices.shape),
        weights.dtype,
    )
}

pub(crate) fn embedding_backward(weights: Meta, output_grad: Meta, _indices: Meta) -> Rule {
    Rule::like(&weights).costing(ComputeKind::Elementwise, rules::numel(&output_grad.shape))
}

// Matrix products.

pub(crate) fn float_matmul(lhs: Meta, rhs: Meta) -> Rule {
    let shape = rules::matmul(lhs.shape.clone(), rhs.shape);
    let flops = rules::matmul_flops(&shape, &lhs.shape);
    Rule::elementwise(shape, lhs.dtype).costing(ComputeKind::Matmul, flops)
}

pub(crate) fn linear(x: Meta, weight: Meta, _bias: Option<Meta>) -> Rule {
    let shape = rules::linear(x.shape.clone(), weight.shape);
    let flops = rules::matmul_flops(&shape, &x.shape);
    Rule::elementwise(shape, x.dtype).costing(ComputeKind::Matmul, flops)
}

pub(crate) fn linear_x_backward(weight: Meta, output_grad: Meta) -> Rule {
    let shape = rules::linear(output_grad.shape.clone(), rules::transpose(weight.shape));
    let flops = rules::matmul_flops(&shape, &output_grad.shape);
    Rule::elementwise(shape, output_grad.dtype).costing(ComputeKind::Matmul, flops)
}

pub(crate) fn linear_weight_backward(x: Meta, output_grad: Meta) -> Rule {
    let shape = match (&x.shape, &output_grad.shape) {
        (Some(x), Some(g)) => Some(Shape::new([
            *x.last().unwrap_or(&0),
            *g.last().unwrap_or(&0),
        ])),
        _ => None,
    };
    let flops = rules::matmul_flops(&output_grad.shape, &x.shape);
    Rule::elementwise(shape, x.dtype).costing(ComputeKind::Matmul, flops)
}

pub(crate) fn linear_bias_backward(output_grad: Meta) -> Rule {
    let shape = output_grad
        .shape
        .as_ref()
        .and_then(|g| g.last())
        .map(|n| Shape::new([*n]));
    Rule::reduction(shape, output_grad.dtype, &output_grad)
}

// Convolutions: the forward pass and the gradients of input, weight and bias, the same rules
// for 1, 2 and 3 spatial dimensions. The generator reads the names in each `conv_rules!` line
// as rules of this table, as it reads every `pub(crate) fn` above.

macro_rules! conv_rules {
    ($n:literal: $conv:ident, $conv_x:ident, $conv_w:ident, $conv_b:ident,
     $tr:ident, $tr_x:ident, $tr_w:ident, $tr_b:ident) => {
        pub(crate) fn $conv(
            x: Meta,
            weight: Meta,
            _bias: Option<Meta>,
            options: &ConvOptions<$n>,
        ) -> Rule {
            let shape = rules::conv(x.shape, weight.shape.clone(), options);
            let flops = rules::conv_flops(&shape, &weight.shape);
            Rule::elementwise(shape, x.dtype).costing(ComputeKind::Conv, flops)
        }

        pub(crate) fn $conv_x(
            x: Meta,
            weight: Meta,
            output_grad: Meta,
            _options: &ConvOptions<$n>,
        ) -> Rule {
            let flops = rules::conv_flops(&output_grad.shape, &weight.shape);
            Rule::like(&x).costing(ComputeKind::Conv, flops)
        }

        pub(crate) fn $conv_w(
            _x: Meta,
            weight: Meta,
            output_grad: Meta,
            _options: &ConvOptions<$n>,
        ) -> Rule {
            let flops = rules::conv_flops(&output_grad.shape, &weight.shape);
            Rule::like(&weight).costing(ComputeKind::Conv, flops)
        }

        pub(crate) fn $conv_b(x: Meta, bias: Meta, output_grad: Meta) -> Rule {
            conv_bias_backward(x, bias, output_grad)
        }

        pub(crate) fn $tr(
            x: Meta,
            weight: Meta,
            _bias: Option<Meta>,
            options: &ConvTransposeOptions<$n>,
        ) -> Rule {
            let flops = rules::conv_flops(&x.shape, &weight.shape);
            let shape = rules::conv_transpose(x.shape, weight.shape, options);
            Rule::elementwise(shape, x.dtype).costing(ComputeKind::Conv, flops)
        }

        pub(crate) fn $tr_x(
            weight: Meta,
            output_grad: Meta,
            options: &ConvTransposeOptions<$n>,
        ) -> Rule {
            let shape =
                rules::conv_transpose_input(output_grad.shape, weight.shape.clone(), options);
            let flops = rules::conv_flops(&shape, &weight.shape);
            Rule::elementwise(shape, output_grad.dtype).costing(ComputeKind::Conv, flops)
        }

        pub(crate) fn $tr_w(
            x: Meta,
            weight: Meta,
            _output_grad: Meta,
            _options: &ConvTransposeOptions<$n>,
        ) -> Rule {
            let flops = rules::conv_flops(&x.shape, &weight.shape);
            Rule::like(&weight).costing(ComputeKind::Conv, flops)
        }

        pub(crate) fn $tr_b(x: Meta, bias: Meta, output_grad: Meta) -> Rule {
            conv_bias_backward(x, bias, output_grad)
        }
    };
}

/// The bias gradient of every convolution: the output gradient summed to the bias's shape.
fn conv_bias_backward(_x: Meta, bias: Meta, output_grad: Meta) -> Rule {
    Rule::reduction(bias.shape.clone(), bias.dtype, &output_grad)
}

#[rustfmt::skip]
conv_rules!(1: conv1d, conv1d_x_backward, conv1d_weight_backward, conv1d_bias_backward,
    conv_transpose1d, conv_transpose1d_x_backward, conv_transpose1d_weight_backward,
    conv_transpose1d_bias_backward);
#[rustfmt::skip]
conv_rules!(2: conv2d, conv2d_x_backward, conv2d_weight_backward, conv2d_bias_backward,
    conv_transpose2d, conv_transpose2d_x_backward, conv_transpose2d_weight_backward,
    conv_transpose2d_bias_backward);
#[rustfmt::skip]
conv_rules!(3: conv3d, conv3d_x_backward, conv3d_weight_backward, conv3d_bias_backward,
    conv_transpose3d, conv_transpose3d_x_backward, conv_transpose3d_weight_backward,
    conv_transpose3d_bias_backward);

// Normalization and activations: one node calling the inner backend's own kernel.

pub(crate) fn layer_norm(tensor: Meta, _gamma: Meta, _beta: Option<Meta>, _epsilon: &f64) -> Rule {
    Rule::reduction(tensor.shape.clone(), tensor.dtype, &tensor)
}

pub(crate) fn relu(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn gelu(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn sigmoid(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn log_sigmoid(tensor: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn leaky_relu(tensor: Meta, _negative_slope: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn hard_sigmoid(tensor: Meta, _alpha: &Scalar, _beta: &Scalar) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn prelu(tensor: Meta, _alpha: Meta) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn softmax(tensor: Meta, _dim: &usize) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn log_softmax(tensor: Meta, _dim: &usize) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn softmin(tensor: Meta, _dim: &usize) -> Rule {
    Rule::like(&tensor)
}

pub(crate) fn relu_backward(output: Meta, _grad: Meta) -> Rule {
    Rule::like(&output)
}

pub(crate) fn sigmoid_backward(output: Meta, _grad: Meta) -> Rule {
    Rule::like(&output)
}

pub(crate) fn gelu_backward(x: Meta, _grad: Meta) -> Rule {
    Rule::like(&x)
}

pub(crate) fn log_sigmoid_backward(x: Meta, _grad: Meta) -> Rule {
    Rule::like(&x)
}

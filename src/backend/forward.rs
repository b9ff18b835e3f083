//! What the generated `ops/` calls to pass an op through to the inner backend: the log entry of
//! an eager op, and the conversions of Burn's compound arguments and results (tensor enums,
//! transactions, pooling and backward structs) between `Collective<I>` and `I`.

use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitive,
};
use burn_backend::{Backend, TensorPrimitive};
use std::sync::Arc;

use super::lazy::{AnyDevice, Record};
use super::rules::Inputs;
use super::{CTensor, Collective};
use crate::graph::ComputeKind;

/// The log entry of an op that ran eagerly on tensors: its result joins the step graph as an
/// `opaque` node after the nodes it read, so the graph stays connected through it.
#[derive(Clone)]
pub(crate) struct Eager {
    op: &'static str,
    inputs: Inputs,
}

impl Eager {
    /// Op `op`, which read `inputs`.
    pub fn new(op: &'static str, inputs: Inputs) -> Self {
        Eager { op, inputs }
    }

    fn log<P: burn_backend::TensorMetadata + Clone + Send + 'static>(
        self,
        rank: u32,
        device: AnyDevice,
        p: P,
    ) -> CTensor<P> {
        let rec = Record {
            op: self.op,
            kind: ComputeKind::Opaque,
            device,
            shape: None,
            dtype: None,
            inputs: self.inputs.seqs,
            flops: 0,
            drawn: self.inputs.drawn,
        };
        CTensor::eager(rank, rec, p)
    }

    /// A float result, logged.
    pub fn float<I: Backend>(
        self,
        rank: u32,
        p: I::FloatTensorPrimitive,
    ) -> CTensor<I::FloatTensorPrimitive> {
        let device: AnyDevice = Arc::new(I::float_device(&p));
        self.log(rank, device, p)
    }

    /// An int result, logged.
    pub fn int<I: Backend>(
        self,
        rank: u32,
        p: I::IntTensorPrimitive,
    ) -> CTensor<I::IntTensorPrimitive> {
        let device: AnyDevice = Arc::new(I::int_device(&p));
        self.log(rank, device, p)
    }

    /// A bool result, logged.
    pub fn bool<I: Backend>(
        self,
        rank: u32,
        p: I::BoolTensorPrimitive,
    ) -> CTensor<I::BoolTensorPrimitive> {
        let device: AnyDevice = Arc::new(I::bool_device(&p));
        self.log(rank, device, p)
    }
}

/// The rank of the first tensor of a list (rank 0 for an empty list, which Burn refuses before
/// it reaches a backend).
pub(crate) fn rank_of<P>(tensors: &[CTensor<P>]) -> u32 {
    tensors.first().map_or(0, |t| t.rank)
}

/// The device handle of a recorded op over a list of tensors: its first tensor's. An empty list
/// has none (Burn's `Tensor::cat` refuses one; the inner backend's op, run when the result is
/// needed, fails as it would have at once).
pub(crate) fn first_device<P: Clone + Send + 'static, D: Send + Sync + 'static>(
    tensors: &[CTensor<P>],
    of: impl FnOnce(&P) -> D,
) -> super::lazy::AnyDevice {
    match tensors.first() {
        Some(t) => t.device_handle(of),
        None => std::sync::Arc::new(()),
    }
}

/// The rank of a float or quantized tensor.
pub(crate) fn primitive_rank<I: Backend>(t: &TensorPrimitive<Collective<I>>) -> u32 {
    match t {
        TensorPrimitive::Float(t) => t.rank,
        TensorPrimitive::QFloat(t) => t.rank,
    }
}

/// The inner backend's float or quantized tensor, forced for `why`.
pub(crate) fn primitive_inner<I: Backend>(
    t: TensorPrimitive<Collective<I>>,
    why: &'static str,
) -> TensorPrimitive<I> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(t.into_inner_for(why)),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t.into_inner_for(why)),
    }
}

/// The inner backend's float or quantized result on `rank`.
pub(crate) fn primitive<I: Backend>(
    t: TensorPrimitive<I>,
    rank: u32,
) -> TensorPrimitive<Collective<I>> {
    match t {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(CTensor::new(t, rank)),
        TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(CTensor::new(t, rank)),
    }
}

/// A transaction of the inner backend reading the same tensors (forced), so the inner backend
/// batches the reads its own way.
pub(crate) fn transaction<I: Backend>(
    t: TransactionPrimitive<Collective<I>>,
) -> TransactionPrimitive<I> {
    const WHY: &str = "tr_execute";
    TransactionPrimitive::new(
        t.read_floats
            .into_iter()
            .map(|t| t.into_inner_for(WHY))
            .collect(),
        t.read_qfloats
            .into_iter()
            .map(|t| t.into_inner_for(WHY))
            .collect(),
        t.read_ints
            .into_iter()
            .map(|t| t.into_inner_for(WHY))
            .collect(),
        t.read_bools
            .into_iter()
            .map(|t| t.into_inner_for(WHY))
            .collect(),
    )
}

pub(crate) fn max_pool_with_indices_1d<I: Backend>(
    r: MaxPool1dWithIndices<I>,
    rank: u32,
) -> MaxPool1dWithIndices<Collective<I>> {
    MaxPool1dWithIndices::new(CTensor::new(r.output, rank), CTensor::new(r.indices, rank))
}

pub(crate) fn max_pool_backward_1d<I: Backend>(
    r: MaxPool1dBackward<I>,
    rank: u32,
) -> MaxPool1dBackward<Collective<I>> {
    MaxPool1dBackward::new(CTensor::new(r.x_grad, rank))
}

pub(crate) fn max_pool_with_indices_2d<I: Backend>(
    r: MaxPool2dWithIndices<I>,
    rank: u32,
) -> MaxPool2dWithIndices<Collective<I>> {
    MaxPool2dWithIndices::new(CTensor::new(r.output, rank), CTensor::new(r.indices, rank))
}

pub(crate) fn max_pool_backward_2d<I: Backend>(
    r: MaxPool2dBackward<I>,
    rank: u32,
) -> MaxPool2dBackward<Collective<I>> {
    MaxPool2dBackward::new(CTensor::new(r.x_grad, rank))
}

pub(crate) fn deform_conv2d_backward<I: Backend>(
    r: DeformConv2dBackward<I>,
    rank: u32,
) -> DeformConv2dBackward<Collective<I>> {
    DeformConv2dBackward::new(
        CTensor::new(r.x_grad, rank),
        CTensor::new(r.offset_grad, rank),
        CTensor::new(r.weight_grad, rank),
        r.mask_grad.map(|t| CTensor::new(t, rank)),
        r.bias_grad.map(|t| CTensor::new(t, rank)),
    )
}

//! Builds the backward graph of one training step from a model profile.
//!
//! The graph is what recording the step would give: an `input "loss.grad"`, then one backward
//! `compute` node per layer in reverse forward order (each reads the previous one, its cost the
//! layer's `bwd_flops` times the batch), and per parameter a `gradient` (reading the backward of the
//! layer that makes it final) and a `grad_sync` in the profile's measured gradient-ready order. A
//! `sync` node reads every `grad_sync`. Node positions follow the ready order, so the printed
//! schedule interleaves gradients with the compute that produces them, as a real backward does.

use super::{ComputeKind, Graph, GroupId, NodeId, Op, ReduceOp, TensorType, Value};
use crate::model::ModelProfile;

/// Options for [`build_step_graph`].
#[derive(Clone, Copy, Debug)]
pub struct BuildOptions {
    /// Ranks in the data-parallel group.
    pub world: u32,
    /// Samples per rank; multiplies the profile's per-sample FLOPs and activation shapes.
    pub batch: u64,
    /// How gradients are reduced.
    pub reduce: ReduceOp,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            world: 8,
            batch: 8,
            reduce: ReduceOp::Mean,
        }
    }
}

fn compute_kind(layer_type: &str) -> ComputeKind {
    match layer_type {
        "Linear" | "Conv1D" | "Embedding" => ComputeKind::Matmul,
        t if t.starts_with("MultiheadAttention") => ComputeKind::Matmul,
        "Conv2d" => ComputeKind::Conv,
        t if t.contains("Norm") => ComputeKind::Reduction,
        _ => ComputeKind::Elementwise,
    }
}

/// `shape` at `batch` samples (saturating: a profile checks its shapes at load, and a type too
/// large for 64 bits is one the verifier reports).
fn batched(shape: &[u64], batch: u64) -> Vec<u64> {
    let mut s = shape.to_vec();
    if let Some(first) = s.first_mut() {
        *first = first.saturating_mul(batch);
    }
    s
}

/// Emits backward compute nodes for layers `next` down to `to`, chaining each to `prev`.
fn emit_down_to(
    g: &mut Graph,
    compute: &mut [Option<NodeId>],
    profile: &ModelProfile,
    opts: &BuildOptions,
    to: usize,
    prev: &mut NodeId,
    next: &mut isize,
) {
    let dtype = profile.dtype();
    while *next >= to as isize {
        let j = *next as usize;
        let l = &profile.layers[j];
        let id = g.add_node(
            Op::Compute {
                name: format!("{}.bwd", l.name),
                kind: compute_kind(&l.kind),
                flops: l.bwd_flops.saturating_mul(opts.batch),
            },
            [TensorType::new(dtype, &batched(&l.in_shape, opts.batch))],
            &[Value::of(*prev)],
        );
        compute[j] = Some(id);
        *prev = id;
        *next -= 1;
    }
}

/// Adds the gradient of `param` (of type `ty`, made by `source`) and its `grad_sync` (`ready`-th
/// in ready order, over `group`), and returns the `grad_sync`'s value: the pair every step graph
/// ends a parameter's backward with.
pub fn add_gradient_sync(
    g: &mut Graph,
    param: &str,
    ty: &TensorType,
    source: NodeId,
    ready: u32,
    reduce: ReduceOp,
    group: GroupId,
) -> Value {
    let grad = g.add_node(
        Op::Gradient {
            param: param.to_string(),
        },
        [ty.clone()],
        &[Value::of(source)],
    );
    let sync = g.add_node(
        Op::GradSync {
            param: param.to_string(),
            ready,
            reduce,
            group,
        },
        [ty.clone()],
        &[Value::of(grad)],
    );
    Value::of(sync)
}

/// The backward graph of one step of `profile` on `opts.world` ranks.
pub fn build_step_graph(profile: &ModelProfile, opts: &BuildOptions) -> Graph {
    let mut g = Graph::new(profile.model.clone());
    let group = g.add_group(opts.world);
    let dtype = profile.dtype();
    let last = profile.layers.len() - 1;
    let loss = g.add_node(
        Op::Input {
            name: "loss.grad".into(),
        },
        [TensorType::new(
            dtype,
            &batched(&profile.layers[last].out_shape, opts.batch),
        )],
        &[],
    );
    // compute[j] is the backward node of layer j, once emitted.
    let mut compute: Vec<Option<NodeId>> = vec![None; profile.layers.len()];
    let mut prev = loss;
    let mut next_layer = last as isize;
    let mut syncs = Vec::with_capacity(profile.params.len());
    for (ready, &pi) in profile.grad_ready_order.iter().enumerate() {
        let p = &profile.params[pi];
        let layer = profile.final_layer(pi);
        emit_down_to(
            &mut g,
            &mut compute,
            profile,
            opts,
            layer,
            &mut prev,
            &mut next_layer,
        );
        let producer = compute[layer].expect("layer emitted above");
        let ty = TensorType::new(dtype, &p.shape);
        syncs.push(add_gradient_sync(
            &mut g,
            &p.name,
            &ty,
            producer,
            ready as u32,
            opts.reduce,
            group,
        ));
    }
    emit_down_to(
        &mut g,
        &mut compute,
        profile,
        opts,
        0,
        &mut prev,
        &mut next_layer,
    );
    g.add_node(Op::Sync, [], &syncs);
    g
}

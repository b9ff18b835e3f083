//! The graph of a recorded training step: every op a rank recorded between two sync points (a
//! `compute` node each, with its shape, dtype and estimated flops, and data edges between the
//! ops it read), each submitted gradient as the result of the op that produced it, its
//! `grad_sync` in ready order, and the sync point.
//!
//! Requires: the log of one rank in record order (`lazy::take_log`) and the gradients that rank
//! submitted, in ready order, each with the node number its tensor had when submitted.
//!
//! Guarantees: the graph passes the verifier and compiles with the same passes as any step
//! graph; its text form depends only on the recorded ops, not on node numbers or timing.

use hashbrown::HashMap;

use super::lazy::LogEntry;
use crate::graph::builder::add_gradient_sync;
use crate::graph::{DType, Graph, GroupId, NodeId, Op, ReduceOp, TensorType, Value};

/// A gradient submitted for sync.
pub(crate) struct SubmittedGradient<'a> {
    /// Its parameter.
    pub name: &'a str,
    /// Its type.
    pub ty: &'a TensorType,
    /// The node its tensor was when submitted (`None`: computed before anything was recorded).
    pub seq: Option<u64>,
}

/// What one synced step of a rank recorded, kept as it came: its graph ([`step_graph`]) is built
/// only when someone asks for it, so a step does not pay for a graph nobody reads (thousands of
/// nodes for a step of small ops, on the training thread, every step).
pub(crate) struct StepRecord {
    /// Ranks in the group.
    pub world: u32,
    /// The gradient sync's reduction.
    pub reduce: ReduceOp,
    /// The submitted gradients in ready order: parameter, type, node (see [`SubmittedGradient`]).
    pub grads: Vec<(String, TensorType, Option<u64>)>,
    /// The log of the step, in record order.
    pub log: Vec<LogEntry>,
}

impl StepRecord {
    /// The step's graph.
    pub(crate) fn graph(&self) -> Graph {
        let grads: Vec<SubmittedGradient<'_>> = self
            .grads
            .iter()
            .map(|(name, ty, seq)| SubmittedGradient {
                name,
                ty,
                seq: *seq,
            })
            .collect();
        step_graph(self.world, self.reduce, &grads, &self.log)
    }
}

/// The graph dtype of a Burn dtype (integers by width; flex32 is f32 arithmetic).
fn dtype(d: burn_std::DType) -> DType {
    use burn_std::DType as B;
    match d {
        B::F64 => DType::F64,
        B::F32 | B::Flex32 => DType::F32,
        B::F16 => DType::F16,
        B::BF16 => DType::BF16,
        B::I64 | B::U64 => DType::I64,
        B::Bool(_) => DType::Bool,
        B::I32 | B::I16 | B::I8 | B::U32 | B::U16 | B::U8 | B::QFloat(_) => DType::I32,
    }
}

/// The graph type of a recorded op's result (a scalar f32 when its rule did not know it).
pub(crate) fn entry_type(e: &LogEntry) -> TensorType {
    let dims: Vec<u64> = e
        .shape
        .as_ref()
        .map(|s| s.iter().map(|d| *d as u64).collect())
        .unwrap_or_default();
    TensorType::new(e.dtype.map_or(DType::F32, dtype), &dims)
}

/// The graph of one recorded step of one rank.
pub(crate) fn step_graph(
    world: u32,
    reduce: ReduceOp,
    grads: &[SubmittedGradient<'_>],
    log: &[LogEntry],
) -> Graph {
    let mut g = Graph::new("step");
    let group: GroupId = g.add_group(world);
    let in_log: hashbrown::HashSet<u64> = log.iter().map(|e| e.seq).collect();
    // Gradients by the node that produced them; those computed before anything was recorded
    // come first, as graph inputs.
    let mut by_producer: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut syncs = Vec::with_capacity(grads.len());
    for (i, gr) in grads.iter().enumerate() {
        match gr.seq.filter(|s| in_log.contains(s)) {
            Some(s) => by_producer.entry(s).or_default().push(i),
            None => {
                let src = g.add_node(
                    Op::Input {
                        name: format!("{}.grad", gr.name),
                    },
                    [gr.ty.clone()],
                    &[],
                );
                syncs.push(add_sync(&mut g, group, reduce, i, gr, src));
            }
        }
    }
    let mut node_of: HashMap<u64, NodeId> = HashMap::with_capacity(log.len());
    for e in log {
        let operands: Vec<Value> = e
            .inputs
            .iter()
            .filter_map(|s| node_of.get(s).map(|n| Value::of(*n)))
            .collect();
        let ty = entry_type(e);
        let id = g.add_node(
            Op::Compute {
                name: e.op.to_string(),
                kind: e.kind,
                flops: e.flops,
            },
            [ty],
            &operands,
        );
        node_of.insert(e.seq, id);
        // A gradient's sync follows the op that produced it, so the schedule can launch its
        // bucket while the rest of backward runs.
        for i in by_producer.remove(&e.seq).unwrap_or_default() {
            syncs.push(add_sync(&mut g, group, reduce, i, &grads[i], id));
        }
    }
    // The sync point reads the syncs in ready order.
    syncs.sort_by_key(|(i, _)| *i);
    let syncs: Vec<Value> = syncs.into_iter().map(|(_, v)| v).collect();
    g.add_node(Op::Sync, [], &syncs);
    g
}

/// The gradient `i` produced by `src`, and its `grad_sync`.
fn add_sync(
    g: &mut Graph,
    group: GroupId,
    reduce: ReduceOp,
    i: usize,
    gr: &SubmittedGradient<'_>,
    src: NodeId,
) -> (usize, Value) {
    let sync = add_gradient_sync(g, gr.name, gr.ty, src, i as u32, reduce, group);
    (i, sync)
}

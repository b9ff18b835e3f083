//! `async-collectives`: split every blocking all-reduce into a start and a done.
//!
//! **Why it pays.** A blocking all-reduce stalls the compute stream from launch to completion. With
//! the two halves apart, the scheduler can launch the collective as soon as its input exists and
//! wait for it only where its result is needed, so the work in between overlaps communication.
//!
//! **Requires:** a verified graph.
//!
//! **Guarantees:** no `all_reduce` remains. Each became `all_reduce_start` (same operands, reduce
//! op, group and bucket) followed by one `all_reduce_done` that reads every start result in order;
//! readers of result `i` read done result `i`. Order edges into the old node now enter the start,
//! order edges out of it leave the done. Both halves keep the old node's schedule key, so the
//! schedule is unchanged until `schedule-overlap` moves them.
//!
//! Before → after:
//! ```text
//! %5 = all_reduce reduce=sum group=g0 bucket=0 (%4) : f32[272]
//! ```
//! becomes
//! ```text
//! %5 = all_reduce_start reduce=sum group=g0 bucket=0 (%4) : f32[272]
//! %6 = all_reduce_done bucket=0 (%5) : f32[272]
//! ```

use super::{Pass, PassError};
use crate::graph::{Graph, NodeId, Op, Value};

/// The pass. See the module doc.
pub struct AsyncCollectives;

impl Pass for AsyncCollectives {
    fn name(&self) -> &'static str {
        "async-collectives"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool, PassError> {
        let targets: Vec<NodeId> = graph
            .node_ids()
            .filter(|&id| matches!(graph.op(id), Op::AllReduce { .. }))
            .collect();
        let mut pairs = Vec::new();
        for &id in &targets {
            split(graph, id, &mut pairs);
        }
        graph.replace_uses_batch(&pairs);
        for &id in &targets {
            graph.remove_node(id);
        }
        Ok(!targets.is_empty())
    }
}

fn split(graph: &mut Graph, id: NodeId, pairs: &mut Vec<(Value, Value)>) {
    let Some((reduce, group, bucket)) = graph.op(id).as_all_reduce() else {
        unreachable!("targets are all_reduce nodes");
    };
    let operands = graph.operands(id);
    let types = graph.node(id).results.clone();
    let pos = graph.node(id).pos;
    let start = graph.add_node(
        Op::AllReduceStart {
            reduce,
            group,
            bucket,
        },
        types.iter().cloned(),
        &operands,
    );
    let handles: Vec<Value> = (0..types.len() as u32)
        .map(|result| Value {
            node: start,
            result,
        })
        .collect();
    let done = graph.add_node(
        Op::AllReduceDone { bucket },
        types.iter().cloned(),
        &handles,
    );
    graph.node_mut(start).pos = pos;
    graph.node_mut(done).pos = pos;
    for result in 0..types.len() as u32 {
        pairs.push((Value { node: id, result }, Value { node: done, result }));
    }
    graph.transfer_order_edges(id, start, done);
}

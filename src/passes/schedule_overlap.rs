//! `schedule-overlap`: order the graph so communication overlaps the compute after it.
//!
//! **Why it pays.** In backward, the gradients of late layers are ready long before the step ends.
//! Launching each bucket's all-reduce the moment its last gradient exists, and waiting for it only
//! where its result is read, hides the communication behind the backward of earlier layers; only
//! the tail after the last gradient stays exposed.
//!
//! **Requires:** collectives split into `all_reduce_start`/`all_reduce_done`
//! (`async-collectives`); an acyclic graph.
//!
//! **Guarantees:** the schedule keys are rewritten so that [`Graph::topo_order`] is a list schedule
//! in which packs and starts run as soon as their operands exist, dones and unpacks as late as
//! their readers allow (at the sync point for gradients), and every other node keeps its relative
//! order. Starts of one group are chained by order edges in launch order, so every rank issues
//! its collectives in the same order, which NCCL requires; that order is a pure function of the
//! graph. The pass never adds a data edge.
//!
//! Before → after (a start placed where its bucket is ready, the done moved to the sync point):
//! ```text
//! %2 = all_reduce_start reduce=mean group=g0 bucket=0 (%1) : f32[256]
//! %3 = all_reduce_done bucket=0 (%2) : f32[256]
//! %4 = compute "l0.bwd" kind=matmul flops=100 (%0) : f32[8]
//! ```
//! becomes
//! ```text
//! %2 = all_reduce_start reduce=mean group=g0 bucket=0 (%1) : f32[256] ; 1.00 KiB, overlaps 1 compute
//! %3 = compute "l0.bwd" kind=matmul flops=100 (%0) : f32[8]
//! %4 = all_reduce_done bucket=0 (%2) : f32[256]
//! ```

use hashbrown::HashMap;

use super::{Pass, PassError};
use crate::graph::{Graph, GroupId, NodeId, Op};

/// The pass. See the module doc.
pub struct ScheduleOverlap;

impl Pass for ScheduleOverlap {
    fn name(&self) -> &'static str {
        "schedule-overlap"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool, PassError> {
        let before = graph.topo_order()?;
        let order = list_schedule(graph, &before);
        let mut changed = order != before;
        // Chain the starts of each group in launch order.
        let mut last_start: HashMap<GroupId, NodeId> = HashMap::new();
        for &id in &order {
            if let Op::AllReduceStart { group, .. } = *graph.op(id)
                && let Some(prev) = last_start.insert(group, id)
                && !graph.order_preds(id).contains(&prev)
            {
                graph.add_order(prev, id);
                changed = true;
            }
        }
        let keys_ok = order
            .iter()
            .enumerate()
            .all(|(i, id)| graph.node(*id).pos == i as u64);
        if !keys_ok {
            graph.set_schedule(&order);
        }
        Ok(changed)
    }
}

/// Scheduling class: lower runs first among ready nodes.
fn class(op: &Op) -> u8 {
    match op {
        Op::BucketPack { .. } | Op::AllReduceStart { .. } => 0,
        Op::AllReduceDone { .. } | Op::BucketUnpack { .. } => 2,
        _ => 1,
    }
}

/// Kahn's algorithm picking, among ready nodes, the smallest `(class, old position)`.
fn list_schedule(graph: &Graph, before: &[NodeId]) -> Vec<NodeId> {
    let mut old_pos = vec![0u32; graph.node_bound()];
    for (i, id) in before.iter().enumerate() {
        old_pos[id.index()] = i as u32;
    }
    graph.list_schedule(before, |id| (class(graph.op(id)), old_pos[id.index()]))
}

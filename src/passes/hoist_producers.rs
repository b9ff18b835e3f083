//! `hoist-producers`: run the ops that complete the next gradient before independent work.
//!
//! **Why it pays.** A recorded backward pass is a program order, not a dependency order: for a
//! linear layer Burn records the input gradient (needed by the layer below) before the weight
//! gradient (needed by nobody but the optimizer and the all-reduce). Running in program order, a
//! bucket's all-reduce waits for work it does not read. Running each gradient's producers first,
//! and the independent ops right after, starts every bucket earlier by that work while the
//! same ops run, so the communication hides behind more of backward.
//!
//! **The model.** Gradients are forced in ready order (their `grad_sync`'s `ready`). Forcing
//! gradient `k`, produced by compute node `p`, runs the not yet run compute nodes that `p`
//! reads, directly or not (its *producers*), in program order, and leaves the other not yet
//! run nodes up to `p` (the *deferred* ones) for later; they run in program order when a later
//! gradient reads them, or after the last gradient. Deferring costs memory: a deferred node's
//! operands live until it runs, and its result appears later. A gradient hoists only when the
//! bytes of the distinct values its deferred nodes read or produce (compute results only: what
//! a recorder knows) stay within the bound; otherwise everything up to `p` runs in program
//! order. The lazy queue of the Burn backend applies the same rule with the same bound when it
//! forces a gradient (`backend/lazy.rs`), so the order this pass prints is the order a recorded
//! step runs in, as long as nothing else (a data read, an op without a record rule) forced the
//! queue in between.
//!
//! **Requires:** an acyclic graph; gradients as `gradient` nodes read by their `grad_sync`, each
//! produced by a `compute` node (others are left where they are). Runs before bucketing.
//!
//! **Guarantees:** only the schedule keys change, and only the relative order of `compute`
//! nodes; every other node runs as soon as its operands exist, as before. Every data and order
//! edge is kept. With a bound of 0, or when every node up to a gradient is one of its producers
//! (a chain, as a model profile builds), nothing changes. Values that deferral keeps alive
//! longer total at most the bound at any gradient.
//!
//! Before → after (the input gradient `%3` no longer delays the weight gradient's all-reduce):
//! ```text
//! %0 = input "x" : f32[8,16]
//! %1 = input "dy" : f32[8,4]
//! %2 = input "w" : f32[16,4]
//! %3 = compute "linear_x_backward" kind=matmul flops=1024 (%2, %1) : f32[8,16]
//! %4 = compute "linear_weight_backward" kind=matmul flops=1024 (%0, %1) : f32[16,4]
//! %5 = gradient "w" (%4) : f32[16,4]
//! %6 = grad_sync "w" reduce=mean group=g0 ready=0 (%5) : f32[16,4]
//! ```
//! becomes
//! ```text
//! %3 = compute "linear_weight_backward" kind=matmul flops=1024 (%0, %1) : f32[16,4]
//! %4 = gradient "w" (%3) : f32[16,4]
//! %5 = grad_sync "w" reduce=mean group=g0 ready=0 (%4) : f32[16,4]
//! %6 = compute "linear_x_backward" kind=matmul flops=1024 (%2, %1) : f32[8,16]
//! ```

use hashbrown::HashSet;

use super::{Pass, PassError};
use crate::graph::{Graph, NodeId, Op};

/// The pass. See the module doc.
pub struct HoistProducers {
    /// The most bytes that deferred nodes may keep alive at a gradient (0: never hoist).
    pub max_deferred_bytes: u64,
}

impl Pass for HoistProducers {
    fn name(&self) -> &'static str {
        "hoist-producers"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool, PassError> {
        if self.max_deferred_bytes == 0 {
            return Ok(false);
        }
        let before = graph.topo_order()?;
        let compute: Vec<NodeId> = before
            .iter()
            .copied()
            .filter(|id| matches!(graph.op(*id), Op::Compute { .. }))
            .collect();
        let order = hoisted_order(graph, &compute, self.max_deferred_bytes);
        if order == compute {
            return Ok(false);
        }
        let schedule = merge(graph, &before, &order);
        graph.set_schedule(&schedule);
        Ok(true)
    }
}

/// The compute nodes' order under the model of the module doc, from `compute` (program order).
fn hoisted_order(graph: &Graph, compute: &[NodeId], max_bytes: u64) -> Vec<NodeId> {
    let bound = graph.node_bound();
    let mut at = vec![usize::MAX; bound];
    for (i, id) in compute.iter().enumerate() {
        at[id.index()] = i;
    }
    let is_compute = |id: NodeId| at[id.index()] != usize::MAX;
    // Each gradient's producer, in ready order.
    let mut targets: Vec<(u32, NodeId)> = graph
        .node_ids()
        .filter_map(|id| {
            let Op::GradSync { ready, .. } = graph.op(id) else {
                return None;
            };
            let grad = graph.operands(id).first()?.node;
            let producer = graph.operands(grad).first()?.node;
            (matches!(graph.op(grad), Op::Gradient { .. }) && is_compute(producer))
                .then_some((*ready, producer))
        })
        .collect();
    targets.sort_by_key(|&(ready, p)| (ready, at[p.index()]));

    let mut done = vec![false; bound];
    let mut order = Vec::with_capacity(compute.len());
    // Every node before `first` has run.
    let mut first = 0;
    for (_, p) in targets {
        let upto = at[p.index()];
        if done[p.index()] {
            continue;
        }
        // The producers of p not yet run.
        let mut producers: HashSet<NodeId> = HashSet::new();
        let mut stack = vec![p];
        while let Some(n) = stack.pop() {
            if !is_compute(n) || done[n.index()] || !producers.insert(n) {
                continue;
            }
            stack.extend(graph.operands(n).iter().map(|v| v.node));
        }
        let deferred: Vec<NodeId> = compute[first..=upto]
            .iter()
            .copied()
            .filter(|n| !done[n.index()] && !producers.contains(n))
            .collect();
        let hoist = deferred_bytes(graph, &deferred, is_compute) <= max_bytes;
        for &n in &compute[first..=upto] {
            if !done[n.index()] && (!hoist || producers.contains(&n)) {
                done[n.index()] = true;
                order.push(n);
            }
        }
        while first < compute.len() && done[compute[first].index()] {
            first += 1;
        }
    }
    order.extend(compute[first..].iter().filter(|n| !done[n.index()]));
    order
}

/// Bytes of the distinct values the `deferred` nodes read or produce, counting only values
/// that `counted` nodes produce (a recorder knows the types of its own ops' results only).
pub fn deferred_bytes(graph: &Graph, deferred: &[NodeId], counted: impl Fn(NodeId) -> bool) -> u64 {
    let mut seen: HashSet<NodeId> = HashSet::new();
    let mut bytes = 0u64;
    for &n in deferred {
        let operands = graph.operands(n);
        for v in std::iter::once(n).chain(operands.iter().map(|v| v.node)) {
            if counted(v) && seen.insert(v) {
                let b = graph
                    .node(v)
                    .results
                    .iter()
                    .map(|t| t.checked_bytes().unwrap_or(u64::MAX))
                    .fold(0u64, u64::saturating_add);
                bytes = bytes.saturating_add(b);
            }
        }
    }
    bytes
}

/// A topological order of every node in which the compute nodes follow `compute`, the sync
/// point comes last and every other node as soon as its operands exist (ties by its old
/// position).
fn merge(graph: &Graph, before: &[NodeId], compute: &[NodeId]) -> Vec<NodeId> {
    let bound = graph.node_bound();
    let mut key = vec![0u64; bound];
    for (i, id) in before.iter().enumerate() {
        key[id.index()] = i as u64;
    }
    for (i, id) in compute.iter().enumerate() {
        key[id.index()] = i as u64;
    }
    // The sync point stays last.
    let class = |id: NodeId| match graph.op(id) {
        Op::Compute { .. } => 1u8,
        Op::Sync => 2,
        _ => 0,
    };
    graph.list_schedule(before, |id| (class(id), key[id.index()]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::parse::parse;
    use crate::graph::print::print;

    const LAYER: &str = r#"graph "step" {
  group g0 size=2
  %0 = input "x" : f32[8,16]
  %1 = input "dy" : f32[8,4]
  %2 = input "w" : f32[16,4]
  %3 = compute "linear_x_backward" kind=matmul flops=1024 (%2, %1) : f32[8,16]
  %4 = compute "linear_weight_backward" kind=matmul flops=1024 (%0, %1) : f32[16,4]
  %5 = gradient "w" (%4) : f32[16,4]
  %6 = grad_sync "w" reduce=mean group=g0 ready=0 (%5) : f32[16,4]
  %7 = sync (%6)
}
"#;

    fn run(text: &str, bytes: u64) -> (bool, String) {
        let mut g = parse(text).unwrap();
        let changed = HoistProducers {
            max_deferred_bytes: bytes,
        }
        .run(&mut g)
        .unwrap();
        (changed, print(&g))
    }

    #[test]
    fn the_weight_gradient_runs_before_the_input_gradient() {
        let (changed, text) = run(LAYER, 1 << 20);
        assert!(changed);
        let at = |s: &str| text.find(s).unwrap();
        assert!(at("linear_weight_backward") < at("grad_sync"), "{text}");
        assert!(at("grad_sync") < at("linear_x_backward"), "{text}");
        assert!(at("linear_x_backward") < at("= sync"), "{text}");
    }

    #[test]
    fn nothing_moves_past_the_bound_or_with_a_zero_bound() {
        // The deferred node keeps f32[8,16] (its result) alive: 512 bytes.
        assert!(run(LAYER, 512).0);
        assert_eq!(run(LAYER, 511), (false, print(&parse(LAYER).unwrap())));
        assert!(!run(LAYER, 0).0);
    }

    #[test]
    fn a_chain_is_left_alone() {
        let text = r#"graph "chain" {
  group g0 size=2
  %0 = input "dy" : f32[4]
  %1 = compute "a" kind=elementwise flops=4 (%0) : f32[4]
  %2 = gradient "p" (%1) : f32[4]
  %3 = grad_sync "p" reduce=mean group=g0 ready=0 (%2) : f32[4]
  %4 = compute "b" kind=elementwise flops=4 (%1) : f32[4]
  %5 = gradient "q" (%4) : f32[4]
  %6 = grad_sync "q" reduce=mean group=g0 ready=1 (%5) : f32[4]
  %7 = sync (%3, %6)
}
"#;
        assert!(!run(text, u64::MAX).0);
    }
}

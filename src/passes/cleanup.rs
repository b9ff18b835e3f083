//! `dead-code`: remove pure nodes whose results nobody reads.
//!
//! **Why it pays.** Rewrites leave values behind (a gradient whose sync was dropped by the user, a
//! pack that lost its collective); executing them costs time and memory for nothing.
//!
//! **Requires:** an acyclic graph.
//!
//! **Guarantees:** every remaining `compute`, `parameter`, `input` and `bucket_pack` node has a
//! data or order successor. Gradients (the optimizer reads them), unpacks (they write gradients
//! back), collectives (other ranks wait for them) and sync points are never removed. One sweep in reverse
//! schedule order removes whole dead chains; run inside the `cleanup` fixpoint group.
//!
//! Before → after:
//! ```text
//! %0 = input "x" : f32[4]
//! %1 = compute "unused" kind=elementwise flops=4 (%0) : f32[4]
//! ```
//! becomes the empty graph.

use super::{Pass, PassError};
use crate::graph::Graph;

/// The pass. See the module doc.
pub struct Cleanup;

impl Pass for Cleanup {
    fn name(&self) -> &'static str {
        "dead-code"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool, PassError> {
        let order = graph.topo_order()?;
        let mut changed = false;
        for &id in order.iter().rev() {
            if graph.op(id).is_pure() && graph.successors(id).is_empty() {
                graph.remove_node(id);
                changed = true;
            }
        }
        Ok(changed)
    }
}

//! The graph's structure without node indices ([`GraphStructure`], the plan cache's key) and
//! the crate's one stable hash ([`Fnv64`]).

use smallvec::SmallVec;

use super::{CycleError, Graph, GroupId, Op, TensorType};

impl Graph {
    /// The graph's structure: its groups, then every node in schedule order with its op and
    /// attributes, result types, operands and order predecessors by schedule position.
    /// Independent of node indices; two graphs with equal structures compile to the same plan.
    pub fn structure(&self) -> Result<GraphStructure, CycleError> {
        let order = self.topo_order()?;
        let mut num = vec![u32::MAX; self.node_bound()];
        for (i, id) in order.iter().enumerate() {
            num[id.index()] = i as u32;
        }
        let nodes = order
            .iter()
            .map(|&id| {
                let n = &self.g[id];
                StructureNode {
                    op: n.op.clone(),
                    results: n.results.clone(),
                    operands: self
                        .operands(id)
                        .iter()
                        .map(|v| (num[v.node.index()], v.result))
                        .collect(),
                    after: self
                        .order_preds(id)
                        .iter()
                        .map(|p| num[p.index()])
                        .collect(),
                }
            })
            .collect();
        Ok(GraphStructure {
            groups: self.groups.iter().map(|g| (g.id, g.size)).collect(),
            nodes,
        })
    }

    /// A 64-bit hash of [`Graph::structure`] ([`Fnv64`]: the same in every process and build).
    pub fn structural_hash(&self) -> Result<u64, CycleError> {
        Ok(fnv64(&self.structure()?))
    }
}

/// What [`Graph::structure`] returns: a graph without its node indices, comparable and
/// hashable (the plan cache's key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GraphStructure {
    groups: Vec<(GroupId, u32)>,
    nodes: Vec<StructureNode>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct StructureNode {
    op: Op,
    results: SmallVec<[TensorType; 1]>,
    /// (schedule position of the producer, result index).
    operands: SmallVec<[(u32, u32); 4]>,
    /// Schedule positions of the order predecessors.
    after: SmallVec<[u32; 2]>,
}

/// [`Fnv64`] of `value`'s [`Hash`](std::hash::Hash).
pub fn fnv64(value: &impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut h = Fnv64::default();
    value.hash(&mut h);
    h.finish()
}

/// [`Fnv64`] of `bytes` as they are (no length prefix): FNV-1a of the byte string.
pub fn fnv64_bytes(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = Fnv64::default();
    h.write(bytes);
    h.finish()
}

/// FNV-1a, 64-bit: a small, stable hasher (std's `DefaultHasher` may change across releases),
/// for what must hash alike on every rank and in every build.
#[derive(Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for Fnv64 {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published FNV-1a 64-bit test vectors: every digest of the crate (graph structure,
    /// plan agreement, rendezvous token, parameter fingerprints, weights) is this function.
    #[test]
    fn fnv64_is_fnv_1a() {
        assert_eq!(fnv64_bytes(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv64_bytes(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv64_bytes(b"foobar"), 0x8594_4171_f739_67e8);
    }
}

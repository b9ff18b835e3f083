//! The graph IR: a dataflow graph of one recorded training-step segment.
//!
//! Nodes carry a closed [`Op`] and the types of their results; edges are either data edges (an
//! operand slot of the consumer reads a result of the producer) or order-only edges (the consumer
//! must run after the producer, nothing flows).
//!
//! Invariants the rest of the crate relies on (checked by [`verify`]):
//! - the graph is acyclic;
//! - the data operands of a node occupy slots `0..n` exactly once each;
//! - a data edge names a result index the producer has.
//!
//! The schedule is part of the graph: every node has a position key `pos`, and
//! [`Graph::topo_order`] is Kahn's algorithm that always picks the ready node with the smallest
//! `(pos, index)`. Passes that only add nodes get a deterministic order for free; the
//! `schedule-overlap` pass rewrites the keys so that this order is the chosen schedule. The text
//! form prints nodes in this order, so what a person reads is what runs.
//!
//! This module never touches Burn or devices.

pub mod builder;
pub mod parse;
pub mod print;
mod structure;
mod types;
pub mod verify;

pub use structure::{Fnv64, GraphStructure, fnv64, fnv64_bytes};
pub use types::{
    ComputeKind, DType, GroupId, MAX_PACK_ALIGN_BYTES, PACK_ALIGN_BYTES, ReduceOp, TensorType,
    pack_align_ok,
};

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use petgraph::Direction;
use petgraph::stable_graph::{EdgeIndex, NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use smallvec::SmallVec;

/// Identifies a node of a [`Graph`]. Stable across removals of other nodes; never printed.
pub type NodeId = NodeIndex<u32>;

/// The operation of a node. A closed set: every pass matches it exhaustively.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// A model parameter (a leaf). One result.
    Parameter {
        /// Parameter name, unique in the graph.
        name: String,
    },
    /// A data input of the step (a leaf). One result.
    Input {
        /// Input name.
        name: String,
    },
    /// Device compute with a cost estimate. One result.
    Compute {
        /// Human label (a layer name, an op name).
        name: String,
        /// Class of the work.
        kind: ComputeKind,
        /// Floating-point operations it performs.
        flops: u64,
    },
    /// The final gradient of a parameter. One operand (what produced it), one result.
    Gradient {
        /// Name of the parameter whose gradient this is.
        param: String,
    },
    /// Burn's `submit_gradient_sync`: the gradient must be all-reduced and written back in place.
    /// One operand (the gradient), one result (the reduced gradient).
    GradSync {
        /// Parameter name.
        param: String,
        /// Position in the gradient-ready order (0 = first ready).
        ready: u32,
        /// Reduction across ranks.
        reduce: ReduceOp,
        /// Device group.
        group: GroupId,
    },
    /// A blocking all-reduce over one or more tensors (one operand per tensor, one result each).
    AllReduce {
        /// Reduction across ranks.
        reduce: ReduceOp,
        /// Device group.
        group: GroupId,
        /// Bucket number when the bucketing pass formed it.
        bucket: Option<u32>,
    },
    /// Flatten the operands into one contiguous buffer, dividing by `scale_div` when set and
    /// casting to the result's dtype. One result: the flat bucket.
    BucketPack {
        /// Bucket number.
        bucket: u32,
        /// Divide every element by this (the group size, for a mean).
        scale_div: Option<u32>,
        /// Every member of a multi-member bucket starts at a multiple of this many bytes of
        /// the flat buffer (a power of two; [`PACK_ALIGN_BYTES`] unless the members must be
        /// addressable as views of the buffer, which devices allow at coarser alignments).
        align: u32,
    },
    /// Split a reduced flat bucket back into its members (casting back to each member's dtype).
    /// One operand, one result per member.
    BucketUnpack {
        /// Bucket number.
        bucket: u32,
        /// Hand the members back as views of the reduced bucket, not copies (PyTorch DDP's
        /// `gradient_as_bucket_view`; members of the bucket's own dtype only). A device that
        /// cannot address a member at its offset copies that one.
        views: bool,
    },
    /// Launch an all-reduce asynchronously. Results are in-flight handles, one per operand.
    AllReduceStart {
        /// Reduction across ranks.
        reduce: ReduceOp,
        /// Device group.
        group: GroupId,
        /// Bucket number, when bucketed.
        bucket: Option<u32>,
    },
    /// Wait for an all-reduce launched by the `AllReduceStart` that feeds it. Results are the
    /// reduced tensors, one per operand.
    AllReduceDone {
        /// Bucket number, when bucketed.
        bucket: Option<u32>,
    },
    /// A sync point (`submit_sync_collective`): everything it reads is reduced and written back
    /// when it completes. No results.
    Sync,
}

impl Op {
    /// An [`Op::AllReduce`]'s reduction, group and bucket; `None` for any other op.
    pub fn as_all_reduce(&self) -> Option<(ReduceOp, GroupId, Option<u32>)> {
        match *self {
            Op::AllReduce {
                reduce,
                group,
                bucket,
            } => Some((reduce, group, bucket)),
            _ => None,
        }
    }

    /// Whether the node only computes its results (no communication, no effect on the step):
    /// dead-code removal drops such a node when nobody reads it, and the verifier does not count
    /// a read by a dead one.
    pub fn is_pure(&self) -> bool {
        matches!(
            self,
            Op::Compute { .. } | Op::Parameter { .. } | Op::Input { .. } | Op::BucketPack { .. }
        )
    }

    /// The keyword the text form uses for this op.
    pub fn keyword(&self) -> &'static str {
        match self {
            Op::Parameter { .. } => "parameter",
            Op::Input { .. } => "input",
            Op::Compute { .. } => "compute",
            Op::Gradient { .. } => "gradient",
            Op::GradSync { .. } => "grad_sync",
            Op::AllReduce { .. } => "all_reduce",
            Op::BucketPack { .. } => "bucket_pack",
            Op::BucketUnpack { .. } => "bucket_unpack",
            Op::AllReduceStart { .. } => "all_reduce_start",
            Op::AllReduceDone { .. } => "all_reduce_done",
            Op::Sync => "sync",
        }
    }

    /// Whether this op reduces its operands across ranks (so a gradient flowing into it counts
    /// as reduced).
    pub fn is_reduction(&self) -> bool {
        matches!(
            self,
            Op::GradSync { .. } | Op::AllReduce { .. } | Op::AllReduceStart { .. }
        )
    }

    /// Whether this op is communication (a collective or one of its halves).
    pub fn is_collective(&self) -> bool {
        matches!(
            self,
            Op::GradSync { .. }
                | Op::AllReduce { .. }
                | Op::AllReduceStart { .. }
                | Op::AllReduceDone { .. }
        )
    }
}

/// A node: its op, the types of its results, and its schedule key.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What the node does.
    pub op: Op,
    /// Types of its results, in result order.
    pub results: SmallVec<[TensorType; 1]>,
    /// Schedule key: among ready nodes the smallest `pos` runs first.
    pub pos: u64,
}

/// An edge of the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    /// Operand slot `operand` of the target reads result `result` of the source.
    Data {
        /// Operand slot of the consumer.
        operand: u32,
        /// Result index of the producer.
        result: u32,
    },
    /// The target runs after the source; no data flows.
    Order,
}

/// One result of one node: what an operand refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value {
    /// Producing node.
    pub node: NodeId,
    /// Result index.
    pub result: u32,
}

impl Value {
    /// Result 0 of `node`.
    pub fn of(node: NodeId) -> Self {
        Value { node, result: 0 }
    }
}

/// A device group declaration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    /// Its id.
    pub id: GroupId,
    /// Number of ranks in it.
    pub size: u32,
}

/// A dataflow graph of one step segment.
#[derive(Clone, Debug)]
pub struct Graph {
    /// Name shown in the header of the text form.
    pub name: String,
    groups: Vec<Group>,
    g: StableDiGraph<Node, Edge, u32>,
    next_pos: u64,
}

/// The graph contains a cycle through the given node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the graph has a cycle (through or behind node index {})", node.index())]
pub struct CycleError {
    /// A node on (or blocked behind) the cycle.
    pub node: NodeId,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Self {
        Graph {
            name: name.into(),
            groups: Vec::new(),
            g: StableDiGraph::default(),
            next_pos: 0,
        }
    }

    /// Declares a device group of `size` ranks and returns its id.
    pub fn add_group(&mut self, size: u32) -> GroupId {
        let id = GroupId(self.groups.len() as u32);
        self.groups.push(Group { id, size });
        id
    }

    /// Declares a group with an explicit id (used by the parser).
    pub fn declare_group(&mut self, id: GroupId, size: u32) {
        self.groups.retain(|g| g.id != id);
        self.groups.push(Group { id, size });
        self.groups.sort_by_key(|g| g.id);
    }

    /// The declared groups, by id.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Resizes group `id` (profiling a recorded step at another world size); false if it is not
    /// declared.
    pub fn set_group_size(&mut self, id: GroupId, size: u32) -> bool {
        match self.groups.iter_mut().find(|g| g.id == id) {
            Some(g) => {
                g.size = size;
                true
            }
            None => false,
        }
    }

    /// The size of group `id`.
    pub fn group_size(&self, id: GroupId) -> Option<u32> {
        self.groups.iter().find(|g| g.id == id).map(|g| g.size)
    }

    /// Adds a node reading `operands` (slot `i` reads `operands[i]`), scheduled after every
    /// node that exists now unless its position is changed.
    pub fn add_node(
        &mut self,
        op: Op,
        results: impl IntoIterator<Item = TensorType>,
        operands: &[Value],
    ) -> NodeId {
        let pos = self.next_pos;
        self.next_pos += 1;
        let id = self.g.add_node(Node {
            op,
            results: results.into_iter().collect(),
            pos,
        });
        for (i, v) in operands.iter().enumerate() {
            self.g.add_edge(
                v.node,
                id,
                Edge::Data {
                    operand: i as u32,
                    result: v.result,
                },
            );
        }
        id
    }

    /// Adds an order-only edge: `after` runs after `before`.
    pub fn add_order(&mut self, before: NodeId, after: NodeId) {
        let exists = self
            .g
            .edges_connecting(before, after)
            .any(|e| *e.weight() == Edge::Order);
        if !exists {
            self.g.add_edge(before, after, Edge::Order);
        }
    }

    /// Adds a raw edge (the parser uses this to rebuild a graph from text).
    pub fn add_edge(&mut self, from: NodeId, to: NodeId, edge: Edge) -> EdgeIndex<u32> {
        self.g.add_edge(from, to, edge)
    }

    /// Removes a node and all its edges.
    pub fn remove_node(&mut self, id: NodeId) -> Option<Node> {
        self.g.remove_node(id)
    }

    /// The node, if it exists.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id]
    }

    /// Mutable access to a node.
    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.g[id]
    }

    /// Whether `id` names a live node.
    pub fn contains(&self, id: NodeId) -> bool {
        self.g.contains_node(id)
    }

    /// The op of a node.
    pub fn op(&self, id: NodeId) -> &Op {
        &self.g[id].op
    }

    /// Type of a value.
    pub fn ty(&self, v: Value) -> &TensorType {
        &self.g[v.node].results[v.result as usize]
    }

    /// Number of live nodes.
    pub fn node_count(&self) -> usize {
        self.g.node_count()
    }

    /// One more than the largest node index ever used: the length for arrays indexed by node.
    pub fn node_bound(&self) -> usize {
        self.g.node_bound()
    }

    /// Number of edges.
    pub fn edge_count(&self) -> usize {
        self.g.edge_count()
    }

    /// Live node ids in index order (not a schedule; use [`Graph::topo_order`] for that).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.g.node_indices()
    }

    /// The underlying petgraph graph, read-only.
    pub fn raw(&self) -> &StableDiGraph<Node, Edge, u32> {
        &self.g
    }

    /// Operands of a node in slot order.
    pub fn operands(&self, id: NodeId) -> SmallVec<[Value; 4]> {
        let mut ops: SmallVec<[(u32, Value); 4]> = self
            .g
            .edges_directed(id, Direction::Incoming)
            .filter_map(|e| match *e.weight() {
                Edge::Data { operand, result } => Some((
                    operand,
                    Value {
                        node: e.source(),
                        result,
                    },
                )),
                Edge::Order => None,
            })
            .collect();
        ops.sort_unstable_by_key(|(slot, _)| *slot);
        ops.into_iter().map(|(_, v)| v).collect()
    }

    /// Nodes this node must run after through order-only edges, sorted by id.
    pub fn order_preds(&self, id: NodeId) -> SmallVec<[NodeId; 2]> {
        let mut v: SmallVec<[NodeId; 2]> = self
            .g
            .edges_directed(id, Direction::Incoming)
            .filter(|e| *e.weight() == Edge::Order)
            .map(|e| e.source())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Consumers of a node's results: `(consumer, operand slot, result index)`.
    pub fn uses(&self, id: NodeId) -> SmallVec<[(NodeId, u32, u32); 4]> {
        let mut v: SmallVec<[(NodeId, u32, u32); 4]> = self
            .g
            .edges_directed(id, Direction::Outgoing)
            .filter_map(|e| match *e.weight() {
                Edge::Data { operand, result } => Some((e.target(), operand, result)),
                Edge::Order => None,
            })
            .collect();
        v.sort_unstable();
        v
    }

    /// All direct successors (data or order), deduplicated.
    pub fn successors(&self, id: NodeId) -> SmallVec<[NodeId; 4]> {
        let mut v: SmallVec<[NodeId; 4]> =
            self.g.neighbors_directed(id, Direction::Outgoing).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// All direct predecessors (data or order), deduplicated.
    pub fn predecessors(&self, id: NodeId) -> SmallVec<[NodeId; 4]> {
        let mut v: SmallVec<[NodeId; 4]> =
            self.g.neighbors_directed(id, Direction::Incoming).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Makes every reader of `old` read `new` instead (data edges only).
    pub fn replace_uses(&mut self, old: Value, new: Value) {
        let edges: Vec<(EdgeIndex<u32>, NodeId, u32)> = self
            .g
            .edges_directed(old.node, Direction::Outgoing)
            .filter_map(|e| match *e.weight() {
                Edge::Data { operand, result } if result == old.result => {
                    Some((e.id(), e.target(), operand))
                }
                _ => None,
            })
            .collect();
        for (e, target, operand) in edges {
            self.g.remove_edge(e);
            self.g.add_edge(
                new.node,
                target,
                Edge::Data {
                    operand,
                    result: new.result,
                },
            );
        }
    }

    /// Makes readers of each `old` read the paired `new` instead, for many pairs at once.
    ///
    /// Each affected consumer has its incoming edges rebuilt once, head first, so the cost is
    /// linear in the consumers' in-degrees. (Removing edges one by one from a node with many
    /// operands, like a sync point, is quadratic in petgraph's edge lists.)
    pub fn replace_uses_batch(&mut self, pairs: &[(Value, Value)]) {
        let map: hashbrown::HashMap<Value, Value> = pairs.iter().copied().collect();
        let mut consumers: Vec<NodeId> = Vec::new();
        for (old, _) in pairs {
            for e in self.g.edges_directed(old.node, Direction::Outgoing) {
                if let Edge::Data { result, .. } = *e.weight()
                    && result == old.result
                {
                    consumers.push(e.target());
                }
            }
        }
        consumers.sort_unstable();
        consumers.dedup();
        for c in consumers {
            let incoming: Vec<(NodeId, Edge)> = self
                .g
                .edges_directed(c, Direction::Incoming)
                .map(|e| (e.source(), *e.weight()))
                .collect();
            while let Some(e) = self.g.edges_directed(c, Direction::Incoming).next() {
                let id = e.id();
                self.g.remove_edge(id);
            }
            // Re-add in the original order of the list (it is head-first, so reverse it).
            for (src, w) in incoming.into_iter().rev() {
                match w {
                    Edge::Data { operand, result } => {
                        let v = Value { node: src, result };
                        let to = map.get(&v).copied().unwrap_or(v);
                        self.g.add_edge(
                            to.node,
                            c,
                            Edge::Data {
                                operand,
                                result: to.result,
                            },
                        );
                    }
                    Edge::Order => {
                        self.g.add_edge(src, c, Edge::Order);
                    }
                }
            }
        }
    }

    /// Moves the order-only edges of `old`: those into it now enter `first`, those out of it now
    /// leave `last` (the same node when `old` is replaced by one node, the ends of a chain when
    /// it is replaced by several).
    pub fn transfer_order_edges(&mut self, old: NodeId, first: NodeId, last: NodeId) {
        let ins: Vec<NodeId> = self.order_preds(old).into_iter().collect();
        let outs: Vec<NodeId> = self
            .g
            .edges_directed(old, Direction::Outgoing)
            .filter(|e| *e.weight() == Edge::Order)
            .map(|e| e.target())
            .collect();
        for p in ins {
            if p != first {
                self.add_order(p, first);
            }
        }
        for s in outs {
            if s != last {
                self.add_order(last, s);
            }
        }
    }

    /// The schedule: a topological order that, among ready nodes, picks the smallest
    /// `(pos, index)`. Deterministic for a given graph.
    pub fn topo_order(&self) -> Result<Vec<NodeId>, CycleError> {
        let bound = self.g.node_bound();
        let mut indeg = vec![0u32; bound];
        for e in (&self.g).edge_references() {
            indeg[e.target().index()] += 1;
        }
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
        for id in self.g.node_indices() {
            if indeg[id.index()] == 0 {
                heap.push(Reverse((self.g[id].pos, id.index() as u32)));
            }
        }
        let mut order = Vec::with_capacity(self.g.node_count());
        while let Some(Reverse((_, idx))) = heap.pop() {
            let id = NodeIndex::new(idx as usize);
            order.push(id);
            for e in self.g.edges_directed(id, Direction::Outgoing) {
                let t = e.target();
                let d = &mut indeg[t.index()];
                *d -= 1;
                if *d == 0 {
                    heap.push(Reverse((self.g[t].pos, t.index() as u32)));
                }
            }
        }
        if order.len() != self.g.node_count() {
            let node = self
                .g
                .node_indices()
                .find(|n| indeg[n.index()] > 0)
                .expect("a node with remaining in-degree exists when the order is short");
            return Err(CycleError { node });
        }
        Ok(order)
    }

    /// A topological order of `nodes` (every live node) that, among ready nodes, takes the one
    /// with the smallest `(key, index)`: the list scheduler the scheduling passes share.
    pub fn list_schedule<K: Ord>(
        &self,
        nodes: &[NodeId],
        key: impl Fn(NodeId) -> K,
    ) -> Vec<NodeId> {
        let mut indeg = vec![0u32; self.g.node_bound()];
        for &id in nodes {
            indeg[id.index()] = self.predecessors(id).len() as u32;
        }
        let prio = |id: NodeId| Reverse((key(id), id.index() as u32));
        let mut heap = BinaryHeap::new();
        for &id in nodes {
            if indeg[id.index()] == 0 {
                heap.push(prio(id));
            }
        }
        let mut order = Vec::with_capacity(nodes.len());
        while let Some(Reverse((_, idx))) = heap.pop() {
            let id = NodeIndex::new(idx as usize);
            order.push(id);
            for s in self.successors(id) {
                let d = &mut indeg[s.index()];
                *d -= 1;
                if *d == 0 {
                    heap.push(prio(s));
                }
            }
        }
        order
    }

    /// Sets the schedule keys so that [`Graph::topo_order`] returns `order` (which must be a
    /// topological order of every live node).
    pub fn set_schedule(&mut self, order: &[NodeId]) {
        for (i, &id) in order.iter().enumerate() {
            self.g[id].pos = i as u64;
        }
        self.next_pos = order.len() as u64;
    }
}

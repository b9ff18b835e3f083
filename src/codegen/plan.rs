//! Lowering of a scheduled graph to a [`Plan`]: what one rank launches, stream by stream.
//!
//! Requires: a verified graph whose schedule is final (the output of the pass pipeline; an
//! unoptimized graph with blocking `grad_sync` nodes lowers too).
//!
//! Guarantees:
//! - Two streams, as on a GPU: the **compute** stream runs the step's compute, bucket pack and
//!   unpack kernels in schedule order; the **comm** stream runs the collective calls in launch
//!   order. They meet only at events: the compute stream records `ready#c` once collective `c`'s
//!   input exists, the comm stream waits on it, calls, and records `done#c`, which the compute
//!   stream waits on where the graph first needs the result (`all_reduce_done`, or at once for a
//!   blocking collective).
//! - Gradients live in slots, one per `gradient` node in schedule order, and are reduced in place:
//!   an unbucketed collective works on the slot itself, a bucket's unpack writes back into the
//!   slots of its members (copies, or views of the reduced bucket when the graph's unpack says
//!   `as=views`: the step then prints `view`, and launches no kernel where the device can bind
//!   every member at its offset). The `sync` step lists the slots that hold reduced gradients.
//! - Buckets have layouts from [`layout`](super::layout): offsets, alignment, padding.
//! - The plan is a pure function of the graph; its text form ([`Plan`]'s `Display`) is
//!   deterministic, and collective steps read like the NCCL calls they become.

use std::fmt::{self, Write};

use hashbrown::HashMap;
use thiserror::Error;

use super::layout::{BucketLayout, layout_of};
use crate::graph::print::fmt_bytes;
use crate::graph::{CycleError, DType, Graph, GroupId, NodeId, Op, ReduceOp, TensorType, Value};

/// A gradient's storage on a rank.
#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    /// Parameter whose gradient this is.
    pub param: String,
    /// Type of the gradient.
    pub ty: TensorType,
}

/// One collective launch of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanCollective {
    /// Launch index (0 = first on the comm stream).
    pub id: u32,
    /// Bucket number from the graph, when the bucketing pass formed this collective.
    pub bucket: Option<u32>,
    /// Whether a pack kernel fills a flat buffer for it (else each slot is reduced in place, one
    /// call each, grouped when several).
    pub packed: bool,
    /// Gradient slots it reduces, in buffer order.
    pub slots: Vec<u32>,
    /// Reduction on the wire (`sum` after a prescaled pack).
    pub op: ReduceOp,
    /// Device group and its size.
    pub group: GroupId,
    /// Ranks in the group.
    pub group_size: u32,
    /// Where each member sits (for a bucket) or the member list (for slots).
    pub layout: BucketLayout,
    /// Whether the graph waits at once (a blocking collective).
    pub blocking: bool,
    /// Whether its unpack hands the members back as views of the reduced bucket instead of
    /// copies (`bucket_unpack ... as=views`).
    pub views: bool,
}

impl PlanCollective {
    /// Event the compute stream records once the input exists.
    pub fn ready_event(&self) -> Event {
        Event::Ready(self.id)
    }
    /// Event the comm stream records once the call finished.
    pub fn done_event(&self) -> Event {
        Event::Done(self.id)
    }
    /// Wire dtype.
    pub fn wire_dtype(&self) -> DType {
        DType::from_name(&self.layout.wire_dtype).unwrap_or(DType::F32)
    }
}

/// A cross-stream event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// Input of collective `c` is ready (compute → comm).
    Ready(u32),
    /// Collective `c` finished (comm → compute).
    Done(u32),
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Ready(c) => write!(f, "ready#{c}"),
            Event::Done(c) => write!(f, "done#{c}"),
        }
    }
}

/// One step of a stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// The step's own compute (a backward layer, an op of the recorded segment).
    Compute {
        /// Graph node it comes from.
        node: u32,
        /// Label.
        name: String,
        /// Estimated floating-point operations.
        flops: u64,
    },
    /// A gradient becomes final in its slot.
    Gradient {
        /// Slot index.
        slot: u32,
    },
    /// Launch a bucket's pack kernel (gather, scale, cast) on the compute stream.
    Pack {
        /// Collective whose bucket it fills.
        collective: u32,
    },
    /// Launch a bucket's unpack kernel (scatter back into the member slots, cast back).
    Unpack {
        /// Collective whose bucket it empties.
        collective: u32,
    },
    /// Record an event on this stream.
    Record(Event),
    /// Make this stream wait for an event.
    Wait(Event),
    /// A collective call on the comm stream (one NCCL call per buffer, grouped when several).
    AllReduce {
        /// Collective index.
        collective: u32,
    },
    /// The sync point: every listed slot holds its reduced gradient.
    Sync {
        /// Slots written back.
        slots: Vec<u32>,
    },
}

/// A lowered step: everything one rank launches.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Name of the graph.
    pub name: String,
    /// Structural hash of the graph it was lowered from.
    pub graph_hash: u64,
    /// Gradient slots, in the order their gradients become final.
    pub slots: Vec<Slot>,
    /// Collectives, in launch order.
    pub collectives: Vec<PlanCollective>,
    /// Compute stream steps, in order.
    pub compute: Vec<Step>,
    /// Comm stream steps, in order.
    pub comm: Vec<Step>,
}

/// Why a graph could not be lowered.
#[derive(Debug, Error)]
pub enum LowerError {
    /// The graph has a cycle.
    #[error(transparent)]
    Cycle(#[from] CycleError),
    /// A node reads something the plan cannot provide at that point.
    #[error("cannot lower `{line}`: {why}")]
    Unsupported {
        /// The node's text form.
        line: String,
        /// What is wrong.
        why: String,
    },
}

/// Where a value lives at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    /// Not tracked by the plan (compute results, inputs, parameters).
    Opaque,
    /// A gradient slot.
    Slot(u32),
    /// A packed bucket buffer not yet handed to a collective (its pack node).
    Packed(NodeId),
    /// A packed bucket buffer owned by collective `c`.
    Bucket(u32),
    /// Result `i` of collective `c`, still in flight.
    InFlight(u32, u32),
}

struct Lowering<'g> {
    graph: &'g Graph,
    /// Printed number of every node (for error lines).
    num: Vec<u32>,
    loc: HashMap<Value, Loc>,
    /// Pack node → (index of its pack step, member slots), until its collective is known.
    packs: HashMap<NodeId, (usize, Vec<u32>)>,
    plan: Plan,
}

impl Lowering<'_> {
    fn err(&self, id: NodeId, why: impl Into<String>) -> LowerError {
        LowerError::Unsupported {
            line: crate::graph::print::node_line(self.graph, id, &self.num, self.num[id.index()]),
            why: why.into(),
        }
    }

    fn loc(&self, v: Value) -> Loc {
        self.loc.get(&v).copied().unwrap_or(Loc::Opaque)
    }

    fn slots_of(&self, id: NodeId) -> Result<Vec<u32>, LowerError> {
        self.graph
            .operands(id)
            .iter()
            .map(|v| match self.loc(*v) {
                Loc::Slot(s) => Ok(s),
                other => Err(self.err(
                    id,
                    format!(
                        "operand %{}#{} is not a gradient slot ({other:?})",
                        v.node.index(),
                        v.result
                    ),
                )),
            })
            .collect()
    }

    fn collective(
        &mut self,
        id: NodeId,
        reduce: ReduceOp,
        group: GroupId,
        bucket: Option<u32>,
        blocking: bool,
    ) -> Result<(), LowerError> {
        let ops = self.graph.operands(id).to_vec();
        let c = self.plan.collectives.len() as u32;
        let (packed, slots) = match ops.as_slice() {
            [v] if matches!(self.loc(*v), Loc::Packed(_)) => {
                let Some((step, slots)) = self.packs.remove(&v.node) else {
                    return Err(self.err(id, "bucket buffer read by a second collective"));
                };
                self.plan.compute[step] = Step::Pack { collective: c };
                self.loc.insert(*v, Loc::Bucket(c));
                (true, slots)
            }
            _ => (false, self.slots_of(id)?),
        };
        let group_size = self
            .graph
            .group_size(group)
            .ok_or_else(|| self.err(id, format!("group {group} is not declared")))?;
        let layout = layout_of(self.graph, id, reduce, group, bucket);
        let coll = PlanCollective {
            id: c,
            bucket,
            packed,
            slots,
            op: reduce,
            group,
            group_size,
            layout,
            blocking,
            views: false,
        };
        self.plan.compute.push(Step::Record(coll.ready_event()));
        self.plan.comm.push(Step::Wait(coll.ready_event()));
        self.plan.comm.push(Step::AllReduce { collective: c });
        self.plan.comm.push(Step::Record(coll.done_event()));
        for (i, v) in ops.iter().enumerate() {
            let result = Value {
                node: id,
                result: i as u32,
            };
            let l = if blocking {
                self.loc(*v)
            } else {
                Loc::InFlight(c, i as u32)
            };
            self.loc.insert(result, l);
        }
        if blocking {
            self.plan.compute.push(Step::Wait(coll.done_event()));
        }
        self.plan.collectives.push(coll);
        Ok(())
    }

    fn node(&mut self, id: NodeId) -> Result<(), LowerError> {
        // Nothing may read a value while its collective is in flight.
        if !matches!(self.graph.op(id), Op::AllReduceDone { .. }) {
            for v in self.graph.operands(id) {
                if let Loc::InFlight(c, _) = self.loc(v) {
                    return Err(self.err(
                        id,
                        format!("reads collective #{c}'s result before its all_reduce_done"),
                    ));
                }
            }
        }
        match self.graph.op(id).clone() {
            Op::Parameter { .. } | Op::Input { .. } => {}
            Op::Compute { name, flops, .. } => {
                for v in self.graph.operands(id) {
                    if let Loc::Bucket(_) = self.loc(v) {
                        return Err(self.err(id, "compute reads a bucket buffer"));
                    }
                }
                self.plan.compute.push(Step::Compute {
                    node: id.index() as u32,
                    name,
                    flops,
                });
            }
            Op::Gradient { param } => {
                let slot = self.plan.slots.len() as u32;
                let ty = self.graph.node(id).results[0].clone();
                self.plan.slots.push(Slot { param, ty });
                self.loc.insert(
                    Value {
                        node: id,
                        result: 0,
                    },
                    Loc::Slot(slot),
                );
                self.plan.compute.push(Step::Gradient { slot });
            }
            Op::GradSync { reduce, group, .. } => {
                self.collective(id, reduce, group, None, true)?;
            }
            Op::AllReduce {
                reduce,
                group,
                bucket,
            } => self.collective(id, reduce, group, bucket, true)?,
            Op::AllReduceStart {
                reduce,
                group,
                bucket,
            } => self.collective(id, reduce, group, bucket, false)?,
            Op::BucketPack { .. } => {
                let slots = self.slots_of(id)?;
                // The step names its collective once the collective that reads it is lowered.
                self.packs.insert(id, (self.plan.compute.len(), slots));
                self.loc.insert(
                    Value {
                        node: id,
                        result: 0,
                    },
                    Loc::Packed(id),
                );
                self.plan.compute.push(Step::Pack {
                    collective: u32::MAX,
                });
            }
            Op::AllReduceDone { .. } => {
                let mut coll = None;
                for (i, v) in self.graph.operands(id).iter().enumerate() {
                    let Loc::InFlight(c, _) = self.loc(*v) else {
                        return Err(self.err(id, "operand is not an in-flight collective"));
                    };
                    coll = Some(c);
                    let start_operand = self.graph.operands(v.node)[v.result as usize];
                    let back = self.loc(start_operand);
                    self.loc.insert(
                        Value {
                            node: id,
                            result: i as u32,
                        },
                        back,
                    );
                }
                if let Some(c) = coll {
                    self.plan.compute.push(Step::Wait(Event::Done(c)));
                }
            }
            Op::BucketUnpack { views, .. } => {
                let [v] = self.graph.operands(id)[..] else {
                    return Err(self.err(id, "unpack takes one operand"));
                };
                let Loc::Bucket(c) = self.loc(v) else {
                    return Err(self.err(id, "unpack of something that is not a reduced bucket"));
                };
                self.plan.collectives[c as usize].views = views;
                let member_slots = self.plan.collectives[c as usize].slots.clone();
                for (i, s) in member_slots.iter().enumerate() {
                    self.loc.insert(
                        Value {
                            node: id,
                            result: i as u32,
                        },
                        Loc::Slot(*s),
                    );
                }
                self.plan.compute.push(Step::Unpack { collective: c });
            }
            Op::Sync => {
                let slots = self.slots_of(id)?;
                self.plan.compute.push(Step::Sync { slots });
            }
        }
        Ok(())
    }
}

/// Lowers a scheduled graph to a plan.
pub fn lower(graph: &Graph) -> Result<Plan, LowerError> {
    let order = graph.topo_order()?;
    let mut num = vec![u32::MAX; graph.node_bound()];
    for (i, id) in order.iter().enumerate() {
        num[id.index()] = i as u32;
    }
    let mut l = Lowering {
        graph,
        num,
        loc: HashMap::new(),
        packs: HashMap::new(),
        plan: Plan {
            name: graph.name.clone(),
            graph_hash: graph.structural_hash()?,
            slots: Vec::new(),
            collectives: Vec::new(),
            compute: Vec::new(),
            comm: Vec::new(),
        },
    };
    for id in order {
        l.node(id)?;
    }
    if let Some((&pack, _)) = l.packs.iter().next() {
        return Err(l.err(pack, "no collective reads this bucket"));
    }
    Ok(l.plan)
}

/// Name of the pack kernel for a member dtype and wire dtype (`pack_f32_bf16`).
pub fn pack_kernel_name(member: &str, wire: &str) -> String {
    format!("pack_{member}_{wire}")
}

/// NCCL's name for a dtype.
pub fn nccl_dtype(d: DType) -> &'static str {
    match d {
        DType::F32 => "ncclFloat32",
        DType::F16 => "ncclFloat16",
        DType::BF16 => "ncclBfloat16",
        DType::F64 => "ncclFloat64",
        DType::I64 => "ncclInt64",
        DType::I32 => "ncclInt32",
        DType::Bool => "ncclUint8",
    }
}

/// NCCL's name for a reduction (`mean` is NCCL's average).
pub fn nccl_op(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "ncclSum",
        ReduceOp::Mean => "ncclAvg",
    }
}

impl Plan {
    /// The slot of the first gradient the compute stream takes at or after step `pc` that
    /// `wanted` accepts, if any.
    pub fn gradient_from(&self, pc: usize, wanted: impl Fn(u32) -> bool) -> Option<u32> {
        self.compute[pc.min(self.compute.len())..]
            .iter()
            .find_map(|s| match s {
                Step::Gradient { slot } if wanted(*slot) => Some(*slot),
                _ => None,
            })
    }

    /// Bytes all collectives put on the wire.
    pub fn wire_bytes(&self) -> u64 {
        self.collectives.iter().map(|c| c.layout.bytes).sum()
    }

    fn fmt_step(&self, s: &Step, out: &mut String) -> fmt::Result {
        match s {
            Step::Compute { name, flops, .. } => write!(out, "compute {name:?} flops={flops}"),
            Step::Gradient { slot } => {
                write!(
                    out,
                    "gradient s{slot} {:?}",
                    self.slots[*slot as usize].param
                )
            }
            Step::Pack { collective } => {
                let c = &self.collectives[*collective as usize];
                let l = &c.layout;
                let member = l.members.first().map_or("f32", |m| m.dtype.as_str());
                write!(
                    out,
                    "launch {} bucket={} members={} elems={}",
                    pack_kernel_name(member, &l.wire_dtype),
                    c.bucket_label(),
                    l.members.len(),
                    l.numel
                )?;
                if let Some(d) = l.scale_div {
                    write!(out, " scale=1/{d}")?;
                }
                Ok(())
            }
            Step::Unpack { collective } => {
                let c = &self.collectives[*collective as usize];
                let l = &c.layout;
                if c.views {
                    // No kernel where the device binds every member at its offset.
                    return write!(
                        out,
                        "view bucket={} members={} ; slices of the reduced bucket",
                        c.bucket_label(),
                        l.members.len()
                    );
                }
                let member = l.members.first().map_or("f32", |m| m.dtype.as_str());
                write!(
                    out,
                    "launch unpack_{}_{} bucket={} members={}",
                    l.wire_dtype,
                    member,
                    c.bucket_label(),
                    l.members.len()
                )
            }
            Step::Record(e) => write!(out, "record {e}"),
            Step::Wait(e) => write!(out, "wait {e}"),
            Step::AllReduce { collective } => {
                let c = &self.collectives[*collective as usize];
                let calls = c.calls();
                if calls.len() > 1 {
                    out.push_str("ncclGroupStart()\n    ");
                }
                for (i, (buf, count, dtype)) in calls.iter().enumerate() {
                    if i > 0 {
                        out.push_str("\n    ");
                    }
                    write!(
                        out,
                        "ncclAllReduce({buf}, {buf}, count={count}, {}, {}, comm=g{}, stream=comm) ; #{} {}",
                        nccl_dtype(*dtype),
                        nccl_op(c.op),
                        c.group.0,
                        c.id,
                        fmt_bytes(count * dtype.size()),
                    )?;
                }
                if calls.len() > 1 {
                    out.push_str("\n    ncclGroupEnd()");
                }
                Ok(())
            }
            Step::Sync { slots } => write!(out, "sync slots={}", slots.len()),
        }
    }
}

impl PlanCollective {
    fn bucket_label(&self) -> String {
        match self.bucket {
            Some(b) => format!("b{b}"),
            None => format!("c{}", self.id),
        }
    }

    /// The NCCL calls this collective makes: (buffer, element count, dtype).
    pub fn calls(&self) -> Vec<(String, u64, DType)> {
        if self.packed {
            return vec![(self.bucket_label(), self.layout.numel, self.wire_dtype())];
        }
        self.slots
            .iter()
            .zip(&self.layout.members)
            .map(|(s, m)| {
                (
                    format!("s{s}"),
                    m.numel,
                    DType::from_name(&m.dtype).unwrap_or(DType::F32),
                )
            })
            .collect()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        writeln!(
            out,
            "plan {:?} graph={:016x} slots={} collectives={} wire={}",
            self.name,
            self.graph_hash,
            self.slots.len(),
            self.collectives.len(),
            fmt_bytes(self.wire_bytes())
        )?;
        for c in self.collectives.iter().filter(|c| c.packed) {
            let l = &c.layout;
            write!(
                out,
                "buffer {} {}[{}] padding={} ; {} ·",
                c.bucket_label(),
                l.wire_dtype,
                l.numel,
                l.padding,
                fmt_bytes(l.bytes)
            )?;
            for (s, m) in c.slots.iter().zip(&l.members) {
                write!(out, " s{s}@{}", m.offset)?;
            }
            out.push('\n');
        }
        out.push_str("stream compute {\n");
        for s in &self.compute {
            out.push_str("    ");
            self.fmt_step(s, &mut out)?;
            out.push('\n');
        }
        out.push_str("}\nstream comm {\n");
        for s in &self.comm {
            out.push_str("    ");
            self.fmt_step(s, &mut out)?;
            out.push('\n');
        }
        out.push_str("}\n");
        f.write_str(&out)
    }
}

//! Bucket layouts: for every collective of an optimized graph, in launch order, the tensors it
//! reduces and where each sits in the flat buffer.
//!
//! Members are laid out in operand order, each starting at a multiple of the pack's `align`
//! bytes of the wire dtype ([`PACK_ALIGN_BYTES`] for a collective without a pack, so vectorized
//! kernels and NCCL see aligned members); the gaps and the tail are padding that packs write as
//! zero. A single-member collective has no padding.

use serde::Serialize;

use crate::graph::{
    CycleError, DType, Graph, GroupId, NodeId, Op, PACK_ALIGN_BYTES, ReduceOp, Value,
};

/// One tensor inside a bucket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MemberLayout {
    /// Parameter whose gradient this is, when the member is a gradient.
    pub param: Option<String>,
    /// Offset in the flat buffer, in elements (the same count in the member's and the wire dtype).
    pub offset: u64,
    /// Element count.
    pub numel: u64,
    /// The member's own dtype (the buffer may be cast).
    pub dtype: String,
}

impl MemberLayout {
    /// Its elements' indices in the flat buffer.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset as usize..(self.offset + self.numel) as usize
    }
}

/// One collective launch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BucketLayout {
    /// Bucket number (launch order for bucketed graphs).
    pub bucket: Option<u32>,
    /// Reduction performed on the wire (`sum` after a prescaled pack).
    pub reduce: String,
    /// Divisor folded into the pack, if any.
    pub scale_div: Option<u32>,
    /// Device group.
    pub group: u32,
    /// Element type on the wire.
    pub wire_dtype: String,
    /// Members in buffer order.
    pub members: Vec<MemberLayout>,
    /// Elements on the wire, padding included.
    pub numel: u64,
    /// Padding elements (alignment gaps and tail) inside `numel`.
    pub padding: u64,
    /// Bytes on the wire.
    pub bytes: u64,
    /// Bytes of the members in their own dtype.
    pub member_bytes: u64,
}

fn param_of(graph: &Graph, v: Value) -> Option<String> {
    match graph.op(v.node) {
        Op::Gradient { param } => Some(param.clone()),
        _ => None,
    }
}

pub(crate) fn layout_of(
    graph: &Graph,
    id: NodeId,
    reduce: ReduceOp,
    group: GroupId,
    bucket: Option<u32>,
) -> BucketLayout {
    let ops = graph.operands(id);
    // A single operand produced by a pack means the members are the pack's operands.
    let (members_vals, scale_div, wire, align_bytes): (Vec<Value>, Option<u32>, DType, u64) =
        match (ops.as_slice(), ops.first().map(|v| graph.op(v.node))) {
            (
                [v],
                Some(Op::BucketPack {
                    scale_div, align, ..
                }),
            ) => (
                graph.operands(v.node).to_vec(),
                *scale_div,
                graph.ty(*v).dtype,
                u64::from(*align),
            ),
            _ => (
                ops.to_vec(),
                None,
                graph.ty(ops[0]).dtype,
                u64::from(PACK_ALIGN_BYTES),
            ),
        };
    let align = if members_vals.len() > 1 {
        (align_bytes / wire.size()).max(1)
    } else {
        1
    };
    let members = members_vals.iter().map(|v| {
        let t = graph.ty(*v);
        (param_of(graph, *v), t.numel(), t.dtype)
    });
    let mut l = BucketLayout::place(members, wire, scale_div, align);
    l.bucket = bucket;
    l.reduce = reduce.name().to_string();
    l.group = group.0;
    l
}

impl BucketLayout {
    /// A bucket of members of `sizes` elements of `member` each (parameters `p0`, `p1`, ...),
    /// laid out as codegen lays out a pack with `align_bytes` (one member: no padding): bucket
    /// 0, group 0, summed. For tests, benches and one-off copies.
    pub fn of_sizes(
        sizes: &[u64],
        member: DType,
        wire: DType,
        scale_div: Option<u32>,
        align_bytes: u64,
    ) -> BucketLayout {
        let align = if sizes.len() > 1 {
            (align_bytes / wire.size()).max(1)
        } else {
            1
        };
        let members = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (Some(format!("p{i}")), n, member));
        BucketLayout::place(members, wire, scale_div, align)
    }

    /// Members in this order, each at a multiple of `align` elements, the tail padded to one.
    fn place(
        members: impl Iterator<Item = (Option<String>, u64, DType)>,
        wire: DType,
        scale_div: Option<u32>,
        align: u64,
    ) -> BucketLayout {
        let mut offset: u64 = 0;
        let mut placed = Vec::new();
        let mut member_bytes = 0;
        let mut data: u64 = 0;
        for (param, numel, dtype) in members {
            offset = offset.next_multiple_of(align);
            data = data.saturating_add(numel);
            placed.push(MemberLayout {
                param,
                offset,
                numel,
                dtype: dtype.name().to_string(),
            });
            offset += numel;
            member_bytes = numel
                .saturating_mul(dtype.size())
                .saturating_add(member_bytes);
        }
        let numel = offset.next_multiple_of(align);
        BucketLayout {
            bucket: Some(0),
            reduce: ReduceOp::Sum.name().to_string(),
            scale_div,
            group: 0,
            wire_dtype: wire.name().to_string(),
            numel,
            padding: numel - data,
            bytes: numel * wire.size(),
            member_bytes,
            members: placed,
        }
    }
}

/// Layouts of every collective (blocking, started, or a not-yet-lowered `grad_sync`), in schedule
/// order, which is launch order.
pub fn bucket_layouts(graph: &Graph) -> Result<Vec<BucketLayout>, CycleError> {
    let mut out = Vec::new();
    for id in graph.topo_order()? {
        match *graph.op(id) {
            Op::AllReduce {
                reduce,
                group,
                bucket,
            }
            | Op::AllReduceStart {
                reduce,
                group,
                bucket,
            } => out.push(layout_of(graph, id, reduce, group, bucket)),
            Op::GradSync { reduce, group, .. } => {
                out.push(layout_of(graph, id, reduce, group, None))
            }
            _ => {}
        }
    }
    Ok(out)
}

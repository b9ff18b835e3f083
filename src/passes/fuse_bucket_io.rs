//! `fuse-bucket-io`: lower a multi-tensor all-reduce to one fused pack, an all-reduce of the flat
//! buffer, and one fused unpack.
//!
//! **Why it pays.** A bucket needs its members in one contiguous buffer. Copying member by member,
//! then scaling for a mean, then casting for a low-precision reduce, reads and writes the bucket
//! three times. One pack kernel does the flatten, the divide by the group size and the cast in a
//! single pass, as PyTorch DDP folds its divide into the copy into the bucket; one unpack kernel
//! scatters and casts back.
//!
//! **Requires:** `all_reduce` nodes whose members share a dtype (the verifier's bucket invariant).
//!
//! **Guarantees:** every `all_reduce` with more than one operand, or whose bucket is cast to another
//! `reduce_dtype`, becomes `bucket_pack → all_reduce (one flat operand) → bucket_unpack`, and every
//! reader of member `i` reads unpack result `i`, of the member's original type. With `prescale`,
//! a `mean` becomes a pack with `scale=1/N` (N the group size) and a `sum` all-reduce, so that the
//! divide is fused into the copy. Single-tensor all-reduces with nothing to cast are left alone:
//! packing them would only add a copy. The pack and unpack are elementwise regions: copy, scale,
//! cast, nothing else. Every pack carries the configured member alignment (`align=`, printed
//! when it is not the default 16 bytes), which the bucket layout honours. With `views`
//! (`gradient_as_bucket_view`) an unpack that casts nothing hands its members back as views of
//! the reduced bucket (`as=views`), and the pack aligns members at least [`VIEW_ALIGN_BYTES`]
//! apart so that every member can be bound at its offset.
//!
//! Before → after (group of 4):
//! ```text
//! %4 = all_reduce reduce=mean group=g0 bucket=0 (%1, %3) : f32[16,16], f32[16]
//! ```
//! becomes
//! ```text
//! %4 = bucket_pack bucket=0 scale=1/4 (%1, %3) : f32[272]
//! %5 = all_reduce reduce=sum group=g0 bucket=0 (%4) : f32[272]
//! %6 = bucket_unpack bucket=0 (%5) : f32[16,16], f32[16]
//! ```

use super::{Pass, PassError};
use crate::graph::{DType, Graph, NodeId, Op, PACK_ALIGN_BYTES, ReduceOp, TensorType, Value};

/// Options of the pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FuseConfig {
    /// Cast buckets to this float type for the all-reduce.
    pub reduce_dtype: Option<DType>,
    /// Fold a mean's divide into the pack and reduce with `sum`.
    pub prescale: bool,
    /// Member alignment of every pack, in bytes (a power of two).
    pub align_bytes: u32,
    /// Unpack members as views of the reduced bucket where nothing is cast (and align the
    /// members at least [`VIEW_ALIGN_BYTES`] apart so that a device can bind every one).
    pub views: bool,
}

impl Default for FuseConfig {
    fn default() -> Self {
        FuseConfig {
            reduce_dtype: None,
            prescale: false,
            align_bytes: PACK_ALIGN_BYTES,
            views: false,
        }
    }
}

/// The member alignment of a bucket whose members are handed back as views: 512 bytes, the
/// coarsest offset alignment CubeCL's runtimes ask of a buffer binding (CUDA's; wgpu devices
/// ask at most 256).
pub const VIEW_ALIGN_BYTES: u32 = 512;

/// The pass. See the module doc.
pub struct FuseBucketIo {
    config: FuseConfig,
}

impl FuseBucketIo {
    /// A pass with the given options.
    pub fn new(config: FuseConfig) -> Self {
        FuseBucketIo { config }
    }
}

impl Pass for FuseBucketIo {
    fn name(&self) -> &'static str {
        "fuse-bucket-io"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool, PassError> {
        if !crate::graph::pack_align_ok(u64::from(self.config.align_bytes)) {
            return Err(PassError::Unsupported(format!(
                "pack alignment {} bytes is not a power of two of at most {} bytes",
                self.config.align_bytes,
                crate::graph::MAX_PACK_ALIGN_BYTES
            )));
        }
        let targets: Vec<NodeId> = graph
            .node_ids()
            .filter(|&id| {
                let Op::AllReduce { .. } = graph.op(id) else {
                    return false;
                };
                let ops = graph.operands(id);
                let dtype = graph.ty(ops[0]).dtype;
                let cast = self
                    .config
                    .reduce_dtype
                    .is_some_and(|d| d != dtype && dtype.is_float());
                let packable = ops.iter().all(|v| graph.ty(*v).dtype.is_float());
                packable && (ops.len() > 1 || cast)
            })
            .collect();
        let mut next_bucket = graph
            .node_ids()
            .filter_map(|id| match graph.op(id) {
                Op::AllReduce { bucket, .. } | Op::AllReduceStart { bucket, .. } => *bucket,
                Op::BucketPack { bucket, .. } => Some(*bucket),
                _ => None,
            })
            .max()
            .map_or(0, |b| b + 1);
        let mut pairs = Vec::new();
        for &id in &targets {
            fuse_one(graph, id, &self.config, &mut next_bucket, &mut pairs)?;
        }
        graph.replace_uses_batch(&pairs);
        for &id in &targets {
            graph.remove_node(id);
        }
        Ok(!targets.is_empty())
    }
}

fn fuse_one(
    graph: &mut Graph,
    id: NodeId,
    cfg: &FuseConfig,
    next_bucket: &mut u32,
    pairs: &mut Vec<(Value, Value)>,
) -> Result<(), PassError> {
    let Some((reduce, group, bucket)) = graph.op(id).as_all_reduce() else {
        unreachable!("targets are all_reduce nodes");
    };
    let operands = graph.operands(id);
    let members: Vec<TensorType> = operands.iter().map(|v| graph.ty(*v).clone()).collect();
    let total: u64 = members.iter().map(|t| t.numel()).sum();
    let dtype = cfg.reduce_dtype.unwrap_or(members[0].dtype);
    let bucket = bucket.unwrap_or_else(|| {
        *next_bucket += 1;
        *next_bucket - 1
    });
    let (scale_div, reduce) = match (reduce, cfg.prescale) {
        (ReduceOp::Mean, true) => {
            let n = graph.group_size(group).ok_or_else(|| {
                PassError::Unsupported(format!(
                    "all_reduce of bucket {bucket} names undeclared group {group}"
                ))
            })?;
            (Some(n), ReduceOp::Sum)
        }
        (r, _) => (None, r),
    };
    let pos = graph.node(id).pos;
    let flat = TensorType::new(dtype, &[total]);
    let pack = graph.add_node(
        Op::BucketPack {
            bucket,
            scale_div,
            align: if cfg.views {
                cfg.align_bytes.max(VIEW_ALIGN_BYTES)
            } else {
                cfg.align_bytes
            },
        },
        [flat.clone()],
        &operands,
    );
    let ar = graph.add_node(
        Op::AllReduce {
            reduce,
            group,
            bucket: Some(bucket),
        },
        [flat],
        &[Value::of(pack)],
    );
    // Every member shares a dtype (the verifier's bucket rule): views unless it was cast.
    let views = cfg.views && members.iter().all(|t| t.dtype == dtype);
    let unpack = graph.add_node(
        Op::BucketUnpack { bucket, views },
        members,
        &[Value::of(ar)],
    );
    for n in [pack, ar, unpack] {
        graph.node_mut(n).pos = pos;
    }
    for i in 0..operands.len() as u32 {
        pairs.push((
            Value {
                node: id,
                result: i,
            },
            Value {
                node: unpack,
                result: i,
            },
        ));
    }
    // Order constraints on the old collective now bind the whole pack → reduce → unpack chain.
    graph.transfer_order_edges(id, pack, unpack);
    Ok(())
}

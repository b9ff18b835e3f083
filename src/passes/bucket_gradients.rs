//! `bucket-gradients`: combine per-parameter gradient syncs into bucketed all-reduces.
//!
//! **Why it pays.** An all-reduce costs a fixed latency plus its bytes over the bandwidth; one
//! collective per parameter pays the latency ~150 times a step and keeps the link idle between
//! small messages. Buckets amortise the latency, and launching each bucket as soon as its last
//! gradient exists lets communication run under the rest of backward.
//!
//! **Requires:** a verified graph whose `grad_sync` nodes carry unique `ready` positions.
//!
//! **Guarantees:** every `grad_sync` is replaced by one result of exactly one `all_reduce` with
//! `bucket=k`; buckets are numbered in launch order (the ready position of their last member);
//! members of one bucket share reduce op, dtype and group (the key) and are contiguous in ready
//! order within their key; no member depends on another (a dependency closes the bucket); with
//! `ddp` and `cost` a bucket exceeds the cap only by the tensor that closed it. Tensors are never
//! split.
//!
//! Policies ([`BucketPolicy`]):
//! - `per-param`: one bucket per gradient (Burn's behaviour today).
//! - `ddp`: PyTorch DDP's rule. Per key, limits `[first_bucket_bytes, cap, cap, ...]`; walking in
//!   ready order a bucket closes as soon as its size reaches the current limit.
//! - `cost`: dynamic programming over bucket boundaries under the cost model. Each gradient's
//!   ready time comes from the compute before it; a bucket of several tensors is packed on the
//!   compute stream when its last member is ready (delaying what follows) and unpacked at the
//!   sync point, a single tensor is reduced in place; the communication stream is serial:
//!   `f(j) = min_s max(ready(j) + delays so far, f(s-1)) + allreduce(bytes(s..=j))`, an
//!   all-reduce that starts before the segment's compute is over paying the system's busy
//!   alpha where it has one ([`crate::cost::SystemProfile::alpha_busy_us`], until the horizon
//!   [`crate::cost::CostModel::busy_horizon`] puts the end of the busy cores) and delaying the
//!   compute after it by the system's interference where it has one
//!   ([`crate::cost::SystemProfile::interference_us`]: the delays are packs and
//!   interference). The program
//!   runs twice (judging a prefix by when the step would end, and by when its last all-reduce
//!   finishes), and the policy keeps the best, by the predicted end of the step ([`step_end`]),
//!   of those two, DDP's partition and one bucket per tensor (ties go to fewer buckets), so it is
//!   never predicted worse than `ddp`. Its feasible buckets are those `ddp` could form (under the
//!   cap but for the closing tensor) holding at most [`MAX_COST_BUCKET_TENSORS`] tensors.
//!
//! Before → after (`ddp`, first bucket 1 KiB):
//! ```text
//! %1 = gradient "b" (%0) : f32[256]
//! %2 = grad_sync "b" reduce=mean group=g0 ready=0 (%1) : f32[256]
//! %4 = gradient "w" (%3) : f32[256]
//! %5 = grad_sync "w" reduce=mean group=g0 ready=1 (%4) : f32[256]
//! %6 = sync (%2, %5)
//! ```
//! becomes
//! ```text
//! %1 = gradient "b" (%0) : f32[256]
//! %2 = all_reduce reduce=mean group=g0 bucket=0 (%1) : f32[256]
//! %4 = gradient "w" (%3) : f32[256]
//! %5 = all_reduce reduce=mean group=g0 bucket=1 (%4) : f32[256]
//! %6 = sync (%2, %5)
//! ```

use std::ops::Range;

use hashbrown::HashMap;

use super::{Pass, PassError};
use crate::config::{BucketConfig, BucketPolicy};
use crate::cost::CostModel;
use crate::graph::{DType, Graph, GroupId, NodeId, Op, ReduceOp, Value};

/// Largest number of tensors the `cost` policy puts in one bucket (bounds its search; XLA's
/// all-reduce combiner uses a similar count limit).
pub const MAX_COST_BUCKET_TENSORS: usize = 1024;

/// The pass. See the module doc.
pub struct BucketGradients {
    config: BucketConfig,
    cost: CostModel,
}

impl BucketGradients {
    /// A pass with the given options; `cost` is used by the `cost` policy.
    pub fn new(config: BucketConfig, cost: CostModel) -> Self {
        BucketGradients { config, cost }
    }
}

impl Pass for BucketGradients {
    fn name(&self) -> &'static str {
        "bucket-gradients"
    }

    fn run(&self, graph: &mut Graph) -> Result<bool, PassError> {
        let buckets = plan_buckets(graph, &self.config, &self.cost)?;
        if buckets.is_empty() {
            return Ok(false);
        }
        rewrite(graph, &buckets);
        Ok(true)
    }
}

/// What combines with what: collectives combine only within one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey {
    /// Reduce op.
    pub reduce: ReduceOp,
    /// Element type.
    pub dtype: DType,
    /// Device group.
    pub group: GroupId,
}

/// One gradient sync as the policies see it.
#[derive(Clone, Debug)]
struct Candidate {
    node: NodeId,
    bytes: u64,
    ready_time: f64,
    topo: usize,
    /// The bucket holding this candidate must start at or after this index of its key's sequence.
    lo: usize,
}

/// Chooses buckets: lists of `grad_sync` nodes, in launch order.
pub fn plan_buckets(
    graph: &Graph,
    config: &BucketConfig,
    cost: &CostModel,
) -> Result<Vec<Vec<NodeId>>, PassError> {
    let order = graph.topo_order()?;
    // Sequence of grad_syncs per key, in ready order, with ready times from the compute before.
    let mut keys: Vec<BucketKey> = Vec::new();
    let mut seqs: HashMap<BucketKey, Vec<(u32, Candidate)>> = HashMap::new();
    let mut t = 0.0f64;
    for (topo, &id) in order.iter().enumerate() {
        match graph.op(id) {
            Op::Compute { flops, .. } => t += cost.compute_secs(*flops),
            Op::GradSync {
                reduce,
                group,
                ready,
                ..
            } => {
                let ty = &graph.node(id).results[0];
                let key = BucketKey {
                    reduce: *reduce,
                    dtype: ty.dtype,
                    group: *group,
                };
                if !seqs.contains_key(&key) {
                    keys.push(key);
                }
                seqs.entry(key).or_default().push((
                    *ready,
                    Candidate {
                        node: id,
                        bytes: ty.bytes(),
                        ready_time: t,
                        topo,
                        lo: 0,
                    },
                ));
            }
            _ => {}
        }
    }
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    // The compute is over. An all-reduce that starts before it takes time from it; one that
    // starts before the system's busy horizon (the end of the compute, or where the system
    // says the cores come free) pays the busy alpha.
    let compute_until = t;
    let busy_until = cost.busy_horizon(t);
    keys.sort();
    let mut all: Vec<(usize, BucketKey, Vec<NodeId>)> = Vec::new();
    for key in keys {
        let mut seq = seqs.remove(&key).expect("key collected above");
        seq.sort_by_key(|(r, c)| (*r, c.topo));
        let mut cands: Vec<Candidate> = seq.into_iter().map(|(_, c)| c).collect();
        dependency_floors(graph, &order, &mut cands);
        // A sync that depends on one of its key ready after it: no bucketing respects both.
        if let Some((i, c)) = cands.iter().enumerate().find(|(i, c)| c.lo > *i) {
            let later = &cands[c.lo - 1];
            let name = |n: NodeId| match graph.op(n) {
                Op::GradSync { param, ready, .. } => {
                    format!("grad_sync \"{param}\" (ready={ready})")
                }
                _ => format!("node {}", n.index()),
            };
            return Err(PassError::Unsupported(format!(
                "{} depends on {}, which is ready after it: ready positions must follow the dependencies (sync {i} of its key)",
                name(c.node),
                name(later.node)
            )));
        }
        let sizes: Vec<u64> = cands.iter().map(|c| c.bytes).collect();
        let lo: Vec<usize> = cands.iter().map(|c| c.lo).collect();
        let ranges = match config.policy {
            BucketPolicy::PerParam => (0..cands.len()).map(|i| i..i + 1).collect(),
            BucketPolicy::Ddp => {
                ddp_partition(&sizes, &lo, config.first_bucket_bytes, config.cap_bytes)
            }
            BucketPolicy::Cost => {
                let ready: Vec<f64> = cands.iter().map(|c| c.ready_time).collect();
                let ranks = graph.group_size(key.group).unwrap_or(1);
                cost_partition(
                    &sizes,
                    &ready,
                    &lo,
                    config.first_bucket_bytes,
                    config.cap_bytes,
                    |b, start| cost.all_reduce_secs_at(b, ranks, start < busy_until),
                    |b| cost.copy_secs(b),
                    |at| cost.interference_secs(ranks, at < compute_until),
                )
            }
        };
        for r in ranges {
            let last_topo = cands[r.clone()].iter().map(|c| c.topo).max().unwrap_or(0);
            all.push((
                last_topo,
                key,
                cands[r].iter().map(|c| c.node).collect::<Vec<_>>(),
            ));
        }
    }
    all.sort_by_key(|(t, k, _)| (*t, *k));
    Ok(all.into_iter().map(|(_, _, b)| b).collect())
}

/// Sets each candidate's `lo`: one past the latest earlier candidate of the same key it depends
/// on (through any path of data or order edges), so no bucket holds both.
fn dependency_floors(graph: &Graph, order: &[NodeId], cands: &mut [Candidate]) {
    let mut idx_of: HashMap<NodeId, usize> = HashMap::with_capacity(cands.len());
    for (i, c) in cands.iter().enumerate() {
        idx_of.insert(c.node, i);
    }
    // anc[n] = 1 + the largest sequence index of a candidate that is an ancestor of n (0: none).
    let mut anc = vec![0usize; graph.node_bound()];
    for &id in order {
        let mut a = 0;
        for p in graph.predecessors(id) {
            a = a.max(anc[p.index()]);
            if let Some(&i) = idx_of.get(&p) {
                a = a.max(i + 1);
            }
        }
        anc[id.index()] = a;
        if let Some(&i) = idx_of.get(&id) {
            cands[i].lo = a;
        }
    }
}

/// PyTorch DDP's greedy rule over sizes in ready order. `lo[i]` forces a boundary: the bucket
/// holding `i` starts at or after `lo[i]`.
pub fn ddp_partition(sizes: &[u64], lo: &[usize], first: u64, cap: u64) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    let mut limit = first;
    for i in 0..sizes.len() {
        if i > start && lo[i] > start {
            out.push(start..i);
            start = i;
            bytes = 0;
            limit = cap;
        }
        bytes += sizes[i];
        if bytes >= limit {
            out.push(start..i + 1);
            start = i + 1;
            bytes = 0;
            limit = cap;
        }
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// The cost policy (see the module doc): the best, under [`step_end`], of its dynamic program
/// judged two ways (by when the step would end; by when the last all-reduce finishes), DDP's
/// partition with limits `first` and `cap`, and one bucket per tensor. `ready[i]` is when tensor
/// `i` is ready if no pack ran before it, `allreduce(bytes, start)` the predicted time of one
/// all-reduce of `bytes` that starts at `start`, `copy(bytes)` that of a pack or an unpack,
/// `interference(at)` the compute-stream time an all-reduce takes from the compute it runs
/// beside (see [`crate::cost::SystemProfile::interference_us`]), `at` its start on the
/// compute's own clock (less the delays packs and interference added before it: against the
/// `ready` times, whether compute still runs).
#[allow(clippy::too_many_arguments)]
pub fn cost_partition(
    sizes: &[u64],
    ready: &[f64],
    lo: &[usize],
    first: u64,
    cap: u64,
    allreduce: impl Fn(u64, f64) -> f64,
    copy: impl Fn(u64) -> f64,
    interference: impl Fn(f64) -> f64,
) -> Vec<Range<usize>> {
    let costs = Costs {
        allreduce: &allreduce,
        copy: &copy,
        interference: &interference,
    };
    let candidates = [
        dp_partition(sizes, ready, lo, cap, &costs, true),
        dp_partition(sizes, ready, lo, cap, &costs, false),
        ddp_partition(sizes, lo, first, cap),
        (0..sizes.len()).map(|i| i..i + 1).collect(),
    ];
    let mut best: Option<(f64, usize, Vec<Range<usize>>)> = None;
    for c in candidates {
        let end = step_end(sizes, ready, &c, &costs);
        let better = match &best {
            None => true,
            Some((e, n, _)) => {
                let eps = 1e-12 + 1e-9 * e.abs();
                end < e - eps || ((end - e).abs() <= eps && c.len() < *n)
            }
        };
        if better {
            best = Some((end, c.len(), c));
        }
    }
    best.map(|b| b.2).unwrap_or_default()
}

/// What the cost policy prices a partition with (see [`cost_partition`]).
#[derive(Clone, Copy)]
pub struct Costs<'a> {
    /// An all-reduce of `bytes` that starts at `start`.
    pub allreduce: &'a dyn Fn(u64, f64) -> f64,
    /// A pack or an unpack of `bytes`.
    pub copy: &'a dyn Fn(u64) -> f64,
    /// The compute an all-reduce takes from the compute beside it, given its start on the
    /// compute's own clock (see [`cost_partition`]).
    pub interference: &'a dyn Fn(f64) -> f64,
}

/// When a step with buckets `parts` ends, as the schedule runs it: each bucket of several
/// tensors is packed on the compute stream once its last member is ready (delaying everything
/// after it) and launched on a serial communication stream, delaying the compute beside it by
/// its interference; at the sync point the compute stream waits for each bucket in launch order
/// and unpacks the packed ones.
pub fn step_end(sizes: &[u64], ready: &[f64], parts: &[Range<usize>], costs: &Costs<'_>) -> f64 {
    let Costs {
        allreduce,
        copy,
        interference,
    } = costs;
    let mut delay = 0.0;
    let mut link = 0.0f64;
    let mut done: Vec<(f64, f64)> = Vec::with_capacity(parts.len());
    for r in parts {
        let Some(j) = r.end.checked_sub(1) else {
            continue;
        };
        let bytes: u64 = sizes[r.clone()].iter().sum();
        let unpack = if r.len() > 1 { copy(bytes) } else { 0.0 };
        delay += unpack;
        let start = (ready[j] + delay).max(link);
        link = start + allreduce(bytes, start);
        delay += interference(start - delay);
        done.push((link, unpack));
    }
    let mut t = ready.last().copied().unwrap_or(0.0) + delay;
    for (finish, unpack) in done {
        t = t.max(finish) + unpack;
    }
    t
}

/// The cost policy's dynamic program over bucket boundaries; `by_end` judges a prefix by when
/// a step made of it would end, else by when its last all-reduce finishes.
fn dp_partition(
    sizes: &[u64],
    ready: &[f64],
    lo: &[usize],
    cap: u64,
    costs: &Costs<'_>,
    by_end: bool,
) -> Vec<Range<usize>> {
    let Costs {
        allreduce,
        copy,
        interference,
    } = costs;
    #[derive(Clone, Copy)]
    struct Best {
        /// When the last all-reduce of the prefix finishes.
        finish: f64,
        /// Compute-stream delay the prefix's packs and interference add.
        delay: f64,
        /// Compute-stream time of the prefix's unpacks (at the sync point).
        unpacks: f64,
        /// When a step made of this prefix would end.
        end: f64,
        buckets: usize,
        /// Start of the prefix's last bucket.
        start: usize,
    }
    let n = sizes.len();
    let mut best = vec![
        Best {
            finish: 0.0,
            delay: 0.0,
            unpacks: 0.0,
            end: 0.0,
            buckets: 0,
            start: 0,
        };
        n + 1
    ];
    for j in 0..n {
        let mut cand: Option<Best> = None;
        let mut before_last = 0u64;
        let mut max_lo = lo[j];
        let mut s = j;
        loop {
            if s < max_lo {
                break;
            }
            let bytes = before_last + sizes[j];
            let prev = best[s];
            let packed = s < j;
            let copy_secs = if packed { copy(bytes) } else { 0.0 };
            let unpacks = prev.unpacks + copy_secs;
            let shift = prev.delay + copy_secs;
            let start = (ready[j] + shift).max(prev.finish);
            let finish = start + allreduce(bytes, start);
            let delay = shift + interference(start - shift);
            let end = (finish + copy_secs).max(ready[j] + delay + unpacks);
            let c = Best {
                finish,
                delay,
                unpacks,
                end,
                buckets: prev.buckets + 1,
                start: s,
            };
            let better = match cand {
                None => true,
                Some(b) => {
                    let eps = 1e-12 + 1e-9 * b.end.abs();
                    if by_end && (c.end - b.end).abs() > eps {
                        c.end < b.end
                    } else if (c.finish - b.finish).abs() > eps {
                        c.finish < b.finish
                    } else if (c.delay - b.delay).abs() > eps {
                        c.delay < b.delay
                    } else {
                        c.buckets < b.buckets
                    }
                }
            };
            if better {
                cand = Some(c);
            }
            if s == 0 || j - s + 1 >= MAX_COST_BUCKET_TENSORS {
                break;
            }
            s -= 1;
            before_last += sizes[s];
            max_lo = max_lo.max(lo[s]);
            if before_last >= cap {
                break;
            }
        }
        best[j + 1] = cand.expect("the single-tensor bucket is always feasible");
    }
    let mut out = Vec::new();
    let mut j = n;
    while j > 0 {
        let s = best[j].start;
        out.push(s..j);
        j = s;
    }
    out.reverse();
    out
}

fn rewrite(graph: &mut Graph, buckets: &[Vec<NodeId>]) {
    let mut pairs = Vec::new();
    for (b, members) in buckets.iter().enumerate() {
        let Op::GradSync { reduce, group, .. } = *graph.op(members[0]) else {
            unreachable!("plan_buckets returns grad_sync nodes only");
        };
        let operands: Vec<Value> = members.iter().map(|m| graph.operands(*m)[0]).collect();
        let types: Vec<_> = members
            .iter()
            .map(|m| graph.node(*m).results[0].clone())
            .collect();
        let pos = members
            .iter()
            .map(|m| graph.node(*m).pos)
            .max()
            .unwrap_or(0);
        let ar = graph.add_node(
            Op::AllReduce {
                reduce,
                group,
                bucket: Some(b as u32),
            },
            types,
            &operands,
        );
        graph.node_mut(ar).pos = pos;
        for (i, &m) in members.iter().enumerate() {
            pairs.push((
                Value::of(m),
                Value {
                    node: ar,
                    result: i as u32,
                },
            ));
            graph.transfer_order_edges(m, ar, ar);
        }
    }
    graph.replace_uses_batch(&pairs);
    for m in buckets.iter().flatten() {
        graph.remove_node(*m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ddp_closes_when_limit_reached() {
        let r = ddp_partition(&[4, 4, 4, 4, 4], &[0; 5], 8, 12);
        assert_eq!(r, vec![0..2, 2..5]);
    }

    #[test]
    fn ddp_dependency_forces_boundary() {
        let r = ddp_partition(&[1, 1, 1, 1], &[0, 0, 2, 0], 100, 100);
        assert_eq!(r, vec![0..2, 2..4]);
    }

    #[test]
    fn cost_prefers_fewer_buckets_when_all_hidden() {
        // Everything ready at t=0 except the last; latency dominates: one bucket is best.
        let r = cost_partition(
            &[1, 1, 1],
            &[0.0, 0.0, 0.0],
            &[0; 3],
            100,
            100,
            |b, _| 1.0 + b as f64 * 1e-3,
            |_| 0.0,
            |_| 0.0,
        );
        assert_eq!(r, vec![0..3]);
    }

    #[test]
    fn cost_splits_to_overlap() {
        // Tensor 0 ready at 0, tensor 1 ready at 10; launching 0 early hides it.
        let r = cost_partition(
            &[100, 100],
            &[0.0, 10.0],
            &[0; 2],
            1000,
            1000,
            |b, _| 0.1 + b as f64 * 0.05,
            |_| 0.0,
            |_| 0.0,
        );
        assert_eq!(r, vec![0..1, 1..2]);
    }

    #[test]
    fn collectives_that_slow_the_compute_beside_them_are_fewer() {
        // Three tensors ready at 0, 10 and 20, the backward over at 20; an all-reduce takes 3
        // per tensor. Free beside the backward, one per tensor hides all but the last (ends at
        // 23). When a collective under the backward takes 5 from the compute, one per tensor
        // ends at 33 (the second and third ready at 15 and 30); two launches, the first at
        // 10, end at 28 (the third ready at 25); one at the end, at 29.
        let run = |tax: f64| {
            cost_partition(
                &[1, 1, 1],
                &[0.0, 10.0, 20.0],
                &[0; 3],
                100,
                100,
                |b, _| 3.0 * b as f64,
                |_| 0.0,
                move |at| if at < 20.0 { tax } else { 0.0 },
            )
        };
        assert_eq!(run(0.0), vec![0..1, 1..2, 2..3]);
        assert_eq!(run(5.0), vec![0..2, 2..3]);
    }

    #[test]
    fn a_collective_dearer_during_the_backward_waits_for_its_end() {
        // Tensor 0 ready at 0, tensor 1 at 10, the backward over at 10. At one alpha
        // throughout, reducing tensor 0 alone under the backward wins (ends at 16 against 21);
        // when a collective costs 20 more while the backward runs, one bucket after it does.
        let run = |busy: f64| {
            let ar = move |b: u64, start: f64| if start < 10.0 { busy } else { 1.0 } + b as f64;
            cost_partition(
                &[5, 5],
                &[0.0, 10.0],
                &[0; 2],
                100,
                100,
                ar,
                |_| 0.0,
                |_| 0.0,
            )
        };
        assert_eq!(run(1.0), vec![0..1, 1..2]);
        assert_eq!(run(20.0), vec![0..2]);
    }

    #[test]
    fn cost_is_never_predicted_worse_than_ddp_or_per_param() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let n = (next() % 40 + 1) as usize;
            let sizes: Vec<u64> = (0..n).map(|_| next() % 5000 + 1).collect();
            let mut t = 0.0;
            let ready: Vec<f64> = (0..n)
                .map(|_| {
                    t += (next() % 100) as f64 * 1e-3;
                    t
                })
                .collect();
            let lo = vec![0; n];
            let ar = |b: u64, _| 0.02 + b as f64 * 2e-5;
            let cp = |b: u64| b as f64 * 4e-6;
            // Half the cases with interference under the backward.
            let tax = if next() % 2 == 0 { 0.0 } else { 0.01 };
            let busy_until = t;
            let itf = move |at: f64| if at < busy_until { tax } else { 0.0 };
            let cost = cost_partition(&sizes, &ready, &lo, 2000, 8000, ar, cp, itf);
            let costs = Costs {
                allreduce: &ar,
                copy: &cp,
                interference: &itf,
            };
            let end = step_end(&sizes, &ready, &cost, &costs);
            for other in [
                ddp_partition(&sizes, &lo, 2000, 8000),
                (0..n).map(|i| i..i + 1).collect(),
            ] {
                assert!(end <= step_end(&sizes, &ready, &other, &costs) + 1e-12);
            }
            // A partition of 0..n in order.
            assert_eq!(cost.first().map(|r| r.start), Some(0));
            assert!(cost.windows(2).all(|w| w[0].end == w[1].start));
            assert_eq!(cost.last().map(|r| r.end), Some(n));
        }
    }

    #[test]
    fn step_end_counts_packs_unpacks_and_the_serial_link() {
        // Two tensors ready at 0 and 1; all-reduce 1 + bytes; copy = bytes / 10.
        let ar = |b: u64, _| 1.0 + b as f64;
        let cp = |b: u64| b as f64 / 10.0;
        let none = |_| 0.0;
        let costs = Costs {
            allreduce: &ar,
            copy: &cp,
            interference: &none,
        };
        // Separately: launch at 0 (done 3), at 1 (done max(1, 3) + 3 = 6); no copies.
        assert_eq!(step_end(&[2, 2], &[0.0, 1.0], &[0..1, 1..2], &costs), 6.0);
        // Together: pack 0.4 at 1, launch 1.4, done 6.4, unpack 0.4.
        let together = step_end(&[2, 2], &[0.0, 1.0], &[Range { start: 0, end: 2 }], &costs);
        assert!((together - 6.8).abs() < 1e-12, "{together}");
        // A collective launched before the backward's end (at 1) that takes 0.5 from the
        // compute beside it: the first one's launch at 0 delays the second's readiness to 1.5.
        let tax = |at: f64| if at < 1.0 { 0.5 } else { 0.0 };
        let taxed = Costs {
            interference: &tax,
            ..costs
        };
        // First at 0 (done 3, compute +0.5), second ready at 1.5, starts at 3, done 6.
        assert_eq!(step_end(&[2, 2], &[0.0, 1.0], &[0..1, 1..2], &taxed), 6.0);
        // Tensors ready at 0 and 4: without the tax, done 3 and 7; with it, the second is ready
        // at 4.5 and done 7.5.
        assert_eq!(step_end(&[2, 2], &[0.0, 4.0], &[0..1, 1..2], &costs), 7.0);
        let tax4 = |at: f64| if at < 4.0 { 0.5 } else { 0.0 };
        let taxed4 = Costs {
            interference: &tax4,
            ..costs
        };
        assert_eq!(step_end(&[2, 2], &[0.0, 4.0], &[0..1, 1..2], &taxed4), 7.5);
    }

    #[test]
    fn cost_respects_cap_and_floors() {
        let r = cost_partition(
            &[5, 5, 5],
            &[0.0; 3],
            &[0, 1, 0],
            6,
            6,
            |_, _| 1.0,
            |_| 0.0,
            |_| 0.0,
        );
        assert!(r.iter().all(|x| x.start >= 1 || x.end <= 1), "{r:?}");
    }
}

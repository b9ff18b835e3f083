//! The verifier: checks every invariant of a graph and returns all violations at once.
//!
//! Invariants, each reported with the printed line of the node it concerns:
//! 1. **acyclic**: data and order edges form a DAG;
//! 2. **well-formed edges**: a node's data operands fill slots `0..n` once each, and each names a
//!    result its producer has;
//! 3. **op signatures**: each op has the operand and result counts and types its definition says
//!    (for example an all-reduce returns the types it reads; a pack's flat result holds exactly its
//!    members' elements; an unpack's results hold exactly its operand's elements);
//! 4. **start/done pairing**: every `all_reduce_start` has exactly one `all_reduce_done`, which reads
//!    all its results in order, and nothing else reads them;
//! 5. **bucket legality**: the members of one collective or pack share a dtype (reduce op and group
//!    are the op's own), and no member depends on another;
//! 6. **bucket cap** (when a cap is given): a bucket without its last member is under the cap, so
//!    a bucket exceeds the cap only by the tensor that closed it, or when it holds one tensor;
//! 7. **reduced exactly once**: a gradient flows into at most one reduction, each parameter has at
//!    most one gradient, `ready` positions are unique, and no reduced value is dropped;
//! 8. **fused regions are elementwise**: a pack only copies, scales by `1/N` (N >= 1) and casts
//!    between float types; its unpack reads the reduced pack of the same bucket and casts each
//!    member back to the type it had; its member alignment is a power of two of at most 64 KiB;
//!    an unpack that hands members back as views of the bucket casts nothing.
//!
//! 9. **sizes fit**: every result's element and byte counts fit in 64 bits.
//!
//! Groups named by collectives must be declared in the header.

use std::fmt;

use hashbrown::{HashMap, HashSet};
use thiserror::Error;

use super::{Edge, Graph, NodeId, Op, TensorType, Value, print};

/// Options for checks that depend on the compiler's configuration.
#[derive(Clone, Copy, Debug, Default)]
pub struct VerifyOptions {
    /// When set, invariant 6 is checked against this many bytes.
    pub bucket_cap_bytes: Option<u64>,
}

/// One violated invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The printed line of the node concerned (empty for whole-graph problems).
    pub line: String,
    /// What is wrong.
    pub message: String,
}

/// All violations found in a graph.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub struct VerifyError {
    /// Every violation, in schedule order of the nodes concerned.
    pub violations: Vec<Violation>,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} invariant violation(s):", self.violations.len())?;
        for v in &self.violations {
            if v.line.is_empty() {
                write!(f, "\n  {}", v.message)?;
            } else {
                write!(f, "\n  {}\n    at: {}", v.message, v.line)?;
            }
        }
        Ok(())
    }
}

struct Checker<'a> {
    g: &'a Graph,
    num: Vec<u32>,
    out: Vec<Violation>,
    /// Nodes dead-code removal keeps.
    live: HashSet<NodeId>,
}

/// The nodes dead-code removal keeps: every node that is not pure (see [`Op::is_pure`]), and
/// everything such a node reads or waits for, directly or not.
fn surviving(g: &Graph) -> HashSet<NodeId> {
    let mut stack: Vec<NodeId> = g.node_ids().filter(|id| !g.op(*id).is_pure()).collect();
    let mut live: HashSet<NodeId> = stack.iter().copied().collect();
    while let Some(n) = stack.pop() {
        for p in g.predecessors(n) {
            if live.insert(p) {
                stack.push(p);
            }
        }
    }
    live
}

impl Checker<'_> {
    fn report(&mut self, id: NodeId, message: impl Into<String>) {
        let line = print::node_line(self.g, id, &self.num, self.num[id.index()]);
        self.out.push(Violation {
            line,
            message: message.into(),
        });
    }
}

/// Checks every invariant; `Ok` when the graph satisfies all of them.
pub fn verify(graph: &Graph, opts: &VerifyOptions) -> Result<(), VerifyError> {
    let (order, cyclic) = match graph.topo_order() {
        Ok(o) => (o, None),
        Err(e) => (graph.node_ids().collect::<Vec<_>>(), Some(e.node)),
    };
    let mut num = vec![u32::MAX; graph.node_bound()];
    for (i, id) in order.iter().enumerate() {
        num[id.index()] = i as u32;
    }
    let mut c = Checker {
        g: graph,
        num,
        out: Vec::new(),
        live: surviving(graph),
    };
    if let Some(n) = cyclic {
        c.report(n, "graph has a cycle through or behind this node");
    }
    let mut grad_of_param: HashMap<&str, NodeId> = HashMap::new();
    let mut ready_seen: HashMap<u32, NodeId> = HashMap::new();
    for &id in &order {
        for (i, ty) in graph.node(id).results.iter().enumerate() {
            if ty.checked_bytes().is_none() {
                c.report(
                    id,
                    format!("result {i} ({ty}) has more bytes than fit in 64 bits"),
                );
            }
        }
        check_edges(&mut c, id);
        check_signature(&mut c, id);
        match graph.op(id) {
            Op::Gradient { param } => {
                if grad_of_param.insert(param.as_str(), id).is_some() {
                    c.report(
                        id,
                        format!("parameter \"{param}\" has more than one gradient"),
                    );
                }
                let reductions = reductions_of(graph, id);
                if reductions > 1 {
                    c.report(
                        id,
                        format!("gradient of \"{param}\" is reduced {reductions} times"),
                    );
                }
            }
            Op::GradSync { param, ready, .. } => {
                if ready_seen.insert(*ready, id).is_some() {
                    c.report(id, format!("ready position {ready} is used twice"));
                }
                if let Some(v) = graph.operands(id).first()
                    && let Op::Gradient { param: p } = graph.op(v.node)
                    && p != param
                {
                    c.report(
                        id,
                        format!("grad_sync of \"{param}\" reads the gradient of \"{p}\""),
                    );
                }
            }
            _ => {}
        }
        check_groups(&mut c, id);
        check_bucket(&mut c, id, opts, cyclic.is_none());
        check_dropped(&mut c, id);
    }
    if c.out.is_empty() {
        Ok(())
    } else {
        Err(VerifyError { violations: c.out })
    }
}

fn check_edges(c: &mut Checker<'_>, id: NodeId) {
    let g = c.g;
    let mut slots: Vec<u32> = Vec::new();
    let mut bad = Vec::new();
    for e in g
        .raw()
        .edges_directed(id, petgraph::Direction::Incoming)
        .map(|e| (petgraph::visit::EdgeRef::source(&e), *e.weight()))
    {
        if let (src, Edge::Data { operand, result }) = e {
            slots.push(operand);
            if result as usize >= g.node(src).results.len() {
                bad.push(format!(
                    "operand {operand} reads result #{result} of a node with {} result(s)",
                    g.node(src).results.len()
                ));
            }
        }
    }
    slots.sort_unstable();
    if slots.iter().enumerate().any(|(i, s)| *s != i as u32) {
        bad.push(format!(
            "operand slots {slots:?} are not 0..{}",
            slots.len()
        ));
    }
    for m in bad {
        c.report(id, m);
    }
}

fn types_of(g: &Graph, vals: &[Value]) -> Vec<TensorType> {
    vals.iter()
        .filter(|v| (v.result as usize) < g.node(v.node).results.len())
        .map(|v| g.ty(*v).clone())
        .collect()
}

fn check_signature(c: &mut Checker<'_>, id: NodeId) {
    let g = c.g;
    let node = g.node(id);
    let ops = g.operands(id);
    let ins = types_of(g, &ops);
    if ins.len() != ops.len() {
        return; // reported by check_edges
    }
    let nres = node.results.len();
    let mut errs: Vec<String> = Vec::new();
    let mut want = |cond: bool, msg: &str| {
        if !cond {
            errs.push(msg.to_string());
        }
    };
    match &node.op {
        Op::Parameter { .. } | Op::Input { .. } => {
            want(ops.is_empty(), "a leaf takes no operands");
            want(nres == 1, "a leaf has exactly one result");
        }
        Op::Compute { .. } => want(nres == 1, "compute has exactly one result"),
        Op::Gradient { .. } => {
            want(ops.len() == 1, "gradient takes exactly one operand");
            want(nres == 1, "gradient has exactly one result");
        }
        Op::GradSync { .. } => {
            want(ops.len() == 1, "grad_sync takes exactly one operand");
            want(
                node.results.as_slice() == ins.as_slice(),
                "grad_sync returns the type it reads",
            );
        }
        Op::AllReduce { .. } | Op::AllReduceStart { .. } => {
            want(!ops.is_empty(), "a collective needs at least one operand");
            want(
                node.results.as_slice() == ins.as_slice(),
                "a collective returns the types it reads, one result per operand",
            );
            want(
                ins.windows(2).all(|w| w[0].dtype == w[1].dtype),
                "members of one collective must share a dtype",
            );
        }
        Op::AllReduceDone { .. } => {
            want(
                !ops.is_empty(),
                "all_reduce_done needs at least one operand",
            );
            want(
                node.results.as_slice() == ins.as_slice(),
                "all_reduce_done returns the types it reads",
            );
            let start = ops.first().map(|v| v.node);
            let from_one_start = start.is_some_and(|start| {
                matches!(g.op(start), Op::AllReduceStart { .. })
                    && ops
                        .iter()
                        .enumerate()
                        .all(|(i, v)| v.node == start && v.result == i as u32)
                    && ops.len() == g.node(start).results.len()
            });
            want(
                from_one_start,
                "all_reduce_done must read every result of one all_reduce_start, in order",
            );
        }
        Op::BucketPack {
            scale_div, align, ..
        } => {
            want(!ops.is_empty(), "bucket_pack needs at least one member");
            want(
                super::pack_align_ok(u64::from(*align)),
                "bucket_pack's align is a power of two of at most 65536 bytes",
            );
            want(nres == 1, "bucket_pack has exactly one result");
            if let Some(r) = node.results.first() {
                let total: u64 = ins.iter().map(|t| t.numel()).sum();
                want(
                    r.shape.len() == 1 && r.numel() == total,
                    "bucket_pack's result is one flat buffer holding exactly its members' elements",
                );
                want(
                    r.dtype.is_float() && ins.iter().all(|t| t.dtype.is_float()),
                    "bucket_pack casts only between float types",
                );
            }
            want(
                ins.windows(2).all(|w| w[0].dtype == w[1].dtype),
                "members of one bucket must share a dtype",
            );
            want(
                scale_div.is_none_or(|d| d >= 1),
                "scale divisor must be >= 1",
            );
        }
        Op::BucketUnpack { bucket, views } => {
            want(ops.len() == 1, "bucket_unpack takes exactly one operand");
            want(nres >= 1, "bucket_unpack has one result per member");
            if let Some(t) = ins.first() {
                want(
                    !views || node.results.iter().all(|r| r.dtype == t.dtype),
                    "bucket_unpack as=views hands back members of the bucket's own dtype (a cast member is a copy)",
                );
                let total: u64 = node.results.iter().map(|t| t.numel()).sum();
                want(
                    t.shape.len() == 1 && t.numel() == total,
                    "bucket_unpack's results hold exactly its operand's elements",
                );
                match pack_feeding(g, ops[0]) {
                    Some(pack) => {
                        let pack_bucket = match g.op(pack) {
                            Op::BucketPack { bucket, .. } => *bucket,
                            _ => u32::MAX,
                        };
                        want(
                            pack_bucket == *bucket,
                            "bucket_unpack reads the pack of another bucket",
                        );
                        let members = types_of(g, &g.operands(pack));
                        want(
                            members.as_slice() == node.results.as_slice(),
                            "bucket_unpack must return each member in the type it was packed from",
                        );
                    }
                    None => errs.push(
                        "bucket_unpack must read a reduced bucket_pack (through all_reduce or \
                         all_reduce_start/done)"
                            .to_string(),
                    ),
                }
            }
        }
        Op::Sync => want(nres == 0, "sync has no results"),
    }
    for m in errs {
        c.report(id, m);
    }
}

/// The pack whose reduced buffer `v` is: pack → all_reduce → v, or pack → start → done → v.
fn pack_feeding(g: &Graph, v: Value) -> Option<NodeId> {
    let mut cur = v;
    for _ in 0..3 {
        match g.op(cur.node) {
            Op::BucketPack { .. } => return Some(cur.node),
            Op::AllReduce { .. } | Op::AllReduceStart { .. } | Op::AllReduceDone { .. } => {
                let ops = g.operands(cur.node);
                cur = *ops.get(cur.result as usize)?;
            }
            _ => return None,
        }
    }
    None
}

/// How many reductions a gradient flows into (directly, or through a pack).
pub fn reductions_of(g: &Graph, id: NodeId) -> usize {
    let mut n = 0;
    for (user, _, _) in g.uses(id) {
        match g.op(user) {
            op if op.is_reduction() => n += 1,
            Op::BucketPack { .. } => {
                n += g
                    .uses(user)
                    .iter()
                    .filter(|(u, _, _)| g.op(*u).is_reduction())
                    .count()
            }
            _ => {}
        }
    }
    n
}

fn check_groups(c: &mut Checker<'_>, id: NodeId) {
    let group = match c.g.op(id) {
        Op::GradSync { group, .. }
        | Op::AllReduce { group, .. }
        | Op::AllReduceStart { group, .. } => *group,
        _ => return,
    };
    if c.g.group_size(group).is_none() {
        c.report(id, format!("group {group} is not declared"));
    }
}

fn check_bucket(c: &mut Checker<'_>, id: NodeId, opts: &VerifyOptions, acyclic: bool) {
    let g = c.g;
    let is_bucket = matches!(
        g.op(id),
        Op::AllReduce { .. } | Op::AllReduceStart { .. } | Op::BucketPack { .. }
    );
    if !is_bucket {
        return;
    }
    let ops = g.operands(id);
    if ops.len() > 1
        && acyclic
        && let Some(m) = dependent_members(c, &ops)
    {
        c.report(id, m);
    }
    if let Some(cap) = opts.bucket_cap_bytes
        && ops.len() > 1
    {
        let bytes: Vec<u64> = types_of(g, &ops).iter().map(|t| t.bytes()).collect();
        let total: u64 = bytes.iter().sum();
        let before_last = total - bytes.last().copied().unwrap_or(0);
        if before_last >= cap {
            c.report(
                id,
                format!(
                    "bucket holds {} before its last member, over the cap of {}",
                    print::fmt_bytes(before_last),
                    print::fmt_bytes(cap)
                ),
            );
        }
    }
    if let Op::AllReduceStart { .. } = g.op(id) {
        let uses = g.uses(id);
        let dones: HashSet<NodeId> = uses.iter().map(|u| u.0).collect();
        let ok = dones.len() == 1
            && dones
                .iter()
                .all(|d| matches!(g.op(*d), Op::AllReduceDone { .. }))
            && uses.len() == g.node(id).results.len();
        if !ok {
            c.report(
                id,
                "all_reduce_start must be read by exactly one all_reduce_done and nothing else",
            );
        }
    }
}

/// Whether one member's producer reaches another member's producer. The search is bounded by
/// schedule position, so it only walks the region between the members.
fn dependent_members(c: &Checker<'_>, ops: &[Value]) -> Option<String> {
    let g = c.g;
    let members: HashSet<NodeId> = ops.iter().map(|v| v.node).collect();
    let max_pos = members.iter().map(|m| c.num[m.index()]).max()?;
    for &start in &members {
        let mut stack: Vec<NodeId> = g.successors(start).into_vec();
        let mut seen: HashSet<NodeId> = HashSet::new();
        while let Some(n) = stack.pop() {
            if c.num[n.index()] > max_pos || !seen.insert(n) {
                continue;
            }
            if members.contains(&n) {
                return Some(format!(
                    "bucket member %{} depends on member %{}",
                    c.num[n.index()],
                    c.num[start.index()]
                ));
            }
            stack.extend(g.successors(n));
        }
    }
    None
}

fn check_dropped(c: &mut Checker<'_>, id: NodeId) {
    let g = c.g;
    let reduced = matches!(
        g.op(id),
        Op::GradSync { .. }
            | Op::AllReduce { .. }
            | Op::AllReduceDone { .. }
            | Op::BucketUnpack { .. }
    );
    if !reduced {
        return;
    }
    // A result only counts as used when its reader is live: a reduced gradient read only by
    // dead compute is never written back either (and dead-code removal would leave it unread).
    let used: HashSet<u32> = g
        .uses(id)
        .iter()
        .filter(|u| c.live.contains(&u.0))
        .map(|u| u.2)
        .collect();
    let n = g.node(id).results.len() as u32;
    let dropped: Vec<u32> = (0..n).filter(|r| !used.contains(r)).collect();
    if !dropped.is_empty() {
        c.report(
            id,
            format!(
                "reduced result(s) {dropped:?} are never used (or only by dead code), so never written back"
            ),
        );
    }
}

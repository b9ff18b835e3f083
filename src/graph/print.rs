//! The one text form of a graph: what logs, errors and snapshots show.
//!
//! ```text
//! graph "mlp" {
//!   group g0 size=4
//!   %0 = compute "fc2" kind=matmul flops=2048 : f32[8,16]
//!   %1 = gradient "fc2.weight" (%0) : f32[16,16]
//!   %2 = grad_sync "fc2.weight" reduce=mean group=g0 ready=0 (%1) : f32[16,16] ; 1.00 KiB
//!   %3 = sync (%2)
//! }
//! ```
//!
//! Nodes appear in schedule order ([`Graph::topo_order`]) and are numbered `%0, %1, ...` as
//! printed, never by internal index. An operand is `%n` when its producer has one result and
//! `%n#r` otherwise. Order-only predecessors follow as `after(%a, %b)`. Result types follow `:`.
//! Everything after `;` is a comment for people; the parser ignores it.

use std::fmt::Write as _;

use super::{Graph, NodeId, Op};

/// Formats a byte count for people: `512 B`, `1.50 KiB`, `25.00 MiB`, `1.20 GiB`.
pub fn fmt_bytes(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes < 1024 {
        format!("{bytes} B")
    } else if b < KIB * KIB {
        format!("{:.2} KiB", b / KIB)
    } else if b < KIB * KIB * KIB {
        format!("{:.2} MiB", b / (KIB * KIB))
    } else {
        format!("{:.2} GiB", b / (KIB * KIB * KIB))
    }
}

/// Quotes a string for the text form.
pub(crate) fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The keyword and attributes of an op, as printed (without operands or types).
pub fn op_attrs_string(op: &Op) -> String {
    let kw = op.keyword();
    let bucket = |b: &Option<u32>| match b {
        Some(b) => format!(" bucket={b}"),
        None => String::new(),
    };
    match op {
        Op::Parameter { name } | Op::Input { name } => format!("{kw} {}", quote(name)),
        Op::Compute { name, kind, flops } => {
            format!("{kw} {} kind={} flops={flops}", quote(name), kind.name())
        }
        Op::Gradient { param } => format!("{kw} {}", quote(param)),
        Op::GradSync {
            param,
            ready,
            reduce,
            group,
        } => format!(
            "{kw} {} reduce={} group={group} ready={ready}",
            quote(param),
            reduce.name()
        ),
        Op::AllReduce {
            reduce,
            group,
            bucket: b,
        }
        | Op::AllReduceStart {
            reduce,
            group,
            bucket: b,
        } => format!("{kw} reduce={} group={group}{}", reduce.name(), bucket(b)),
        Op::BucketPack {
            bucket,
            scale_div,
            align,
        } => {
            let scale = scale_div
                .map(|d| format!(" scale=1/{d}"))
                .unwrap_or_default();
            let align = if *align == super::PACK_ALIGN_BYTES {
                String::new()
            } else {
                format!(" align={align}")
            };
            format!("{kw} bucket={bucket}{scale}{align}")
        }
        Op::BucketUnpack { bucket, views } => {
            format!(
                "{kw} bucket={bucket}{}",
                if *views { " as=views" } else { "" }
            )
        }
        Op::AllReduceDone { bucket: b } => format!("{kw}{}", bucket(b).trim_end()),
        Op::Sync => kw.to_string(),
    }
}

/// Prints a graph in the text form. A graph with a cycle prints its nodes in index order with a
/// leading comment saying so, so that an error about the cycle can still show the graph.
pub fn print(graph: &Graph) -> String {
    let (order, cyclic) = match graph.topo_order() {
        Ok(o) => (o, false),
        Err(_) => (graph.node_ids().collect(), true),
    };
    let mut num = vec![u32::MAX; graph.node_bound()];
    for (i, id) in order.iter().enumerate() {
        num[id.index()] = i as u32;
    }
    let mut out = String::new();
    if cyclic {
        out.push_str("; graph has a cycle: nodes in creation order\n");
    }
    let _ = writeln!(out, "graph {} {{", quote(&graph.name));
    for g in graph.groups() {
        let _ = writeln!(out, "  group {} size={}", g.id, g.size);
    }
    for (i, &id) in order.iter().enumerate() {
        out.push_str("  ");
        out.push_str(&node_line(graph, id, &num, i as u32));
        if let Some(c) = comment(graph, id, &order, &num, i) {
            out.push_str(" ; ");
            out.push_str(&c);
        }
        out.push('\n');
    }
    out.push_str("}\n");
    out
}

/// One node as printed, given the printed numbers of all nodes (without comment).
pub(crate) fn node_line(graph: &Graph, id: NodeId, num: &[u32], own: u32) -> String {
    let node = graph.node(id);
    let mut s = format!("%{own} = {}", op_attrs_string(&node.op));
    let ops = graph.operands(id);
    if !ops.is_empty() || matches!(node.op, Op::Sync) {
        s.push_str(" (");
        for (k, v) in ops.iter().enumerate() {
            if k > 0 {
                s.push_str(", ");
            }
            let n = num[v.node.index()];
            if graph.node(v.node).results.len() == 1 {
                let _ = write!(s, "%{n}");
            } else {
                let _ = write!(s, "%{n}#{}", v.result);
            }
        }
        s.push(')');
    }
    let preds = graph.order_preds(id);
    if !preds.is_empty() {
        let mut nums: Vec<u32> = preds.iter().map(|p| num[p.index()]).collect();
        nums.sort_unstable();
        s.push_str(" after(");
        for (k, n) in nums.iter().enumerate() {
            if k > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "%{n}");
        }
        s.push(')');
    }
    if !node.results.is_empty() {
        s.push_str(" :");
        for (k, t) in node.results.iter().enumerate() {
            s.push_str(if k == 0 { " " } else { ", " });
            let _ = write!(s, "{t}");
        }
    }
    s
}

/// The trailing human hint of a node, if it has one.
fn comment(graph: &Graph, id: NodeId, order: &[NodeId], num: &[u32], at: usize) -> Option<String> {
    let node = graph.node(id);
    let operand_bytes = || -> (usize, u64) {
        let ops = graph.operands(id);
        let bytes = ops.iter().map(|v| graph.ty(*v).bytes()).sum();
        (ops.len(), bytes)
    };
    match &node.op {
        Op::GradSync { .. } => Some(fmt_bytes(node.results[0].bytes())),
        Op::AllReduce { .. } | Op::BucketPack { .. } => {
            let (n, bytes) = operand_bytes();
            Some(format!(
                "{n} tensor{}, {}",
                if n == 1 { "" } else { "s" },
                fmt_bytes(bytes)
            ))
        }
        Op::AllReduceStart { .. } => {
            let bytes: u64 = node.results.iter().map(|t| t.bytes()).sum();
            let done = graph
                .uses(id)
                .iter()
                .map(|u| u.0)
                .find(|c| matches!(graph.op(*c), Op::AllReduceDone { .. }));
            let overlapped = done.map(|d| {
                let end = num[d.index()] as usize;
                order[at + 1..end.max(at + 1)]
                    .iter()
                    .filter(|n| matches!(graph.op(**n), Op::Compute { .. }))
                    .count()
            });
            Some(match overlapped {
                Some(k) => format!("{}, overlaps up to {k} compute", fmt_bytes(bytes)),
                None => fmt_bytes(bytes),
            })
        }
        _ => None,
    }
}

//! `bucket-gradients`: text in, text out, named after behaviour.

mod common;

use collective_fusion::config::BucketPolicy::{self, Cost, Ddp, PerParam};
use collective_fusion::cost::CostModel;
use collective_fusion::passes::Pass;
use collective_fusion::passes::bucket_gradients::BucketGradients;
use common::{G, bucket, chain, run_passes};

fn bucketize(text: &str, policy: BucketPolicy, first: u64, cap: u64) -> String {
    let pass: Box<dyn Pass> = Box::new(BucketGradients::new(
        bucket(policy, first, cap),
        CostModel::default(),
    ));
    run_passes(text, vec![pass], (policy != PerParam).then_some(cap))
}

/// The bucket membership of every all_reduce line, e.g. `bucket=0: 3 tensors`.
fn buckets(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.contains("= all_reduce "))
        .map(|l| {
            let b = l
                .split("bucket=")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap();
            let n = l
                .split(" (")
                .nth(1)
                .unwrap()
                .split(')')
                .next()
                .unwrap()
                .split(", ")
                .count();
            format!("bucket={b}: {n}")
        })
        .collect()
}

fn f32s(n: usize, numel: u64) -> Vec<String> {
    (0..n).map(|_| format!("f32[{numel}]")).collect()
}

fn grads<'a>(names: &'a [&'a str], tys: &'a [String]) -> Vec<G<'a>> {
    names
        .iter()
        .zip(tys)
        .map(|(n, t)| G(n, t, "mean", "g0"))
        .collect()
}

#[test]
fn respects_byte_threshold_just_under() {
    // 512 + 508 = 1020 bytes < 1024: the bucket stays open and takes the third tensor.
    let tys = vec![
        "f32[128]".into(),
        "f32[127]".into(),
        "f32[128]".into(),
        "f32[128]".into(),
    ];
    let out = bucketize(&chain(&grads(&["a", "b", "c", "d"], &tys)), Ddp, 1024, 1024);
    assert_eq!(buckets(&out), ["bucket=0: 3", "bucket=1: 1"]);
    insta::assert_snapshot!(out);
}

#[test]
fn respects_byte_threshold_exactly_at() {
    // 512 + 512 = 1024 bytes reaches the cap: the bucket closes on the second tensor.
    let tys = f32s(3, 128);
    let out = bucketize(&chain(&grads(&["a", "b", "c"], &tys)), Ddp, 1024, 1024);
    assert_eq!(buckets(&out), ["bucket=0: 2", "bucket=1: 1"]);
    insta::assert_snapshot!(out);
}

#[test]
fn first_bucket_small() {
    let tys = f32s(8, 128);
    let names = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let out = bucketize(&chain(&grads(&names, &tys)), Ddp, 512, 4096);
    assert_eq!(buckets(&out), ["bucket=0: 1", "bucket=1: 7"]);
    insta::assert_snapshot!(out);
}

#[test]
fn oversized_tensor_alone() {
    let tys = vec!["f32[4096]".into(), "f32[16]".into(), "f32[16]".into()];
    for policy in [Ddp, Cost] {
        let out = bucketize(&chain(&grads(&["big", "b", "c"], &tys)), policy, 1024, 1024);
        assert_eq!(buckets(&out), ["bucket=0: 1", "bucket=1: 2"], "{policy:?}");
        if policy == Ddp {
            insta::assert_snapshot!(out);
        }
    }
}

#[test]
fn different_dtypes_kept_apart() {
    let text = chain(&[
        G("a", "f32[16]", "mean", "g0"),
        G("b", "bf16[16]", "mean", "g0"),
        G("c", "f32[16]", "mean", "g0"),
        G("d", "bf16[16]", "mean", "g0"),
    ]);
    let out = bucketize(&text, Ddp, 1 << 20, 1 << 20);
    assert_eq!(buckets(&out), ["bucket=0: 2", "bucket=1: 2"]);
    insta::assert_snapshot!(out);
}

#[test]
fn different_groups_kept_apart() {
    let text = chain(&[
        G("a", "f32[16]", "mean", "g0"),
        G("b", "f32[16]", "mean", "g1"),
        G("c", "f32[16]", "mean", "g0"),
    ]);
    let out = bucketize(&text, Ddp, 1 << 20, 1 << 20);
    assert_eq!(buckets(&out), ["bucket=0: 1", "bucket=1: 2"]);
    insta::assert_snapshot!(out);
}

#[test]
fn different_reduce_ops_kept_apart() {
    let text = chain(&[
        G("a", "f32[16]", "sum", "g0"),
        G("b", "f32[16]", "mean", "g0"),
        G("c", "f32[16]", "sum", "g0"),
    ]);
    let out = bucketize(&text, Ddp, 1 << 20, 1 << 20);
    assert_eq!(buckets(&out), ["bucket=0: 1", "bucket=1: 2"]);
    insta::assert_snapshot!(out);
}

#[test]
fn no_dependent_combination() {
    // "b"'s gradient is computed from the reduced "a": combining them would be a cycle.
    let text = r#"graph "dep" {
  group g0 size=4
  %0 = input "loss.grad" : f32[16]
  %1 = gradient "a" (%0) : f32[16]
  %2 = grad_sync "a" reduce=mean group=g0 ready=0 (%1) : f32[16]
  %3 = compute "uses_a" kind=elementwise flops=16 (%2) : f32[16]
  %4 = gradient "b" (%3) : f32[16]
  %5 = grad_sync "b" reduce=mean group=g0 ready=1 (%4) : f32[16]
  %6 = gradient "c" (%0) : f32[16]
  %7 = grad_sync "c" reduce=mean group=g0 ready=2 (%6) : f32[16]
  %8 = sync (%5, %7)
}
"#;
    for policy in [Ddp, Cost] {
        let out = bucketize(text, policy, 1 << 20, 1 << 20);
        assert_eq!(
            buckets(&out),
            ["bucket=0: 1", "bucket=1: 2"],
            "{policy:?}\n{out}"
        );
        if policy == Ddp {
            insta::assert_snapshot!(out);
        }
    }
}

#[test]
fn per_param_policy_one_bucket_each() {
    let tys = f32s(3, 16);
    let out = bucketize(
        &chain(&grads(&["a", "b", "c"], &tys)),
        PerParam,
        1 << 20,
        1 << 20,
    );
    assert_eq!(buckets(&out), ["bucket=0: 1", "bucket=1: 1", "bucket=2: 1"]);
}

#[test]
fn cost_policy_splits_when_compute_can_hide_comm() {
    // Big tensors with a second of compute between them: each launches on its own.
    let tys = f32s(3, 4 << 20);
    let text = chain(&grads(&["a", "b", "c"], &tys))
        .replace("flops=1000000000 ", "flops=1000000000000000 ");
    let out = bucketize(&text, Cost, 1 << 30, 1 << 30);
    assert_eq!(buckets(&out), ["bucket=0: 1", "bucket=1: 1", "bucket=2: 1"]);
}

#[test]
fn cost_policy_merges_tiny_tensors() {
    // Tiny tensors: latency dominates, so they share one all-reduce.
    let tys = f32s(4, 4);
    let out = bucketize(
        &chain(&grads(&["a", "b", "c", "d"], &tys)),
        Cost,
        1 << 30,
        1 << 30,
    );
    assert_eq!(buckets(&out), ["bucket=0: 4"]);
}

/// The members of each bucket, by gradient name, buckets in the order of their first member
/// (how PyTorch lists a bucket assignment).
fn memberships(text: &str) -> Vec<Vec<String>> {
    let name_of: std::collections::HashMap<String, String> = text
        .lines()
        .filter(|l| l.contains("= gradient \""))
        .map(|l| {
            let id = l.trim().split(' ').next().unwrap().to_string();
            (id, l.split('"').nth(1).unwrap().to_string())
        })
        .collect();
    let mut out: Vec<Vec<String>> = text
        .lines()
        .filter(|l| l.contains("= all_reduce "))
        .map(|l| {
            let args = l.split(" (").nth(1).unwrap().split(')').next().unwrap();
            args.split(", ").map(|a| name_of[a].clone()).collect()
        })
        .collect();
    out.sort_by_key(|b| b[0].clone());
    out
}

/// PyTorch's own cases for DDP's bucket assignment (`_compute_bucket_assignment_by_size`, as
/// its c10d tests state them: tensors in ready order, byte limits `[first, rest...]` per dtype,
/// a bucket closing once it reaches its limit) give the same buckets under the `ddp` policy.
/// Names are the tensors' indices, so the expected lists read as PyTorch writes them.
#[test]
fn ddp_policy_assigns_buckets_as_pytorch_does_in_its_own_cases() {
    let f32_then_f64 = [
        "f32[50]", "f64[25]", "f32[50]", "f64[25]", "f32[50]", "f64[25]",
    ];
    // (tensor types in ready order, first limit, later limit, buckets by tensor index)
    type Case<'a> = (&'a [&'a str], u64, u64, &'a [&'a [&'a str]]);
    let cases: [Case; 4] = [
        // One limit, one dtype.
        (
            &["f32[100]", "f32[200]", "f32[100]", "f32[50]"],
            400,
            400,
            &[&["0"], &["1"], &["2"], &["3"]],
        ),
        // One limit, two dtypes: each dtype fills its own buckets.
        (
            &f32_then_f64,
            400,
            400,
            &[&["0", "2"], &["1", "3"], &["4"], &["5"]],
        ),
        // A small first limit, then a larger one.
        (
            &["f32[10]", "f32[10]", "f32[10]", "f32[10]"],
            40,
            80,
            &[&["0"], &["1", "2"], &["3"]],
        ),
        // Two limits, two dtypes: each dtype starts at the first limit.
        (
            &f32_then_f64,
            200,
            400,
            &[&["0"], &["1"], &["2", "4"], &["3", "5"]],
        ),
    ];
    for (tys, first, cap, want) in cases {
        let names: Vec<String> = (0..tys.len()).map(|i| i.to_string()).collect();
        let gs: Vec<G> = names
            .iter()
            .zip(tys)
            .map(|(n, t)| G(n, t, "mean", "g0"))
            .collect();
        let out = bucketize(&chain(&gs), Ddp, first, cap);
        let want: Vec<Vec<String>> = want
            .iter()
            .map(|b| b.iter().map(|s| s.to_string()).collect())
            .collect();
        assert_eq!(
            memberships(&out),
            want,
            "{tys:?}, limits {first}, {cap}\n{out}"
        );
    }
}

//! `fuse-bucket-io`, `async-collectives`, `schedule-overlap`, `dead-code`, and the pass manager.

mod common;

use collective_fusion::config::BucketPolicy::Ddp;
use collective_fusion::config::PrintAfter;
use collective_fusion::graph::DType;
use collective_fusion::graph::parse::parse;
use collective_fusion::passes::async_collectives::AsyncCollectives;
use collective_fusion::passes::cleanup::Cleanup;
use collective_fusion::passes::fuse_bucket_io::{FuseBucketIo, FuseConfig};
use collective_fusion::passes::schedule_overlap::ScheduleOverlap;
use collective_fusion::passes::{
    CompileError, Fixpoint, ManagerOptions, Pass, PassError, PassManager, compile,
};
use common::{G, bucket, chain, config, roundtrip, run_passes};

const BUCKETED: &str = r#"graph "b" {
  group g0 size=4
  %0 = input "loss.grad" : f32[8]
  %1 = compute "l1.bwd" kind=matmul flops=1000000000 (%0) : f32[8]
  %2 = gradient "w1" (%1) : f32[16,16]
  %3 = gradient "b1" (%1) : f32[16]
  %4 = all_reduce reduce=mean group=g0 bucket=0 (%2, %3) : f32[16,16], f32[16]
  %5 = compute "l0.bwd" kind=matmul flops=1000000000 (%1) : f32[8]
  %6 = gradient "w0" (%5) : f32[16,16]
  %7 = all_reduce reduce=mean group=g0 bucket=1 (%6) : f32[16,16]
  %8 = sync (%4#0, %4#1, %7)
}
"#;

fn fuse(cfg: FuseConfig) -> Box<dyn Pass> {
    Box::new(FuseBucketIo::new(cfg))
}

#[test]
fn fuse_packs_multi_tensor_buckets_and_prescales_mean() {
    let out = run_passes(
        BUCKETED,
        vec![fuse(FuseConfig {
            reduce_dtype: None,
            prescale: true,
            ..FuseConfig::default()
        })],
        None,
    );
    assert!(
        out.contains("bucket_pack bucket=0 scale=1/4 (%2, %3) : f32[272]"),
        "{out}"
    );
    assert!(
        out.contains("all_reduce reduce=sum group=g0 bucket=0"),
        "{out}"
    );
    // The single-tensor bucket needs no copy.
    assert!(
        out.contains("all_reduce reduce=mean group=g0 bucket=1 (%"),
        "{out}"
    );
    insta::assert_snapshot!(out);
}

#[test]
fn fuse_casts_to_reduce_dtype_and_back() {
    let out = run_passes(
        BUCKETED,
        vec![fuse(FuseConfig {
            reduce_dtype: Some(DType::BF16),
            prescale: false,
            ..FuseConfig::default()
        })],
        None,
    );
    assert_eq!(out.matches("bucket_pack").count(), 2, "{out}");
    assert!(out.contains(": bf16[272]"), "{out}");
    assert!(out.contains("bucket_unpack bucket=1 (%"), "{out}");
    insta::assert_snapshot!(out);
}

#[test]
fn fuse_with_views_aligns_members_and_unpacks_as_views_unless_cast() {
    let views = |reduce_dtype| FuseConfig {
        reduce_dtype,
        prescale: true,
        views: true,
        ..FuseConfig::default()
    };
    let out = run_passes(BUCKETED, vec![fuse(views(None))], None);
    assert!(
        out.contains("bucket_pack bucket=0 scale=1/4 align=512 (%2, %3) : f32[272]"),
        "{out}"
    );
    assert!(out.contains("bucket_unpack bucket=0 as=views (%"), "{out}");
    let cast = run_passes(BUCKETED, vec![fuse(views(Some(DType::BF16)))], None);
    assert_eq!(cast.matches("align=512").count(), 2, "{cast}");
    assert!(!cast.contains("as=views"), "{cast}");
}

#[test]
fn async_splits_every_collective() {
    let out = run_passes(BUCKETED, vec![Box::new(AsyncCollectives)], None);
    assert_eq!(out.matches("all_reduce_start").count(), 2);
    assert_eq!(out.matches("all_reduce_done").count(), 2);
    assert!(!out.contains("= all_reduce "), "{out}");
    insta::assert_snapshot!(out);
}

#[test]
fn schedule_launches_early_and_waits_late() {
    let out = run_passes(
        BUCKETED,
        vec![Box::new(AsyncCollectives), Box::new(ScheduleOverlap)],
        None,
    );
    let lines: Vec<&str> = out.lines().collect();
    let pos = |needle: &str| lines.iter().position(|l| l.contains(needle)).unwrap();
    // Bucket 0 launches before the compute of layer 0 and is waited for after it.
    assert!(pos("all_reduce_start reduce=mean group=g0 bucket=0") < pos("\"l0.bwd\""));
    assert!(pos("all_reduce_done bucket=0") > pos("\"l0.bwd\""));
    // Launch order is pinned by an order edge.
    assert!(lines[pos("all_reduce_start reduce=mean group=g0 bucket=1")].contains("after("));
    insta::assert_snapshot!(out);
}

#[test]
fn schedule_is_idempotent() {
    let once = run_passes(
        BUCKETED,
        vec![Box::new(AsyncCollectives), Box::new(ScheduleOverlap)],
        None,
    );
    let mut g = parse(&once).unwrap();
    let changed = ScheduleOverlap.run(&mut g).unwrap();
    assert!(!changed, "a second schedule changed the graph");
    assert_eq!(roundtrip(&g), once);
}

#[test]
fn dead_code_removes_unused_pure_nodes_only() {
    let text = r#"graph "d" {
  group g0 size=2
  %0 = input "x" : f32[4]
  %1 = compute "dead1" kind=elementwise flops=4 (%0) : f32[4]
  %2 = compute "dead2" kind=elementwise flops=4 (%1) : f32[4]
  %3 = gradient "w" (%0) : f32[4]
  %4 = input "y" : f32[4]
  %5 = gradient "kept_unreduced" (%4) : f32[4]
  %6 = all_reduce reduce=sum group=g0 (%3) : f32[4]
  %7 = sync (%6)
}
"#;
    let out = run_passes(
        text,
        vec![Box::new(Fixpoint::new(
            "cleanup",
            vec![Box::new(Cleanup)],
            4,
        ))],
        None,
    );
    assert!(!out.contains("dead"), "{out}");
    assert!(out.contains("kept_unreduced"), "{out}");
    insta::assert_snapshot!(out);
}

struct AlwaysChanges;
impl Pass for AlwaysChanges {
    fn name(&self) -> &'static str {
        "always-changes"
    }
    fn run(&self, _: &mut collective_fusion::graph::Graph) -> Result<bool, PassError> {
        Ok(true)
    }
}

#[test]
fn fixpoint_stops_at_its_limit_with_an_error() {
    let mut g = parse(BUCKETED).unwrap();
    let pm = PassManager::new(
        vec![Box::new(Fixpoint::new(
            "spin",
            vec![Box::new(AlwaysChanges)],
            3,
        ))],
        ManagerOptions::default(),
    );
    let err = pm.run(&mut g).unwrap_err();
    assert!(
        err.to_string()
            .contains("'spin' still changed the graph after 3 iterations"),
        "{err}"
    );
}

struct DropsAGradient;
impl Pass for DropsAGradient {
    fn name(&self) -> &'static str {
        "drops-a-gradient"
    }
    fn run(&self, g: &mut collective_fusion::graph::Graph) -> Result<bool, PassError> {
        let victim = g
            .node_ids()
            .find(|id| matches!(g.op(*id), collective_fusion::graph::Op::GradSync { .. }))
            .unwrap();
        let src = g.operands(victim)[0];
        g.replace_uses(collective_fusion::graph::Value::of(victim), src);
        g.remove_node(victim);
        Ok(true)
    }
}

#[test]
fn manager_catches_a_pass_that_loses_a_gradient() {
    let text = chain(&[
        G("a", "f32[4]", "mean", "g0"),
        G("b", "f32[4]", "mean", "g0"),
    ]);
    let mut g = parse(&text).unwrap();
    let pm = PassManager::new(
        vec![Box::new(DropsAGradient)],
        ManagerOptions {
            verify: true,
            ..Default::default()
        },
    );
    let err = pm.run(&mut g).unwrap_err();
    assert!(matches!(err, CompileError::LostGradient { .. }), "{err}");
    assert!(err.to_string().contains("\"a\" no longer reduced"), "{err}");
}

#[test]
fn manager_names_the_pass_after_which_verification_failed() {
    struct MakesCycle;
    impl Pass for MakesCycle {
        fn name(&self) -> &'static str {
            "makes-cycle"
        }
        fn run(&self, g: &mut collective_fusion::graph::Graph) -> Result<bool, PassError> {
            let order = g.topo_order().unwrap();
            g.add_order(order[order.len() - 1], order[1]);
            Ok(true)
        }
    }
    let mut g = parse(BUCKETED).unwrap();
    let pm = PassManager::new(
        vec![Box::new(MakesCycle)],
        ManagerOptions {
            verify: true,
            ..Default::default()
        },
    );
    let err = pm.run(&mut g).unwrap_err().to_string();
    assert!(err.starts_with("after pass 'makes-cycle':"), "{err}");
    assert!(err.contains("cycle"), "{err}");
}

/// A pass inside a fixpoint group is verified after every change it makes, and the error
/// names it inside its group; the failed compile keeps the graph as the pass left it.
#[test]
fn a_nested_pass_is_verified_named_and_its_graph_kept() {
    struct Breaks;
    impl Pass for Breaks {
        fn name(&self) -> &'static str {
            "breaks"
        }
        fn run(&self, g: &mut collective_fusion::graph::Graph) -> Result<bool, PassError> {
            let order = g.topo_order()?;
            g.add_order(order[order.len() - 1], order[1]);
            Ok(true)
        }
    }
    let pm = PassManager::new(
        vec![Box::new(Fixpoint::new("group", vec![Box::new(Breaks)], 4))],
        ManagerOptions {
            verify: true,
            ..Default::default()
        },
    );
    let err = pm.run(&mut parse(BUCKETED).unwrap()).unwrap_err();
    let CompileError::Pass { pass, error, graph } = &err else {
        panic!("{err}");
    };
    assert_eq!(pass, "group");
    assert!(
        matches!(error, PassError::Verify { pass, .. } if pass == "group/breaks"),
        "{err}"
    );
    assert!(
        err.to_string().contains("after nested pass 'group/breaks'"),
        "{err}"
    );
    assert!(graph.contains("graph \"b\" {"), "{graph}");
    // Unverified, the group's second round finds the cycle the first made: a typed error.
    let err = Fixpoint::new("group", vec![Box::new(Breaks)], 4)
        .run(&mut parse(BUCKETED).unwrap())
        .unwrap_err();
    assert!(matches!(err, PassError::Cycle(_)), "{err}");
}

/// `dead-code` runs inside the `cleanup` group and can be disabled by its own name.
#[test]
fn a_nested_pass_can_be_disabled_by_name() {
    let text = r#"graph "g" {
  %0 = input "x" : f32[4]
  %1 = compute "unused" kind=elementwise flops=4 (%0) : f32[4]
}
"#;
    let mut cfg = config(bucket(Ddp, 16, 1 << 20), true);
    let mut g = parse(text).unwrap();
    compile(&mut g, &cfg).unwrap();
    assert!(!roundtrip(&g).contains("unused"));
    cfg.disabled_passes = vec!["dead-code".into()];
    let mut g = parse(text).unwrap();
    compile(&mut g, &cfg).unwrap();
    assert!(roundtrip(&g).contains("unused"));
}

#[test]
fn disable_pass_by_name_and_print_after_change() {
    let text = chain(&[
        G("a", "f32[4]", "mean", "g0"),
        G("b", "f32[4]", "mean", "g0"),
    ]);
    let mut g = parse(&text).unwrap();
    let mut cfg = config(bucket(Ddp, 16, 1 << 20), true);
    cfg.disabled_passes = vec!["fuse-bucket-io".into()];
    cfg.print_after = PrintAfter::Change;
    let report = compile(&mut g, &cfg).unwrap();
    let ran: Vec<&str> = report.timings.iter().map(|t| t.name).collect();
    assert_eq!(
        ran,
        [
            "hoist-producers",
            "bucket-gradients",
            "async-collectives",
            "schedule-overlap",
            "cleanup"
        ]
    );
    let dumped: Vec<&str> = report.dumps.iter().map(|d| d.0.as_str()).collect();
    assert_eq!(
        dumped,
        ["bucket-gradients", "async-collectives", "schedule-overlap"]
    );
    assert!(!roundtrip(&g).contains("bucket_pack"));

    cfg.disabled_passes = vec!["no-such-pass".into()];
    let err = compile(&mut parse(&text).unwrap(), &cfg)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown pass 'no-such-pass'"), "{err}");
}

#[test]
fn whole_pipeline_on_a_small_chain() {
    let text = chain(&[
        G("fc3.bias", "f32[10]", "mean", "g0"),
        G("fc3.weight", "f32[10,64]", "mean", "g0"),
        G("fc2.bias", "f32[64]", "mean", "g0"),
        G("fc2.weight", "f32[64,64]", "mean", "g0"),
        G("fc1.bias", "f32[64]", "mean", "g0"),
        G("fc1.weight", "f32[64,32]", "mean", "g0"),
    ]);
    let mut g = parse(&text).unwrap();
    compile(&mut g, &config(bucket(Ddp, 4096, 1 << 20), true)).unwrap();
    let out = roundtrip(&g);
    // 3-layer MLP: a small first bucket, then one bucket for the rest.
    assert_eq!(out.matches("all_reduce_start").count(), 2, "{out}");
    assert_eq!(out.matches("bucket_pack").count(), 2, "{out}");
    insta::assert_snapshot!(out);
}

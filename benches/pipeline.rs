//! Pipeline time: the whole default pass pipeline on each reference model and on synthetic
//! backward chains of about 1k, 10k and 100k nodes. Run with `cargo bench --bench pipeline`.

use std::hint::black_box;
use std::time::Duration;

use collective_fusion::config::{BucketPolicy, CompileConfig};
use collective_fusion::graph::builder::{BuildOptions, build_step_graph};
use collective_fusion::graph::{ComputeKind, DType, Graph, Op, ReduceOp, TensorType, Value};
use collective_fusion::model::{BUNDLED, ModelProfile};
use collective_fusion::passes::compile;
use criterion::measurement::WallTime;
use criterion::{BatchSize, BenchmarkGroup, Criterion, criterion_group, criterion_main};

/// A backward chain of `nodes` nodes: compute → gradient → grad_sync, repeated, then a sync.
fn synthetic(nodes: usize) -> Graph {
    let mut g = Graph::new(format!("chain{nodes}"));
    let group = g.add_group(8);
    let mut prev = g.add_node(
        Op::Input {
            name: "loss.grad".into(),
        },
        [TensorType::new(DType::F32, &[1024])],
        &[],
    );
    let mut syncs = Vec::new();
    for i in 0..nodes.saturating_sub(2) / 3 {
        prev = g.add_node(
            Op::Compute {
                name: format!("l{i}.bwd"),
                kind: ComputeKind::Matmul,
                flops: 1_000_000_000 + (i as u64 % 13) * 100_000_000,
            },
            [TensorType::new(DType::F32, &[1024])],
            &[Value::of(prev)],
        );
        let numel = ((i as u64 * 7919) % 10_000 + 1) * 64;
        let ty = TensorType::new(DType::F32, &[numel]);
        let grad = g.add_node(
            Op::Gradient {
                param: format!("p{i}"),
            },
            [ty.clone()],
            &[Value::of(prev)],
        );
        let sync = g.add_node(
            Op::GradSync {
                param: format!("p{i}"),
                ready: i as u32,
                reduce: ReduceOp::Mean,
                group,
            },
            [ty],
            &[Value::of(grad)],
        );
        syncs.push(Value::of(sync));
    }
    g.add_node(Op::Sync, [], &syncs);
    g
}

fn config(policy: BucketPolicy) -> CompileConfig {
    let mut c = CompileConfig::default();
    c.bucket.policy = policy;
    c.verify = false;
    c
}

/// Times the whole pipeline on `graph` under the ddp and cost policies.
fn bench_policies(group: &mut BenchmarkGroup<'_, WallTime>, name: &str, graph: &Graph) {
    for policy in [BucketPolicy::Ddp, BucketPolicy::Cost] {
        let cfg = config(policy);
        group.bench_function(format!("{name}/{}", policy.name()), |b| {
            b.iter_batched(
                || graph.clone(),
                |mut g| black_box(compile(&mut g, &cfg).unwrap()),
                BatchSize::LargeInput,
            )
        });
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("pipeline");
    group.measurement_time(Duration::from_secs(3));
    for (name, _) in BUNDLED {
        let profile = ModelProfile::load(name).unwrap();
        let graph = build_step_graph(&profile, &BuildOptions::default());
        bench_policies(&mut group, name, &graph);
    }
    group.sample_size(10);
    for nodes in [1_000usize, 10_000, 100_000] {
        let graph = synthetic(nodes);
        bench_policies(&mut group, &format!("synthetic-{nodes}"), &graph);
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

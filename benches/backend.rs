//! What `Collective<NdArray>` costs over `NdArray` alone, single rank, no autodiff:
//! - `op/…`: one elementwise add on a 1-element tensor, its result dropped (for
//!   `Collective<NdArray>`: recording a node, which never runs: the per-op recording overhead);
//! - `op_chain64/…`: 64 dependent adds on a 1-element tensor and a read of the result (record,
//!   run in order, read: divide by 64 for the cost per op);
//! - `mlp_forward/…`: a 784 → 1024 → 1024 → 10 MLP forward pass on a batch of 64;
//! - `mlp_forward_wgpu/…`: the same on Burn's default wgpu backend (`burn_wgpu::Wgpu`, its
//!   fusion layer on; Mesa's software Vulkan on a machine without a GPU) against
//!   `Collective<Wgpu>` over it; skipped without a wgpu adapter;
//! - `mark/…`: marking a 16-layer MLP's 32 parameters for gradient sync before a step, under
//!   `Autodiff<Collective<NdArray>>` with a one-rank server running: Burn's own marking alone
//!   (burn-train's `ModuleSharder`: `set_distributed` on each parameter, what a data-parallel
//!   step asks of any backend) against [`mark_distributed`] (the same, plus stable names and the replication check).
//!
//! Run with `cargo bench --bench backend`; the ratio is time(collective) / time(ndarray) within
//! a group.

mod common;

use std::hint::black_box;
use std::time::Duration;

use burn_autodiff::Autodiff;
use burn_backend::Backend;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::module::Module;
use burn_core::tensor::{Tensor, TensorData};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::{Linear, LinearConfig};
use collective_fusion::backend::{Collective, CollectiveDevice, mark_distributed};
use criterion::{Criterion, criterion_group, criterion_main};

/// Two 1-element tensors.
fn operands<B: Backend>(d: &B::Device) -> (Tensor<B, 1>, Tensor<B, 1>) {
    (
        Tensor::from_data(TensorData::new(vec![1.0f32], [1]), d),
        Tensor::from_data(TensorData::new(vec![2.0f32], [1]), d),
    )
}

fn op<B: Backend>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    d: &B::Device,
) {
    let (a, b) = operands::<B>(d);
    c.bench_function(name, |bench| {
        bench.iter(|| black_box(a.clone() + b.clone()))
    });
}

fn chain<B: Backend>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    d: &B::Device,
) {
    let (a, b) = operands::<B>(d);
    c.bench_function(name, |bench| {
        bench.iter(|| {
            let mut x = a.clone();
            for _ in 0..64 {
                x = x + b.clone();
            }
            black_box(x.into_data())
        })
    });
}

fn mlp<B: Backend>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    d: &B::Device,
) {
    B::seed(d, 1);
    let layers: Vec<Linear<B>> = [784, 1024, 1024, 10]
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(d))
        .collect();
    let x: Tensor<B, 2> = Tensor::from_data(TensorData::new(vec![0.5f32; 64 * 784], [64, 784]), d);
    c.bench_function(name, |bench| {
        bench.iter(|| {
            let mut h = x.clone();
            for (i, l) in layers.iter().enumerate() {
                h = l.forward(h);
                if i + 1 < layers.len() {
                    h = burn_core::tensor::activation::relu(h);
                }
            }
            black_box(h.into_data())
        })
    });
}

/// Marking a 16-layer MLP (32 parameters) before each step, Burn's way and ours.
fn mark(c: &mut Criterion) {
    type A = Autodiff<Collective<NdArray>>;
    let cd = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
    Collective::<NdArray>::start_communication_server(
        std::slice::from_ref(&cd),
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    let model: Vec<Linear<A>> = (0..16)
        .map(|_| LinearConfig::new(16, 16).init(&cd))
        .collect();
    let mut held = Some(mark_distributed::<A, _>(model).expect("marking"));
    let mut g = c.benchmark_group("mark");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("burn_set_distributed", |bench| {
        bench.iter(|| {
            // burn-train's own marking (its DDP learner's `grad_sharded`).
            let m = held
                .take()
                .expect("the model")
                .map(&mut burn_train::ModuleSharder);
            held = Some(black_box(m));
        })
    });
    g.bench_function("mark_distributed", |bench| {
        bench.iter(|| {
            let m = mark_distributed::<A, _>(held.take().expect("the model")).expect("marking");
            held = Some(black_box(m));
        })
    });
    g.finish();
    Collective::<NdArray>::close_communication_server(&cd);
}

fn overhead(c: &mut Criterion) {
    let nd = NdArrayDevice::Cpu;
    let cd = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
    let mut g = c.benchmark_group("op");
    g.measurement_time(Duration::from_secs(3));
    op::<NdArray>(&mut g, "ndarray", &nd);
    op::<Collective<NdArray>>(&mut g, "collective_ndarray", &cd);
    g.finish();
    let mut g = c.benchmark_group("op_chain64");
    g.measurement_time(Duration::from_secs(3));
    chain::<NdArray>(&mut g, "ndarray", &nd);
    chain::<Collective<NdArray>>(&mut g, "collective_ndarray", &cd);
    g.finish();
    let mut g = c.benchmark_group("mlp_forward");
    g.measurement_time(Duration::from_secs(5)).sample_size(30);
    mlp::<NdArray>(&mut g, "ndarray", &nd);
    mlp::<Collective<NdArray>>(&mut g, "collective_ndarray", &cd);
    g.finish();
    // Burn's default wgpu backend, fused, when an adapter exists.
    let wd = burn_wgpu::WgpuDevice::DefaultDevice;
    if !common::wgpu_adapter(&wd, "mlp_forward_wgpu") {
        return;
    }
    let cwd = CollectiveDevice::new(wd.clone(), 0);
    let mut g = c.benchmark_group("mlp_forward_wgpu");
    g.measurement_time(Duration::from_secs(5)).sample_size(10);
    mlp::<burn_wgpu::Wgpu>(&mut g, "wgpu_fused", &wd);
    mlp::<Collective<burn_wgpu::Wgpu>>(&mut g, "collective_wgpu_fused", &cwd);
    g.finish();
}

criterion_group!(benches, overhead, mark);
criterion_main!(benches);

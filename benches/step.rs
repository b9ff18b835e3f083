//! One data-parallel training step on one rank: what `Collective<B>` costs over `B` alone, where
//! the step is forward, backward, the gradient sync and an SGD update of an MLP
//! (784 → 1024 → 1024 → 10, batch 64), side by side in one run:
//! - `autodiff`: `Autodiff<B>`, no sync (Burn alone; wgpu only, see below);
//! - `collective`: `Autodiff<Collective<B>>` with no communication server (the lazy layer only);
//! - `collective_sync`: the same with a server of one rank and the model marked distributed, so
//!   every backward pass submits its gradients and syncs them through the plan (bucketed,
//!   packed, all-reduced over a group of one).
//!
//! `B` is NdArray, and Burn's default wgpu backend (`burn_wgpu::Wgpu`, its fusion layer on;
//! Mesa's software Vulkan on a machine without a GPU: a noisy proxy for a GPU), skipped without
//! an adapter. Run with `cargo bench --bench step`; ratios are times within a group over
//! `autodiff`.

mod common;

use std::hint::black_box;
use std::time::Duration;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::tensor::{Tensor, TensorData};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, mark_distributed,
};
use criterion::{
    BenchmarkGroup, Criterion, criterion_group, criterion_main, measurement::WallTime,
};

type Mlp<B> = Vec<Linear<B>>;

fn forward<B: burn_backend::AutodiffBackend>(m: &Mlp<B>, x: Tensor<B, 2>) -> Tensor<B, 2> {
    let mut h = x;
    for (i, l) in m.iter().enumerate() {
        h = l.forward(h);
        if i + 1 < m.len() {
            h = burn_core::tensor::activation::relu(h);
        }
    }
    h
}

/// Benchmarks one step of `B` as `name`; `distributed`: mark the model before each step.
fn step<B: burn_backend::AutodiffBackend>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    d: &B::Device,
    distributed: bool,
) {
    B::seed(d, 1);
    let mut m: Mlp<B> = [784, 1024, 1024, 10]
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(d))
        .collect();
    let x: Tensor<B, 2> = Tensor::from_data(TensorData::new(vec![0.5f32; 64 * 784], [64, 784]), d);
    let y: Tensor<B, 2> = Tensor::from_data(TensorData::new(vec![0.1f32; 64 * 10], [64, 10]), d);
    let mut optim = SgdConfig::new().init::<B, Mlp<B>>();
    g.bench_function(name, |bench| {
        bench.iter(|| {
            let mut model = std::mem::take(&mut m);
            if distributed {
                model = mark_distributed::<B, Mlp<B>>(model).expect("marking the model");
            }
            let loss =
                MseLoss::new().forward(forward(&model, x.clone()), y.clone(), Reduction::Mean);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
            // Wait for the step's work (a device backend queues it).
            black_box(model[0].weight.val().slice([0..1, 0..1]).into_data());
            m = model;
        })
    });
}

/// The three rows for inner backend `$inner` on `$device`.
macro_rules! rows {
    ($c:expr, $group:expr, $inner:ty, $device:expr, $samples:expr, alone: $alone:tt) => {{
        let device = $device;
        let cd = CollectiveDevice::new(device.clone(), 0);
        let mut g = $c.benchmark_group($group);
        g.measurement_time(Duration::from_secs(5))
            .sample_size($samples);
        rows!(@alone $alone, g, $inner, device);
        step::<Autodiff<Collective<$inner>>>(&mut g, "collective", &cd, false);
        CollectiveOptions::default().install::<$inner>();
        Collective::<$inner>::start_communication_server(
            std::slice::from_ref(&cd),
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        );
        step::<Autodiff<Collective<$inner>>>(&mut g, "collective_sync", &cd, true);
        Collective::<$inner>::close_communication_server(&cd);
        g.finish();
    }};
    (@alone true, $g:expr, $inner:ty, $device:expr) => {
        step::<Autodiff<$inner>>(&mut $g, "autodiff", &$device, false);
    };
    (@alone false, $g:expr, $inner:ty, $device:expr) => {
        let _ = &$device;
    };
}

fn benches(c: &mut Criterion) {
    // `Autodiff<NdArray>` needs NdArray to be a `DistributedBackend` here (this crate turns on
    // burn-autodiff's `distributed` feature), which burn-ndarray 0.21 is not: no `autodiff` row.
    rows!(c, "mlp_step_ndarray", NdArray, NdArrayDevice::Cpu, 20, alone: false);
    let wd = burn_wgpu::WgpuDevice::DefaultDevice;
    if !common::wgpu_adapter(&wd, "mlp_step_wgpu") {
        return;
    }
    rows!(c, "mlp_step_wgpu", burn_wgpu::Wgpu, wd, 10, alone: true);
}

criterion_group!(step_benches, benches);
criterion_main!(step_benches);

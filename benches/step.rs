//! One data-parallel training step on one rank: what `Collective<B>` costs over `B` alone, for
//! the models `run` trains (`train::overhead::overhead_models`: the launch-bound MLP, a deep
//! and a compute-bound one, the convnet, the transformer-style blocks, and on a CPU a tiny deep
//! MLP whose step is bound by the host's work per op), the rows of a model run
//! in turn (`train::overhead::StepTable`):
//! - `Autodiff<B>`: Burn alone (not for NdArray, see below);
//! - `Autodiff<Collective<B>>`: the lazy layer, the model not marked (nothing to sync);
//! - `+ sync, one rank`: a server of one rank and the model marked once, before the first step
//!   (`Marking::Once`, as a training loop does; Burn's optimizer keeps the mark), so every
//!   backward pass submits its gradients and syncs them (a group of one leaves them as they
//!   are, `SingleRank`);
//! - `+ marked every step`: the same, the model marked again before every step
//!   (`Marking::EveryStep`): what marking costs a step;
//! - then a second table per model with the plan run anyway (`SingleRank::Run`): the lazy layer,
//!   and `+ plan run, one rank`, whose gradients are read (or packed on the device), reduced
//!   and handed back as with more ranks.
//!
//! Each row's second line is where its step went (`train::overhead::PHASES`) and what the lazy
//! recorder did.
//!
//! `B` is NdArray, Flex (Burn 0.21's CPU backend, `burn_flex::Flex`), Burn's default wgpu backend (`burn_wgpu::Wgpu`, its fusion layer on; Mesa's
//! software Vulkan on a machine without a GPU: a noisy proxy for a GPU), skipped without an
//! adapter, and with `--features cuda` on a machine with a GPU Burn's CUDA backend
//! (`burn_cuda::Cuda`, fusion on), with GPU-sized models. Run with `cargo bench --bench step`
//! (`-- ROUNDS` for another number of timed steps per row than 15; `-- ROUNDS WORD` for the
//! models whose name contains WORD).

mod common;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use collective_fusion::backend::{Collective, CollectiveDevice, CollectiveOptions, SingleRank};
use collective_fusion::train::overhead::{Marking, StepRow, StepTable, overhead_models};

/// Untimed steps per row (kernel compilation, autotuning, allocator warm-up).
const WARMUP: usize = 3;

/// The rows of model `$m` over inner backend `$inner` on `$device`. With `$skip` (the default
/// `SingleRank::Skip`): an `Autodiff<$inner>` row when `$alone` is `true`, the lazy layer, the
/// model marked once, and marked every step; otherwise (`SingleRank::Run`) the lazy layer and
/// the model marked once, so its gradients are read, bucketed, reduced and handed back as with
/// more ranks.
macro_rules! rows {
    ($inner:ty, $device:expr, $m:expr, $alone:tt, $skip:expr) => {{
        let (_, model, batch) = $m;
        let cd = CollectiveDevice::new($device.clone(), 0);
        let mut rows = Vec::new();
        if $skip {
            rows!(@alone $alone, rows, $inner, $device, model, batch);
        }
        let marked: &[(&str, Marking)] = if $skip {
            &[
                ("  + sync, one rank", Marking::Once),
                ("  + marked every step", Marking::EveryStep),
            ]
        } else {
            &[("  + plan run, one rank", Marking::Once)]
        };
        type C = Autodiff<Collective<$inner>>;
        let lazy = ("Autodiff<Collective<B>>", Marking::Unmarked);
        for &(label, marking) in std::iter::once(&lazy).chain(marked) {
            rows.push(StepRow::for_model::<C>(label, &cd, model, batch, marking));
        }
        rows
    }};
    (@alone true, $rows:expr, $inner:ty, $device:expr, $model:expr, $batch:expr) => {
        type A = Autodiff<$inner>;
        let alone = Marking::Unmarked;
        $rows.push(StepRow::for_model::<A>("Autodiff<B>", &$device, $model, $batch, alone));
    };
    (@alone false, $rows:expr, $inner:ty, $device:expr, $model:expr, $batch:expr) => {};
}

/// Every selected model's table over inner backend `$inner` on `$device`: with the default
/// options (a group of one leaves its gradients alone), then with the plan run anyway.
macro_rules! backend {
    ($inner:ty, $label:expr, $device:expr, alone: $alone:tt, gpu: $gpu:expr, $args:expr) => {{
        let (rounds, only) = $args;
        let device = $device;
        let cd = CollectiveDevice::new(device.clone(), 0);
        for single_rank in [SingleRank::Skip, SingleRank::Run] {
            CollectiveOptions {
                single_rank,
                ..CollectiveOptions::default()
            }
            .install::<$inner>();
            Collective::<$inner>::start_communication_server(
                std::slice::from_ref(&cd),
                DistributedConfig {
                    all_reduce_op: ReduceOperation::Mean,
                },
            );
            for m in overhead_models($gpu) {
                if only.is_some_and(|o: &str| !m.0.contains(o)) {
                    continue;
                }
                let skip = single_rank == SingleRank::Skip;
                let rows = rows!($inner, device, m, $alone, skip);
                let title = format!("{} · {}, batch {}, {single_rank:?}", $label, m.0, m.2);
                print!("{}", StepTable::measure(&title, rows, WARMUP, rounds));
            }
            Collective::<$inner>::close_communication_server(&cd);
        }
    }};
}

fn main() {
    // Cargo passes `--bench`; the words after it are ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let rounds: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(15);
    let only = args.get(1).map(String::as_str);
    println!("one training step on one rank; ratios to each table's first row");
    // `Autodiff<NdArray>` needs NdArray to be a `DistributedBackend` here (this crate turns on
    // burn-autodiff's `distributed` feature), which burn-ndarray 0.21 is not: no `Autodiff<B>`
    // row, the ratios are to `Autodiff<Collective<B>>`.
    backend!(
        burn_ndarray::NdArray,
        "NdArray",
        burn_ndarray::NdArrayDevice::Cpu,
        alone: false,
        gpu: false,
        (rounds, only)
    );
    // Burn 0.21's CPU backend; `Autodiff<Flex>` is no autodiff backend either (as NdArray).
    backend!(
        burn_flex::Flex,
        "burn_flex::Flex",
        burn_flex::FlexDevice,
        alone: false,
        gpu: false,
        (rounds, only)
    );
    let wd = burn_wgpu::WgpuDevice::DefaultDevice;
    if common::wgpu_adapter(&wd, "wgpu") {
        backend!(
            burn_wgpu::Wgpu,
            "burn_wgpu::Wgpu (fusion on)",
            wd,
            alone: true,
            gpu: false,
            (rounds, only)
        );
    }
    #[cfg(feature = "cuda")]
    if collective_fusion::runtime::nccl::device_count() > 0 {
        backend!(
            burn_cuda::Cuda,
            "burn_cuda::Cuda (fusion on)",
            burn_cuda::CudaDevice::default(),
            alone: true,
            gpu: true,
            (rounds, only)
        );
    }
}

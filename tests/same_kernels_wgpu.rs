//! `Collective<B>` asks the inner backend for exactly the work `B` does alone: three training
//! steps of an MLP on Burn's fused wgpu backend launch the same kernels, as many times each, and
//! compile the same kernels (CubeCL's kernel ids, in-place variants included), with and without
//! `Collective`, and with the model marked under a one-rank server (whose sync leaves the
//! gradients as they are). Compared in CubeCL's own log (`common::kernels`); the CUDA
//! counterpart is in `tests/gpu.rs`.

mod common;

use burn_wgpu::{Wgpu, WgpuDevice};

/// The child's part, run only with `CF_KERNEL_PROBE` set (as the test below runs it).
#[test]
fn kernel_probe_child() {
    common::kernels::child::<Wgpu>(WgpuDevice::DefaultDevice);
}

#[test]
fn a_training_step_under_collective_runs_the_kernels_burn_alone_runs_marked_or_not() {
    if std::env::var_os(common::kernels::CHILD).is_some() || common::cube::wgpu_client().is_none() {
        return;
    }
    common::kernels::assert_same(&common::kernels::sides("kernel_probe_child"));
}

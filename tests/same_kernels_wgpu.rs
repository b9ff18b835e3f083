//! `Collective<B>` asks the inner backend for exactly the work `B` does alone: three training
//! steps of an MLP on Burn's fused wgpu backend launch the same kernels, as many times each, and
//! compile the same kernels (CubeCL's kernel ids, in-place variants included), with and without
//! `Collective`, and with the model marked under a one-rank server (whose sync leaves the
//! gradients as they are). Compared in CubeCL's own log (`common::kernels`); the CUDA
//! counterpart is in `tests/gpu.rs`.

mod common;

use burn_wgpu::{CubeBackend, Wgpu, WgpuDevice, WgpuRuntime};

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

/// The child's part of the persistent-memory check (fused wgpu), run only with
/// `CF_PERSISTENT_PROBE` set.
#[test]
fn persistent_probe_child() {
    common::persistent::child::<Wgpu>(WgpuDevice::DefaultDevice);
}

/// The same, unfused.
#[test]
fn persistent_probe_child_unfused() {
    common::persistent::child::<CubeBackend<WgpuRuntime, f32, i32, u32>>(WgpuDevice::DefaultDevice);
}

#[test]
fn parameters_go_to_cubecls_persistent_memory_under_collective_as_alone() {
    if std::env::var_os(common::persistent::CHILD).is_some()
        || common::cube::wgpu_client().is_none()
    {
        return;
    }
    for child in ["persistent_probe_child", "persistent_probe_child_unfused"] {
        let sides = common::persistent::sides(child);
        assert!(
            sides[0].allocations > 0,
            "{child}: the model's parameters took no persistent memory alone: {sides:?}"
        );
        assert_eq!(sides[1], sides[0], "{child}: Collective differs from alone");
    }
}

/// Burn asks a backend which dtypes a device supports (to pick a device's default dtypes and to
/// check `set_default_dtypes`) and whether autodiff is on (Dropout and BatchNorm's training
/// mode): `Collective<B>` answers what `B` answers, fused or not.
#[test]
fn collective_answers_what_wgpu_answers_of_its_dtypes_and_autodiff() {
    use burn_backend::Backend;
    use burn_std::{BoolStore, DType};
    use collective_fusion::backend::{Collective, CollectiveDevice};
    if std::env::var_os(common::persistent::CHILD).is_some()
        || common::cube::wgpu_client().is_none()
    {
        return;
    }
    fn same<B: Backend<Device = WgpuDevice>>() -> usize {
        let d = WgpuDevice::DefaultDevice;
        let cd = CollectiveDevice::new(d.clone(), 0);
        let all = [
            DType::F64,
            DType::F32,
            DType::Flex32,
            DType::F16,
            DType::BF16,
            DType::I64,
            DType::I32,
            DType::I16,
            DType::I8,
            DType::U64,
            DType::U32,
            DType::U16,
            DType::U8,
            DType::Bool(BoolStore::Native),
            DType::Bool(BoolStore::U8),
            DType::Bool(BoolStore::U32),
        ];
        for dt in all {
            assert_eq!(
                Collective::<B>::supports_dtype(&cd, dt),
                B::supports_dtype(&d, dt),
                "supports_dtype({dt:?})"
            );
            assert_eq!(
                Collective::<B>::dtype_usage(&cd, dt),
                B::dtype_usage(&d, dt),
                "dtype_usage({dt:?})"
            );
        }
        assert_eq!(Collective::<B>::ad_enabled(&cd), B::ad_enabled(&d));
        all.iter().filter(|dt| B::supports_dtype(&d, **dt)).count()
    }
    assert!(same::<Wgpu>() > 0);
    assert!(same::<CubeBackend<WgpuRuntime, f32, i32, u32>>() > 0);
}

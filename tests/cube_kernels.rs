//! The CubeCL bucket kernels on CubeCL's wgpu runtime (Mesa's software Vulkan driver on machines
//! without a GPU) against the host path: bitwise for f32, within the format's rounding for the
//! half types. The checks live in `common/cube.rs`, shared with the CUDA runs in `tests/gpu.rs`.

mod common;

use collective_fusion::graph::DType;
use collective_fusion::runtime::HostBuffer;
use common::cube::{SIZES, check_cast, check_f32_bitwise, layout, round_trip_sizes};
use cubecl::prelude::*;
use cubecl::wgpu::WgpuRuntime;

/// The wgpu client, or `None` (with a visible message) without a Vulkan adapter.
fn client() -> Option<ComputeClient<WgpuRuntime>> {
    common::cube::wgpu_client()
}

#[test]
fn pack_and_unpack_f32_match_the_host_path_bitwise() {
    if let Some(c) = client() {
        check_f32_bitwise(&c);
    }
}

#[test]
fn pack_casting_to_f16_is_within_f16_rounding() {
    if let Some(c) = client() {
        check_cast(&c, DType::F16, 10);
    }
}

#[test]
fn pack_casting_to_bf16_is_within_bf16_rounding() {
    if let Some(c) = client() {
        check_cast(&c, DType::BF16, 7);
    }
}

#[test]
fn pack_and_unpack_f16_eight_to_an_access_match_the_host_path_bitwise() {
    if let Some(c) = client() {
        common::cube::check_f16_bitwise(&c);
    }
}

#[test]
fn padding_is_zero_and_members_sit_at_their_offsets() {
    let Some(c) = client() else {
        return;
    };
    let Some((_, dev_flat, _, _)) = round_trip_sizes(&c, &SIZES, DType::F32, DType::F32, None)
    else {
        return;
    };
    let l = layout(&SIZES, DType::F32, DType::F32, None);
    let HostBuffer::F32(v) = dev_flat else {
        panic!()
    };
    let mut covered = vec![false; v.len()];
    for m in &l.members {
        for c in &mut covered[m.offset as usize..][..m.numel as usize] {
            *c = true;
        }
    }
    assert!(l.padding > 0);
    for (i, c) in covered.iter().enumerate() {
        if !c {
            assert_eq!(v[i].to_bits(), 0, "padding element {i}");
        }
    }
}

#[test]
fn a_bucket_with_more_members_than_one_launch_binds_is_packed_in_several_launches() {
    let Some(c) = client() else {
        return;
    };
    // 150 members: more than the 64 a launch takes.
    let sizes: Vec<u64> = (0..150).map(|i| (i % 7) * 37 + 1).collect();
    let Some((host_flat, dev_flat, host_back, dev_back)) =
        round_trip_sizes(&c, &sizes, DType::F32, DType::F32, Some(8))
    else {
        return;
    };
    assert!(host_flat.bits_eq(&dev_flat));
    for (a, b) in host_back.iter().zip(&dev_back) {
        assert!(a.bits_eq(b));
    }
}

#[test]
fn a_bucket_past_one_grid_of_chunks_is_packed_in_rounds_with_the_host_path_bits() {
    let Some(c) = client() else {
        return;
    };
    // 5 Mi f32 in 16-byte vectors: 1280 chunks, so each cube takes two in turn; the odd member
    // goes scalar: 4097 chunks, five rounds.
    let sizes = [5 << 20, (4 << 20) + 3, 9];
    let Some((host_flat, dev_flat, host_back, dev_back)) =
        round_trip_sizes(&c, &sizes, DType::F32, DType::F32, Some(3))
    else {
        return;
    };
    assert!(host_flat.bits_eq(&dev_flat));
    for (a, b) in host_back.iter().zip(&dev_back) {
        assert!(a.bits_eq(b));
    }
}

#[test]
fn a_plan_over_device_gradients_gives_the_bits_of_the_host_path() {
    if let Some(c) = client() {
        common::cube::check_plan_on_device(&c);
    }
}

#[test]
fn collectives_reduced_in_place_on_the_device_give_the_bits_of_the_host_path() {
    if let Some(c) = client() {
        let comms = collective_fusion::runtime::InProcessGroup::ranks(
            2,
            std::time::Duration::from_secs(60),
        )
        .into_iter()
        .map(|inner| {
            Box::new(common::cube::DeviceReducing {
                inner,
                client: c.clone(),
            }) as Box<dyn collective_fusion::runtime::Communicator>
        })
        .collect();
        common::cube::check_plan_reduced_on_device(&c, comms);
    }
}

#[test]
fn reduced_members_handed_back_as_views_of_the_bucket_hold_their_own_elements() {
    if let Some(c) = client() {
        common::cube::check_bucket_views(&c);
    }
}

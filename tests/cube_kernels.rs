//! The CubeCL bucket kernels on CubeCL's wgpu runtime (Mesa's software Vulkan driver on machines
//! without a GPU) against the host path: bitwise for f32, within the format's rounding for the
//! half types.

use collective_fusion::codegen::layout::{BucketLayout, MemberLayout};
use collective_fusion::graph::DType;
use collective_fusion::runtime::HostBuffer;
use collective_fusion::runtime::cube::{self, DeviceMember};
use collective_fusion::runtime::host;
use collective_fusion::runtime::synthetic::SplitMix64;
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

/// The wgpu client, or `None` (with a visible message) on a machine without a Vulkan adapter,
/// unless `CF_REQUIRE_WGPU` is set (CI sets it, so there the kernels always run).
fn client() -> Option<ComputeClient<WgpuRuntime>> {
    let got = std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice));
    match got {
        Ok(c) => Some(c),
        Err(_) if std::env::var_os("CF_REQUIRE_WGPU").is_none() => {
            eprintln!(
                "skipped: no wgpu adapter (install mesa-vulkan-drivers and libvulkan1 to run the CubeCL kernel tests)"
            );
            None
        }
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// A layout of members with these sizes, aligned as the codegen aligns them.
fn layout(sizes: &[u64], member: DType, wire: DType, scale_div: Option<u32>) -> BucketLayout {
    let align = (16 / wire.size()).max(1);
    let mut offset = 0;
    let mut members = Vec::new();
    for (i, n) in sizes.iter().enumerate() {
        offset = u64::next_multiple_of(offset, align);
        members.push(MemberLayout {
            param: Some(format!("p{i}")),
            offset,
            numel: *n,
            dtype: member.name().to_string(),
        });
        offset += n;
    }
    let numel = offset.next_multiple_of(align);
    BucketLayout {
        bucket: Some(0),
        reduce: "sum".into(),
        scale_div,
        group: 0,
        wire_dtype: wire.name().to_string(),
        members,
        numel,
        padding: numel - sizes.iter().sum::<u64>(),
        bytes: numel * wire.size(),
        member_bytes: sizes.iter().sum::<u64>() * member.size(),
    }
}

fn random(n: u64, seed: u64) -> Vec<f64> {
    let mut r = SplitMix64(seed);
    (0..n).map(|_| r.next_value()).collect()
}

fn upload(client: &ComputeClient<WgpuRuntime>, b: &HostBuffer) -> DeviceMember {
    DeviceMember {
        handle: client.create_from_slice(b.as_bytes()),
        len: b.len(),
    }
}

fn read(
    client: &ComputeClient<WgpuRuntime>,
    h: cubecl::server::Handle,
    dtype: DType,
) -> HostBuffer {
    let bytes = client.read_one(h).expect("reading a device buffer");
    match dtype {
        DType::F32 => HostBuffer::F32(bytemuck_f32(&bytes)),
        DType::F16 => HostBuffer::F16(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        DType::BF16 => HostBuffer::BF16(
            bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
        ),
        d => panic!("unexpected dtype {d}"),
    }
}

fn bytemuck_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Sizes with odd lengths (padding), a large member (grid-stride loop), and many members.
const SIZES: [u64; 7] = [1, 1000, 3, 70_001, 4096, 17, 262_147];

fn round_trip(
    member: DType,
    wire: DType,
    scale_div: Option<u32>,
) -> Option<(HostBuffer, HostBuffer, Vec<HostBuffer>, Vec<HostBuffer>)> {
    round_trip_sizes(&SIZES, member, wire, scale_div)
}

fn round_trip_sizes(
    sizes: &[u64],
    member: DType,
    wire: DType,
    scale_div: Option<u32>,
) -> Option<(HostBuffer, HostBuffer, Vec<HostBuffer>, Vec<HostBuffer>)> {
    let client = client()?;
    let l = layout(sizes, member, wire, scale_div);
    let members: Vec<HostBuffer> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| HostBuffer::from_f64(member, &random(*n, i as u64)).unwrap())
        .collect();
    let refs: Vec<&HostBuffer> = members.iter().collect();
    let host_flat = host::pack(&l, &refs, scale_div).unwrap();
    let dev: Vec<DeviceMember> = members.iter().map(|m| upload(&client, m)).collect();
    let flat = match cube::pack(&client, &l, &dev, scale_div) {
        Ok(h) => h,
        Err(e @ cube::CubeError::Unsupported { .. }) => {
            eprintln!("skipped: {e} (wgpu adapter without this type)");
            return None;
        }
        Err(e) => panic!("{e}"),
    };
    let dev_flat = read(&client, flat.clone(), wire);
    // Unpack into fresh zeroed members, on both paths.
    let mut host_back: Vec<HostBuffer> = sizes
        .iter()
        .map(|n| HostBuffer::zeros(member, *n as usize).unwrap())
        .collect();
    {
        let mut outs: Vec<&mut HostBuffer> = host_back.iter_mut().collect();
        host::unpack(&l, &host_flat, &mut outs).unwrap();
    }
    let dev_back: Vec<DeviceMember> = host_back
        .iter()
        .map(|m| upload(&client, &HostBuffer::zeros(member, m.len()).unwrap()))
        .collect();
    cube::unpack(&client, &l, &flat, &dev_back).unwrap();
    let dev_back: Vec<HostBuffer> = dev_back
        .into_iter()
        .map(|m| read(&client, m.handle, member))
        .collect();
    Some((host_flat, dev_flat, host_back, dev_back))
}

#[test]
fn pack_and_unpack_f32_match_the_host_path_bitwise() {
    for scale in [None, Some(4), Some(3)] {
        let Some((host_flat, dev_flat, host_back, dev_back)) =
            round_trip(DType::F32, DType::F32, scale)
        else {
            return;
        };
        assert!(host_flat.bits_eq(&dev_flat), "pack, scale {scale:?}");
        for (i, (a, b)) in host_back.iter().zip(&dev_back).enumerate() {
            assert!(a.bits_eq(b), "unpack member {i}, scale {scale:?}");
        }
    }
}

/// Relative difference within one unit in the last place of a format with `mantissa_bits`.
fn within_rounding(a: &HostBuffer, b: &HostBuffer, mantissa_bits: i32) {
    let eps = f64::powi(2.0, -mantissa_bits);
    for (i, (x, y)) in a.to_f64().iter().zip(b.to_f64()).enumerate() {
        assert!(
            (x - y).abs() <= eps * x.abs().max(y.abs()),
            "element {i}: {x} vs {y}"
        );
    }
}

#[test]
fn pack_casting_to_f16_is_within_f16_rounding() {
    if let Some((host_flat, dev_flat, host_back, dev_back)) =
        round_trip(DType::F32, DType::F16, Some(4))
    {
        within_rounding(&host_flat, &dev_flat, 10);
        for (a, b) in host_back.iter().zip(&dev_back) {
            within_rounding(a, b, 10);
        }
    }
}

#[test]
fn pack_casting_to_bf16_is_within_bf16_rounding() {
    if let Some((host_flat, dev_flat, host_back, dev_back)) =
        round_trip(DType::F32, DType::BF16, Some(4))
    {
        within_rounding(&host_flat, &dev_flat, 7);
        for (a, b) in host_back.iter().zip(&dev_back) {
            within_rounding(a, b, 7);
        }
    }
}

#[test]
fn padding_is_zero_and_members_sit_at_their_offsets() {
    let Some((_, dev_flat, _, _)) = round_trip(DType::F32, DType::F32, None) else {
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
    // 150 members: more than the 64 a launch takes.
    let sizes: Vec<u64> = (0..150).map(|i| (i % 7) * 37 + 1).collect();
    let Some((host_flat, dev_flat, host_back, dev_back)) =
        round_trip_sizes(&sizes, DType::F32, DType::F32, Some(8))
    else {
        return;
    };
    assert!(host_flat.bits_eq(&dev_flat));
    for (a, b) in host_back.iter().zip(&dev_back) {
        assert!(a.bits_eq(b));
    }
}

//! The CubeCL bucket-kernel harness, generic over the CubeCL runtime: the wgpu tests
//! (`tests/cube_kernels.rs`) and the CUDA ones (`tests/gpu.rs`) run the same checks.
#![allow(dead_code)]

use collective_fusion::codegen::layout::{BucketLayout, MemberLayout};
use collective_fusion::graph::DType;
use collective_fusion::runtime::HostBuffer;
use collective_fusion::runtime::cube::{self, DeviceMember};
use collective_fusion::runtime::host;
use collective_fusion::runtime::synthetic::SplitMix64;
use cubecl::prelude::*;

/// A layout of members with these sizes, aligned as the codegen aligns them.
pub fn layout(sizes: &[u64], member: DType, wire: DType, scale_div: Option<u32>) -> BucketLayout {
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

pub fn upload<R: Runtime>(client: &ComputeClient<R>, b: &HostBuffer) -> DeviceMember {
    DeviceMember {
        handle: client.create_from_slice(b.as_bytes()),
        len: b.len(),
    }
}

pub fn read<R: Runtime>(
    client: &ComputeClient<R>,
    h: cubecl::server::Handle,
    dtype: DType,
) -> HostBuffer {
    let bytes = client.read_one(h).expect("reading a device buffer");
    match dtype {
        DType::F32 => HostBuffer::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
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

/// Sizes with odd lengths (padding), a large member (grid-stride loop), and many members.
pub const SIZES: [u64; 7] = [1, 1000, 3, 70_001, 4096, 17, 262_147];

/// What a round trip gives: the host and device flat buffers, and the members unpacked back by
/// the host and by the device.
pub type RoundTrip = (HostBuffer, HostBuffer, Vec<HostBuffer>, Vec<HostBuffer>);

/// Packs random members of `sizes` on the host and on the device, and unpacks both back;
/// `None` (with a message) when the runtime lacks the type.
pub fn round_trip_sizes<R: Runtime>(
    client: &ComputeClient<R>,
    sizes: &[u64],
    member: DType,
    wire: DType,
    scale_div: Option<u32>,
) -> Option<RoundTrip> {
    let l = layout(sizes, member, wire, scale_div);
    let members: Vec<HostBuffer> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| HostBuffer::from_f64(member, &random(*n, i as u64)).unwrap())
        .collect();
    let refs: Vec<&HostBuffer> = members.iter().collect();
    let host_flat = host::pack(&l, &refs, scale_div).unwrap();
    let dev: Vec<DeviceMember> = members.iter().map(|m| upload(client, m)).collect();
    let flat = match cube::pack(client, &l, &dev, scale_div) {
        Ok(h) => h,
        Err(e @ cube::CubeError::Unsupported { .. }) => {
            eprintln!("skipped: {e} (a runtime without this type)");
            return None;
        }
        Err(e) => panic!("{e}"),
    };
    let dev_flat = read(client, flat.clone(), wire);
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
        .map(|m| upload(client, &HostBuffer::zeros(member, m.len()).unwrap()))
        .collect();
    cube::unpack(client, &l, &flat, &dev_back).unwrap();
    let dev_back: Vec<HostBuffer> = dev_back
        .into_iter()
        .map(|m| read(client, m.handle, member))
        .collect();
    Some((host_flat, dev_flat, host_back, dev_back))
}

/// Relative difference within one unit in the last place of a format with `mantissa_bits`.
pub fn within_rounding(a: &HostBuffer, b: &HostBuffer, mantissa_bits: i32) {
    let eps = f64::powi(2.0, -mantissa_bits);
    for (i, (x, y)) in a.to_f64().iter().zip(b.to_f64()).enumerate() {
        assert!(
            (x - y).abs() <= eps * x.abs().max(y.abs()),
            "element {i}: {x} vs {y}"
        );
    }
}

/// f32 pack/unpack equal the host path bit for bit, for no scale and two divisors.
pub fn check_f32_bitwise<R: Runtime>(client: &ComputeClient<R>) {
    for scale in [None, Some(4), Some(3)] {
        let Some((host_flat, dev_flat, host_back, dev_back)) =
            round_trip_sizes(client, &SIZES, DType::F32, DType::F32, scale)
        else {
            return;
        };
        assert!(host_flat.bits_eq(&dev_flat), "pack, scale {scale:?}");
        for (i, (a, b)) in host_back.iter().zip(&dev_back).enumerate() {
            assert!(a.bits_eq(b), "unpack member {i}, scale {scale:?}");
        }
    }
}

/// A cast to `wire` (f16: 10 mantissa bits, bf16: 7) is within that format's rounding.
pub fn check_cast<R: Runtime>(client: &ComputeClient<R>, wire: DType, mantissa_bits: i32) {
    if let Some((host_flat, dev_flat, host_back, dev_back)) =
        round_trip_sizes(client, &SIZES, DType::F32, wire, Some(4))
    {
        within_rounding(&host_flat, &dev_flat, mantissa_bits);
        for (a, b) in host_back.iter().zip(&dev_back) {
            within_rounding(a, b, mantissa_bits);
        }
    }
}

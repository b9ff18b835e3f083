//! The CubeCL bucket-kernel harness, generic over the CubeCL runtime: the wgpu tests
//! (`tests/cube_kernels.rs`) and the CUDA ones (`tests/gpu.rs`) run the same checks.
#![allow(dead_code)]

use collective_fusion::codegen::launches::MAX_MEMBERS_PER_LAUNCH;
use collective_fusion::codegen::layout::BucketLayout;
use collective_fusion::graph::DType;
use collective_fusion::runtime::HostBuffer;
use collective_fusion::runtime::cube::{self, DeviceMember};
use collective_fusion::runtime::host;
use collective_fusion::runtime::synthetic::SplitMix64;
use cubecl::prelude::*;

/// The wgpu client of the default adapter, or `None` (with a visible message) on a machine
/// without one, unless `CF_REQUIRE_WGPU` is set (CI sets it, so there the wgpu tests always
/// run).
pub fn wgpu_client() -> Option<ComputeClient<cubecl::wgpu::WgpuRuntime>> {
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    let got = std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice));
    match got {
        Ok(c) => Some(c),
        Err(_) if std::env::var_os("CF_REQUIRE_WGPU").is_none() => {
            eprintln!(
                "skipped: no wgpu adapter (install mesa-vulkan-drivers and libvulkan1 to run the wgpu tests)"
            );
            None
        }
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// A layout of members with these sizes, aligned as the codegen aligns them.
pub fn layout(sizes: &[u64], member: DType, wire: DType, scale_div: Option<u32>) -> BucketLayout {
    BucketLayout::of_sizes(sizes, member, wire, scale_div, 16)
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
    HostBuffer::from_le_bytes(dtype, &bytes)
        .unwrap_or_else(|| panic!("{} bytes are not a buffer of {dtype}", bytes.len()))
}

/// Sizes with odd lengths (padding), a large member (grid-stride loop), and many members.
pub const SIZES: [u64; 7] = [1, 1000, 3, 70_001, 4096, 17, 262_147];

/// Empty members first, between others and last: a cube must find the member its range is in,
/// never an empty one that shares its first cube.
pub const SIZES_WITH_EMPTY: [u64; 8] = [0, 8, 0, 0, 70_000, 5, 4096, 0];

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

/// f32 pack/unpack equal the host path bit for bit, for no scale and two divisors, with and
/// without empty members.
pub fn check_f32_bitwise<R: Runtime>(client: &ComputeClient<R>) {
    // More members than one launch takes, vectorizable and odd-sized: consecutive launches of
    // both widths into one buffer.
    let many: Vec<u64> = (0..2 * MAX_MEMBERS_PER_LAUNCH as u64 + 5)
        .map(|i| [4096, 5, 1000, 3][i as usize % 4] + 8 * i)
        .collect();
    for (sizes, scale) in [
        (&SIZES[..], None),
        (&SIZES, Some(4)),
        (&SIZES, Some(3)),
        (&SIZES_WITH_EMPTY, Some(4)),
        (&many, Some(2)),
    ] {
        let Some((host_flat, dev_flat, host_back, dev_back)) =
            round_trip_sizes(client, sizes, DType::F32, DType::F32, scale)
        else {
            return;
        };
        assert!(
            host_flat.bits_eq(&dev_flat),
            "pack {sizes:?}, scale {scale:?}"
        );
        for (i, (a, b)) in host_back.iter().zip(&dev_back).enumerate() {
            assert!(
                a.bits_eq(b),
                "unpack member {i} of {sizes:?}, scale {scale:?}"
            );
        }
    }
}

/// f16 members on an f16 wire (8 elements per 16-byte access) round-trip bit for bit, with no
/// scale; skipped where the runtime lacks f16.
pub fn check_f16_bitwise<R: Runtime>(client: &ComputeClient<R>) {
    if let Some((host_flat, dev_flat, host_back, dev_back)) =
        round_trip_sizes(client, &SIZES, DType::F16, DType::F16, None)
    {
        assert!(host_flat.bits_eq(&dev_flat), "f16 pack");
        for (i, (a, b)) in host_back.iter().zip(&dev_back).enumerate() {
            assert!(a.bits_eq(b), "f16 unpack member {i}");
        }
    }
}

/// Members whose buffers start 4 bytes past a 16-byte boundary (views into one allocation, as
/// a tensor slice gives), and a bucket that does, are packed and unpacked with the host path's
/// bits: the kernels must not use 16-byte accesses on them. Runtimes that bind buffers only at aligned offsets (wgpu)
/// cannot run this.
pub fn check_unaligned_members<R: Runtime>(client: &ComputeClient<R>) {
    let sizes = [4096u64, 8, 1000, 12];
    let l = layout(&sizes, DType::F32, DType::F32, Some(2));
    let values: Vec<HostBuffer> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| HostBuffer::from_f64(DType::F32, &random(*n, 40 + i as u64)).unwrap())
        .collect();
    // One allocation: a 4-byte lead, then the members back to back.
    let mut bytes = vec![0u8; 4];
    for v in &values {
        bytes.extend_from_slice(v.as_bytes());
    }
    let all = client.create_from_slice(&bytes);
    let total = bytes.len() as u64;
    let mut at = 4u64;
    let views: Vec<DeviceMember> = values
        .iter()
        .map(|v| {
            let len = v.as_bytes().len() as u64;
            let handle = all.clone().offset_start(at).offset_end(total - at - len);
            at += len;
            DeviceMember {
                handle,
                len: v.len(),
            }
        })
        .collect();
    let refs: Vec<&HostBuffer> = values.iter().collect();
    let host_flat = host::pack(&l, &refs, Some(2)).unwrap();
    let flat = cube::pack(client, &l, &views, Some(2)).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        host_flat.bits_eq(&read(client, flat.clone(), DType::F32)),
        "pack"
    );
    // Unpack from a bucket that itself starts 4 bytes into its allocation, into aligned members.
    let mut lead = vec![0u8; 4];
    lead.extend_from_slice(host_flat.as_bytes());
    let shifted = client.create_from_slice(&lead).offset_start(4);
    let fresh: Vec<DeviceMember> = sizes
        .iter()
        .map(|n| upload(client, &HostBuffer::zeros(DType::F32, *n as usize).unwrap()))
        .collect();
    cube::unpack(client, &l, &shifted, &fresh).unwrap_or_else(|e| panic!("{e}"));
    for (i, (m, v)) in fresh.into_iter().zip(&values).enumerate() {
        let got = read(client, m.handle, DType::F32).to_f64();
        let want: Vec<f64> = v.to_f64().iter().map(|x| x / 2.0).collect();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "member {i} unpacked from an unaligned bucket"
        );
    }
    // Unpack into the unaligned views: the allocation then holds the halved members.
    cube::unpack(client, &l, &flat, &views).unwrap_or_else(|e| panic!("{e}"));
    let back = read(client, all, DType::F32).to_f64();
    let mut k = 1;
    for (i, v) in values.iter().enumerate() {
        for (j, x) in v.to_f64().iter().enumerate() {
            assert_eq!(
                back[k].to_bits(),
                (x / 2.0).to_bits(),
                "member {i} element {j}"
            );
            k += 1;
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

/// Runs `plan` on its group's ranks in process, each rank's gradients as `make` turns them into
/// slots; returns each rank's reduced gradients (read into host memory) and its device packs.
pub fn run_plan_slots(
    plan: &collective_fusion::codegen::plan::Plan,
    inputs: Vec<Vec<HostBuffer>>,
    make: impl Fn(usize, HostBuffer) -> collective_fusion::runtime::Grad,
) -> Vec<(Vec<HostBuffer>, u32)> {
    use collective_fusion::runtime::exec::{ExecOptions, run_in_process_grads};
    let slots = inputs
        .into_iter()
        .map(|g| g.into_iter().enumerate().map(|(i, g)| make(i, g)).collect())
        .collect();
    run_in_process_grads(plan, slots, ExecOptions::default())
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .map(|(g, report)| {
            let host = g
                .into_iter()
                .map(|g| g.into_host().unwrap_or_else(|e| panic!("{e}")))
                .collect();
            (host, report.device_packs)
        })
        .collect()
}

/// A plan of `sizes` f32 gradients on `world` ranks (mean), bucketed by `policy` under a small
/// cap so that there are several buckets.
pub fn small_plan(
    sizes: &[u64],
    world: u32,
    policy: collective_fusion::config::BucketPolicy,
) -> collective_fusion::codegen::plan::Plan {
    use collective_fusion::graph::parse::parse;
    let names: Vec<(String, String)> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| (format!("p{i}"), format!("f32[{n}]")))
        .collect();
    let grads: Vec<super::G<'_>> = names
        .iter()
        .map(|(name, ty)| super::G(name, ty, "mean", "g0"))
        .collect();
    let text = super::chain_in(world, &grads);
    let mut g = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let config = collective_fusion::config::CompileConfig {
        bucket: collective_fusion::config::BucketConfig {
            policy,
            cap_bytes: 16 << 10,
            first_bucket_bytes: 4 << 10,
        },
        overlap: true,
        verify: true,
        ..Default::default()
    };
    collective_fusion::passes::compile(&mut g, &config).unwrap_or_else(|e| panic!("{e}"));
    collective_fusion::codegen::plan::lower(&g).unwrap_or_else(|e| panic!("{e}"))
}

/// A plan whose gradients are device buffers gives the bits of the same plan on host buffers:
/// packed buckets (on the device), a bucket with one host member (packed on the host), and one
/// all-reduce per gradient (each read to the host).
pub fn check_plan_on_device<R: Runtime>(client: &ComputeClient<R>) {
    use collective_fusion::config::BucketPolicy;
    use collective_fusion::runtime::Grad;
    use collective_fusion::runtime::cube::CubeGrad;
    let sizes = [300u64, 1000, 17, 2048, 3, 900, 4096, 64];
    let world = 2;
    let to_device = |g: HostBuffer| {
        Grad::Device(Box::new(CubeGrad {
            client: client.clone(),
            handle: client.create_from_slice(g.as_bytes()),
            len: g.len(),
            dtype: g.dtype(),
        }))
    };
    for policy in [BucketPolicy::Ddp, BucketPolicy::PerParam] {
        let plan = small_plan(&sizes, world, policy);
        let inputs: Vec<Vec<HostBuffer>> = (0..world as usize)
            .map(|r| collective_fusion::runtime::synthetic::seeded_gradients(&plan, r, 11))
            .collect();
        let host = run_plan_slots(&plan, inputs.clone(), |_, g| Grad::Host(g));
        let device = run_plan_slots(&plan, inputs.clone(), |_, g| to_device(g));
        // Slot 0 stays in host memory: its bucket is packed on the host.
        let mixed = run_plan_slots(&plan, inputs, |i, g| {
            if i == 0 { Grad::Host(g) } else { to_device(g) }
        });
        let packed = plan.collectives.iter().filter(|c| c.packed).count() as u32;
        let packed_without_slot_0 = plan
            .collectives
            .iter()
            .filter(|c| c.packed && !c.slots.contains(&0))
            .count() as u32;
        assert_eq!(host[0].1, 0);
        match policy {
            BucketPolicy::PerParam => assert_eq!(device[0].1, 0, "per-param packs nothing"),
            _ => {
                assert!(packed >= 2, "the test plan should have several buckets");
                assert_eq!(device[0].1, packed, "every bucket packed on the device");
                assert!(
                    packed_without_slot_0 < packed,
                    "slot 0 is in a packed bucket"
                );
                assert_eq!(
                    mixed[0].1, packed_without_slot_0,
                    "the mixed bucket packed on the host"
                );
            }
        }
        for (r, ((h, _), ((d, _), (m, _)))) in
            host.iter().zip(device.iter().zip(&mixed)).enumerate()
        {
            for (s, ((a, b), c)) in h.iter().zip(d).zip(m).enumerate() {
                let p = &plan.slots[s].param;
                assert!(
                    a.bits_eq(b),
                    "{policy:?} rank {r} {p}: device differs from host"
                );
                assert!(
                    a.bits_eq(c),
                    "{policy:?} rank {r} {p}: mixed differs from host"
                );
            }
        }
    }
}

/// A test double of a communicator that reduces device buckets "in place": it reads the bucket,
/// has the wrapped host communicator reduce it, and hands back a new device bucket holding the
/// result, so the executor's device-collective path (the bucket stays a device bucket through
/// the collective and the unpack reads it on the device) runs without NCCL.
pub struct DeviceReducing<R: Runtime> {
    pub inner: collective_fusion::runtime::InProcessComm,
    pub client: ComputeClient<R>,
}

impl<R: Runtime> collective_fusion::runtime::Communicator for DeviceReducing<R> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: collective_fusion::runtime::CollectiveDesc,
    ) -> Result<collective_fusion::runtime::PendingReduce, collective_fusion::runtime::CommError>
    {
        self.inner.all_reduce(buffer, what)
    }

    fn reduces_device_memory(&self) -> bool {
        true
    }

    fn all_reduce_device(
        &self,
        bucket: Box<dyn collective_fusion::runtime::DeviceBucket>,
        what: collective_fusion::runtime::CollectiveDesc,
    ) -> Result<collective_fusion::runtime::DeviceLaunch, collective_fusion::runtime::CommError>
    {
        use collective_fusion::runtime::cube::CubeBucket;
        use collective_fusion::runtime::{DeviceLaunch, PendingReduce};
        let Some(b) = bucket.as_any().downcast_ref::<CubeBucket<R>>() else {
            return Ok(DeviceLaunch::Declined(bucket));
        };
        let label = b.label.clone();
        let host = bucket.read().unwrap_or_else(|e| panic!("{e}"));
        let pending = self.inner.all_reduce(host, what.clone())?;
        let client = self.client.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let result = pending
                .wait(std::time::Duration::from_secs(60))
                .map(|(reduced, span)| {
                    let out: Box<dyn collective_fusion::runtime::DeviceBucket> =
                        Box::new(CubeBucket {
                            handle: client.create_from_slice(reduced.as_bytes()),
                            client,
                            len: reduced.len(),
                            dtype: reduced.dtype(),
                            label,
                        });
                    (out, span)
                });
            let _ = tx.send(result);
        });
        Ok(DeviceLaunch::Launched(PendingReduce::new(
            self.rank(),
            what,
            rx,
        )))
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// A plan over device gradients, run through `comms` (one per rank, each reducing device
/// memory in place), gives the bits of the same plan on host buffers in process, with every
/// collective reduced on the device (packed buckets, and copies of the gradients that have an
/// all-reduce of their own) and every reduced gradient still on the device.
pub fn check_plan_reduced_on_device<R: Runtime>(
    client: &ComputeClient<R>,
    comms: Vec<Box<dyn collective_fusion::runtime::Communicator>>,
) {
    use collective_fusion::config::BucketPolicy;
    for policy in [BucketPolicy::Ddp, BucketPolicy::PerParam] {
        reduced_on_device(client, &comms, policy);
    }
}

fn reduced_on_device<R: Runtime>(
    client: &ComputeClient<R>,
    comms: &[Box<dyn collective_fusion::runtime::Communicator>],
    policy: collective_fusion::config::BucketPolicy,
) {
    use collective_fusion::runtime::Grad;
    use collective_fusion::runtime::cube::CubeGrad;
    use collective_fusion::runtime::exec::{
        ExecOptions, NoHooks, Workspace, execute_in, run_in_process_grads,
    };
    let sizes = [300u64, 1000, 17, 2048, 3, 900, 4096, 64];
    let world = comms.len();
    let plan = small_plan(&sizes, world as u32, policy);
    let packed = plan.collectives.iter().filter(|c| c.packed).count() as u32;
    let calls: u32 = plan
        .collectives
        .iter()
        .map(|c| if c.packed { 1 } else { c.slots.len() as u32 })
        .sum();
    let inputs: Vec<Vec<HostBuffer>> = (0..world)
        .map(|r| collective_fusion::runtime::synthetic::seeded_gradients(&plan, r, 5))
        .collect();
    let host = run_in_process_grads(
        &plan,
        inputs
            .iter()
            .map(|g| g.iter().cloned().map(Grad::Host).collect())
            .collect(),
        ExecOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let device: Vec<(Vec<Grad>, collective_fusion::runtime::ExecReport)> =
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .iter()
                .zip(&inputs)
                .map(|(comm, ins)| {
                    let plan = &plan;
                    scope.spawn(move || {
                        let mut grads: Vec<Grad> = ins
                            .iter()
                            .map(|g| {
                                Grad::Device(Box::new(CubeGrad {
                                    client: client.clone(),
                                    handle: client.create_from_slice(g.as_bytes()),
                                    len: g.len(),
                                    dtype: g.dtype(),
                                }))
                            })
                            .collect();
                        let report = execute_in(
                            plan,
                            comm.as_ref(),
                            &mut grads,
                            &mut NoHooks,
                            ExecOptions::default(),
                            &mut Workspace::default(),
                        )
                        .unwrap_or_else(|e| panic!("{e}"));
                        (grads, report)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
    for (r, ((h, _), (d, report))) in host.into_iter().zip(device).enumerate() {
        assert_eq!(report.device_packs, packed, "{policy:?} rank {r}");
        assert_eq!(report.device_collectives, calls, "{policy:?} rank {r}");
        for (s, (a, b)) in h.into_iter().zip(d).enumerate() {
            assert!(
                matches!(b, Grad::Device(_)),
                "{policy:?} rank {r} slot {s}: the reduced gradient left the device"
            );
            let (a, b) = (a.into_host().unwrap(), b.into_host().unwrap());
            assert!(
                a.bits_eq(&b),
                "{policy:?} rank {r} {}: reduced on the device differs from host",
                plan.slots[s].param
            );
        }
    }
}

/// `gradient_as_bucket_view`: a reduced bucket unpacked with views hands back every member of
/// the wire dtype at an offset the device binds as a slice of the bucket (no copy), copies the
/// others out with the unpack kernel, and every member holds its own elements either way.
pub fn check_bucket_views<R: Runtime>(client: &ComputeClient<R>) {
    use collective_fusion::runtime::cube::CubeGrad;
    use collective_fusion::runtime::{DeviceGrad, Packed};
    let device_align = client.properties().memory.alignment.max(1);
    let sizes = [128u64, 3, 256, 5, 1024, 77];
    let values: Vec<HostBuffer> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| HostBuffer::from_f64(DType::F32, &random(n, 40 + i as u64)).unwrap())
        .collect();
    let grads: Vec<CubeGrad<R>> = values
        .iter()
        .map(|v| CubeGrad {
            client: client.clone(),
            handle: client.create_from_slice(v.as_bytes()),
            len: v.len(),
            dtype: DType::F32,
        })
        .collect();
    let members: Vec<&dyn DeviceGrad> = grads.iter().map(|g| g as &dyn DeviceGrad).collect();
    // 512-byte members (what the option asks of the compiler), the default 16, and a cast.
    for (align_bytes, wire, views) in [
        (512, DType::F32, true),
        (16, DType::F32, true),
        (512, DType::F32, false),
        (512, DType::F16, true),
    ] {
        let l = BucketLayout::of_sizes(&sizes, DType::F32, wire, None, align_bytes);
        let case = format!("{align_bytes}-byte members, wire {wire}, views {views}");
        let Some(flat) = members[0].pack(&l, &members, None).unwrap() else {
            eprintln!("skipped {case}: the device does not run {wire}");
            continue;
        };
        // Reduced on the device, and reduced in host memory (a host communicator's result).
        let on_host = flat.read().unwrap();
        for reduced in [Packed::Device(flat), Packed::Host(on_host)] {
            let case = match reduced {
                Packed::Host(_) => format!("{case}, reduced in host memory"),
                Packed::Device(_) => case.clone(),
            };
            let out = members[0].unpack(&l, &members, &reduced, views).unwrap();
            let viewable: Vec<bool> = l
                .members
                .iter()
                .map(|m| views && wire == DType::F32 && (m.offset * 4) % device_align == 0)
                .collect();
            let want = viewable.iter().filter(|v| **v).count() as u32;
            assert_eq!(out.views, want, "{case}: device alignment {device_align}");
            if align_bytes >= device_align && views && wire == DType::F32 {
                assert_eq!(out.views as usize, sizes.len(), "{case}");
            }
            assert_eq!(out.grads.len(), sizes.len(), "{case}");
            for (i, ((g, v), m)) in out.grads.iter().zip(&values).zip(&l.members).enumerate() {
                let cube = g
                    .as_any()
                    .downcast_ref::<CubeGrad<R>>()
                    .expect("a CubeGrad");
                // A view is the bucket's buffer from the member's offset; a copy is a new buffer.
                let start = cube.handle.offset_start.unwrap_or(0);
                if viewable[i] {
                    assert_eq!(
                        start,
                        m.offset * 4,
                        "{case}: member {i} is not at its offset"
                    );
                    assert!(cube.handle.size() >= l.bytes, "{case}: member {i}");
                } else {
                    assert_eq!(start, 0, "{case}: member {i} is a copy");
                }
                let back = g.read().unwrap();
                if wire == DType::F32 {
                    assert!(back.bits_eq(v), "{case}: member {i} holds other elements");
                } else {
                    within_rounding(v, &back, 10);
                }
            }
        }
    }
}

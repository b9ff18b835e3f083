//! Runtime throughput, side by side with memcpy of the same bytes on the same machine:
//! - `allreduce/{bytes}`: memcpy of the buffer vs the in-process all-reduce on 2 and 4 ranks and
//!   the TCP all-reduce over loopback on 2 ranks and on 4, through rank 0 (`tcp_star_4ranks`)
//!   and, from 1 MiB, through the mesh (`tcp_4ranks`) (algorithm bandwidth: bytes of one rank's
//!   buffer per unit time).
//! - `pack/{bytes}`: memcpy vs the host pack and the CubeCL pack (wgpu) of a 16-member bucket,
//!   and a device copy of the same bytes (a plain 16-byte-vector CubeCL copy kernel, with a new
//!   output buffer per call as the pack has): the pack/copy ratio is the GPU check's metric.
//! - `pack_members/4096KiB`: one 4 MiB bucket in 1, 4, 16 and 64 members, beside the copy (on a
//!   software driver every member's code runs under a mask, so the member count costs there).
//! - `bucket_io/{bytes}`: a 16-member bucket of wgpu gradients, from device buffers to a flat host
//!   buffer (what the communicator takes) and back into device buffers: staged (each gradient
//!   read into host memory, host pack and unpack, each written back) vs device buckets (CubeCL
//!   pack and unpack on the device, one read and one write of the flat bucket).
//! - `declined_read/{n}x{bytes}`: a backward pass of device work with a wgpu bucket launched over
//!   a host communicator after each piece: the bucket read into host memory on the caller's
//!   thread against on the communicator's; prints the time the caller spent in the launches.
//!
//! Run with `cargo bench --bench runtime`; criterion prints each throughput, the ratios are
//! throughput(x) / throughput(memcpy) within one group.

use std::hint::black_box;
use std::time::Duration;

use collective_fusion::codegen::layout::BucketLayout;
use collective_fusion::graph::{DType, ReduceOp};
use collective_fusion::runtime::comm::{CollectiveDesc, Communicator};
use collective_fusion::runtime::cube::{self, CubeGrad, DeviceMember};
use collective_fusion::runtime::tcp::{TcpComm, TcpOptions};
use collective_fusion::runtime::{DeviceGrad, HostBuffer, InProcessGroup, Packed, host};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

const SIZES: [usize; 3] = [256 << 10, 4 << 20, 32 << 20];
/// The all-reduce's sizes: `SIZES` and 1 MiB, where the TCP mesh starts (`SHARDED_MIN_BYTES`).
const ALLREDUCE_SIZES: [usize; 4] = [256 << 10, 1 << 20, 4 << 20, 32 << 20];

/// The device-copy baseline of the pack bench: one vector per unit.
#[cube(launch_unchecked)]
fn copy_kernel<F: Float, N: Size>(src: &Array<Vector<F, N>>, dst: &mut Array<Vector<F, N>>) {
    if ABSOLUTE_POS < src.len() {
        dst[ABSOLUTE_POS] = src[ABSOLUTE_POS];
    }
}

fn desc(count: usize) -> CollectiveDesc {
    CollectiveDesc::of_bucket(0, ReduceOp::Sum, DType::F32, count as u64)
}

/// The baseline of every group: a copy of `n` f32 between two buffers.
fn memcpy_baseline(g: &mut BenchmarkGroup<'_, WallTime>, n: usize) {
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
}

/// A TCP group of `world` ranks over loopback, each rank's connections its own.
fn tcp_group(world: usize, options: TcpOptions) -> Vec<Box<dyn Communicator>> {
    TcpComm::loopback_group(world, Duration::from_secs(60), options)
        .expect("a TCP group over loopback")
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect()
}

fn allreduce(c: &mut Criterion) {
    for bytes in ALLREDUCE_SIZES {
        let n = bytes / 4;
        let mut g = c.benchmark_group(format!("allreduce/{}KiB", bytes >> 10));
        g.throughput(Throughput::Bytes(bytes as u64));
        g.measurement_time(Duration::from_secs(3)).sample_size(20);
        memcpy_baseline(&mut g, n);
        let star = TcpOptions {
            sharded_min_bytes: None,
        };
        let cases = [
            ("inprocess", 2usize),
            ("inprocess", 4),
            ("tcp", 2),
            ("tcp", 4),
            ("tcp_star", 4),
        ];
        for (transport, world) in cases {
            let comms: Vec<Box<dyn Communicator>> = if transport == "tcp" {
                tcp_group(world, TcpOptions::default())
            } else if transport == "tcp_star" {
                tcp_group(world, star)
            } else {
                InProcessGroup::ranks(world, Duration::from_secs(60))
                    .into_iter()
                    .map(|c| Box::new(c) as Box<dyn Communicator>)
                    .collect()
            };
            let mut bufs: Vec<Option<HostBuffer>> = (0..world)
                .map(|_| Some(HostBuffer::F32(vec![1.0; n])))
                .collect();
            g.bench_function(format!("{transport}_{world}ranks"), |b| {
                b.iter(|| {
                    let pending: Vec<_> = comms
                        .iter()
                        .zip(bufs.iter_mut())
                        .map(|(c, buf)| c.all_reduce(buf.take().unwrap(), desc(n)).unwrap())
                        .collect();
                    for (p, slot) in pending.into_iter().zip(bufs.iter_mut()) {
                        *slot = Some(p.wait(Duration::from_secs(60)).unwrap().0);
                    }
                })
            });
        }
        g.finish();
    }
}

fn layout(total: usize, members: usize) -> BucketLayout {
    // Members back to back (4-byte alignment: no padding), prescaled for 4 ranks.
    let sizes = vec![(total / members) as u64; members];
    BucketLayout::of_sizes(&sizes, DType::F32, DType::F32, Some(4), 4)
}

fn pack(c: &mut Criterion) {
    let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
    for bytes in SIZES {
        let n = bytes / 4;
        let l = layout(n, 16);
        let mut g = c.benchmark_group(format!("pack/{}KiB", bytes >> 10));
        g.throughput(Throughput::Bytes(bytes as u64));
        g.measurement_time(Duration::from_secs(3)).sample_size(20);
        memcpy_baseline(&mut g, n);
        let members: Vec<HostBuffer> = (0..16)
            .map(|_| HostBuffer::F32(vec![1.5; n / 16]))
            .collect();
        let refs: Vec<&HostBuffer> = members.iter().collect();
        let mut out = host::pack(&l, &refs, Some(4)).unwrap();
        g.bench_function("host_pack", |b| {
            b.iter(|| {
                host::pack_into(&l, &refs, Some(4), &mut out).unwrap();
                black_box(&out);
            })
        });
        let dev = upload_members(&client, &members);
        g.bench_function("cubecl_pack_wgpu", |b| {
            b.iter(|| device_pack(&client, &l, &dev))
        });
        device_copy(&mut g, &client, n);
        g.finish();
    }
}

fn upload_members(
    client: &ComputeClient<WgpuRuntime>,
    members: &[HostBuffer],
) -> Vec<DeviceMember> {
    members
        .iter()
        .map(|m| DeviceMember {
            handle: client.create_from_slice(m.as_bytes()),
            len: m.len(),
        })
        .collect()
}

/// One pack of `dev` on the device, waited for.
fn device_pack(client: &ComputeClient<WgpuRuntime>, l: &BucketLayout, dev: &[DeviceMember]) {
    let h = cube::pack(client, l, dev, Some(4)).unwrap();
    cubecl::future::block_on(client.sync()).unwrap();
    black_box(h);
}

/// The device copy of `n` f32 into a new buffer, the pack's baseline.
fn device_copy(
    g: &mut BenchmarkGroup<'_, WallTime>,
    client: &ComputeClient<WgpuRuntime>,
    n: usize,
) {
    let src = client.create_from_slice(HostBuffer::F32(vec![1.5; n]).as_bytes());
    g.bench_function("cubecl_copy_wgpu", |b| {
        b.iter(|| {
            let dst = client.empty(n * 4);
            let vectors = (n / 4) as u32;
            let count = cubecl::server::CubeCountSelection::new(client, vectors.div_ceil(256));
            // SAFETY: both buffers hold `n` f32 (a multiple of 4); the kernel guards its index.
            unsafe {
                copy_kernel::launch_unchecked::<f32, WgpuRuntime>(
                    client,
                    count.cube_count(),
                    CubeDim::new_1d(256),
                    4,
                    ArrayArg::from_raw_parts(src.clone(), n),
                    ArrayArg::from_raw_parts(dst.clone(), n),
                );
            }
            cubecl::future::block_on(client.sync()).unwrap();
            black_box(dst);
        })
    });
}

/// One 4 MiB bucket split into 1 to 64 members, beside the copy: what the member count costs.
fn pack_members(c: &mut Criterion) {
    let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
    let bytes = 4 << 20;
    let n = bytes / 4;
    let mut g = c.benchmark_group("pack_members/4096KiB");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.measurement_time(Duration::from_secs(3)).sample_size(20);
    for m in [1, 4, 16, 64] {
        let l = layout(n, m);
        let members: Vec<HostBuffer> = (0..m).map(|_| HostBuffer::F32(vec![1.5; n / m])).collect();
        let dev = upload_members(&client, &members);
        g.bench_function(format!("cubecl_pack_wgpu/{m}"), |b| {
            b.iter(|| device_pack(&client, &l, &dev))
        });
    }
    device_copy(&mut g, &client, n);
    g.finish();
}

/// Sixteen wgpu gradients of `n / 16` f32 each, gradient `i` filled with `base + i`.
fn sixteen_grads(
    client: &ComputeClient<WgpuRuntime>,
    n: usize,
    base: f32,
) -> Vec<CubeGrad<WgpuRuntime>> {
    (0..16)
        .map(|i| {
            let h = HostBuffer::F32(vec![base + i as f32; n / 16]);
            CubeGrad {
                client: client.clone(),
                handle: client.create_from_slice(h.as_bytes()),
                len: h.len(),
                dtype: DType::F32,
            }
        })
        .collect()
}

fn bucket_io(c: &mut Criterion) {
    let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
    for bytes in SIZES {
        let n = bytes / 4;
        let l = layout(n, 16);
        let mut g = c.benchmark_group(format!("bucket_io/{}KiB", bytes >> 10));
        g.throughput(Throughput::Bytes(bytes as u64));
        g.measurement_time(Duration::from_secs(3)).sample_size(10);
        let grads = sixteen_grads(&client, n, 1.5);
        let members: Vec<&dyn DeviceGrad> = grads.iter().map(|g| g as &dyn DeviceGrad).collect();
        g.bench_function("host_staged", |b| {
            b.iter(|| {
                let mut host: Vec<HostBuffer> = members.iter().map(|m| m.read().unwrap()).collect();
                let flat = {
                    let refs: Vec<&HostBuffer> = host.iter().collect();
                    host::pack(&l, &refs, Some(4)).unwrap()
                };
                let mut outs: Vec<&mut HostBuffer> = host.iter_mut().collect();
                host::unpack(&l, &flat, &mut outs).unwrap();
                let back: Vec<_> = host
                    .iter()
                    .map(|h| client.create_from_slice(h.as_bytes()))
                    .collect();
                cubecl::future::block_on(client.sync()).unwrap();
                black_box(back);
            })
        });
        // Packed on the device, through host memory (what a host communicator gets).
        g.bench_function("device_buckets", |b| {
            b.iter(|| {
                let flat = members[0].pack(&l, &members, Some(4)).unwrap().unwrap();
                let flat = Packed::Host(flat.read().unwrap());
                let back = members[0].unpack(&l, &members, &flat, false).unwrap();
                cubecl::future::block_on(client.sync()).unwrap();
                black_box(back);
            })
        });
        // Packed and unpacked on the device with nothing crossing to the host (what NCCL's
        // in-place all-reduce leaves around the call).
        g.bench_function("device_in_place", |b| {
            b.iter(|| {
                let flat = members[0].pack(&l, &members, Some(4)).unwrap().unwrap();
                let back = members[0]
                    .unpack(&l, &members, &Packed::Device(flat), false)
                    .unwrap();
                cubecl::future::block_on(client.sync()).unwrap();
                black_box(back);
            })
        });
        // As above, with the reduced gradients handed back as views of the bucket
        // (`gradient_as_bucket_view`): no unpack kernel. Every member here is 16 KiB or more,
        // so each sits at an offset the device can bind.
        g.bench_function("device_in_place_views", |b| {
            b.iter(|| {
                let flat = members[0].pack(&l, &members, Some(4)).unwrap().unwrap();
                let back = members[0]
                    .unpack(&l, &members, &Packed::Device(flat), true)
                    .unwrap();
                assert_eq!(back.views, 16);
                cubecl::future::block_on(client.sync()).unwrap();
                black_box(back);
            })
        });
        g.finish();
        // Device memory the unpacked gradients take beside their reduced bucket while both are
        // alive (the bucket is freed after the unpack when the gradients are copies; views keep
        // it as their storage).
        let beside = |views: bool| {
            let flat = Packed::Device(members[0].pack(&l, &members, Some(4)).unwrap().unwrap());
            cubecl::future::block_on(client.sync()).unwrap();
            let before = client.memory_usage().unwrap().bytes_in_use;
            let back = members[0].unpack(&l, &members, &flat, views).unwrap();
            cubecl::future::block_on(client.sync()).unwrap();
            let after = client.memory_usage().unwrap().bytes_in_use;
            drop((back, flat));
            after.saturating_sub(before)
        };
        println!(
            "bucket_io/{}KiB/memory: unpacked gradients take {} KiB beside their bucket as copies, {} KiB as views",
            bytes >> 10,
            beside(false) >> 10,
            beside(true) >> 10
        );
    }
}

/// A host communicator that reads a declined device bucket on the caller's thread (the
/// trait's default), as the executor did before the host communicators read it on their own.
struct CallerReads(collective_fusion::runtime::InProcessComm);

impl Communicator for CallerReads {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world(&self) -> usize {
        self.0.world()
    }

    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: CollectiveDesc,
    ) -> Result<collective_fusion::runtime::PendingReduce, collective_fusion::runtime::CommError>
    {
        self.0.all_reduce(buffer, what)
    }

    fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }
}

/// A backward pass that queues device work and launches a declined device bucket after each
/// piece (a wgpu bucket over a host communicator): the bucket read on the caller's thread
/// (which then waits for the device before it can queue the next piece) against the read on
/// the communicator's thread. Prints the time the caller spent in the launches.
fn declined_read(c: &mut Criterion) {
    const BUCKETS: usize = 8;
    let client = WgpuRuntime::client(&WgpuDevice::DefaultDevice);
    let bytes = 4 << 20;
    let n = bytes / 4;
    let grads = |n: usize| sixteen_grads(&client, n, 0.5);
    // The bucket's gradients, and "backward work": a pack of four times as many bytes.
    let (bucket_grads, work_grads) = (grads(n), grads(4 * n));
    let members: Vec<&dyn DeviceGrad> = bucket_grads.iter().map(|g| g as &dyn DeviceGrad).collect();
    let work: Vec<&dyn DeviceGrad> = work_grads.iter().map(|g| g as &dyn DeviceGrad).collect();
    let (l, lw) = (layout(n, 16), layout(4 * n, 16));
    let step = |comm: &dyn Communicator| -> Duration {
        let mut in_launch = Duration::ZERO;
        let mut pending = Vec::with_capacity(BUCKETS);
        for _ in 0..BUCKETS {
            let done = work[0].pack(&lw, &work, None).unwrap();
            let flat = members[0].pack(&l, &members, Some(1)).unwrap().unwrap();
            let t = std::time::Instant::now();
            pending.push(comm.all_reduce_read(flat, desc(n)).unwrap());
            in_launch += t.elapsed();
            black_box(done);
        }
        for p in pending {
            black_box(p.wait(Duration::from_secs(60)).unwrap());
        }
        in_launch
    };
    let on_comm = InProcessGroup::ranks(1, Duration::from_secs(60)).remove(0);
    let on_caller = CallerReads(InProcessGroup::ranks(1, Duration::from_secs(60)).remove(0));
    let mut g = c.benchmark_group(format!("declined_read/{BUCKETS}x{}KiB", bytes >> 10));
    g.throughput(Throughput::Bytes((BUCKETS * bytes) as u64));
    g.measurement_time(Duration::from_secs(5)).sample_size(10);
    g.bench_function("read_on_caller", |b| b.iter(|| step(&on_caller)));
    g.bench_function("read_on_comm_thread", |b| b.iter(|| step(&on_comm)));
    g.finish();
    let median = |comm: &dyn Communicator| {
        let mut t: Vec<Duration> = (0..7).map(|_| step(comm)).collect();
        t.sort();
        t[3]
    };
    println!(
        "declined_read/{BUCKETS}x{}KiB/caller: the backward thread spent {:.1} ms in the launches reading on it, {:.1} ms with the communicator's thread reading (medians of 7 steps)",
        bytes >> 10,
        median(&on_caller).as_secs_f64() * 1e3,
        median(&on_comm).as_secs_f64() * 1e3,
    );
}

criterion_group!(
    benches,
    allreduce,
    pack,
    pack_members,
    bucket_io,
    declined_read
);
criterion_main!(benches);

//! GPU tests: the CubeCL bucket kernels on CubeCL's CUDA runtime against the host path, their
//! bandwidth against the device's copy bandwidth, and the NCCL communicator (feature `cuda`). They are compiled always and, on a machine
//! without a GPU, libcuda or libnccl (or without the feature), each says so on stderr and
//! passes; `CF_REQUIRE_GPU=1` (what `scripts/gpu-run.sh` sets) turns that skip into a failure,
//! for the tests that need one GPU; those that need more (a group of NCCL processes, one GPU
//! each) fail for want of them only where `CF_REQUIRE_GPUS` says the machine has that many.

mod common;

/// Whether to run; prints why not.
#[allow(dead_code)]
fn gpu_or_skip(test: &str, gpus: usize, nccl: bool) -> bool {
    let why = gpu_missing(gpus, nccl);
    match why {
        None => true,
        Some(why) => {
            let gpus_required = std::env::var("CF_REQUIRE_GPUS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(1);
            if std::env::var("CF_REQUIRE_GPU").is_ok_and(|v| v == "1") && gpus <= gpus_required {
                panic!("{test}: CF_REQUIRE_GPU=1 but {why}");
            }
            eprintln!("SKIPPED {test}: {why}");
            false
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_missing(_gpus: usize, _nccl: bool) -> Option<String> {
    Some("built without the `cuda` feature".into())
}

#[cfg(feature = "cuda")]
fn gpu_missing(gpus: usize, nccl: bool) -> Option<String> {
    use collective_fusion::runtime::nccl::{device_count, nccl_available};
    if nccl && !nccl_available() {
        return Some("libcuda or libnccl cannot be loaded".into());
    }
    let n = device_count();
    (n < gpus).then(|| format!("{n} CUDA device(s), the test needs {gpus}"))
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_tests_need_the_cuda_feature() {
    gpu_or_skip("gpu tests", 1, false);
}

#[cfg(feature = "cuda")]
mod kernels {
    use std::time::Instant;

    use collective_fusion::codegen::layout::BucketLayout;
    use collective_fusion::graph::DType;
    use collective_fusion::runtime::HostBuffer;
    use collective_fusion::runtime::cube::{self, DeviceMember};
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;

    use super::common::cube::{check_cast, check_f32_bitwise, layout, upload};
    use super::gpu_or_skip;

    fn client() -> Option<ComputeClient<CudaRuntime>> {
        gpu_or_skip("cubecl cuda kernels", 1, false)
            .then(|| CudaRuntime::client(&CudaDevice::new(0)))
    }

    #[test]
    fn pack_and_unpack_f32_on_cuda_match_the_host_path_bitwise() {
        if let Some(c) = client() {
            check_f32_bitwise(&c);
        }
    }

    #[test]
    fn f16_members_and_members_at_unaligned_addresses_on_cuda_match_the_host_path_bitwise() {
        if let Some(c) = client() {
            super::common::cube::check_f16_bitwise(&c);
            super::common::cube::check_unaligned_members(&c);
        }
    }

    #[test]
    fn casts_to_f16_and_bf16_on_cuda_are_within_their_rounding() {
        if let Some(c) = client() {
            check_cast(&c, DType::F16, 10);
            check_cast(&c, DType::BF16, 7);
        }
    }

    #[test]
    fn a_plan_over_cuda_gradients_gives_the_bits_of_the_host_path() {
        if let Some(c) = client() {
            super::common::cube::check_plan_on_device(&c);
        }
    }

    #[test]
    fn reduced_members_handed_back_as_views_on_cuda_hold_their_own_elements() {
        if let Some(c) = client() {
            super::common::cube::check_bucket_views(&c);
        }
    }

    fn sync(c: &ComputeClient<CudaRuntime>) {
        cubecl::future::block_on(c.sync()).expect("device sync");
    }

    /// Seconds per call of `f` until `wait` says the device is done, and until `f` returned
    /// (the host's share: building and launching), the medians of `reps` timed calls after a
    /// warm-up.
    fn time(reps: usize, mut f: impl FnMut(), mut wait: impl FnMut()) -> (f64, f64) {
        f();
        wait();
        let (mut done, mut launched): (Vec<f64>, Vec<f64>) = (0..reps)
            .map(|_| {
                let t0 = Instant::now();
                f();
                let launched = t0.elapsed().as_secs_f64();
                wait();
                (t0.elapsed().as_secs_f64(), launched)
            })
            .unzip();
        done.sort_by(f64::total_cmp);
        launched.sort_by(f64::total_cmp);
        (done[reps / 2], launched[reps / 2])
    }

    /// Seconds per call of `f` when `QUEUED` calls are made back to back and then waited for
    /// once (`wait`), the median of five such batches: what a call costs when calls queue
    /// behind each other, as a step's packs queue behind its backward. The host's share and the
    /// device's overlap, so this is the larger of the two per call.
    fn queued(mut f: impl FnMut(), mut wait: impl FnMut()) -> f64 {
        const QUEUED: usize = 20;
        f();
        wait();
        let mut per: Vec<f64> = (0..5)
            .map(|_| {
                let t0 = Instant::now();
                for _ in 0..QUEUED {
                    f();
                }
                wait();
                t0.elapsed().as_secs_f64() / QUEUED as f64
            })
            .collect();
        per.sort_by(f64::total_cmp);
        per[2]
    }

    /// Not a pass/fail test: prints the pack and unpack kernels' bandwidth against a
    /// device-to-device copy of the same bytes (cudarc's `cuMemcpyDtoD`), measured side by side.
    #[test]
    fn bench_pack_bandwidth_against_the_device_copy() {
        let Some(c) = client() else {
            return;
        };
        let ctx = cudarc::driver::CudaContext::new(0).expect("CUDA context");
        let stream = ctx.default_stream();
        // What a CubeCL sync costs with nothing queued: part of every pack and unpack time
        // below, not of the copy's (timed on a bare CUDA stream).
        let (idle, _) = time(9, || {}, || sync(&c));
        println!("cubecl sync with nothing queued: {:.1} us", idle * 1e6);
        // The kernels are specialized on the member count: the first pack of a count compiles
        // its kernel. Counts no other test here packs, small members.
        for members in [7usize, 15, 31, 63] {
            let sizes = vec![4096u64; members];
            let l: BucketLayout = layout(&sizes, DType::F32, DType::F32, Some(8));
            let dev: Vec<DeviceMember> = sizes
                .iter()
                .map(|n| upload(&c, &HostBuffer::zeros(DType::F32, *n as usize).unwrap()))
                .collect();
            let t0 = Instant::now();
            let flat = cube::pack(&c, &l, &dev, Some(8)).expect("pack");
            sync(&c);
            let first = t0.elapsed().as_secs_f64();
            drop(flat);
            let (again, _) = time(
                5,
                || drop(cube::pack(&c, &l, &dev, Some(8)).expect("pack")),
                || sync(&c),
            );
            println!(
                "first pack of {members} members: {:.1} ms (compiling its kernel); after: {:.1} us",
                first * 1e3,
                again * 1e6
            );
        }
        // Two ways to time each: one call waited for alone (the host's launch, CubeCL's sync and
        // the device's work in a row), and calls queued back to back (see `queued`). The copy
        // is timed both ways too, on its own bare CUDA stream.
        println!(
            "bytes        members  pack/copy  queued  pack us  (launch)  queued  unpack us  queued  copy us  queued  pack GB/s queued"
        );
        // The same bytes in fewer members too, so that a cost per member shows.
        for (members, each) in [
            (16u64, 1u64 << 18),
            (1, 1 << 22),
            (64, 1 << 20),
            (4, 1 << 24),
            (1, 1 << 26),
            (32, 1 << 23),
        ] {
            let sizes = vec![each; members as usize];
            let l: BucketLayout = layout(&sizes, DType::F32, DType::F32, Some(8));
            let bytes = l.bytes as usize;
            let dev: Vec<DeviceMember> = sizes
                .iter()
                .map(|n| upload(&c, &HostBuffer::zeros(DType::F32, *n as usize).unwrap()))
                .collect();
            let mut flat = None;
            let (pack, pack_launch) = time(
                9,
                || flat = Some(cube::pack(&c, &l, &dev, Some(8)).expect("pack")),
                || sync(&c),
            );
            let flat = flat.expect("packed");
            let (unpack, _) = time(
                9,
                || cube::unpack(&c, &l, &flat, &dev).expect("unpack"),
                || sync(&c),
            );
            let src = stream.alloc_zeros::<u8>(bytes).expect("alloc");
            let mut dst = stream.alloc_zeros::<u8>(bytes).expect("alloc");
            let (copy, _) = time(
                9,
                || stream.memcpy_dtod(&src, &mut dst).expect("copy"),
                || stream.synchronize().unwrap(),
            );
            let pack_q = queued(
                || drop(cube::pack(&c, &l, &dev, Some(8)).expect("pack")),
                || sync(&c),
            );
            let unpack_q = queued(
                || cube::unpack(&c, &l, &flat, &dev).expect("unpack"),
                || sync(&c),
            );
            let copy_q = queued(
                || stream.memcpy_dtod(&src, &mut dst).expect("copy"),
                || stream.synchronize().unwrap(),
            );
            // Read + write, as bandwidth tools count a copy.
            let gbs = |t: f64| 2.0 * bytes as f64 / t / 1e9;
            println!(
                "{bytes:>11}  {members:>7}  {:>9.2}  {:>6.2}  {:>7.1}  {:>8.1}  {:>6.1}  {:>9.1}  {:>6.1}  {:>7.1}  {:>6.1}  {:>16.1}",
                copy / pack,
                copy_q / pack_q,
                pack * 1e6,
                pack_launch * 1e6,
                pack_q * 1e6,
                unpack * 1e6,
                unpack_q * 1e6,
                copy * 1e6,
                copy_q * 1e6,
                gbs(pack_q),
            );
        }
    }
}

#[cfg(feature = "cuda")]
mod nccl {
    use std::time::{Duration, Instant};

    use collective_fusion::codegen::plan::{Plan, lower};
    use collective_fusion::config::{BucketConfig, BucketPolicy, CompileConfig, MIB};
    use collective_fusion::graph::builder::{BuildOptions, build_step_graph};
    use collective_fusion::graph::{DType, ReduceOp};
    use collective_fusion::model::ModelProfile;
    use collective_fusion::passes::compile;
    use collective_fusion::runtime::comm::{CollectiveDesc, CommError};
    use collective_fusion::runtime::nccl::{NcclComm, NcclInitError, unique_id};
    use collective_fusion::runtime::rendezvous::rendezvous;
    use collective_fusion::runtime::synthetic::seeded_gradients;
    use collective_fusion::runtime::{
        Communicator, ExecOptions, HostBuffer, execute, run_in_process,
    };

    use super::gpu_or_skip;

    /// Rank 0 of a world of one, through the real rendezvous and a fresh NCCL id.
    fn single_rank() -> NcclComm {
        let cfg = super::common::world_of_one();
        let id = rendezvous(&cfg, || unique_id().unwrap()).unwrap();
        assert_eq!(id.len(), 128);
        NcclComm::new(0, 0, 1, &id, Duration::from_secs(30)).unwrap()
    }

    fn desc(op: ReduceOp, dtype: DType, count: u64) -> CollectiveDesc {
        CollectiveDesc {
            collective: 0,
            bucket: Some(0),
            op,
            dtype,
            count,
            params: vec!["p".into()],
        }
    }

    #[test]
    fn a_single_rank_all_reduce_through_the_rendezvous_returns_its_input() {
        if !gpu_or_skip("nccl single rank", 1, true) {
            return;
        }
        let comm = single_rank();
        for (op, buf) in [
            (
                ReduceOp::Sum,
                HostBuffer::from_f64(DType::F32, &[1.5, -2.0, 3.25]).unwrap(),
            ),
            (
                ReduceOp::Mean,
                HostBuffer::from_f64(DType::BF16, &[0.5, 7.0]).unwrap(),
            ),
            (
                ReduceOp::Sum,
                HostBuffer::from_f64(DType::F16, &[1.0; 1000]).unwrap(),
            ),
            (
                ReduceOp::Mean,
                HostBuffer::from_f64(DType::F64, &[1e-300, 2.0]).unwrap(),
            ),
        ] {
            let d = desc(op, buf.dtype(), buf.len() as u64);
            let (out, _) = comm
                .all_reduce(buf.clone(), d)
                .unwrap()
                .wait(Duration::from_secs(30))
                .unwrap();
            assert!(out.bits_eq(&buf), "{op:?} {:?}", buf.dtype());
        }
    }

    /// Host buffers go through the comm thread's pinned staging memory: a group of buffers of
    /// three dtypes shares one batch (each its own place), a larger one makes the memory grow,
    /// and a smaller one reuses it; every result has its own input's bits (one rank: the
    /// all-reduce is the identity, so a buffer given another's place would show). Prints the
    /// host-buffer round trip's bandwidth.
    #[test]
    fn host_buffers_through_pinned_staging_come_back_with_their_own_bits() {
        if !gpu_or_skip("nccl pinned staging", 1, true) {
            return;
        }
        use collective_fusion::runtime::Communicator;
        use collective_fusion::runtime::synthetic::SplitMix64;
        let comm = single_rank();
        let random = |dtype: DType, n: usize, seed: u64| {
            let mut r = SplitMix64(seed);
            let v: Vec<f64> = (0..n).map(|_| r.next_value()).collect();
            HostBuffer::from_f64(dtype, &v).unwrap()
        };
        let batches = [
            vec![
                random(DType::F32, 1000, 1),
                random(DType::F16, 7, 2),
                HostBuffer::F32(Vec::new()),
                random(DType::BF16, 70_001, 3),
            ],
            vec![random(DType::F32, 16 << 20, 4)],
            vec![random(DType::F64, 33, 5), random(DType::F32, 5, 6)],
        ];
        for (b, batch) in batches.iter().enumerate() {
            comm.group(true);
            let pending: Vec<_> = batch
                .iter()
                .map(|buf| {
                    let d = desc(ReduceOp::Sum, buf.dtype(), buf.len() as u64);
                    comm.all_reduce(buf.clone(), d).unwrap()
                })
                .collect();
            comm.group(false);
            for (k, (p, buf)) in pending.into_iter().zip(batch).enumerate() {
                let (out, _) = p.wait(Duration::from_secs(30)).unwrap();
                assert!(out.bits_eq(buf), "batch {b}, buffer {k} ({})", buf.dtype());
            }
        }
        let buf = random(DType::F32, 16 << 20, 7);
        let mut times: Vec<f64> = (0..5)
            .map(|_| {
                let d = desc(ReduceOp::Sum, DType::F32, buf.len() as u64);
                // The copy handed over is made (and its pages touched) before the clock starts:
                // 64 MiB of fresh pages cost tens of milliseconds of page faults, which are the
                // test's, not the collective's.
                let mine = buf.clone();
                let t0 = Instant::now();
                let p = comm.all_reduce(mine, d).unwrap();
                let (out, _) = p.wait(Duration::from_secs(30)).unwrap();
                let s = t0.elapsed().as_secs_f64();
                drop(out);
                s
            })
            .collect();
        times.sort_by(f64::total_cmp);
        let bytes = buf.as_bytes().len() as f64;
        println!(
            "host buffer through pinned staging: {} MiB all-reduced in {:.2} ms (median of 5), \
             {:.1} GB/s each way",
            bytes as u64 >> 20,
            times[2] * 1e3,
            bytes / times[2] / 1e9
        );
    }

    /// An NCCL collective's span is the device's: timed events around its call, anchored at
    /// the moment the comm thread saw the stream pass it, so it lies inside the host's view
    /// (from the call to the reply, which also holds the copy back to the host), and a 64 MiB
    /// all-reduce takes a measurable time on it.
    #[test]
    fn an_nccl_collective_is_timed_by_the_device() {
        if !gpu_or_skip("nccl device timing", 1, true) {
            return;
        }
        let comm = single_rank();
        let buf = HostBuffer::from_f64(DType::F32, &vec![1.0; 16 << 20]).unwrap();
        for round in 0..3 {
            let d = desc(ReduceOp::Sum, DType::F32, buf.len() as u64);
            let called = Instant::now();
            let (_, span) = comm
                .all_reduce(buf.clone(), d)
                .unwrap()
                .wait(Duration::from_secs(30))
                .unwrap();
            let replied = Instant::now();
            assert!(span.start >= called && span.end <= replied, "round {round}");
            let device = span.end - span.start;
            assert!(device > Duration::ZERO, "round {round}");
            eprintln!(
                "device timing round {round}: 64 MiB host-buffer all-reduce: {:.3} ms on the device (copy in and NCCL), {:.3} ms from the call to the reply",
                device.as_secs_f64() * 1e3,
                (replied - called).as_secs_f64() * 1e3
            );
        }
    }

    fn gpt2_plan() -> Plan {
        let profile = ModelProfile::load("gpt2").unwrap();
        let mut g = build_step_graph(
            &profile,
            &BuildOptions {
                world: 1,
                batch: 8,
                reduce: ReduceOp::Mean,
            },
        );
        let config = CompileConfig {
            bucket: BucketConfig {
                policy: BucketPolicy::Ddp,
                cap_bytes: 25 * MIB,
                first_bucket_bytes: MIB,
            },
            ..CompileConfig::default()
        };
        compile(&mut g, &config).unwrap();
        lower(&g).unwrap()
    }

    #[test]
    fn a_gpt2_plan_over_nccl_equals_the_in_process_run_bitwise() {
        if !gpu_or_skip("nccl gpt2 plan", 1, true) {
            return;
        }
        let plan = gpt2_plan();
        let comm = single_rank();
        let mut grads = seeded_gradients(&plan, 0, 42);
        let t0 = Instant::now();
        execute(
            &plan,
            &comm,
            &mut grads,
            &mut collective_fusion::runtime::exec::NoHooks,
            ExecOptions::default(),
        )
        .unwrap();
        eprintln!(
            "gpt2 plan, {} collectives, over NCCL: {:?}",
            plan.collectives.len(),
            t0.elapsed()
        );
        let reference = run_in_process(
            &plan,
            vec![seeded_gradients(&plan, 0, 42)],
            ExecOptions::default(),
        )
        .unwrap();
        for (i, (a, b)) in grads.iter().zip(&reference[0].0).enumerate() {
            assert!(a.bits_eq(b), "slot {i} ({})", plan.slots[i].param);
        }
    }

    /// A plan over `Collective<Cuda>`-style gradients (CubeCL CUDA buffers) on NCCL: every
    /// collective is reduced in place in device memory (nothing crosses to the host), and the
    /// result has the bits of the host path.
    #[test]
    fn buckets_of_cuda_gradients_are_reduced_in_place_by_nccl() {
        if !gpu_or_skip("nccl in place", 1, true) {
            return;
        }
        use cubecl::Runtime;
        use cubecl::cuda::{CudaDevice, CudaRuntime};
        let client = CudaRuntime::client(&CudaDevice::new(0));
        super::common::cube::check_plan_reduced_on_device(&client, vec![Box::new(single_rank())]);
    }

    /// Not a pass/fail test: whether an NCCL all-reduce queued on a communication stream runs
    /// concurrently with the kernels queued on a compute stream after it, on the device's own
    /// timeline (CUDA event timestamps). The streams are set up as `NcclComm` and CubeCL set up
    /// theirs (two non-blocking streams of the primary context); the compute stand-in is a
    /// series of device-to-device copies, since CubeCL does not expose its stream for events.
    /// With one GPU the group has one rank, so the all-reduce (not in place) is NCCL's copy.
    #[test]
    fn bench_an_nccl_call_overlaps_the_compute_queued_after_it() {
        if !gpu_or_skip("nccl overlap", 1, true) {
            return;
        }
        use cudarc::driver::sys::CUevent_flags;
        use cudarc::driver::{CudaContext, CudaEvent};
        use cudarc::nccl::{Comm, Id, ReduceOp as Op};
        let ctx = CudaContext::new(0).unwrap();
        let comm_stream = ctx.new_stream().unwrap();
        let compute = ctx.new_stream().unwrap();
        let comm = Comm::from_rank(comm_stream.clone(), 0, 1, Id::new().unwrap()).unwrap();
        let n = 128usize << 20; // 512 MiB of f32 per buffer
        let send = comm_stream.alloc_zeros::<f32>(n).unwrap();
        let mut recv = comm_stream.alloc_zeros::<f32>(n).unwrap();
        let a = compute.alloc_zeros::<f32>(n).unwrap();
        let mut b = compute.alloc_zeros::<f32>(n).unwrap();
        let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
        for round in 0..3 {
            comm_stream.synchronize().unwrap();
            compute.synchronize().unwrap();
            // One origin for both streams' timestamps.
            let origin = compute.record_event(timed).unwrap();
            comm_stream.wait(&origin).unwrap();
            let n0 = comm_stream.record_event(timed).unwrap();
            comm.all_reduce(&send, &mut recv, &Op::Sum).unwrap();
            let n1 = comm_stream.record_event(timed).unwrap();
            let c0 = compute.record_event(timed).unwrap();
            for _ in 0..4 {
                compute.memcpy_dtod(&a, &mut b).unwrap();
            }
            let c1 = compute.record_event(timed).unwrap();
            let at = |e: &CudaEvent| f64::from(origin.elapsed_ms(e).unwrap());
            let (n0, n1, c0, c1) = (at(&n0), at(&n1), at(&c0), at(&c1));
            let overlap = (n1.min(c1) - n0.max(c0)).max(0.0);
            eprintln!(
                "overlap round {round}: NCCL all-reduce of 512 MiB {n0:.3}..{n1:.3} ms, compute \
                 queued after it {c0:.3}..{c1:.3} ms: overlapped {overlap:.3} ms ({:.0}% of the \
                 NCCL call)",
                100.0 * overlap / (n1 - n0).max(1e-9)
            );
        }
    }

    /// Runs everywhere the feature is on, GPU or not: the check comes before NCCL is loaded.
    #[test]
    fn two_ranks_of_one_process_on_one_gpu_are_refused_by_name() {
        let err = NcclComm::group(&[0, 1, 0], Duration::from_secs(1))
            .err()
            .expect("two ranks cannot share GPU 0");
        assert!(
            matches!(&err, NcclInitError::SharedDevice { device: 0, ranks } if ranks == &[0, 2]),
            "{err}"
        );
        assert!(err.to_string().contains("ranks [0, 2]"), "{err}");
    }

    #[test]
    fn an_aborted_rank_fails_its_later_collectives_with_the_reason() {
        if !gpu_or_skip("nccl abort", 1, true) {
            return;
        }
        let comm = single_rank();
        let buf = HostBuffer::from_f64(DType::F32, &[1.0, 2.0]).unwrap();
        let d = desc(ReduceOp::Sum, DType::F32, 2);
        let wait = Duration::from_secs(30);
        comm.all_reduce(buf.clone(), d.clone())
            .unwrap()
            .wait(wait)
            .unwrap();
        comm.abort("stopped by the test");
        for _ in 0..2 {
            let err = comm
                .all_reduce(buf.clone(), d.clone())
                .and_then(|p| p.wait(wait))
                .expect_err("an aborted rank runs no collective");
            assert!(
                matches!(&err, CommError::Aborted { rank: 0, reason, .. } if reason == "stopped by the test"),
                "{err}"
            );
        }
    }

    /// Set in a child process this binary starts to run one test (see [`alone`]).
    const NCCL_CHILD: &str = "CF_NCCL_CHILD";

    /// Runs test `name` of this binary in a child process and asserts that it passed; its
    /// exit status is printed. For the tests that leave a thread inside `ncclCommInitRank`, a
    /// blocking call nothing can cancel: the process that ends with that thread in NCCL is the
    /// child (an earlier run saw a test binary with such a thread die of SIGSEGV at exit, after
    /// every test had reported).
    fn alone(name: &str) {
        let exe = std::env::current_exe().expect("this test binary");
        let out = super::common::output_bounded(
            std::process::Command::new(exe)
                .args(["--exact", name, "--nocapture", "--test-threads=1"])
                .env(NCCL_CHILD, "1"),
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("test {name} ... ok")),
            "{name} in a child process:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!(
            "{name}: passed in a child process, which then exited with {}",
            out.status
        );
    }

    /// Whether to run the body of test `name` (`what` in a skip message) in this process: not
    /// without a GPU (it is skipped), nor in the test binary itself, which runs it in a child
    /// process instead ([`alone`]).
    fn here_in_a_child(what: &str, name: &str) -> bool {
        if !gpu_or_skip(what, 1, true) {
            return false;
        }
        if std::env::var_os(NCCL_CHILD).is_none() {
            alone(name);
            return false;
        }
        true
    }

    #[test]
    fn a_rank_whose_peer_never_joins_times_out_instead_of_hanging() {
        if !here_in_a_child(
            "nccl init timeout",
            "nccl::a_rank_whose_peer_never_joins_times_out_instead_of_hanging",
        ) {
            return;
        }
        let id = unique_id().unwrap();
        let t0 = Instant::now();
        // Rank 0 of two; rank 1 never calls ncclCommInitRank.
        let err = NcclComm::new(0, 0, 2, &id, Duration::from_secs(3))
            .err()
            .expect("init cannot complete alone");
        assert!(
            matches!(err, NcclInitError::InitTimeout { rank: 0, .. }),
            "{err}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    /// A rank that joined the rendezvous and then ended before `ncclCommInitRank`: rank 0's
    /// join fails naming it within the departure grace, not after its (long) timeout.
    #[test]
    fn a_rank_that_ends_before_nccl_init_is_named_by_the_peer_watch() {
        use collective_fusion::runtime::rendezvous::{RendezvousConfig, rendezvous_watched};
        if !here_in_a_child(
            "nccl init, peer departed",
            "nccl::a_rank_that_ends_before_nccl_init_is_named_by_the_peer_watch",
        ) {
            return;
        }
        let port = super::common::free_port();
        let cfg = move |r| RendezvousConfig::loopback(r, 2, port, Duration::from_secs(30));
        let t0 = Instant::now();
        let peer = std::thread::spawn(move || {
            let (_, watch) = rendezvous_watched(&cfg(1), Vec::new).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            drop(watch);
        });
        let err = NcclComm::join(&cfg(0), Duration::from_secs(30))
            .err()
            .expect("init cannot complete without rank 1");
        peer.join().unwrap();
        assert!(
            matches!(&err, NcclInitError::PeerDeparted { rank: 0, why } if why.contains("rank 1")),
            "{err}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }

    /// The CLI of this build: `CF_CLI` where the binaries were carried to another machine
    /// (`scripts/gpu-run.sh` sets it), else the one cargo built beside this test.
    fn cli() -> String {
        std::env::var("CF_CLI")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_collective-fusion").to_string())
    }

    const NCCL_RUN: [&str; 4] = ["--backend", "cuda", "--transport", "nccl"];

    /// Fault table, NCCL row (two GPUs): two processes of `run --backend cuda --transport
    /// nccl`, rank 1 killed with SIGKILL mid-run; rank 0 exits 1 within twice the timeout,
    /// naming rank 1 (its rendezvous connection closed without a goodbye).
    #[test]
    fn a_rank_killed_mid_run_over_nccl_fails_the_other_naming_it() {
        if !gpu_or_skip("nccl, a rank killed mid-run", 2, true) {
            return;
        }
        super::common::kill::survivors_fail_naming(&cli(), &NCCL_RUN, 2, 1);
    }

    /// The same with rank 0 killed.
    #[test]
    fn rank_zero_killed_mid_run_over_nccl_fails_the_other_naming_it() {
        if !gpu_or_skip("nccl, rank 0 killed mid-run", 2, true) {
            return;
        }
        super::common::kill::survivors_fail_naming(&cli(), &NCCL_RUN, 2, 0);
    }
}

/// `Autodiff<Collective<Cuda>>`: a short training step on the GPU, against the same step on
/// `Autodiff<Collective<NdArray>>` (one rank each; the gradient sync runs through the compiler).
#[cfg(feature = "cuda")]
mod training {
    use burn_autodiff::Autodiff;
    use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
    use burn_core::tensor::Tensor;
    use burn_cuda::{Cuda, CudaDevice};
    use burn_ndarray::{NdArray, NdArrayDevice};
    use burn_nn::loss::{MseLoss, Reduction};
    use burn_nn::{Linear, LinearConfig};
    use burn_optim::{GradientsParams, Optimizer, SgdConfig};
    use collective_fusion::backend::{
        Collective, CollectiveDevice, CollectiveOptions, JoinOptions, Transport, mark_distributed,
        sync_stats,
    };
    use collective_fusion::train::{module_weights, synthetic_batch};

    use super::gpu_or_skip;

    fn steps<I: burn_backend::Backend>(
        dev: I::Device,
        init: Vec<Vec<f32>>,
        transport: Transport,
        views: bool,
    ) -> (Vec<f32>, collective_fusion::backend::SyncStats) {
        type Bk<I> = Autodiff<Collective<I>>;
        let mut options = CollectiveOptions {
            transport,
            // One GPU, one rank: run the plan anyway, so the device path is what is tested.
            single_rank: collective_fusion::backend::SingleRank::Run,
            ..CollectiveOptions::default()
        };
        options.config.gradient_as_bucket_view = views;
        options.install::<I>();
        let d = CollectiveDevice::new(dev, 0);
        Collective::<I>::start_communication_server(
            std::slice::from_ref(&d),
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        );
        let mut m: Vec<Linear<Bk<I>>> = [32usize, 64, 8]
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(&d))
            .collect();
        // The same starting weights on both backends.
        for (l, w) in m.iter_mut().zip(init.chunks(2)) {
            let (o, i) = (l.weight.dims()[1], l.weight.dims()[0]);
            // A parameter's new value must require gradients itself: `Param::map` takes the
            // flag from the tensor it is given, and without it backward computes no gradient.
            l.weight = l.weight.clone().map(|_| {
                Tensor::from_data(burn_core::tensor::TensorData::new(w[0].clone(), [i, o]), &d)
                    .require_grad()
            });
            if let Some(b) = &l.bias {
                l.bias = Some(b.clone().map(|_| {
                    Tensor::from_data(burn_core::tensor::TensorData::new(w[1].clone(), [o]), &d)
                        .require_grad()
                }));
            }
        }
        let start = module_weights::<Bk<I>, _>(&m);
        let flat: Vec<f32> = init.iter().flatten().copied().collect();
        assert_eq!(start, flat, "the seeded weights were installed");
        let mut optim = SgdConfig::new().init::<Bk<I>, Vec<Linear<Bk<I>>>>();
        for step in 0..3 {
            m = mark_distributed::<Bk<I>, _>(m).expect("marking the model");
            let (x, y) = synthetic_batch::<Bk<I>>(step, (0, 16), 32, 8, &d);
            let h = burn_core::tensor::activation::relu(m[0].forward(x));
            let loss = MseLoss::new().forward(m[1].forward(h), y, Reduction::Mean);
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            m = optim.step(0.05, m, grads);
        }
        let stats = sync_stats::<I>(0);
        Collective::<I>::close_communication_server(&d);
        assert_eq!(stats.eager_steps + stats.flushed_steps, 3, "{stats:?}");
        let end = module_weights::<Bk<I>, _>(&m);
        let moved: f64 = end
            .iter()
            .zip(&start)
            .map(|(a, b)| f64::from((a - b).abs()))
            .sum();
        assert!(moved > 1e-3, "training did not move the weights ({moved})");
        (end, stats)
    }

    #[test]
    fn a_collective_cuda_training_step_matches_ndarray() {
        if !gpu_or_skip("Collective<Cuda> training", 1, false) {
            return;
        }
        let init = initial_weights(3);
        let (gpu, gpu_stats) = steps::<Cuda>(
            CudaDevice::default(),
            init.clone(),
            Transport::InProcess,
            false,
        );
        let (cpu, cpu_stats) =
            steps::<NdArray>(NdArrayDevice::Cpu, init, Transport::InProcess, false);
        // The CUDA gradients were packed by the kernels on their own buffers; NdArray's on the
        // host.
        assert!(gpu_stats.device_buckets >= 3, "{gpu_stats:?}");
        assert_eq!(gpu_stats.device_collectives, 0, "{gpu_stats:?}");
        assert_eq!(cpu_stats.device_buckets, 0, "{cpu_stats:?}");
        close(&gpu, &cpu, "ndarray");
    }

    /// Threads sharing one rank of `Collective<Cuda>` (fused; CubeCL and Burn's fusion keep a
    /// stream per thread) each get what the host computes.
    #[test]
    fn threads_sharing_a_fused_cuda_rank_each_get_what_the_host_computes() {
        if !gpu_or_skip("threads sharing a Collective<Cuda> rank", 1, false) {
            return;
        }
        crate::common::threads::check_threads_sharing_a_rank::<Cuda>(|| {
            CollectiveDevice::new(CudaDevice::default(), 9)
        });
    }

    /// Two ranks sharing the GPU (the in-process communicator: NCCL takes one GPU a rank).
    fn two_ranks_on_the_gpu() -> Vec<CollectiveDevice<CudaDevice>> {
        (0..2)
            .map(|r| CollectiveDevice::new(CudaDevice::default(), r))
            .collect()
    }

    /// Uneven inputs on fused `Collective<Cuda>`: ranks of 2 and 3 batches train as one rank,
    /// the finished rank's zero gradients packed on the device as the others' are (as many
    /// device buckets); dividing the last step by the world, then by the one rank that trained.
    #[test]
    fn ranks_with_uneven_inputs_on_cuda_train_as_one_rank() {
        if !gpu_or_skip("uneven inputs on Collective<Cuda>", 1, false) {
            return;
        }
        let by_trained = JoinOptions {
            divide_by_initial_world_size: false,
        };
        for join in [JoinOptions::default(), by_trained] {
            let ended = crate::common::join::assert_uneven_ranks_train_as_one_rank::<Cuda>(
                &two_ranks_on_the_gpu(),
                &[2, 3],
                CollectiveOptions::default(),
                join,
                1e-3,
            );
            let buckets: Vec<u64> = ended.iter().map(|e| e.stats.device_buckets).collect();
            assert!(
                buckets[0] > 0 && buckets[0] == buckets[1],
                "{join:?}: {buckets:?}"
            );
        }
    }

    /// A finished rank takes part in the buffer sync on fused `Collective<Cuda>`
    /// (`common::join::assert_a_finished_rank_takes_part_in_the_buffer_sync`).
    #[test]
    fn a_finished_rank_takes_part_in_the_buffer_sync_on_cuda() {
        if !gpu_or_skip("uneven inputs with buffers on Collective<Cuda>", 1, false) {
            return;
        }
        let devices = two_ranks_on_the_gpu();
        crate::common::ranks::start_server::<Cuda>(
            &devices,
            CollectiveOptions::default(),
            ReduceOperation::Mean,
        );
        crate::common::join::assert_a_finished_rank_takes_part_in_the_buffer_sync::<Cuda>(&devices);
        Collective::<Cuda>::close_communication_server(&devices[0]);
    }

    /// `SyncBatchNorm` on fused `Collective<Cuda>`: two ranks end where one `BatchNorm` over
    /// both ranks' rows ends (`common::sync_norm`).
    #[test]
    fn synchronized_batch_norm_on_cuda_trains_as_one_rank() {
        if !gpu_or_skip("SyncBatchNorm on Collective<Cuda>", 1, false) {
            return;
        }
        crate::common::sync_norm::assert_trains_as_one_rank::<Cuda>(
            &two_ranks_on_the_gpu(),
            CollectiveOptions::default(),
            1e-3,
        );
    }

    /// Burn's CUDA backend without its fusion layer (`Cuda` is Burn's default, fused).
    type UnfusedCuda = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

    #[test]
    fn an_unfused_collective_cuda_training_step_matches_the_fused_one() {
        if !gpu_or_skip("Collective<CubeBackend<Cuda>> training", 1, false) {
            return;
        }
        let init = initial_weights(5);
        let (fused, fused_stats) = steps::<Cuda>(
            CudaDevice::default(),
            init.clone(),
            Transport::InProcess,
            false,
        );
        let (bare, bare_stats) =
            steps::<UnfusedCuda>(CudaDevice::default(), init, Transport::InProcess, false);
        // Both take the device path: the fused gradients resolved through the fusion client.
        assert!(fused_stats.device_buckets >= 3, "{fused_stats:?}");
        assert!(bare_stats.device_buckets >= 3, "{bare_stats:?}");
        close(&fused, &bare, "unfused");
    }

    /// `Collective<Dispatch>` on Dispatch's CUDA device: its gradients are packed on the GPU by
    /// Dispatch's own ops (burn-dispatch keeps the CubeCL tensor out of reach), and the step
    /// ends where `Collective<Cuda>`'s does.
    #[test]
    fn a_collective_dispatch_cuda_training_step_packs_on_the_device_and_matches_cuda() {
        if !gpu_or_skip("Collective<Dispatch> on CUDA training", 1, false) {
            return;
        }
        use burn_dispatch::{Dispatch, DispatchDevice};
        let init = initial_weights(6);
        let (dispatch, dispatch_stats) = steps::<Dispatch>(
            DispatchDevice::Cuda(CudaDevice::default()),
            init.clone(),
            Transport::InProcess,
            false,
        );
        let (cuda, _) = steps::<Cuda>(CudaDevice::default(), init, Transport::InProcess, false);
        assert!(dispatch_stats.device_buckets >= 3, "{dispatch_stats:?}");
        assert_eq!(dispatch_stats.view_grads, 0, "{dispatch_stats:?}");
        close(&dispatch, &cuda, "cuda");
    }

    /// The child's part of the kernel comparison on CUDA, run only with `CF_KERNEL_PROBE` set
    /// (as the test below runs it).
    #[test]
    fn kernel_probe_child() {
        super::common::kernels::child::<Cuda>(CudaDevice::default());
    }

    /// What `tests/same_kernels_wgpu.rs` checks on wgpu, on Burn's fused CUDA backend: three
    /// MLP steps launch and compile the same kernels alone, under `Collective`, and marked under
    /// a one-rank server.
    #[test]
    fn a_training_step_under_collective_runs_the_kernels_burn_alone_runs_on_cuda() {
        use super::common::kernels;
        if std::env::var_os(kernels::CHILD).is_some()
            || !gpu_or_skip("kernels under Collective", 1, false)
        {
            return;
        }
        kernels::assert_same(&kernels::sides("training::kernel_probe_child"));
    }

    /// The child's part of the persistent-memory check on CUDA, run only with
    /// `CF_PERSISTENT_PROBE` set.
    #[test]
    fn persistent_probe_child() {
        super::common::persistent::child::<Cuda>(CudaDevice::default());
    }

    /// What `tests/same_kernels_wgpu.rs` checks on wgpu, on Burn's fused CUDA backend: a model's
    /// parameters take CubeCL's persistent memory under `Collective` as they do alone.
    #[test]
    fn parameters_go_to_cubecls_persistent_memory_under_collective_as_alone() {
        if std::env::var_os(super::common::persistent::CHILD).is_some()
            || !gpu_or_skip("persistent memory under Collective", 1, false)
        {
            return;
        }
        let sides = super::common::persistent::sides("training::persistent_probe_child");
        assert!(sides[0].allocations > 0, "{sides:?}");
        assert_eq!(sides[1], sides[0], "Collective differs from alone");
    }

    /// Not a pass/fail test: what the lazy layer costs on a GPU. One training step (forward,
    /// backward, SGD, a one-element read that waits for the device), median of 20 after 5
    /// warm-up steps, one rank, rows in turn (`train::overhead`), for the GPU-sized overhead
    /// models (three MLPs, the convnet, the blocks): Burn alone (`Autodiff<Cuda>`, fusion on),
    /// `Autodiff<Collective<Cuda>>` with the model unmarked (the lazy layer only; also with the
    /// recorder's window at 2, 16 and 4096 ops instead of the default 64), marked once under a
    /// one-rank NCCL server (the default `SingleRank::Skip`: what a user with one GPU gets) and
    /// marked again every step (what marking costs), and with the plan run anyway over NCCL
    /// (`SingleRank::Run`: buckets packed and reduced in place, as with more GPUs).
    #[test]
    fn bench_a_training_step_against_burn_alone() {
        if !gpu_or_skip("lazy layer overhead", 1, true) {
            return;
        }
        use collective_fusion::backend::SingleRank;
        use collective_fusion::train::RunModel;
        use collective_fusion::train::overhead::{Marking, StepRow, StepTable, overhead_models};
        type A = Autodiff<Cuda>;
        type C = Autodiff<Collective<Cuda>>;
        let dev = CudaDevice::default();
        let cd = CollectiveDevice::new(dev.clone(), 0);
        for (name, model, batch) in overhead_models(true) {
            // With the default `SingleRank::Skip` (what a user with one GPU gets), then with
            // the plan run anyway over NCCL (`SingleRank::Run`: buckets packed and reduced in
            // place, as with more GPUs); Burn alone runs in turn with each.
            for single_rank in [SingleRank::Skip, SingleRank::Run] {
                let options = CollectiveOptions {
                    transport: Transport::Nccl(super::common::world_of_one()),
                    single_rank,
                    ..CollectiveOptions::default()
                };
                options.install::<Cuda>();
                Collective::<Cuda>::start_communication_server(
                    std::slice::from_ref(&cd),
                    DistributedConfig {
                        all_reduce_op: ReduceOperation::Mean,
                    },
                );
                fn rows(
                    dev: &CudaDevice,
                    cd: &CollectiveDevice<CudaDevice>,
                    model: RunModel,
                    batch: usize,
                    skip: bool,
                ) -> Vec<StepRow> {
                    let mut rows = vec![StepRow::for_model::<A>(
                        "Autodiff<Cuda>",
                        dev,
                        model,
                        batch,
                        Marking::Unmarked,
                    )];
                    if skip {
                        rows.push(StepRow::for_model::<C>(
                            "Autodiff<Collective<Cuda>>",
                            cd,
                            model,
                            batch,
                            Marking::Unmarked,
                        ));
                        // Marked once (as a training loop does; Burn's optimizer keeps the
                        // mark), right after the same model unmarked (it ran after the window
                        // rows before, which a row's place in the turn might have slowed), then
                        // marked again every step: what marking costs a step.
                        rows.push(StepRow::for_model::<C>(
                            "  + one-rank NCCL server, skip",
                            cd,
                            model,
                            batch,
                            Marking::Once,
                        ));
                        rows.push(StepRow::for_model::<C>(
                            "  + marked every step",
                            cd,
                            model,
                            batch,
                            Marking::EveryStep,
                        ));
                        // The same with the recorder handing work to the inner backend every
                        // op (window 2), every 8, or once a step (4096: a whole step kept until
                        // its read) instead of every 32 (the default window, 64): what
                        // recording ahead of the device costs, and what is left for the read.
                        for window in [2, 16, 4096] {
                            rows.push(
                                StepRow::for_model::<C>(
                                    &format!("  lazy window {window}"),
                                    cd,
                                    model,
                                    batch,
                                    Marking::Unmarked,
                                )
                                .with_lazy_window(window),
                            );
                        }
                    } else {
                        rows.push(StepRow::for_model::<C>(
                            "  + plan run over NCCL",
                            cd,
                            model,
                            batch,
                            Marking::Once,
                        ));
                    }
                    rows
                }
                let skip = single_rank == SingleRank::Skip;
                let rows = rows(&dev, &cd, model, batch, skip);
                let title = format!("overhead · {name}, batch {batch}, {single_rank:?}");
                eprint!("{}", StepTable::measure(&title, rows, 5, 20));
                Collective::<Cuda>::close_communication_server(&cd);
            }
        }
    }

    /// The child's part of the memory table on CUDA: measures the row `CF_MEMORY_ROW` names
    /// of the overhead model `CF_MEMORY_MODEL` indexes and prints its reading; does nothing
    /// without them (as the bench below runs it).
    #[test]
    fn memory_child() {
        use collective_fusion::train::memory::{CubeProbe, MEMORY_CHILD, MemoryRow, measure_row};
        use cubecl::Runtime;
        let (Ok(row), Ok(model)) = (std::env::var(MEMORY_CHILD), std::env::var(MEMORY_MODEL))
        else {
            return;
        };
        let row = MemoryRow::from_name(&row).expect("a memory row");
        let (_, model, batch) = collective_fusion::train::overhead::overhead_models(true)
            [model.parse::<usize>().unwrap()];
        let dev = CudaDevice::default();
        let mut probe = CubeProbe(cubecl::cuda::CudaRuntime::client(&dev));
        // One rank over NCCL: buckets packed and reduced in place on the device.
        let options = CollectiveOptions {
            transport: Transport::NcclLocal,
            ..CollectiveOptions::default()
        };
        let m = measure_row::<Cuda>(row, options, dev, model, batch, (3, 5), &mut probe);
        println!("{m}");
    }

    /// The overhead model a memory child measures, by its index in `overhead_models(true)`.
    const MEMORY_MODEL: &str = "CF_MEMORY_MODEL";

    /// Not a pass/fail test: what a training step holds in device memory (CubeCL's pools:
    /// the peak they reserved, what is in use between steps), each row in a child process of
    /// this binary (`train::memory`): Burn alone (`Autodiff<Cuda>`, fusion on), the lazy layer,
    /// marked under a one-rank NCCL server (skipping the sync), and the plan run anyway with
    /// the reduced gradients copied out of their bucket or handed back as views of it.
    #[test]
    fn bench_what_a_training_step_holds_in_device_memory() {
        use collective_fusion::train::memory::{MEMORY_CHILD, MemoryRow, MemoryTable};
        if std::env::var_os(MEMORY_CHILD).is_some() || !gpu_or_skip("step memory", 1, true) {
            return;
        }
        let exe = std::env::current_exe().expect("this test binary");
        let models = collective_fusion::train::overhead::overhead_models(true);
        for (index, (name, _, batch)) in models.into_iter().enumerate() {
            let title = format!("memory · {name}, batch {batch}");
            let table = MemoryTable::in_children(&title, &MemoryRow::ALL, (3, 5), 2, |_| {
                let mut c = std::process::Command::new(&exe);
                c.args(["--exact", "training::memory_child", "--nocapture"])
                    .env(MEMORY_MODEL, index.to_string());
                c
            });
            eprint!("{table}");
        }
    }

    /// Seeded weights and biases of the two layers, in [-0.1, 0.1].
    fn initial_weights(seed: u64) -> Vec<Vec<f32>> {
        let mut rng = collective_fusion::runtime::synthetic::SplitMix64(seed);
        let mut w = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| (rng.next_u64() % 2001) as f32 / 10_000.0 - 0.1)
                .collect()
        };
        vec![w(32 * 64), w(64), w(64 * 8), w(8)]
    }

    fn close(gpu: &[f32], other: &[f32], what: &str) {
        assert_eq!(gpu.len(), other.len());
        for (i, (a, b)) in gpu.iter().zip(other).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1e-2),
                "weight {i}: cuda {a} vs {what} {b}"
            );
        }
    }

    /// The same steps with NCCL as the transport (one rank, through the rendezvous): the
    /// gradients are reduced in place on the GPU, and the weights match the in-process run bit
    /// for bit (a one-rank mean is exact either way).
    #[test]
    fn a_collective_cuda_step_over_nccl_reduces_its_buckets_in_place() {
        if !gpu_or_skip("Collective<Cuda> over NCCL", 1, true) {
            return;
        }
        let init = initial_weights(4);
        let cfg = super::common::world_of_one();
        let (threads, _) = steps::<Cuda>(
            CudaDevice::default(),
            init.clone(),
            Transport::InProcess,
            false,
        );
        // Across processes (one here, through the rendezvous), single-process multi-GPU (one
        // GPU here), and with the reduced gradients as views of the NCCL-reduced buckets.
        for (transport, views) in [
            (Transport::Nccl(cfg.clone()), false),
            (Transport::NcclLocal, false),
            (Transport::Nccl(cfg), true),
        ] {
            let name = format!("{transport:?}, views {views}");
            let (nccl, stats) =
                steps::<Cuda>(CudaDevice::default(), init.clone(), transport, views);
            assert!(stats.device_buckets >= 3, "{name}: {stats:?}");
            assert_eq!(stats.view_grads > 0, views, "{name}: {stats:?}");
            // Every bucket, and the gradients with an all-reduce of their own.
            assert!(
                stats.device_collectives >= stats.device_buckets,
                "{name}: {stats:?}"
            );
            for (i, (a, b)) in nccl.iter().zip(&threads).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{name}: weight {i}: {a} vs in-process {b}"
                );
            }
        }
    }
}

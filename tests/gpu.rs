//! GPU tests: the NCCL communicator (feature `cuda`). They are compiled always and, on a machine
//! without a GPU, libcuda or libnccl (or without the feature), each says so on stderr and
//! passes; `CF_REQUIRE_GPU=1` (what `scripts/gpu-check.sh` sets) turns that skip into a failure.

/// Whether to run; prints why not.
#[allow(dead_code)]
fn gpu_or_skip(test: &str, gpus: usize) -> bool {
    let why = gpu_missing(gpus);
    match why {
        None => true,
        Some(why) => {
            if std::env::var("CF_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{test}: CF_REQUIRE_GPU=1 but {why}");
            }
            eprintln!("SKIPPED {test}: {why}");
            false
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_missing(_gpus: usize) -> Option<String> {
    Some("built without the `cuda` feature".into())
}

#[cfg(feature = "cuda")]
fn gpu_missing(gpus: usize) -> Option<String> {
    use collective_fusion::runtime::nccl::{device_count, nccl_available};
    if !nccl_available() {
        return Some("libcuda or libnccl cannot be loaded".into());
    }
    let n = device_count();
    (n < gpus).then(|| format!("{n} CUDA device(s), the test needs {gpus}"))
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_tests_need_the_cuda_feature() {
    gpu_or_skip("gpu tests", 1);
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
    use collective_fusion::runtime::comm::CollectiveDesc;
    use collective_fusion::runtime::nccl::{NcclComm, NcclInitError, unique_id};
    use collective_fusion::runtime::rendezvous::{RendezvousConfig, rendezvous};
    use collective_fusion::runtime::synthetic::seeded_gradients;
    use collective_fusion::runtime::{
        Communicator, ExecOptions, HostBuffer, execute, run_in_process,
    };

    use super::gpu_or_skip;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap()
    }

    /// Rank 0 of a world of one, through the real rendezvous and a fresh NCCL id.
    fn single_rank() -> NcclComm {
        let cfg = RendezvousConfig {
            rank: 0,
            world: 1,
            local_rank: 0,
            addr: "127.0.0.1".into(),
            port: free_port(),
            timeout: Duration::from_secs(30),
        };
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
        if !gpu_or_skip("nccl single rank", 1) {
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
        if !gpu_or_skip("nccl gpt2 plan", 1) {
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

    #[test]
    fn a_rank_whose_peer_never_joins_times_out_instead_of_hanging() {
        if !gpu_or_skip("nccl init timeout", 1) {
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
}

//! Replicas that start alike: `mark_distributed` under a running communication server checks
//! that every rank built the same model and gives every rank rank 0's weights (or verifies
//! them), as PyTorch DDP does when it wraps a model.

use std::sync::Mutex;
use std::time::Duration;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::module::Module;
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, InitialWeights, ReplicaError, mark_distributed,
};
use collective_fusion::graph::{DType, ReduceOp};
use collective_fusion::runtime::comm::{CollectiveDesc, Communicator};
use collective_fusion::runtime::{HostBuffer, InProcessGroup};
use collective_fusion::train::{module_weights, synthetic_batch};

type Inner = Collective<NdArray>;
type B = Autodiff<Inner>;
type Dev = CollectiveDevice<NdArrayDevice>;
type Mlp = Vec<Linear<B>>;

/// Sessions are per backend type: tests that start one run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const WIDTHS: [usize; 4] = [12, 16, 8, 3];

fn device(rank: u32) -> Dev {
    CollectiveDevice::new(NdArrayDevice::Cpu, rank)
}

/// An MLP of `widths`, initialized under `seed` on rank 0's device, then moved to `rank`'s.
fn model(widths: &[usize], seed: u64, rank: u32) -> Mlp {
    let d = device(0);
    <B as burn_backend::Backend>::seed(&d, seed);
    let m: Mlp = widths
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(&d))
        .collect();
    // Parameters initialize lazily: materialize them under this seed.
    let _ = weights(&m);
    m.fork(&device(rank))
}

fn weights(m: &Mlp) -> Vec<f32> {
    module_weights::<B, Mlp>(m)
}

fn bits(w: &[f32]) -> Vec<u32> {
    w.iter().map(|x| x.to_bits()).collect()
}

fn start(world: u32, initial_weights: InitialWeights, timeout: Duration) -> Vec<Dev> {
    let devices: Vec<Dev> = (0..world).map(device).collect();
    CollectiveOptions {
        timeout,
        initial_weights,
        ..CollectiveOptions::default()
    }
    .install::<NdArray>();
    Inner::start_communication_server(
        &devices,
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    devices
}

/// One SGD step on rows of the rank's share of a fixed batch.
fn step(m: Mlp, rank: usize) -> Mlp {
    let d = device(rank as u32);
    let (x, y) = synthetic_batch::<B>(0, (rank * 2, rank * 2 + 2), WIDTHS[0], 3, &d);
    let mut h = x;
    for (i, l) in m.iter().enumerate() {
        h = l.forward(h);
        if i + 1 < m.len() {
            h = burn_core::tensor::activation::relu(h);
        }
    }
    let loss = MseLoss::new().forward(h, y, Reduction::Mean);
    let grads = GradientsParams::from_grads(loss.backward(), &m);
    SgdConfig::new().init::<B, Mlp>().step(0.1, m, grads)
}

/// Marks each rank's model on a thread of its own, then runs `then` there.
fn on_every_rank<T: Send>(
    models: Vec<Mlp>,
    then: impl Fn(usize, Mlp) -> T + Sync,
) -> Vec<Result<T, ReplicaError>> {
    std::thread::scope(|s| {
        let then = &then;
        let hs: Vec<_> = models
            .into_iter()
            .enumerate()
            .map(|(r, m)| s.spawn(move || mark_distributed::<B, Mlp>(m).map(|m| then(r, m))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_that_build_their_own_models_start_from_rank_zero_weights() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 3;
    let models: Vec<Mlp> = (0..world)
        .map(|r| model(&WIDTHS, 100 + r as u64, r))
        .collect();
    let rank0 = weights(&models[0]);
    assert_ne!(
        bits(&rank0),
        bits(&weights(&models[1])),
        "differently seeded models differ before marking"
    );
    // The same step from replicas that were alike from the start (rank 0's model everywhere).
    let alike: Vec<Mlp> = (0..world).map(|r| model(&WIDTHS, 100, r)).collect();

    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(20));
    let marked = on_every_rank(models, |r, m| (weights(&m), weights(&step(m, r))));
    let reference = on_every_rank(alike, |r, m| weights(&step(m, r)));
    Inner::close_communication_server(&devices[0]);

    let reference: Vec<Vec<f32>> = reference.into_iter().map(Result::unwrap).collect();
    for (r, out) in marked.into_iter().enumerate() {
        let (start, after) = out.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(
            bits(&start),
            bits(&rank0),
            "rank {r} starts from rank 0's weights"
        );
        assert_ne!(
            bits(&after),
            bits(&start),
            "rank {r} trained (its weights still require grad)"
        );
        assert_eq!(
            bits(&after),
            bits(&reference[0]),
            "rank {r} after one step: as if every rank had started alike"
        );
    }
}

#[test]
fn a_rank_whose_model_has_an_extra_layer_fails_every_rank_naming_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 3;
    let deeper = [12, 16, 8, 8, 3];
    let models: Vec<Mlp> = (0..world)
        .map(|r| model(if r == 2 { &deeper } else { &WIDTHS }, 5, r))
        .collect();
    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(20));
    let out = on_every_rank(models, |_, _| ());
    Inner::close_communication_server(&devices[0]);
    for (r, o) in out.into_iter().enumerate() {
        let e = o.expect_err("a rank whose model differs fails");
        let msg = e.to_string();
        match &e {
            ReplicaError::ModelsDiffer {
                rank,
                index,
                other_rank,
                ..
            } => {
                assert_eq!(*rank, r);
                // Parameters in walk order: 0.weight 0.bias 1.weight 1.bias 2.weight ...
                assert_eq!(*index, 4, "{msg}");
                assert_eq!(*other_rank, if r == 2 { 0 } else { 2 }, "{msg}");
            }
            other => panic!("rank {r}: {other}"),
        }
        assert!(
            msg.contains("2.weight f32[8,3]") || msg.contains("2.weight f32[3,8]"),
            "{msg}"
        );
        assert!(msg.contains("2.weight f32[8,8]"), "{msg}");
        let counts = if r == 2 {
            "(8 parameters on rank 2, 6 on rank 0)"
        } else {
            "(6 parameters on rank"
        };
        assert!(msg.contains(counts), "{msg}");
    }
}

#[test]
fn verified_weights_must_be_rank_zero_weights() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 2;
    let devices = start(world, InitialWeights::Verify, Duration::from_secs(20));
    // One checkpoint everywhere: verified, kept.
    let same: Vec<Mlp> = (0..world).map(|r| model(&WIDTHS, 9, r)).collect();
    let expected = weights(&same[0]);
    for (r, o) in on_every_rank(same, |_, m| weights(&m))
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            bits(&o.unwrap_or_else(|e| panic!("rank {r}: {e}"))),
            bits(&expected)
        );
    }
    // Different weights: every rank fails, naming the first parameter.
    let differ: Vec<Mlp> = (0..world)
        .map(|r| model(&WIDTHS, 9 + r as u64, r))
        .collect();
    let out = on_every_rank(differ, |_, _| ());
    Inner::close_communication_server(&devices[0]);
    for (r, o) in out.into_iter().enumerate() {
        let msg = o.expect_err("weights that differ fail").to_string();
        assert!(msg.starts_with(&format!("rank {r}: ")), "{msg}");
        assert!(
            msg.contains("0.weight f32[12,16]") || msg.contains("0.weight f32[16,12]"),
            "{msg}"
        );
        assert!(
            msg.contains("on rank 1 is not bit for bit rank 0's"),
            "{msg}"
        );
    }
}

#[test]
fn marking_replicated_parameters_again_communicates_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 2;
    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(2));
    let models: Vec<Mlp> = (0..world).map(|r| model(&WIDTHS, 3, r)).collect();
    let marked: Vec<Mlp> = on_every_rank(models, |_, m| m)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // Rank 0 alone marks again (as before every backward pass): an exchange would wait for
    // rank 1 and time out.
    let again = mark_distributed::<B, Mlp>(marked[0].clone());
    // A new model is replicated again: alone, rank 0 times out, naming the exchange.
    let fresh = mark_distributed::<B, Mlp>(model(&WIDTHS, 4, 0));
    Inner::close_communication_server(&devices[0]);
    assert!(again.is_ok(), "{:?}", again.err());
    let msg = fresh.expect_err("an exchange nobody joins").to_string();
    assert!(
        msg.contains("timed out") && msg.contains("mark_distributed"),
        "{msg}"
    );
}

#[test]
fn a_sum_with_negative_zeros_is_a_bit_exact_broadcast() {
    let special = [
        0.0f32,
        -0.0,
        1.0,
        -3.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE / 2.0,
        -f32::MIN_POSITIVE / 4.0,
        f32::MAX,
        f32::NAN,
    ];
    let comms = InProcessGroup::ranks(3, Duration::from_secs(5));
    let out: Vec<HostBuffer> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let buf = if c.rank() == 0 {
                        HostBuffer::F32(special.to_vec())
                    } else {
                        HostBuffer::neg_zeros(DType::F32, special.len()).unwrap()
                    };
                    let what = CollectiveDesc {
                        collective: 0,
                        bucket: None,
                        op: ReduceOp::Sum,
                        dtype: DType::F32,
                        count: special.len() as u64,
                        params: Vec::new(),
                    };
                    c.all_reduce(buf, what)
                        .unwrap()
                        .wait(Duration::from_secs(10))
                        .unwrap()
                        .0
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, b) in out.iter().enumerate() {
        let HostBuffer::F32(v) = b else {
            panic!("rank {r}: f32 in, f32 out")
        };
        for (x, want) in v.iter().zip(special) {
            if want.is_nan() {
                assert!(x.is_nan(), "rank {r}");
            } else {
                assert_eq!(x.to_bits(), want.to_bits(), "rank {r}: {want:e}");
            }
        }
    }
    for d in [DType::F16, DType::BF16, DType::F64] {
        let z = HostBuffer::neg_zeros(d, 2).unwrap();
        assert_eq!(z.dtype(), d);
        assert!(z.to_f64().iter().all(|x| *x == 0.0 && x.is_sign_negative()));
    }
}

/// Marking walks every float a module holds: BatchNorm's running statistics (a `RunningState`,
/// not a parameter) start as rank 0's too, as PyTorch DDP broadcasts buffers when it wraps a
/// model.
#[test]
fn running_statistics_start_as_rank_zero_statistics() {
    use burn_core::tensor::Tensor;
    use burn_nn::{BatchNorm, BatchNormConfig};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 2;
    // Each rank's BatchNorm sees its own inputs twice, so its running mean and variance (one
    // update behind, as Burn keeps them) are its own.
    let norms: Vec<BatchNorm<B>> = (0..world)
        .map(|r| {
            let d = device(0);
            let bn = BatchNormConfig::new(3).init::<B>(&d);
            for k in 0..2 {
                let (x, _) = synthetic_batch::<B>(r * 10 + k, (0, 4), 3 * 5, 1, &d);
                let x: Tensor<B, 3> = x.reshape([4, 3, 5]) * (r as f32 + 1.0);
                let _ = bn.forward(x).into_data();
            }
            bn.fork(&device(r as u32))
        })
        .collect();
    let stats = |m: &BatchNorm<B>| bits(&module_weights::<B, BatchNorm<B>>(m));
    let rank0 = stats(&norms[0]);
    assert_ne!(
        rank0,
        stats(&norms[1]),
        "the ranks' statistics differ before marking"
    );
    let devices = start(
        world as u32,
        InitialWeights::Broadcast,
        Duration::from_secs(20),
    );
    let marked: Vec<Vec<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = norms
            .into_iter()
            .map(|m| s.spawn(move || stats(&mark_distributed::<B, BatchNorm<B>>(m).unwrap())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    Inner::close_communication_server(&devices[0]);
    for (r, m) in marked.iter().enumerate() {
        assert_eq!(m, &rank0, "rank {r}: running statistics after marking");
    }
}

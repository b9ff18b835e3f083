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
    BufferSync, Collective, CollectiveDevice, CollectiveOptions, InitialWeights, ReplicaError,
    mark_distributed, replicate_from, sync_buffers,
};
use collective_fusion::graph::{DType, ReduceOp};
use collective_fusion::runtime::comm::{CollectiveDesc, Communicator};
use collective_fusion::runtime::{HostBuffer, InProcessGroup};
use collective_fusion::train::{module_weights, synthetic_batch};

mod common;

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

/// One model per rank of `world`, rank `r`'s seeded `seed + r`: ranks that built their own.
fn seeded_models(world: u32, seed: u64) -> Vec<Mlp> {
    (0..world)
        .map(|r| model(&WIDTHS, seed + u64::from(r), r))
        .collect()
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

/// The gradients of the MSE loss on the rank's rows of batch `k`, with `dropout` before each
/// layer if given.
fn grads(m: &Mlp, rank: usize, k: usize, dropout: Option<&burn_nn::Dropout>) -> GradientsParams {
    let d = device(rank as u32);
    let (x, y) = synthetic_batch::<B>(k, (rank * 2, rank * 2 + 2), WIDTHS[0], 3, &d);
    let mut h = x;
    for (i, l) in m.iter().enumerate() {
        if let Some(dropout) = dropout {
            h = dropout.forward(h);
        }
        h = l.forward(h);
        if i + 1 < m.len() {
            h = burn_core::tensor::activation::relu(h);
        }
    }
    let loss = MseLoss::new().forward(h, y, Reduction::Mean);
    GradientsParams::from_grads(loss.backward(), m)
}

/// One SGD step on rows of the rank's share of a fixed batch.
fn step(m: Mlp, rank: usize) -> Mlp {
    let grads = grads(&m, rank, 0, None);
    SgdConfig::new().init::<B, Mlp>().step(0.1, m, grads)
}

/// Marks each rank's model on a thread of its own, then runs `then` there.
fn on_every_rank<T: Send>(
    models: Vec<Mlp>,
    then: impl Fn(usize, Mlp) -> T + Sync,
) -> Vec<Result<T, ReplicaError>> {
    common::ranks::on_threads(models, |r, m| {
        mark_distributed::<B, Mlp>(m).map(|m| then(r, m))
    })
}

#[test]
fn ranks_that_build_their_own_models_start_from_rank_zero_weights() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 3;
    let models = seeded_models(world, 100);
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

/// `replicate_from`: every rank takes rank 2's weights bit for bit (still trained: they require
/// a gradient); a root outside the server is an error naming it on every rank.
#[test]
fn any_rank_can_give_every_rank_its_weights() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 3;
    let models = seeded_models(world, 200);
    let rank2 = weights(&models[2]);
    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(20));
    let out = common::ranks::on_threads(models, |_, m| {
        let m = replicate_from::<B, Mlp>(m, 2)?;
        let trained = m.iter().all(|l| l.weight.val().is_require_grad());
        let refused = replicate_from::<B, Mlp>(m.clone(), 3).map(|_| ());
        Ok::<_, ReplicaError>((weights(&m), trained, refused))
    });
    Inner::close_communication_server(&devices[0]);
    for (r, o) in out.into_iter().enumerate() {
        let (w, trained, refused) = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(bits(&w), bits(&rank2), "rank {r} has rank 2's weights");
        assert!(trained, "rank {r}: the weights still require a gradient");
        let e = refused.expect_err("rank 3 of 3 is refused");
        assert!(
            e.to_string()
                .contains("rank 3 is not one of the server's 3 ranks"),
            "rank {r}: {e}"
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
    let differ = seeded_models(world, 9);
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
    let out: Vec<HostBuffer> = common::ranks::on_threads(comms.iter().collect(), |_, c| {
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
    let marked: Vec<Vec<u32>> = common::ranks::on_threads(norms, |_, m| {
        stats(&mark_distributed::<B, BatchNorm<B>>(m).unwrap())
    });
    Inner::close_communication_server(&devices[0]);
    for (r, m) in marked.iter().enumerate() {
        assert_eq!(m, &rank0, "rank {r}: running statistics after marking");
    }
}

/// An MLP whose parameters initialize lazily on `d` (as Burn's modules build: nothing drawn yet).
fn lazy_model(seed: u64, d: &Dev) -> Mlp {
    <B as burn_backend::Backend>::seed(d, seed);
    WIDTHS
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(d))
        .collect()
}

/// Asserts that every rank ended with rank 0's weights.
fn assert_alike(out: Vec<Result<Vec<f32>, ReplicaError>>, what: &str) {
    let out: Vec<Vec<u32>> = out
        .into_iter()
        .enumerate()
        .map(|(r, o)| bits(&o.unwrap_or_else(|e| panic!("{what}, rank {r}: {e}"))))
        .collect();
    for (r, w) in out.iter().enumerate() {
        assert_eq!(w, &out[0], "{what}: rank {r}'s weights are not rank 0's");
    }
}

/// A lazily initialized model forked to every rank draws each rank's own values when first
/// read. Marking it replicates rank 0's, also when the same parameters (same ids) were
/// replicated before: a second run from the same template in one process, whether or not the
/// values were read before marking.
#[test]
fn a_lazy_model_forked_again_is_replicated_again() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 2;
    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(20));
    let template = lazy_model(11, &devices[0]);
    for run in 0..3 {
        let models: Vec<Mlp> = devices.iter().map(|d| template.clone().fork(d)).collect();
        if run == 2 {
            // Read first: the values are drawn before marking sees the model.
            let drawn: Vec<Vec<u32>> = models.iter().map(|m| bits(&weights(m))).collect();
            assert_ne!(drawn[0], drawn[1], "each rank drew its own values");
        }
        let out = on_every_rank(models, |r, m| weights(&step(m, r)));
        assert_alike(out, &format!("run {run}"));
    }
    Inner::close_communication_server(&devices[0]);
}

/// A parameter given new random values (its id kept) is replicated again at the next marking
/// (a trained one is not: `training_with_dropout_leaves_marking_silent`).
#[test]
fn a_parameter_drawn_again_is_replicated_again() {
    use burn_core::tensor::{Distribution, Tensor};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 2;
    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(20));
    let models: Vec<Mlp> = (0..world).map(|r| model(&WIDTHS, 5, r)).collect();
    let out = on_every_rank(models, |r, m| {
        let mut m = step(m, r);
        // A head initialized again, through an op: each rank draws its own.
        let head = m.len() - 1;
        m[head].weight = m[head].weight.clone().map(|t| {
            let shape = t.shape();
            (Tensor::<B, 2>::random(shape, Distribution::Default, &t.device()) * 0.1).require_grad()
        });
        let head_drawn = bits(&weights(&m));
        (head_drawn, m)
    });
    let (drawn, models): (Vec<Vec<u32>>, Vec<Mlp>) = out.into_iter().map(Result::unwrap).unzip();
    assert_ne!(drawn[0], drawn[1], "each rank drew its own head");
    let out = on_every_rank(models, |r, m| weights(&step(m, r)));
    Inner::close_communication_server(&devices[0]);
    assert_alike(out, "after the head was drawn again");
}

/// Dropout draws on every rank, but what reaches the parameters is the synced gradient:
/// trained parameters are not drawn, and marking them again communicates nothing.
#[test]
fn training_with_dropout_leaves_marking_silent() {
    use burn_nn::DropoutConfig;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 2;
    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(2));
    let models: Vec<Mlp> = (0..world).map(|r| model(&WIDTHS, 6, r)).collect();
    let dropout = DropoutConfig::new(0.5).init();
    let train = |m: Mlp, r: usize, k: usize| -> Mlp {
        let grads = grads(&m, r, k, Some(&dropout));
        SgdConfig::new().init::<B, Mlp>().step(0.1, m, grads)
    };
    let out = on_every_rank(models, |r, m| {
        let m = train(m, r, 0);
        let m = mark_distributed::<B, Mlp>(m).expect("marking again");
        train(m, r, 1)
    });
    let trained: Vec<Mlp> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(bits(&weights(&trained[0])), bits(&weights(&trained[1])));
    // Rank 0 alone marks again: an exchange would wait for rank 1 and time out.
    let again = mark_distributed::<B, Mlp>(trained[0].clone());
    Inner::close_communication_server(&devices[0]);
    assert!(again.is_ok(), "{:?}", again.err());
}

/// A checkpoint of the model and its optimizer, taken mid-training and loaded into a model and
/// an optimizer built afresh (other random values), resumes exactly: every rank ends where
/// training straight through ends, bit for bit.
#[test]
fn a_checkpoint_of_model_and_optimizer_resumes_bit_for_bit() {
    use burn_core::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    use burn_optim::AdamConfig;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let world = 2;
    let devices = start(world, InitialWeights::Broadcast, Duration::from_secs(20));
    let adam_steps = |mut m: Mlp, o: &mut _, r: usize, steps: std::ops::Range<usize>| -> Mlp {
        let o: &mut burn_optim::adaptor::OptimizerAdaptor<burn_optim::Adam, Mlp, B> = o;
        for k in steps {
            m = mark_distributed::<B, Mlp>(m).expect("marking");
            let grads = grads(&m, r, k, None);
            m = o.step(0.01, m, grads);
        }
        m
    };
    // Drawn once: both runs start from the same values.
    let template = lazy_model(21, &devices[0]);
    let _ = weights(&template);
    let straight = on_every_rank(
        devices.iter().map(|d| template.clone().fork(d)).collect(),
        {
            |r, m| {
                let mut o = AdamConfig::new().init::<B, Mlp>();
                weights(&adam_steps(m, &mut o, r, 0..4))
            }
        },
    );
    let resumed = on_every_rank(
        devices.iter().map(|d| template.clone().fork(d)).collect(),
        {
            |r, m| {
                let d = device(r as u32);
                let mut o = AdamConfig::new().init::<B, Mlp>();
                let m = adam_steps(m, &mut o, r, 0..2);
                let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
                let model_bytes = recorder
                    .record(m.into_record(), ())
                    .expect("saving the model");
                let optim_bytes = recorder
                    .record(o.to_record(), ())
                    .expect("saving the optimizer");
                let fresh = lazy_model(99, &d).load_record(recorder.load(model_bytes, &d).unwrap());
                let mut o = AdamConfig::new()
                    .init::<B, Mlp>()
                    .load_record(recorder.load(optim_bytes, &d).unwrap());
                weights(&adam_steps(fresh, &mut o, r, 2..4))
            }
        },
    );
    Inner::close_communication_server(&devices[0]);
    let straight: Vec<Vec<f32>> = straight.into_iter().map(Result::unwrap).collect();
    assert_eq!(bits(&straight[0]), bits(&straight[1]), "straight through");
    for (r, w) in resumed.into_iter().enumerate() {
        let w = w.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(bits(&w), bits(&straight[0]), "rank {r}: resumed");
    }
}

/// A BatchNorm's input on `rank` at step `k`: each rank's its own (scaled by the rank).
fn norm_input(rank: usize, k: usize, d: &Dev) -> burn_core::tensor::Tensor<B, 3> {
    let (x, _) = synthetic_batch::<B>(rank * 10 + k, (0, 4), 3 * 5, 1, d);
    x.reshape([4, 3, 5]) * (rank as f32 + 1.0)
}

/// The bits of a BatchNorm's running mean and variance as it holds them (Burn keeps a thread's
/// latest update aside until its next forward pass: this is the value a module walk sees).
fn running_bits<Bk: burn_backend::Backend>(bn: &burn_nn::BatchNorm<Bk>) -> Vec<u32> {
    let mut v = bn.running_mean.value().into_data().to_vec::<f32>().unwrap();
    v.extend(bn.running_var.value().into_data().to_vec::<f32>().unwrap());
    bits(&v)
}

/// Its latest running statistics (the update kept aside folded in).
fn latest_bits(bn: &burn_nn::BatchNorm<B>) -> Vec<u32> {
    use burn_core::module::AutodiffModule;
    running_bits(&bn.valid())
}

/// One training step of rank `rank`'s BatchNorm at step `k`: a forward pass on its own input
/// and an SGD step on its scale and shift.
fn norm_step(bn: burn_nn::BatchNorm<B>, rank: usize, k: usize, d: &Dev) -> burn_nn::BatchNorm<B> {
    let y = bn.forward(norm_input(rank, k, d));
    let loss = (y - 0.5).powf_scalar(2.0).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &bn);
    SgdConfig::new()
        .init::<B, burn_nn::BatchNorm<B>>()
        .step(0.1, bn, grads)
}

/// The bits of a BatchNorm's trained parameters (scale, then shift).
fn trained_bits(bn: &burn_nn::BatchNorm<B>) -> Vec<u32> {
    let mut v = bn.gamma.val().into_data().to_vec::<f32>().unwrap();
    v.extend(bn.beta.val().into_data().to_vec::<f32>().unwrap());
    bits(&v)
}

/// `steps` training steps of a BatchNorm on every rank, each on a thread of its own: marked
/// once, then each step `sync_buffers(how)`, a forward pass on the rank's own input, and an SGD
/// step on its scale and shift. Per rank: the latest statistics before each sync if `latest`
/// (reading them folds the update kept aside in, which `sync_buffers` must do itself: a test
/// of that reads nothing before), the statistics right after it, and the trained parameters at
/// the end. Each rank builds its own BatchNorm, or with `template` forks one built on rank 0's
/// device (Burn's `fork` shares a running statistic between the copies).
#[allow(clippy::type_complexity)]
fn train_norms(
    world: usize,
    steps: usize,
    how: BufferSync,
    latest: bool,
    template: bool,
) -> Vec<(Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<u32>)> {
    use burn_nn::{BatchNorm, BatchNormConfig};
    let _devices = start(
        world as u32,
        InitialWeights::Broadcast,
        Duration::from_secs(20),
    );
    let template = template.then(|| BatchNormConfig::new(3).init::<B>(&device(0)));
    let norms: Vec<BatchNorm<B>> = (0..world)
        .map(|r| {
            let d = device(r as u32);
            match &template {
                Some(t) => t.clone().fork(&d),
                None => BatchNormConfig::new(3).init::<B>(&d),
            }
        })
        .collect();
    let out = common::ranks::on_threads(norms, |r, bn| {
        let d = device(r as u32);
        let mut bn = mark_distributed::<B, BatchNorm<B>>(bn)
            .unwrap_or_else(|e| panic!("rank {r}: marking: {e}"));
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for k in 0..steps {
            if latest {
                before.push(latest_bits(&bn));
            }
            bn =
                sync_buffers::<B, _>(bn, how).unwrap_or_else(|e| panic!("rank {r}, step {k}: {e}"));
            after.push(running_bits(&bn));
            bn = norm_step(bn, r, k, &d);
        }
        let trained = trained_bits(&bn);
        (before, after, trained)
    });
    Inner::close_communication_server(&device(0));
    out
}

/// PyTorch DDP's `broadcast_buffers=True`: `sync_buffers` before each forward pass gives every
/// rank rank 0's running statistics, bit for bit, and they are the latest ones: rank 0's match
/// a lone BatchNorm's fed rank 0's inputs, step for step (Burn keeps the latest update aside;
/// sending the value a walk sees would send one step behind, and the next forward pass would put
/// the rank's own update back). Trained parameters stay alike through the gradient sync.
#[test]
fn sync_buffers_gives_every_rank_rank_zero_latest_running_statistics() {
    use burn_nn::BatchNormConfig;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let steps = 4;
    // A rank's statistics alone, before any server runs.
    let lone = |rank: usize| -> Vec<Vec<u32>> {
        let d = device(0);
        let bn = BatchNormConfig::new(3).init::<B>(&d);
        (0..steps)
            .map(|k| {
                let latest = latest_bits(&bn);
                let _ = bn.forward(norm_input(rank, k, &d));
                latest
            })
            .collect()
    };
    let reference = lone(0);
    assert_ne!(reference[1], reference[0], "a forward pass updates them");
    assert_ne!(
        lone(1)[1],
        reference[1],
        "each rank's own statistics differ"
    );
    let out = train_norms(3, steps, BufferSync::Broadcast, false, false);
    for (r, (_, after, trained)) in out.iter().enumerate() {
        for k in 0..steps {
            assert_eq!(
                after[k], reference[k],
                "rank {r}, step {k}: rank 0's latest"
            );
        }
        assert_eq!(trained, &out[0].2, "rank {r}: trained parameters");
    }
}

/// `BufferSync::Mean` gives every rank the mean of the ranks' latest statistics, the same bits
/// on every rank.
#[test]
fn sync_buffers_mean_gives_every_rank_the_ranks_mean() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (world, steps) = (3, 3);
    let out = train_norms(world, steps, BufferSync::Mean, true, false);
    for k in 1..steps {
        let want: Vec<f32> = (0..out[0].0[k].len())
            .map(|i| {
                let sum: f32 = out.iter().map(|o| f32::from_bits(o.0[k][i])).sum();
                sum / world as f32
            })
            .collect();
        assert_ne!(
            out[0].0[k], out[1].0[k],
            "step {k}: the ranks' own statistics differ"
        );
        for (r, o) in out.iter().enumerate() {
            assert_eq!(o.1[k], out[0].1[k], "rank {r}, step {k}: the same bits");
            for (got, want) in o.1[k].iter().zip(&want) {
                let got = f32::from_bits(*got);
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "rank {r}, step {k}: {got} against {want}"
                );
            }
        }
    }
}

/// The README's way: one model built on rank 0's device and forked to every rank. Burn's `fork`
/// gives each copy its own parameters but shares a running statistic between the copies (one
/// object, on the device of the copy forked last), so a rank's BatchNorm holds its statistics on
/// another rank's device: marking and `sync_buffers` take them (marking refused it as a model
/// marked on two ranks), and the ranks train and hold alike statistics, either way.
#[test]
fn a_template_forked_to_every_rank_marks_and_syncs_its_shared_statistics() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for how in [BufferSync::Broadcast, BufferSync::Mean] {
        let steps = 3;
        let out = train_norms(3, steps, how, false, true);
        for (r, (_, after, trained)) in out.iter().enumerate() {
            for (k, (mine, rank0)) in after.iter().zip(&out[0].1).enumerate() {
                assert_eq!(mine, rank0, "{how:?}, rank {r}, step {k}");
            }
            assert_eq!(trained, &out[0].2, "{how:?}, rank {r}: trained parameters");
        }
        assert_ne!(
            out[0].1[2], out[0].1[0],
            "{how:?}: the statistics were updated"
        );
    }
}

/// Uneven inputs with buffers made alike each step (`join`, `sync_buffers(Broadcast)` before
/// each forward pass, `finish_model`): ranks of 1, 3 and 2 steps. A finished rank takes part in
/// the others' buffer syncs, and the statistics sent are those of the lowest rank that trained
/// the step before (PyTorch's authoritative rank), never a finished rank's older ones: step 1
/// takes rank 0's (it trained step 0, then finished), step 2 rank 1's own. Every rank ends with
/// rank 1's parameters and statistics.
#[test]
fn uneven_ranks_broadcast_the_statistics_of_a_rank_that_trained_the_step_before() {
    use burn_core::module::AutodiffModule;
    use burn_nn::{BatchNorm, BatchNormConfig};
    use collective_fusion::backend::join;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let steps = [1, 3, 2];
    let _devices = start(3, InitialWeights::Broadcast, Duration::from_secs(20));
    let norms: Vec<BatchNorm<B>> = (0..3)
        .map(|r| BatchNormConfig::new(3).init::<B>(&device(r)))
        .collect();
    let out = common::ranks::on_threads(norms, |r, bn| {
        let d = device(r as u32);
        let mut bn = mark_distributed::<B, BatchNorm<B>>(bn)
            .unwrap_or_else(|e| panic!("rank {r}: marking: {e}"));
        let scope = join::<NdArray>(&d);
        let (mut before, mut after) = (Vec::new(), Vec::new());
        for k in 0..steps[r] {
            before.push(latest_bits(&bn));
            bn = sync_buffers::<B, _>(bn, BufferSync::Broadcast)
                .unwrap_or_else(|e| panic!("rank {r}, step {k}: {e}"));
            after.push(running_bits(&bn));
            bn = norm_step(bn, r, k, &d);
        }
        let own = latest_bits(&bn);
        let (bn, report) = scope
            .finish_model::<B, BatchNorm<B>>(bn)
            .unwrap_or_else(|e| panic!("rank {r}: finishing: {e}"));
        let (params, stats) = (trained_bits(&bn), running_bits(&bn.valid()));
        (before, after, own, stats, params, report)
    });
    Inner::close_communication_server(&device(0));
    let (rank0, rank1, rank2) = (&out[0], &out[1], &out[2]);
    assert_eq!(rank1.5.authority, 1);
    assert_eq!(rank0.5.shadowed_steps, 2);
    // Step 1: rank 0's statistics after its one step, sent by rank 0 out of inputs.
    assert_ne!(
        rank0.2, rank1.0[1],
        "rank 0's statistics differ from rank 1's"
    );
    assert_eq!(rank1.1[1], rank0.2, "step 1: rank 0's latest");
    assert_eq!(rank2.1[1], rank0.2, "step 1: rank 0's latest");
    // Step 2: rank 1's own (it trained step 1), not rank 0's older ones.
    assert_ne!(rank1.0[2], rank0.2, "rank 1's statistics moved on");
    assert_eq!(rank1.1[2], rank1.0[2], "step 2: rank 1's own latest");
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.3, rank1.3, "rank {r}: statistics at the end");
        assert_eq!(o.4, rank1.4, "rank {r}: parameters at the end");
    }
}

/// The same loop finished with `finish` (no model to sync buffers with): the training rank's
/// buffer sync meets the finished rank's round, and both fail with the mismatch at once.
#[test]
fn uneven_ranks_that_sync_buffers_and_finish_without_the_model_fail_together() {
    use burn_nn::{BatchNorm, BatchNormConfig};
    use collective_fusion::backend::join;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let _devices = start(2, InitialWeights::Broadcast, Duration::from_secs(20));
    let norms: Vec<BatchNorm<B>> = (0..2)
        .map(|r| BatchNormConfig::new(3).init::<B>(&device(r)))
        .collect();
    let started = std::time::Instant::now();
    let out = common::ranks::on_threads(norms, |r, bn| {
        let d = device(r as u32);
        let mut bn = mark_distributed::<B, BatchNorm<B>>(bn).expect("marking");
        let scope = join::<NdArray>(&d);
        let run = catch_unwind(AssertUnwindSafe(|| {
            for k in 0..1 + r {
                bn = sync_buffers::<B, _>(bn.clone(), BufferSync::Broadcast)
                    .map_err(|e| e.to_string())?;
                bn = norm_step(bn.clone(), r, k, &d);
            }
            Ok::<_, String>(())
        }));
        match run {
            Err(p) => p.downcast_ref::<String>().cloned().unwrap_or_default(),
            Ok(Err(e)) => e,
            Ok(Ok(())) => match scope.finish() {
                Ok(report) => format!("finished: {report:?}"),
                Err(e) => e.to_string(),
            },
        }
    });
    Inner::close_communication_server(&device(0));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    for (r, msg) in out.iter().enumerate() {
        assert!(
            msg.contains("collective mismatch") && msg.contains("uneven-inputs round"),
            "rank {r}: {msg}"
        );
    }
}

/// Ranks whose modules hold different buffers fail together, naming the first that differs.
#[test]
fn ranks_whose_buffers_differ_fail_naming_the_buffer() {
    use burn_nn::{BatchNorm, BatchNormConfig};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = start(2, InitialWeights::Broadcast, Duration::from_secs(20));
    let out: Vec<Result<BatchNorm<B>, ReplicaError>> =
        common::ranks::on_threads(vec![(); 2], |r, ()| {
            let bn = BatchNormConfig::new(3 + r).init::<B>(&device(r as u32));
            sync_buffers::<B, _>(bn, BufferSync::Broadcast)
        });
    Inner::close_communication_server(&devices[0]);
    for (r, o) in out.into_iter().enumerate() {
        match o {
            Err(ReplicaError::ModelsDiffer {
                index,
                mine,
                theirs,
                ..
            }) => {
                assert_eq!(index, 0, "rank {r}");
                let mine = mine.unwrap();
                assert!(mine.starts_with("running_mean"), "rank {r}: {mine}");
                assert!(mine.contains(&format!("{}", 3 + r)), "rank {r}: {mine}");
                assert!(theirs.unwrap().starts_with("running_mean"), "rank {r}");
            }
            Err(e) => panic!("rank {r}: {e}"),
            Ok(_) => panic!("rank {r}: buffers of different shapes synced"),
        }
    }
}

/// A rank that never calls `sync_buffers` is a timeout on the one that does, as a typed error
/// saying where it waited, not a hang.
#[test]
fn a_rank_that_never_syncs_its_buffers_is_a_timeout_naming_the_call() {
    use burn_nn::BatchNormConfig;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = start(2, InitialWeights::Broadcast, Duration::from_secs(1));
    let bn = BatchNormConfig::new(3).init::<B>(&devices[0]);
    let started = std::time::Instant::now();
    let out = std::thread::spawn(move || sync_buffers::<B, _>(bn, BufferSync::Mean).err())
        .join()
        .unwrap();
    Inner::close_communication_server(&devices[0]);
    match out {
        Some(ReplicaError::BufferComm(e)) => {
            let text = ReplicaError::BufferComm(e).to_string();
            assert!(text.contains("sync_buffers"), "{text}");
            assert!(text.contains("ranks [1] never arrived"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A module of buffers alone, shared between the ranks' copies (a `RunningState` forked to each
/// rank lives on the device of the copy forked last): the rank is the one the thread works for,
/// not the device's, so each rank talks on its own communicator.
#[test]
fn shared_buffers_alone_sync_on_the_rank_the_thread_works_for() {
    use burn_core::module::RunningState;
    use burn_core::tensor::Tensor;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = start(2, InitialWeights::Broadcast, Duration::from_secs(20));
    let stats = RunningState::new(Tensor::<B, 1>::from_floats([1.0, 2.0, 3.0], &devices[0]));
    let inputs: Vec<_> = (0..2u32)
        .map(|r| {
            (
                stats.clone().fork(&devices[r as usize]),
                model(&WIDTHS, 3, r),
            )
        })
        .collect();
    let out: Vec<Result<Vec<f32>, ReplicaError>> =
        common::ranks::on_threads(inputs, |_, (mine, model)| {
            // The thread works for its rank from its marking on.
            let _ = mark_distributed::<B, Mlp>(model)?;
            let mine = sync_buffers::<B, _>(mine, BufferSync::Broadcast)?;
            Ok(mine.value().into_data().to_vec::<f32>().unwrap())
        });
    Inner::close_communication_server(&devices[0]);
    for (r, o) in out.into_iter().enumerate() {
        let v = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(v, [1.0, 2.0, 3.0], "rank {r}");
    }
}

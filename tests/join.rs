//! Uneven inputs (`join`): ranks that run out of batches at different steps end with the model
//! one rank trains on every rank's batches of each step (a finished rank adding nothing), and a
//! finished rank that cannot take part fails every rank instead of leaving one waiting.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::Duration;

use burn_autodiff::Autodiff;
use burn_backend::Backend;
use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_core::tensor::Tensor;
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, JoinError, JoinReport, join, mark_distributed,
};
use collective_fusion::train::{module_weights, synthetic_batch};

mod common;

type Inner = Collective<NdArray>;
type B = Autodiff<Inner>;
type Dev = CollectiveDevice<NdArrayDevice>;
type Net = (Linear<B>, Linear<B>);

/// Sessions are per backend type: tests that start one run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const WIDTH: usize = 6;
const OUTPUTS: usize = 3;
const ROWS: usize = 2;
const LR: f64 = 0.2;

fn devices(world: usize) -> Vec<Dev> {
    (0..world as u32)
        .map(|r| CollectiveDevice::new(NdArrayDevice::Cpu, r))
        .collect()
}

fn start(world: usize, timeout: Duration) -> Vec<Dev> {
    let devices = devices(world);
    let options = CollectiveOptions {
        timeout,
        ..CollectiveOptions::default()
    };
    common::ranks::start_server::<NdArray>(&devices, options, ReduceOperation::Mean);
    devices
}

fn net(d: &Dev) -> Net {
    <B as Backend>::seed(d, 5);
    let net: Net = (
        LinearConfig::new(WIDTH, WIDTH).init(d),
        LinearConfig::new(WIDTH, OUTPUTS).init(d),
    );
    let _ = module_weights::<B, Net>(&net);
    net
}

/// The loss of rank `rank`'s batch of `step`.
fn loss(net: &Net, rank: usize, step: usize, d: &Dev) -> Tensor<B, 1> {
    let (x, y) = synthetic_batch::<B>(step, (rank * ROWS, (rank + 1) * ROWS), WIDTH, OUTPUTS, d);
    let out = net
        .1
        .forward(burn_core::tensor::activation::relu(net.0.forward(x)));
    MseLoss::new().forward(out, y, Reduction::Mean)
}

/// Rank `rank` trains on its first `steps` batches inside a join scope, then finishes; its
/// weights before and after taking the authority's, and what it saw.
fn train_rank(net: Net, rank: usize, steps: usize, d: &Dev) -> (Vec<f32>, Vec<f32>, JoinReport) {
    let mut net = mark_distributed::<B, Net>(net).expect("marking the model");
    let scope = join::<NdArray>(d);
    let mut sgd = SgdConfig::new().init::<B, Net>();
    for step in 0..steps {
        let grads = GradientsParams::from_grads(loss(&net, rank, step, d).backward(), &net);
        net = sgd.step(LR, net, grads);
    }
    let own = module_weights::<B, Net>(&net);
    let (net, report) = scope
        .finish_model::<B, Net>(net)
        .expect("finishing the scope");
    (own, module_weights::<B, Net>(&net), report)
}

/// `f`'s result, or the message it panicked with (a rank's failed gradient sync panics).
fn caught<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// Ranks of 2, 4 and 3 batches, with the gradient sync's mean, end where one rank ends that
/// steps on the sum of the losses of the ranks that had a batch, divided by the world (what a
/// finished rank's zeros make of the mean); each rank saw every round, the early ones took part
/// in the steps they had no batch for, and every rank ends with the last one's weights.
#[test]
fn ranks_with_uneven_inputs_train_as_one_rank_and_end_alike() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let steps = [2, 4, 3];
    let world = steps.len();
    let d0 = devices(1).remove(0);
    let initial = module_weights::<B, Net>(&net(&d0));
    // No server: one rank, every batch of each step.
    let mut one = net(&d0);
    let mut sgd = SgdConfig::new().init::<B, Net>();
    for step in 0..*steps.iter().max().unwrap() {
        let total = (0..world)
            .filter(|r| step < steps[*r])
            .map(|r| loss(&one, r, step, &d0))
            .reduce(|a, b| a + b)
            .unwrap()
            / world as f32;
        let grads = GradientsParams::from_grads(total.backward(), &one);
        one = sgd.step(LR, one, grads);
    }
    let one = module_weights::<B, Net>(&one);

    let devices = start(world, Duration::from_secs(60));
    let ranks = common::ranks::forked_per_rank::<B, _, _>(&devices, &net(&d0), |m, d, r| {
        train_rank(m, r, steps[r], d)
    });
    Collective::<NdArray>::close_communication_server(&devices[0]);

    for (r, (_, _, report)) in ranks.iter().enumerate() {
        assert_eq!(
            report,
            &JoinReport {
                rank: r,
                shadowed_steps: (4 - steps[r]) as u64,
                rounds: 4,
                last_trained: vec![1],
                authority: 1,
            }
        );
    }
    // The early ranks' own weights lag the last one's; afterwards every rank has its bits.
    assert_ne!(ranks[0].0, ranks[1].0, "rank 0 stopped two steps early");
    for (r, (_, after, _)) in ranks.iter().enumerate() {
        assert_eq!(
            after, &ranks[1].0,
            "rank {r} does not end with rank 1's weights"
        );
    }
    common::ranks::assert_ends_as_one_rank(&ranks[1].0, &one, &initial, 1e-4, 1e-3);
}

/// A rank that runs out of inputs before its first step cannot take part in the others' steps
/// (it knows no step to replay): it gets `JoinError::NoStep`, and the rank still training fails
/// in its gradient sync with the group's abort, well before the timeout.
#[test]
fn a_rank_without_a_step_to_replay_fails_every_rank() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = start(2, Duration::from_secs(60));
    let started = std::time::Instant::now();
    let d0 = devices[0];
    let results = common::ranks::forked_per_rank::<B, _, _>(&devices, &net(&d0), |m, d, r| {
        caught(|| {
            let net = mark_distributed::<B, Net>(m).expect("marking the model");
            let scope = join::<NdArray>(d);
            if r == 1 {
                let grads = GradientsParams::from_grads(loss(&net, r, 0, d).backward(), &net);
                drop(grads);
            }
            scope.finish()
        })
    });
    Collective::<NdArray>::close_communication_server(&d0);
    match &results[0] {
        Ok(Err(e @ JoinError::NoStep { rank: 0, training })) => {
            assert_eq!(training, &vec![1]);
            assert!(e.to_string().contains("before it synced any step"), "{e}");
        }
        other => panic!("rank 0: expected JoinError::NoStep, got {other:?}"),
    }
    match &results[1] {
        Err(msg) => assert!(msg.contains("before it synced any step"), "rank 1: {msg}"),
        Ok(r) => panic!("rank 1: expected its gradient sync to fail, got {r:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// While a rank has finished, another collective of the others (a user all-reduce) meets its
/// round: every rank fails with the communicator's mismatch error naming the round, never hangs.
#[test]
fn another_collective_while_a_rank_has_finished_fails_every_rank() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = start(2, Duration::from_secs(60));
    let started = std::time::Instant::now();
    let d0 = devices[0];
    let results = common::ranks::forked_per_rank::<B, _, _>(&devices, &net(&d0), |m, d, r| {
        caught(|| {
            let mut net = mark_distributed::<B, Net>(m).expect("marking the model");
            let scope = join::<NdArray>(d);
            let mut sgd = SgdConfig::new().init::<B, Net>();
            let grads = GradientsParams::from_grads(loss(&net, r, 0, d).backward(), &net);
            net = sgd.step(LR, net, grads);
            if r == 1 {
                let t = Tensor::<Inner, 1>::ones([4], d);
                let summed = collective_fusion::backend::all_reduce::<Inner, 1>(
                    t,
                    ReduceOperation::Sum,
                    &devices,
                );
                let _ = summed.resolve().into_data();
            }
            drop(net);
            scope.finish()
        })
    });
    Collective::<NdArray>::close_communication_server(&d0);
    let message = |r: usize| match &results[r] {
        Ok(Ok(report)) => panic!("rank {r}: expected a failure, got {report:?}"),
        Ok(Err(e)) => e.to_string(),
        Err(msg) => msg.clone(),
    };
    for r in 0..2 {
        let m = message(r);
        assert!(m.contains("uneven-inputs round"), "rank {r}: {m}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

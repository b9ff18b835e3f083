//! `SyncBatchNorm`: ranks whose batch norms share their statistics normalize, differentiate and
//! train as one Burn `BatchNorm` over the rows of every rank.

use std::sync::Mutex;
use std::time::Duration;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_core::module::{AutodiffModule, Param};
use burn_core::tensor::{DType, Tensor, TensorData, set_default_dtypes};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::{BatchNorm, BatchNormConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, SyncBatchNorm, SyncBatchNormConfig,
    SyncBatchNormError,
};

mod common;

type Inner = Collective<NdArray>;
type B = Autodiff<Inner>;
type Dev = CollectiveDevice<NdArrayDevice>;

/// Sessions are per backend type: tests that start one run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const CHANNELS: usize = 4;
/// Rows of each rank's batch: ranks may differ.
const ROWS: [usize; 3] = [2, 3, 1];
/// A rank may have none.
const ROWS_ONE_EMPTY: [usize; 3] = [3, 0, 2];

fn device(rank: u32) -> Dev {
    CollectiveDevice::new(NdArrayDevice::Cpu, rank)
}

fn devices(world: usize) -> Vec<Dev> {
    (0..world as u32).map(device).collect()
}

fn start(world: usize) -> Vec<Dev> {
    let devices = devices(world);
    let options = CollectiveOptions {
        timeout: Duration::from_secs(60),
        ..CollectiveOptions::default()
    };
    common::ranks::start_server::<NdArray>(&devices, options, ReduceOperation::Mean);
    devices
}

/// Rows `rows` of a deterministic `[rows, CHANNELS, 3, 3]` input whose channels have means
/// far from zero (5 + channel) against a spread of about one, and of the loss weights.
fn values(rows: std::ops::Range<usize>, salt: f32) -> TensorData {
    let per_row = CHANNELS * 9;
    let v: Vec<f32> = (rows.start * per_row..rows.end * per_row)
        .map(|i| {
            let channel = (i / 9) % CHANNELS;
            5.0 + channel as f32 + (i as f32 * 0.37 + salt).sin()
        })
        .collect();
    TensorData::new(v, [rows.len(), CHANNELS, 3, 3])
}

/// A norm with distinct gammas and betas, as `Sync` or Burn's.
fn norm_params(d: &Dev) -> BatchNorm<B> {
    let mut norm = BatchNormConfig::new(CHANNELS).init::<B>(d);
    let gamma: Vec<f32> = (0..CHANNELS).map(|c| 0.5 + c as f32 * 0.25).collect();
    let beta: Vec<f32> = (0..CHANNELS).map(|c| c as f32 * 0.1 - 0.2).collect();
    norm.gamma = Param::from_tensor(Tensor::from_data(TensorData::new(gamma, [CHANNELS]), d));
    norm.beta = Param::from_tensor(Tensor::from_data(TensorData::new(beta, [CHANNELS]), d));
    norm
}

/// What one forward and backward pass gives: the output, the input's gradient, gamma's and
/// beta's, and the running mean and variance after it.
struct Pass {
    out: Vec<f32>,
    input_grad: Vec<f32>,
    gamma_grad: Vec<f32>,
    beta_grad: Vec<f32>,
    running: Vec<f32>,
}

fn floats<const D: usize>(t: Tensor<Inner, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().expect("f32 values")
}

/// One pass over `rows` of the input, with the loss `sum(out * weights)`.
fn pass(
    forward: impl Fn(Tensor<B, 4>) -> Tensor<B, 4>,
    params: (&Param<Tensor<B, 1>>, &Param<Tensor<B, 1>>),
    running: impl Fn() -> Vec<f32>,
    rows: std::ops::Range<usize>,
    d: &Dev,
) -> Pass {
    let x = Tensor::<B, 4>::from_data(values(rows.clone(), 0.0), d).require_grad();
    let weights = Tensor::<B, 4>::from_data(values(rows, 1.3), d);
    let out = forward(x.clone());
    let grads = (out.clone() * weights).sum().backward();
    Pass {
        out: floats(out.inner()),
        input_grad: floats(x.grad(&grads).expect("the input's gradient")),
        gamma_grad: floats(params.0.grad(&grads).expect("gamma's gradient")),
        beta_grad: floats(params.1.grad(&grads).expect("beta's gradient")),
        running: running(),
    }
}

fn running_of(mean: Tensor<B, 1>, var: Tensor<B, 1>) -> Vec<f32> {
    let mut v = floats(mean.inner());
    v.extend(floats(var.inner()));
    v
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}[{i}]: {a} against {b} (all: {got:?} against {want:?})"
        );
    }
}

/// Burn's `BatchNorm` over every rank's rows at once, on one rank and no server.
fn one_batch_norm(total: usize) -> Pass {
    let d = device(0);
    let norm = norm_params(&d);
    pass(
        |x| norm.forward(x),
        (&norm.gamma, &norm.beta),
        || {
            running_of(
                norm.running_mean.value_sync(),
                norm.running_var.value_sync(),
            )
        },
        0..total,
        &d,
    )
}

/// Each rank its `rows` through a `SyncBatchNorm`, the group found from the server or given
/// (`with_group`).
fn synchronized(rows: &[usize], given_group: bool) -> Vec<Pass> {
    let world = rows.len();
    let devices = start(world);
    let passes = common::ranks::on_threads(devices.iter().collect(), |r, d| {
        let mut norm = SyncBatchNorm::from_batch_norm(norm_params(d));
        if given_group {
            norm = norm.with_group(&devices);
        }
        let from: usize = rows[..r].iter().sum();
        pass(
            |x| norm.forward(x),
            (&norm.gamma, &norm.beta),
            || {
                let mean = norm.running_mean.value_sync();
                running_of(mean, norm.running_var.value_sync())
            },
            from..from + rows[r],
            d,
        )
    });
    Inner::close_communication_server(&devices[0]);
    passes
}

fn normalizes_and_differentiates_as_one_batch_norm_over_every_rank(
    rows: &[usize],
    given_group: bool,
) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let total: usize = rows.iter().sum();
    let one = one_batch_norm(total);
    let ranks = synchronized(rows, given_group);
    let per_row = CHANNELS * 9;
    let mut from = 0;
    for (r, p) in ranks.iter().enumerate() {
        let span = from * per_row..(from + rows[r]) * per_row;
        assert_close(
            &format!("rank {r}'s output"),
            &p.out,
            &one.out[span.clone()],
            1e-4,
        );
        // Each rank's input gradient is that of the sum of every rank's loss.
        assert_close(
            &format!("rank {r}'s input gradient"),
            &p.input_grad,
            &one.input_grad[span],
            1e-3,
        );
        assert_close(
            &format!("rank {r}'s running statistics"),
            &p.running,
            &one.running,
            1e-5,
        );
        from += rows[r];
    }
    // Gamma and beta act on each rank's own rows: the ranks' gradients add up to one rank's.
    let sum = |f: fn(&Pass) -> &Vec<f32>| -> Vec<f32> {
        (0..CHANNELS)
            .map(|c| ranks.iter().map(|p| f(p)[c]).sum())
            .collect()
    };
    assert_close(
        "gamma's gradient",
        &sum(|p| &p.gamma_grad),
        &one.gamma_grad,
        1e-3,
    );
    assert_close(
        "beta's gradient",
        &sum(|p| &p.beta_grad),
        &one.beta_grad,
        1e-4,
    );
    // What a norm of each rank's rows alone gives instead: the check above can tell them apart.
    let alone = {
        let d = device(0);
        let norm = norm_params(&d);
        pass(
            |x| norm.forward(x),
            (&norm.gamma, &norm.beta),
            Vec::new,
            0..rows[0],
            &d,
        )
    };
    let gap = alone
        .out
        .iter()
        .zip(&ranks[0].out)
        .map(|(a, b)| (a - b).abs());
    assert!(
        gap.fold(0.0, f32::max) > 0.1,
        "rank 0's rows alone normalize alike"
    );
}

#[test]
fn ranks_normalize_and_differentiate_as_one_batch_norm_over_every_rank() {
    normalizes_and_differentiates_as_one_batch_norm_over_every_rank(&ROWS, false);
}

#[test]
fn a_given_group_normalizes_as_the_server_group() {
    normalizes_and_differentiates_as_one_batch_norm_over_every_rank(&ROWS, true);
}

/// A rank without rows adds nothing to the statistics, and still takes their update.
#[test]
fn a_rank_without_rows_takes_the_others_statistics() {
    normalizes_and_differentiates_as_one_batch_norm_over_every_rank(&ROWS_ONE_EMPTY, false);
}

/// Without a running server the statistics are the rank's own, as Burn's `BatchNorm`'s; in
/// inference the running ones are used; the module converts to and from Burn's losslessly.
#[test]
fn without_a_group_or_in_inference_it_is_burn_batch_norm() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device(0);
    let sync = SyncBatchNorm::from_batch_norm(norm_params(&d));
    let burn = norm_params(&d);
    let x = || Tensor::<B, 4>::from_data(values(0..3, 0.0), &d);
    assert_close(
        "output",
        &floats(sync.forward(x()).inner()),
        &floats(burn.forward(x()).inner()),
        1e-5,
    );
    let (sync, burn) = (sync.valid(), burn.valid());
    let x = Tensor::<Inner, 4>::from_data(values(0..3, 0.0), &d);
    let got = floats(sync.forward(x.clone()));
    assert_close("inference output", &got, &floats(burn.forward(x)), 1e-6);
    let back: BatchNorm<Inner> = sync.into_batch_norm();
    assert_eq!(
        back.running_mean
            .value()
            .into_data()
            .to_vec::<f32>()
            .unwrap()
            .len(),
        CHANNELS
    );
}

/// A module whose group is given must run on one of its devices; an input of rank 1 is refused
/// as Burn's `BatchNorm` refuses it.
#[test]
fn a_device_outside_the_given_group_is_refused() {
    let norm = SyncBatchNormConfig::new(CHANNELS)
        .init::<B>(&device(0))
        .with_group(&devices(2));
    let err = norm
        .try_forward(Tensor::<B, 4>::from_data(values(0..1, 0.0), &device(5)))
        .expect_err("a device outside the group is refused");
    assert!(
        matches!(err, SyncBatchNormError::NotInGroup { group: 2, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("is not in its group"), "{err}");
    let flat = Tensor::<B, 1>::from_floats([1.0, 2.0], &device(0));
    assert_eq!(
        norm.try_forward(flat).err(),
        Some(SyncBatchNormError::Rank(1))
    );
}

/// Two ranks of three rows each, with the gradient sync's mean, end where one rank on the six
/// rows ends: weights and running statistics.
#[test]
fn ranks_with_a_synchronized_norm_train_as_one_rank_on_the_concatenated_batch() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let options = CollectiveOptions {
        timeout: Duration::from_secs(60),
        ..CollectiveOptions::default()
    };
    common::sync_norm::assert_trains_as_one_rank::<NdArray>(&devices(2), options, 1e-4);
}

/// Flex ranks whose devices' default float type is f16.
type HalfInner = Collective<burn_flex::Flex>;
type Half = Autodiff<HalfInner>;

/// Half precision: f16 ranks whose rows have a mean of 200 and a spread of 30, 2193 rows a rank
/// (an f16 count is exact only up to 2048; a sum of squared deviations, 2 million, is past
/// f16's largest value) normalize as one f32 `BatchNorm` over both ranks' rows does, within
/// f16's rounding, with finite gradients.
#[test]
fn half_precision_ranks_combine_their_statistics_in_f32() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const HW: [usize; 2] = [43, 51];
    let rows = |rank: usize| {
        let n = HW[0] * HW[1];
        let v: Vec<f32> = (rank * 2 * n..(rank + 1) * 2 * n)
            .map(|i| 200.0 + 30.0 * (i as f32 * 0.731).sin())
            .collect();
        TensorData::new(v, [1, 2, HW[0], HW[1]])
    };
    let d = device(0);
    let one = {
        let both = Tensor::cat(
            vec![
                Tensor::<B, 4>::from_data(rows(0), &d),
                Tensor::from_data(rows(1), &d),
            ],
            0,
        );
        floats(BatchNormConfig::new(2).init::<B>(&d).forward(both).inner())
    };
    let devices: Vec<CollectiveDevice<burn_flex::FlexDevice>> = (0..2)
        .map(|r| CollectiveDevice::new(burn_flex::FlexDevice, r))
        .collect();
    for d in &devices {
        set_default_dtypes::<Half>(d, DType::F16, DType::I32).expect("f16 as the default");
    }
    let options = CollectiveOptions {
        timeout: Duration::from_secs(60),
        ..CollectiveOptions::default()
    };
    common::ranks::start_server::<burn_flex::Flex>(&devices, options, ReduceOperation::Mean);
    let ranks = common::ranks::on_threads(devices.clone(), |r, d| {
        let norm = SyncBatchNormConfig::new(2).init::<Half>(&d);
        let x = Tensor::<Half, 4>::from_data(rows(r), &d).require_grad();
        assert_eq!(x.dtype(), DType::F16);
        let out = norm.forward(x.clone());
        let grads = out.clone().sum().backward();
        let grad = x.grad(&grads).expect("the input's gradient");
        let f = |t: Tensor<HalfInner, 4>| -> Vec<f32> {
            t.into_data().convert::<f32>().to_vec().unwrap()
        };
        (f(out.inner()), f(grad))
    });
    HalfInner::close_communication_server(&devices[0]);
    let per_rank = one.len() / 2;
    for (r, (out, grad)) in ranks.iter().enumerate() {
        let want = &one[r * per_rank..(r + 1) * per_rank];
        for (i, (a, b)) in out.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 2e-2,
                "rank {r}'s output[{i}]: {a} against {b}"
            );
        }
        assert!(grad.iter().all(|g| g.is_finite()), "rank {r}'s gradient");
    }
}

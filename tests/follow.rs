//! Steps that sync different gradient lists: a model whose middle layers a schedule skips on
//! some steps (every rank alike), as a GAN's alternating steps or a multi-task model's heads
//! do. Once each pattern was seen, every step follows the plan of the segment that came after
//! the last one (its buckets launch during backward), and the ranks still end where one rank on
//! the concatenated batch ends.

mod common;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_core::tensor::Tensor;
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, CollectiveTensor, SyncStats, all_reduce,
    mark_distributed, recorded_collectives, sync_stats,
};
use collective_fusion::config::{BucketConfig, BucketPolicy, CompileConfig};
use collective_fusion::runtime::agree::is_barrier;
use collective_fusion::train::{module_weights, synthetic_batch};

type Inner = Collective<NdArray>;
type B = Autodiff<Inner>;
type Dev = CollectiveDevice<NdArrayDevice>;
type Net = Vec<Linear<B>>;

const WORLD: u32 = 2;
const ROWS: usize = 3;
const WIDTH: usize = 8;
const STEPS: usize = 9;
/// The gradients of the model's four `WIDTH` × `WIDTH` layers, weights and biases, f32.
const GRADIENT_BYTES: u64 = 4 * (WIDTH * (WIDTH + 1)) as u64 * 4;

/// Sessions are per backend type: one test at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Every rank's device.
fn rank_devices() -> Vec<Dev> {
    (0..WORLD)
        .map(|r| CollectiveDevice::new(NdArrayDevice::Cpu, r))
        .collect()
}

/// Starts the server of `WORLD` ranks, with buckets small enough that a step has several (so a
/// step that follows a plan launches during backward); their devices.
fn start_ranks() -> Vec<Dev> {
    start_ranks_recording(false)
}

/// [`start_ranks`], recording each rank's collectives when `record` is set.
fn start_ranks_recording(record: bool) -> Vec<Dev> {
    let devices = rank_devices();
    let options = CollectiveOptions {
        record_collectives: record,
        timeout: std::time::Duration::from_secs(60),
        config: CompileConfig {
            bucket: BucketConfig {
                policy: BucketPolicy::Ddp,
                cap_bytes: 300,
                first_bucket_bytes: 300,
            },
            ..CompileConfig::default()
        },
        ..CollectiveOptions::default()
    };
    common::ranks::start_server::<NdArray>(&devices, options, ReduceOperation::Mean);
    devices
}

fn init(d: &Dev) -> Net {
    <B as burn_backend::Backend>::seed(d, 5);
    let net: Net = (0..4)
        .map(|_| LinearConfig::new(WIDTH, WIDTH).init(d))
        .collect();
    // Parameters initialize lazily; materialize them now, under this seed.
    let _ = module_weights::<B, Net>(&net);
    net
}

/// Which layer of the middle ones a step skips: the gradient lists the steps sync.
#[derive(Clone, Copy)]
enum Lists {
    /// Step `step` skips layer `1 + step % period` (none when `period` is 1): `period` lists in
    /// turn.
    InTurn(usize),
    /// Step `step` skips layer 1, the other steps none: one step leaves the plan it follows.
    OneStepSkips(usize),
}

impl Lists {
    fn skipped(self, step: usize) -> Option<usize> {
        match self {
            Lists::InTurn(period) => (period > 1).then_some(1 + step % period),
            Lists::OneStepSkips(at) => (step == at).then_some(1),
        }
    }
}

fn forward(net: &Net, x: Tensor<B, 2>, skip: Option<usize>) -> Tensor<B, 2> {
    net.iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != skip)
        .fold(x, |h, (_, l)| {
            burn_core::tensor::activation::relu(l.forward(h))
        })
}

/// How a rank logs its loss.
#[derive(Clone, Copy, PartialEq)]
enum Log {
    Nothing,
    /// Each step's loss all-reduced (mean over the ranks) before backward, the values read
    /// only after the last step, as a training loop logs a metric.
    MeanLoss,
    /// The mean and then the sum of each step's loss, all-reduced before backward; rank 0
    /// reads the mean before it issues the sum (it prints it), the others read both after the
    /// last step. So the ranks enter backward with different numbers of all-reduces queued.
    Rank0ReadsTheMean,
}

fn read(t: CollectiveTensor<Inner, 1>) -> Vec<f32> {
    t.resolve().into_data().to_vec::<f32>().expect("f32")
}

/// Trains `STEPS` steps; the weights at the end, and the logged losses.
fn train(
    mut net: Net,
    rows: (usize, usize),
    d: &Dev,
    distributed: bool,
    lists: Lists,
    log: Log,
) -> (Vec<f32>, Vec<f32>) {
    let mut sgd = SgdConfig::new().init::<B, Net>();
    let devices = rank_devices();
    let mut logged: Vec<Box<dyn FnOnce() -> Vec<f32>>> = Vec::new();
    for step in 0..STEPS {
        if distributed {
            net = mark_distributed::<B, Net>(net).expect("marking the model");
        }
        let (x, y) = synthetic_batch::<B>(step, rows, WIDTH, WIDTH, d);
        let loss =
            MseLoss::new().forward(forward(&net, x, lists.skipped(step)), y, Reduction::Mean);
        let l = || loss.clone().inner().reshape([1]);
        match log {
            Log::Nothing => {}
            Log::MeanLoss => {
                let mean = all_reduce::<Inner, 1>(l(), ReduceOperation::Mean, &devices);
                logged.push(Box::new(move || read(mean)));
            }
            Log::Rank0ReadsTheMean => {
                let mean = all_reduce::<Inner, 1>(l(), ReduceOperation::Mean, &devices);
                if rows.0 == 0 {
                    // A value, read now: the queue launches (the sum is not issued yet).
                    let now = read(mean);
                    logged.push(Box::new(move || now));
                } else {
                    logged.push(Box::new(move || read(mean)));
                }
                let sum = all_reduce::<Inner, 1>(l(), ReduceOperation::Sum, &devices);
                logged.push(Box::new(move || read(sum)));
            }
        }
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        net = sgd.step(0.1, net, grads);
    }
    let losses = logged.into_iter().flat_map(|l| l()).collect();
    (module_weights::<B, Net>(&net), losses)
}

/// `WORLD` ranks train with `period` gradient lists in turn, logging as `log` says; checks
/// they agree and end where one rank ends, and returns rank 0's sync statistics and the losses
/// each rank logged.
fn alternating(period: usize, log: Log) -> (SyncStats, Vec<Vec<f32>>) {
    trained(Lists::InTurn(period), log)
}

/// [`alternating`] with the steps' gradient lists as `lists` says.
fn trained(lists: Lists, log: Log) -> (SyncStats, Vec<Vec<f32>>) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = start_ranks();
    let start = init(&devices[0]);
    let ranks = common::ranks::forked_per_rank::<B, _, _>(&devices, &start, |m, d, r| {
        train(m, (r * ROWS, (r + 1) * ROWS), d, true, lists, log)
    });
    let (ranks, logged): (Vec<Vec<f32>>, Vec<Vec<f32>>) = ranks.into_iter().unzip();
    let stats = sync_stats::<NdArray>(0);
    Inner::close_communication_server(&devices[0]);
    assert_eq!(ranks[0], ranks[1], "the ranks diverged");
    let d = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
    let (one, _) = train(
        init(&d),
        (0, WORLD as usize * ROWS),
        &d,
        false,
        lists,
        Log::Nothing,
    );
    let initial = module_weights::<B, Net>(&init(&d));
    common::ranks::assert_ends_as_one_rank(&ranks[0], &one, &initial, 1e-5, 1e-3);
    (stats, logged)
}

/// One gradient list: every step after the first follows the previous step's plan.
#[test]
fn steps_that_sync_one_list_follow_the_previous_plan() {
    let (st, _) = alternating(1, Log::Nothing);
    assert_eq!(
        (st.eager_steps, st.flushed_steps),
        (STEPS as u64 - 1, 1),
        "{st:?}"
    );
    // What the sync keeps between steps: its buckets, one copy of the gradients, allocated in
    // the first step.
    assert_eq!(st.host_bucket_bytes, GRADIENT_BYTES, "{st:?}");
    assert_eq!(st.host_bucket_allocations, 3, "{st:?}");
    // Each step that follows its plan copies every gradient (all row-major, all in packed
    // buckets) into its bucket from NdArray's own memory, with no host copy of its own.
    assert_eq!(
        st.gradients_read_into_buckets,
        (STEPS as u64 - 1) * 8,
        "{st:?}"
    );
}

/// One step that skips a layer leaves the plan it follows where the skipped layer's gradients
/// were due, and reduces the rest with a plan of their own at its sync point. Those buckets are
/// kept while the following steps do the same, and let go at the first step that does not:
/// after the last step the rank keeps one copy of the gradients, as with one list.
#[test]
fn a_step_that_leaves_its_plan_keeps_no_buckets_of_its_own_after_the_next_step() {
    let (st, _) = trained(Lists::OneStepSkips(4), Log::Nothing);
    // Steps 0 and 4 reduce at their sync point; so do step 5, which step 4's list did not
    // predict, and step 6, predicted as step 4 (what came after the full list last time).
    assert_eq!((st.eager_steps, st.flushed_steps), (5, 4), "{st:?}");
    // Steps 5 and 6 reduced the same rest (608 bytes of buckets, kept from one to the other):
    // let go at step 7, the first that needed none (1,760 bytes kept to the end before).
    assert_eq!(st.host_bucket_bytes, GRADIENT_BYTES, "{st:?}");
    assert_eq!(st.host_bucket_allocations, 5, "{st:?}");
}

/// Two and three lists in turn: the first `period` steps compile their plans, the next one
/// meets a segment no history follows yet, and from then on every step follows the plan of the
/// segment that came next last time (following the previous step's plan instead, every step
/// would diverge and reduce at its sync point).
#[test]
fn steps_that_alternate_between_lists_follow_the_plan_that_came_next_last_time() {
    for period in [2, 3] {
        let (st, _) = alternating(period, Log::Nothing);
        let flushed = period as u64 + 1;
        assert_eq!(
            (st.eager_steps, st.flushed_steps),
            (STEPS as u64 - flushed, flushed),
            "period {period}: {st:?}"
        );
        assert_eq!(st.compiled, period as u64, "period {period}: {st:?}");
        // Each step's plan takes the buckets of the plan before it (the lists differ in one
        // layer of the same size): the first step's buckets are the only ones allocated (two
        // a step, 18 in all, before the plans shared them).
        assert!(
            st.host_bucket_bytes <= GRADIENT_BYTES,
            "period {period}: {st:?}"
        );
        assert_eq!(st.host_bucket_allocations, 2, "period {period}: {st:?}");
    }
}

/// An all-reduce of each step's loss issued before backward and read after the last step (a
/// logged metric) launches first, before the step's buckets; the ranks exchange how many they
/// have queued while backward goes on (waiting for that inside backward could wait for a rank
/// stuck in Burn's cleanup of its previous backward pass, which waits for this rank's graph),
/// so the steps still follow their plans. The logged means are every rank's the same, and
/// training is unchanged.
///
/// Whether a step's buckets launch during backward or wait for the sync point depends on when
/// the other rank's count arrives (`held_steps` counts the latter), so the test asserts their
/// sum, and that some steps launched during backward (before, none did).
#[test]
fn a_loss_all_reduced_before_backward_launches_first_and_steps_still_follow_their_plans() {
    let mut eager = 0;
    for period in [1, 2] {
        let (st, logged) = alternating(period, Log::MeanLoss);
        let flushed = if period == 1 { 1 } else { period as u64 + 1 };
        assert_eq!(
            (st.eager_steps + st.held_steps, st.flushed_steps),
            (STEPS as u64 - flushed, flushed),
            "period {period}: {st:?}"
        );
        eager += st.eager_steps;
        assert_eq!(logged[0].len(), STEPS);
        assert_eq!(logged[0], logged[1], "the ranks logged different means");
        assert!(
            logged[0].iter().all(|l| l.is_finite() && *l > 0.0),
            "{logged:?}"
        );
    }
    assert!(eager > 0, "no step launched its buckets during backward");
}

/// Rank 0 reads each step's mean loss before it issues the sum; rank 1 issues both first. At
/// backward rank 1 has two all-reduces queued and rank 0 one: the ranks launch the fewer each
/// round (rank 1 launches the mean with rank 0's read, the sum with rank 0's backward), and
/// only then the buckets. Both log the same values, and train as one rank does.
#[test]
fn ranks_that_enter_backward_with_different_queues_launch_alike() {
    let (st, logged) = alternating(1, Log::Rank0ReadsTheMean);
    assert_eq!(
        (st.eager_steps + st.held_steps, st.flushed_steps),
        (STEPS as u64 - 1, 1),
        "{st:?}"
    );
    // What the sync keeps between steps: its buckets, one copy of the gradients.
    assert_eq!(st.host_bucket_bytes, GRADIENT_BYTES, "{st:?}");
    assert_eq!(logged[0].len(), 2 * STEPS);
    assert_eq!(logged[0], logged[1], "the ranks logged different values");
    for pair in logged[0].chunks(2) {
        let (mean, sum) = (pair[0], pair[1]);
        assert!(
            (sum - WORLD as f32 * mean).abs() <= 1e-5 * sum.abs(),
            "{logged:?}"
        );
    }
}

/// A synchronized batch-norm-like layer: layer `at`'s output is centred on its mean over every
/// rank's rows (a differentiable all-reduce in forward, left lazy with `assume_resolved`; its
/// backward all-reduces inside backward and waits for the other rank there). The ranks train as
/// one rank on the concatenated batch (whose plain batch mean is the mean of the ranks' means),
/// the steps still follow their plans, and each sync point ends with the ranks meeting (one
/// barrier per step), so that none starts a backward that waits for a rank still in Burn's
/// cleanup of the previous one.
fn synchronized_norm_trains_as_one_rank(at: usize) {
    fn forward(net: &Net, x: Tensor<B, 2>, at: usize, devices: Option<&[Dev]>) -> Tensor<B, 2> {
        net.iter().enumerate().fold(x, |h, (i, l)| {
            let h = l.forward(h);
            let h = if i == at {
                let m = h.clone().mean_dim(0);
                let m = match devices {
                    // SAFETY: a lazy result waits for its collective when it is first needed.
                    Some(ds) => unsafe {
                        all_reduce::<B, 2>(m, ReduceOperation::Mean, ds).assume_resolved()
                    },
                    None => m,
                };
                h - m
            } else {
                h
            };
            burn_core::tensor::activation::relu(h)
        })
    }
    fn train(
        mut net: Net,
        rows: (usize, usize),
        d: &Dev,
        at: usize,
        distributed: bool,
    ) -> Vec<f32> {
        let mut sgd = SgdConfig::new().init::<B, Net>();
        let devices = rank_devices();
        for step in 0..STEPS {
            if distributed {
                net = mark_distributed::<B, Net>(net).expect("marking the model");
            }
            let (x, y) = synthetic_batch::<B>(step, rows, WIDTH, WIDTH, d);
            let out = forward(&net, x, at, distributed.then_some(&devices[..]));
            let loss = MseLoss::new().forward(out, y, Reduction::Mean);
            let grads = GradientsParams::from_grads(loss.backward(), &net);
            net = sgd.step(0.1, net, grads);
        }
        module_weights::<B, Net>(&net)
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = start_ranks_recording(true);
    let start = init(&devices[0]);
    let ranks = common::ranks::forked_per_rank::<B, _, _>(&devices, &start, |m, d, r| {
        train(m, (r * ROWS, (r + 1) * ROWS), d, at, true)
    });
    let st = sync_stats::<NdArray>(0);
    let meetings: Vec<usize> = (0..WORLD as usize)
        .map(|r| {
            let calls = recorded_collectives::<NdArray>(r).expect("collectives recorded");
            calls.iter().filter(|c| is_barrier(c)).count()
        })
        .collect();
    Inner::close_communication_server(&devices[0]);
    assert_eq!(
        (st.eager_steps + st.held_steps, st.flushed_steps),
        (STEPS as u64 - 1, 1),
        "{st:?}"
    );
    // What the sync keeps between steps: its buckets, one copy of the gradients.
    assert_eq!(st.host_bucket_bytes, GRADIENT_BYTES, "{st:?}");
    assert_eq!(meetings, vec![STEPS; WORLD as usize], "meetings per rank");
    assert_eq!(ranks[0], ranks[1], "the ranks diverged");
    let d = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
    let one = train(init(&d), (0, WORLD as usize * ROWS), &d, at, false);
    let initial = module_weights::<B, Net>(&init(&d));
    common::ranks::assert_ends_as_one_rank(&ranks[0], &one, &initial, 1e-4, 1e-3);
}

/// The norm inside the model: its backward all-reduce comes after the gradients of the layers
/// after it.
#[test]
fn a_synchronized_norm_trains_as_one_rank() {
    synchronized_norm_trains_as_one_rank(1);
}

/// The norm on the last layer: its backward all-reduce comes before the step's first gradient
/// (backward has started: Burn registered the step's parameters).
#[test]
fn a_synchronized_norm_on_the_last_layer_trains_as_one_rank() {
    synchronized_norm_trains_as_one_rank(3);
}

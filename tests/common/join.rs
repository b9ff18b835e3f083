//! Uneven inputs on any inner backend: ranks with different numbers of batches inside a `join`
//! scope, against one rank that steps on the batches every rank had at each step.

use burn_autodiff::Autodiff;
use burn_backend::Backend;
use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_core::module::AutodiffModule;
use burn_core::tensor::Tensor;
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    BufferSync, Collective, CollectiveDevice, CollectiveOptions, JoinOptions, JoinReport,
    SyncStats, join, join_with, mark_distributed, sync_buffers, sync_stats,
};
use collective_fusion::train::{module_weights, synthetic_batch};

pub type B<I> = Autodiff<Collective<I>>;
/// Two linear layers with a ReLU between.
pub type Net<I> = (Linear<B<I>>, Linear<B<I>>);

const WIDTH: usize = 6;
const OUTPUTS: usize = 3;
const ROWS: usize = 2;
const LR: f64 = 0.2;

/// The model every rank starts from (rank 0's, which marking gives every rank).
pub fn net<I: Backend>(d: &CollectiveDevice<I::Device>) -> Net<I> {
    <B<I> as Backend>::seed(d, 5);
    let net: Net<I> = (
        LinearConfig::new(WIDTH, WIDTH).init(d),
        LinearConfig::new(WIDTH, OUTPUTS).init(d),
    );
    let _ = module_weights::<B<I>, Net<I>>(&net);
    net
}

/// The loss of rank `rank`'s batch of `step`.
pub fn loss<I: Backend>(
    net: &Net<I>,
    rank: usize,
    step: usize,
    d: &CollectiveDevice<I::Device>,
) -> Tensor<B<I>, 1> {
    let rows = (rank * ROWS, (rank + 1) * ROWS);
    let (x, y) = synthetic_batch::<B<I>>(step, rows, WIDTH, OUTPUTS, d);
    let out = net
        .1
        .forward(burn_core::tensor::activation::relu(net.0.forward(x)));
    MseLoss::new().forward(out, y, Reduction::Mean)
}

/// One SGD step of `net` on `loss`.
pub fn step<I: Backend>(net: Net<I>, loss: Tensor<B<I>, 1>) -> Net<I> {
    let grads = GradientsParams::from_grads(loss.backward(), &net);
    SgdConfig::new().init::<B<I>, Net<I>>().step(LR, net, grads)
}

/// What a rank of [`assert_uneven_ranks_train_as_one_rank`] ended with.
pub struct Ended {
    /// Its weights after its own last step.
    pub own: Vec<f32>,
    /// Its weights after `finish_model`.
    pub after: Vec<f32>,
    pub report: JoinReport,
    pub stats: SyncStats,
}

/// Rank `r` of `devices` (a server started with `options`, the gradient sync's mean) trains on
/// its first `steps[r]` batches inside a join scope with `join`, then finishes with
/// `finish_model`. Asserts that every rank saw every round and took part in the steps it had no
/// batch for, that every rank ends with the weights of the lowest rank that trained longest,
/// and that those are (within `rel`) where one rank ends that steps on the sum of the losses of
/// the ranks that had a batch, divided by the world (what a finished rank's zeros make of the
/// mean) or, where `join` says so, by the ranks that had one. Returns what each rank ended with.
pub fn assert_uneven_ranks_train_as_one_rank<I: Backend>(
    devices: &[CollectiveDevice<I::Device>],
    steps: &[usize],
    options: CollectiveOptions,
    join: JoinOptions,
    rel: f64,
) -> Vec<Ended> {
    uneven_ranks::<I>(devices, steps, false, options, join, rel)
}

/// [`assert_uneven_ranks_train_as_one_rank`] with ranks that stop after the first step in which
/// some rank had run out of inputs (`Join::finished_ranks` not empty): every rank ends as if the
/// ranks had at most one batch more than the one with the fewest.
pub fn assert_ranks_that_stop_at_the_first_finish_train_as_one_rank<I: Backend>(
    devices: &[CollectiveDevice<I::Device>],
    steps: &[usize],
    options: CollectiveOptions,
    rel: f64,
) -> Vec<Ended> {
    uneven_ranks::<I>(devices, steps, true, options, JoinOptions::default(), rel)
}

fn uneven_ranks<I: Backend>(
    devices: &[CollectiveDevice<I::Device>],
    batches: &[usize],
    stop: bool,
    options: CollectiveOptions,
    join: JoinOptions,
    rel: f64,
) -> Vec<Ended> {
    // The steps each rank trains: with `stop`, up to the step after the fewest batches.
    let fewest = *batches.iter().min().expect("a rank");
    let steps: Vec<usize> = batches
        .iter()
        .map(|b| if stop { (*b).min(fewest + 1) } else { *b })
        .collect();
    let world = devices.len();
    let d0 = &devices[0];
    let longest = *steps.iter().max().expect("a rank");
    let authority = steps.iter().position(|s| *s == longest).unwrap_or(0);
    let initial = module_weights::<B<I>, Net<I>>(&net::<I>(d0));
    // No server: one rank, every batch of each step.
    let mut one = net::<I>(d0);
    for s in 0..longest {
        let trained = (0..world).filter(|r| s < steps[*r]).count();
        let divisor = if join.divide_by_initial_world_size {
            world
        } else {
            trained
        };
        let total = (0..world)
            .filter(|r| s < steps[*r])
            .map(|r| loss::<I>(&one, r, s, d0))
            .reduce(|a, b| a + b)
            .expect("a rank trains at every step up to the longest")
            / divisor as f32;
        one = step::<I>(one, total);
    }
    let one = module_weights::<B<I>, Net<I>>(&one);

    super::ranks::start_server::<I>(devices, options, ReduceOperation::Mean);
    let ended = super::ranks::forked_per_rank::<B<I>, _, _>(devices, &net::<I>(d0), |m, d, r| {
        let mut net = mark_distributed::<B<I>, Net<I>>(m).expect("marking the model");
        let scope = join_with::<I>(d, join);
        for s in 0..batches[r] {
            let l = loss::<I>(&net, r, s, d);
            net = step::<I>(net, l);
            let finished = scope.finished_ranks();
            // Every rank trains at step `s` up to the fewest batches; at that step the ranks
            // with the fewest ran out.
            let want: Vec<usize> = (0..world).filter(|q| batches[*q] <= s).collect();
            assert_eq!(finished, want, "rank {r}, step {s}");
            if stop && !finished.is_empty() {
                break;
            }
        }
        let own = module_weights::<B<I>, Net<I>>(&net);
        let (net, report) = scope
            .finish_model::<B<I>, Net<I>>(net)
            .expect("finishing the scope");
        Ended {
            own,
            after: module_weights::<B<I>, Net<I>>(&net),
            report,
            stats: sync_stats::<I>(r),
        }
    });
    Collective::<I>::close_communication_server(d0);

    for (r, e) in ended.iter().enumerate() {
        let last_trained: Vec<usize> = (0..world).filter(|q| steps[*q] == longest).collect();
        let want = JoinReport {
            rank: r,
            shadowed_steps: (longest - steps[r]) as u64,
            rounds: longest as u64,
            last_trained,
            authority,
        };
        assert_eq!(e.report, want, "rank {r}");
        assert_eq!(
            e.after, ended[authority].own,
            "rank {r} does not end with rank {authority}'s weights"
        );
    }
    if let Some(early) = (0..world).find(|r| steps[*r] < longest) {
        assert_ne!(
            ended[early].own, ended[authority].own,
            "rank {early} stopped early: its own weights lag"
        );
    }
    super::ranks::assert_ends_as_one_rank(&ended[authority].own, &one, &initial, rel, 1e-3);
    ended
}

/// Uneven inputs with BatchNorm statistics on two ranks of `devices` (a server running, the
/// gradient sync's mean): rank 0 trains one step, rank 1 two, each syncing its buffers
/// (`Broadcast`) before its forward pass. Rank 0, out of inputs, takes part in rank 1's second
/// buffer sync and gradient sync (`finish_model`): there rank 1 takes rank 0's statistics (the
/// lowest rank that trained the step before), and both ranks end with rank 1's parameters and
/// statistics.
pub fn assert_a_finished_rank_takes_part_in_the_buffer_sync<I: Backend>(
    devices: &[CollectiveDevice<I::Device>],
) {
    let bits = |bn: &BatchNorm<Collective<I>>| -> Vec<u32> {
        let mut v = bn.running_mean.value().into_data().to_vec::<f32>().unwrap();
        v.extend(bn.running_var.value().into_data().to_vec::<f32>().unwrap());
        v.iter().map(|x| x.to_bits()).collect()
    };
    let out = super::ranks::on_threads(devices[..2].iter().collect(), |r, d| {
        let bn = BatchNormConfig::new(3).init::<B<I>>(d);
        let mut bn = mark_distributed::<B<I>, _>(bn).expect("marking");
        let scope = join::<I>(d);
        let (mut before, mut synced) = (Vec::new(), Vec::new());
        for k in 0..1 + r {
            before.push(bits(&bn.valid()));
            bn = sync_buffers::<B<I>, _>(bn, BufferSync::Broadcast).expect("syncing buffers");
            synced.push(bits(&bn.valid()));
            let (x, _) = synthetic_batch::<B<I>>(r * 10 + k, (0, 4), 15, 1, d);
            let x = x.reshape([4, 3, 5]) * (r as f32 + 1.0);
            let loss = (bn.forward(x) - 0.5).powf_scalar(2.0).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &bn);
            bn = SgdConfig::new().init::<B<I>, _>().step(0.1, bn, grads);
        }
        let own = bits(&bn.valid());
        let (bn, report) = scope
            .finish_model::<B<I>, _>(bn)
            .expect("finishing the scope");
        let params: Vec<f32> = [bn.gamma.val(), bn.beta.val()]
            .into_iter()
            .flat_map(|t| t.into_data().to_vec::<f32>().unwrap())
            .collect();
        (before, synced, own, bits(&bn.valid()), params, report)
    });
    let (rank0, rank1) = (&out[0], &out[1]);
    assert_eq!(rank0.5.shadowed_steps, 1);
    assert_ne!(rank0.2, rank1.0[1], "the ranks' own statistics differ");
    assert_eq!(rank1.1[1], rank0.2, "step 1: rank 0's latest statistics");
    assert_eq!(rank0.3, rank1.3, "statistics at the end");
    assert_eq!(rank0.4, rank1.4, "parameters at the end");
}

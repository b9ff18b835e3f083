//! A model with a `SyncBatchNorm`, trained data-parallel against one rank on the concatenated
//! batch, on any inner backend.

use burn_autodiff::Autodiff;
use burn_backend::Backend;
use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_core::module::AutodiffModule;
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, SyncBatchNorm, SyncBatchNormConfig,
    mark_distributed,
};
use collective_fusion::train::{module_weights, synthetic_batch};

type B<I> = Autodiff<Collective<I>>;
/// A linear layer, a synchronized norm, a linear head.
type Net<I> = (Linear<B<I>>, SyncBatchNorm<B<I>>, Linear<B<I>>);

const WIDTH: usize = 6;
const OUTPUTS: usize = 3;
const ROWS: usize = 3;
const STEPS: usize = 4;

fn net<I: Backend>(d: &CollectiveDevice<I::Device>) -> Net<I> {
    <B<I> as Backend>::seed(d, 11);
    let net: Net<I> = (
        LinearConfig::new(WIDTH, WIDTH).init(d),
        SyncBatchNormConfig::new(WIDTH).init(d),
        LinearConfig::new(WIDTH, OUTPUTS).init(d),
    );
    let _ = module_weights::<B<I>, Net<I>>(&net);
    net
}

/// Trains `net` on rows `rows` of each step's batch; its weights and running statistics.
fn train<I: Backend>(
    mut net: Net<I>,
    rows: (usize, usize),
    d: &CollectiveDevice<I::Device>,
    distributed: bool,
) -> Vec<f32> {
    let mut sgd = SgdConfig::new().init::<B<I>, Net<I>>();
    for step in 0..STEPS {
        if distributed {
            net = mark_distributed::<B<I>, Net<I>>(net).expect("marking the model");
        }
        let (x, y) = synthetic_batch::<B<I>>(step, rows, WIDTH, OUTPUTS, d);
        let h = net.1.forward(net.0.forward(x));
        let out = net.2.forward(burn_core::tensor::activation::relu(h));
        let loss = MseLoss::new().forward(out, y, Reduction::Mean);
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        net = sgd.step(0.2, net, grads);
    }
    // Burn keeps a thread's last statistics update aside until its next forward pass: fold it
    // in, so that the weights compared include it.
    drop(net.valid());
    module_weights::<B<I>, Net<I>>(&net)
}

/// Trains the model on one rank over every rank's rows (no server running: the norm's
/// statistics are the rank's own), then on `devices` (a server started with `options`, the
/// gradient sync's mean), and asserts that the ranks end alike and where the one rank ended,
/// within `rel`.
pub fn assert_trains_as_one_rank<I: Backend>(
    devices: &[CollectiveDevice<I::Device>],
    options: CollectiveOptions,
    rel: f64,
) {
    let d = &devices[0];
    let one = train::<I>(net::<I>(d), (0, devices.len() * ROWS), d, false);
    let initial = module_weights::<B<I>, Net<I>>(&net::<I>(d));
    super::ranks::start_server::<I>(devices, options, ReduceOperation::Mean);
    // Each rank with statistics of its own: `fork` alone shares each norm's `RunningState`
    // between the ranks, whose final value then depends on when each thread folds its update in.
    let ranks = super::ranks::forked_per_rank::<B<I>, _, _>(devices, &net::<I>(d), |m, d, r| {
        let own = Net::<I>::from_inner(m.valid());
        train::<I>(own, (r * ROWS, (r + 1) * ROWS), d, true)
    });
    Collective::<I>::close_communication_server(d);
    assert_eq!(ranks[0], ranks[1], "the ranks diverged");
    super::ranks::assert_ends_as_one_rank(&ranks[0], &one, &initial, rel, 1e-3);
}

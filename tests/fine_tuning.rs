//! Fine-tuning as users write it: a layer frozen (`Param::set_require_grad(false)`) for the
//! first steps and then trained, so the steps' gradient lists change mid-run, on two ranks of
//! an f32 and of an f64 NdArray, and of Flex (Burn 0.21's other CPU backend). The ranks end as
//! one rank on the concatenated batch, the frozen layer is left alone while frozen, and both
//! lists get a plan their steps follow.

mod common;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_flex::{Flex, FlexDevice};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, mark_distributed, sync_stats,
};
use collective_fusion::train::{module_weights, synthetic_batch};

/// Sessions are per backend type, and two tests' backends are NdArray: one test at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const STEPS: usize = 8;
/// The middle layer is frozen for the steps before this one.
const FROZEN_UNTIL: usize = 4;
const ROWS: usize = 3;
const WIDTH: usize = 8;

/// The test on inner backend `$inner`, its ranks on `$device`: `$name`.
macro_rules! fine_tuning_test {
    ($name:ident, $inner:ty, $device:expr) => {
        #[test]
        fn $name() {
            type I = $inner;
            type Dev = CollectiveDevice<<I as burn_backend::BackendTypes>::Device>;
            type B = Autodiff<Collective<I>>;
            type Net = Vec<Linear<B>>;
            fn init(d: &Dev) -> Net {
                <B as burn_backend::Backend>::seed(d, 5);
                let net: Net = (0..3)
                    .map(|_| LinearConfig::new(WIDTH, WIDTH).init(d))
                    .collect();
                let _ = module_weights::<B, Net>(&net);
                net
            }
            /// Trains `STEPS` steps on `rows` of the synthetic data; the weights after step
            /// `FROZEN_UNTIL - 1` and at the end.
            fn train(mut net: Net, rows: (usize, usize), d: &Dev, marked: bool) -> [Vec<f32>; 2] {
                let mut sgd = SgdConfig::new().init::<B, Net>();
                let mut frozen_end = Vec::new();
                for step in 0..STEPS {
                    let on = step >= FROZEN_UNTIL;
                    let l = net[1].clone();
                    net[1] = Linear {
                        weight: l.weight.set_require_grad(on),
                        bias: l.bias.map(|b| b.set_require_grad(on)),
                    };
                    if marked {
                        net = mark_distributed::<B, Net>(net).expect("marking the model");
                    }
                    let (x, y) = synthetic_batch::<B>(step, rows, WIDTH, WIDTH, d);
                    let out = net
                        .iter()
                        .fold(x, |h, l| burn_core::tensor::activation::relu(l.forward(h)));
                    let loss = MseLoss::new().forward(out, y, Reduction::Mean);
                    let grads = GradientsParams::from_grads(loss.backward(), &net);
                    net = sgd.step(0.1, net, grads);
                    if step + 1 == FROZEN_UNTIL {
                        frozen_end = module_weights::<B, Net>(&net);
                    }
                }
                [frozen_end, module_weights::<B, Net>(&net)]
            }
            let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
            let devices: Vec<Dev> = (0..2).map(|r| CollectiveDevice::new($device, r)).collect();
            let options = CollectiveOptions {
                timeout: std::time::Duration::from_secs(60),
                ..CollectiveOptions::default()
            };
            common::ranks::start_server::<I>(&devices, options, ReduceOperation::Mean);
            let start = init(&devices[0]);
            let ranks = common::ranks::forked_per_rank::<B, _, _>(&devices, &start, |m, d, r| {
                train(m, (r * ROWS, (r + 1) * ROWS), d, true)
            });
            let st = sync_stats::<I>(0);
            Collective::<I>::close_communication_server(&devices[0]);
            assert_eq!(ranks[0], ranks[1], "the ranks diverged");
            // Two lists, each compiled once; every step after each list's first follows a plan.
            assert_eq!((st.compiled, st.flushed_steps), (2, 2), "{st:?}");
            assert_eq!(st.eager_steps + st.held_steps, STEPS as u64 - 2, "{st:?}");
            // Those steps (three of 4 gradients, three of 6, one bucket each) copied every
            // gradient into its bucket from the CPU backend's own memory, and so did step
            // `FROZEN_UNTIL` with the last layer's two, which arrive first, before it left the
            // plan of the frozen steps (its bucket then given back and reduced at its sync
            // point with the rest).
            assert_eq!(st.gradients_read_into_buckets, 3 * 4 + 3 * 6 + 2, "{st:?}");
            let d = CollectiveDevice::new($device, 0);
            let one = train(init(&d), (0, 2 * ROWS), &d, false);
            let initial = module_weights::<B, Net>(&init(&d));
            common::ranks::assert_ends_as_one_rank(&ranks[0][1], &one[1], &initial, 1e-4, 1e-3);
            // While frozen, the middle layer (weights after the first layer's) kept its values.
            let first = WIDTH * WIDTH + WIDTH;
            let middle = first..2 * first;
            assert_eq!(
                ranks[0][0][middle.clone()],
                initial[middle],
                "the frozen layer moved"
            );
        }
    };
}

fine_tuning_test!(
    a_layer_frozen_then_trained_on_f32_ranks_ends_as_one_rank,
    NdArray<f32>,
    NdArrayDevice::Cpu
);
fine_tuning_test!(
    a_layer_frozen_then_trained_on_f64_ranks_ends_as_one_rank,
    NdArray<f64>,
    NdArrayDevice::Cpu
);
fine_tuning_test!(
    a_layer_frozen_then_trained_on_flex_ranks_ends_as_one_rank,
    Flex,
    FlexDevice
);

//! `Autodiff<Collective<NdArray>>` trains burn-nn modules data-parallel on 4 CPU ranks in one
//! process; the weights equal one-rank training on the concatenated batch, and bucketed sync
//! equals per-parameter sync bit for bit.

use std::sync::Mutex;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::module::{AutodiffModule, Module};
use burn_core::tensor::{Tensor, TensorData};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::conv::{Conv2d, Conv2dConfig};
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig, PaddingConfig2d};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, MeasuredPlans, SingleRank, SyncStats,
    UnusedParameters, executed_step_order, expected_plan, hook_times, last_zero_filled,
    mark_distributed, measured_link, measured_step, no_sync, recorded_collectives,
    recorded_step_graph, sync_stats,
};
use collective_fusion::config::{BucketConfig, BucketPolicy, CompileConfig};
use collective_fusion::cost::CostModel;
use collective_fusion::graph::print::print;
use collective_fusion::graph::{Op, ReduceOp, TensorType};
use collective_fusion::measure::{LinkFit, MeasuredProfile};
use collective_fusion::passes::compile;
use collective_fusion::train::{module_weights, synthetic_batch};

type Inner = Collective<NdArray>;
type B = Autodiff<Inner>;
type Dev = CollectiveDevice<NdArrayDevice>;

/// Sessions are per backend type: tests that start one run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const WORLD: u32 = 4;
const ROWS_PER_RANK: usize = 4;
const INPUTS: usize = 36; // a 6×6 single-channel image for the conv net
const OUTPUTS: usize = 4;
const STEPS: usize = 5;

fn device(rank: u32) -> Dev {
    CollectiveDevice::new(NdArrayDevice::Cpu, rank)
}

/// A model the harness trains.
trait Net: AutodiffModule<B> + Clone + Send + 'static {
    fn init(d: &Dev) -> Self;
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2>;
}

type Mlp = Vec<Linear<B>>;

impl Net for Mlp {
    fn init(d: &Dev) -> Self {
        [INPUTS, 32, 16, OUTPUTS]
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(d))
            .collect()
    }
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mut h = x;
        for (i, l) in self.iter().enumerate() {
            h = l.forward(h);
            if i + 1 < self.len() {
                h = burn_core::tensor::activation::relu(h);
            }
        }
        h
    }
}

type ConvNet = (Conv2d<B>, Conv2d<B>, Linear<B>);

impl Net for ConvNet {
    fn init(d: &Dev) -> Self {
        (
            Conv2dConfig::new([1, 4], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(d),
            Conv2dConfig::new([4, 4], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(d),
            LinearConfig::new(4 * INPUTS, OUTPUTS).init(d),
        )
    }
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let n = x.dims()[0];
        let h = x.reshape([n, 1, 6, 6]);
        let h = burn_core::tensor::activation::relu(self.0.forward(h));
        let h = burn_core::tensor::activation::relu(self.1.forward(h));
        self.2.forward(h.reshape([n, 4 * INPUTS]))
    }
}

fn weights<M: Module<B>>(model: &M) -> Vec<f32> {
    module_weights::<B, M>(model)
}

fn init_model<M: Net>() -> M {
    let d = device(0);
    <B as burn_backend::Backend>::seed(&d, 42);
    let model = M::init(&d);
    // Parameters initialize lazily; materialize them now, under this seed, before any copy.
    let _ = weights(&model);
    model
}

/// Rows `[from, to)` of step `step`'s global batch, deterministic.
fn batch(step: usize, from: usize, to: usize, dev: &Dev) -> (Tensor<B, 2>, Tensor<B, 2>) {
    synthetic_batch::<B>(step, (from, to), INPUTS, OUTPUTS, dev)
}

fn train<M: Net>(mut model: M, rows: (usize, usize), dev: &Dev) -> M {
    let mut optim = SgdConfig::new().init::<B, M>();
    for step in 0..STEPS {
        let (x, y) = batch(step, rows.0, rows.1, dev);
        let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(0.05, model, grads);
    }
    model
}

/// Trains on `WORLD` ranks (one thread each) and returns every rank's final weights.
fn train_data_parallel<M: Net>(policy: BucketPolicy) -> Vec<Vec<f32>> {
    train_data_parallel_inspect::<M>(policy, |_| {})
}

/// The compiler options of these tests: `policy` with small caps, so that these small models
/// form several buckets.
fn small_buckets(policy: BucketPolicy) -> CompileConfig {
    CompileConfig {
        bucket: BucketConfig {
            policy,
            cap_bytes: 1024,
            first_bucket_bytes: 256,
        },
        ..CompileConfig::default()
    }
}

/// [`train_data_parallel`], calling `inspect` while the communication server still runs.
fn train_data_parallel_inspect<M: Net>(
    policy: BucketPolicy,
    inspect: impl FnOnce(&[Vec<f32>]),
) -> Vec<Vec<f32>> {
    train_data_parallel_with::<M>(small_buckets(policy), inspect)
}

/// [`train_data_parallel_inspect`] under `config`.
fn train_data_parallel_with<M: Net>(
    config: CompileConfig,
    inspect: impl FnOnce(&[Vec<f32>]),
) -> Vec<Vec<f32>> {
    let devices: Vec<_> = (0..WORLD).map(device).collect();
    CollectiveOptions {
        config: CompileConfig {
            verify: true,
            ..config
        },
        timeout: std::time::Duration::from_secs(30),
        ..CollectiveOptions::default()
    }
    .install::<NdArray>();
    Inner::start_communication_server(
        &devices,
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    let init: M = init_model();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .map(|d| {
                let model = init.clone().fork(d);
                s.spawn(move || {
                    let model = mark_distributed::<B, M>(model).expect("marking the model");
                    let r = d.rank as usize;
                    weights(&train(
                        model,
                        (r * ROWS_PER_RANK, (r + 1) * ROWS_PER_RANK),
                        d,
                    ))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    // The first step compiled and ran at the sync point; every later step followed its plan,
    // launching buckets during backward.
    for (r, trained) in out.iter().enumerate() {
        let stats = sync_stats::<NdArray>(r);
        assert_eq!(
            stats,
            SyncStats {
                eager_steps: STEPS as u64 - 1,
                flushed_steps: 1,
                held_steps: 0,
                local_steps: 0,
                compiled: 1,
                zero_filled: 0,
                device_buckets: 0,
                device_collectives: 0,
                view_grads: 0,
                measured_plans: 0,
                replans: 0,
                host_bucket_bytes: stats.host_bucket_bytes,
                host_bucket_allocations: stats.host_bucket_allocations,
                gradients_read_into_buckets: stats.gradients_read_into_buckets,
            },
            "rank {r}"
        );
        // What the sync keeps between steps: its buckets, at most one copy of the gradients
        // (f32, as many as the weights) and their alignment padding.
        let grads = trained.len() as u64 * 4;
        assert!(
            stats.host_bucket_bytes <= grads + grads / 10,
            "rank {r} keeps {} bytes of buckets for {grads} bytes of gradients",
            stats.host_bucket_bytes
        );
    }
    inspect(&out);
    Inner::close_communication_server(&devices[0]);
    out
}

fn equals_one_rank_on_the_concatenated_batch<M: Net>() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ranks = train_data_parallel::<M>(BucketPolicy::Ddp);
    for (r, w) in ranks.iter().enumerate().skip(1) {
        assert_eq!(w, &ranks[0], "rank {r} diverged from rank 0");
    }
    // Reference: one rank, the whole batch, no communication.
    let reference = weights(&train(
        init_model::<M>(),
        (0, WORLD as usize * ROWS_PER_RANK),
        &device(0),
    ));
    let initial = weights(&init_model::<M>());
    assert_eq!(ranks[0].len(), reference.len());
    let mut moved = 0.0f64;
    for (i, (a, b)) in ranks[0].iter().zip(&reference).enumerate() {
        let (a, b) = (f64::from(*a), f64::from(*b));
        assert!(
            (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1e-3),
            "weight {i}: {a} vs {b}"
        );
        moved += (b - f64::from(initial[i])).abs();
    }
    assert!(moved > 1e-3, "training did not move the weights");
}

fn bucketed_equals_per_parameter<M: Net>() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let bucketed = train_data_parallel::<M>(BucketPolicy::Ddp);
    let per_param = train_data_parallel::<M>(BucketPolicy::PerParam);
    assert!(!bucketed[0].is_empty());
    for (a, b) in bucketed[0].iter().zip(&per_param[0]) {
        assert_eq!(a.to_bits(), b.to_bits());
    }
}

#[test]
fn mlp_on_four_ranks_equals_one_rank_on_the_concatenated_batch() {
    equals_one_rank_on_the_concatenated_batch::<Mlp>();
}

#[test]
fn conv_net_on_four_ranks_equals_one_rank_on_the_concatenated_batch() {
    equals_one_rank_on_the_concatenated_batch::<ConvNet>();
}

#[test]
fn mlp_bucketed_sync_equals_per_parameter_sync_bitwise() {
    bucketed_equals_per_parameter::<Mlp>();
}

#[test]
fn conv_net_bucketed_sync_equals_per_parameter_sync_bitwise() {
    bucketed_equals_per_parameter::<ConvNet>();
}

/// Parameter ids are random per run: names them `param0, param1, ..` by first appearance.
fn by_first_appearance(text: &str) -> String {
    let mut ids: Vec<String> = Vec::new();
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("param.") {
        out.push_str(&rest[..at]);
        let digits: String = rest[at + 6..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        let k = ids.iter().position(|d| *d == digits).unwrap_or_else(|| {
            ids.push(digits.clone());
            ids.len() - 1
        });
        out.push_str(&format!("param{k}"));
        rest = &rest[at + 6 + digits.len()..];
    }
    out.push_str(rest);
    out
}

/// The whole recorded step, forward and backward ops included, compiled: every gradient is the
/// result of the op that computed it, and the compiler buckets and schedules the step's syncs
/// among them.
#[test]
fn the_optimized_graph_of_a_recorded_training_step_is_stable() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    train_data_parallel_inspect::<Mlp>(BucketPolicy::Ddp, |_| {
        let mut g = recorded_step_graph::<NdArray>(0).expect("a recorded step");
        let computes = g
            .node_ids()
            .filter(|n| matches!(g.op(*n), Op::Compute { .. }))
            .count();
        assert!(
            computes > 20,
            "forward, backward and optimizer ops recorded: {computes}"
        );
        let text = print(&g);
        assert!(
            !text.contains(".grad\""),
            "every gradient comes from a recorded op:\n{text}"
        );
        assert!(text.contains("\"linear\" kind=matmul"), "{text}");
        compile(
            &mut g,
            &CompileConfig {
                verify: true,
                ..small_buckets(BucketPolicy::Ddp)
            },
        )
        .expect("the recorded step compiles");
        insta::assert_snapshot!(by_first_appearance(&print(&g)));
    });
}

/// The lazy queue runs a recorded step in the order `hoist-producers` gives its graph: each
/// gradient's producers first, the ops it does not read (a layer's input gradient) after. The
/// weights are those of program order, bit for bit.
#[test]
fn the_queue_runs_each_gradients_producers_first_as_the_pass_orders_them() {
    use collective_fusion::passes::Pass;
    use collective_fusion::passes::hoist_producers::HoistProducers;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let config = small_buckets(BucketPolicy::Ddp);
    let bound = config.hoist_bytes;
    assert!(bound > 0, "on by default");
    let hoisted = train_data_parallel_with::<Mlp>(config.clone(), |_| {
        for r in 0..WORLD as usize {
            let mut g = recorded_step_graph::<NdArray>(r).expect("a recorded step");
            let ran = executed_step_order::<NdArray>(r).expect("a recorded step");
            let compute = |g: &collective_fusion::graph::Graph| -> Vec<_> {
                g.topo_order()
                    .unwrap()
                    .into_iter()
                    .filter(|n| matches!(g.op(*n), Op::Compute { .. }))
                    .collect()
            };
            let recorded = compute(&g);
            let changed = HoistProducers {
                max_deferred_bytes: bound,
            }
            .run(&mut g)
            .unwrap();
            assert!(changed, "rank {r}: a layer's input gradient moves");
            let ran_set: std::collections::HashSet<usize> = ran.iter().copied().collect();
            let planned: Vec<usize> = compute(&g)
                .into_iter()
                .map(|n| recorded.iter().position(|m| *m == n).unwrap())
                .filter(|i| ran_set.contains(i))
                .collect();
            assert_eq!(ran, planned, "rank {r}: the queue ran the pass's order");
            let mut in_order = ran.clone();
            in_order.sort_unstable();
            assert_ne!(ran, in_order, "rank {r}: not program order");
        }
    });
    let in_order = train_data_parallel_with::<Mlp>(
        CompileConfig {
            hoist_bytes: 0,
            ..config
        },
        |_| {
            let ran = executed_step_order::<NdArray>(0).expect("a recorded step");
            assert!(ran.windows(2).all(|w| w[0] < w[1]), "{ran:?}");
        },
    );
    assert_eq!(hoisted, in_order, "the same weights, bit for bit");
}

#[test]
fn the_optimized_sync_of_a_recorded_mlp_step_is_stable() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    train_data_parallel_inspect::<Mlp>(BucketPolicy::Ddp, |_| {
        let (plan, graph) = expected_plan::<NdArray>(0).expect("a plan after the first step");
        assert!(
            plan.collectives.len() > 1,
            "small caps form several buckets"
        );
        let out = by_first_appearance(&format!("{graph}\n{plan}"));
        let out = out.replace(&format!("{:016x}", plan.graph_hash), "<hash>");
        insta::assert_snapshot!(out);
    });
}

#[test]
fn tensor_all_reduce_sums_across_ranks_and_its_backward_all_reduces_the_gradient() {
    use collective_fusion::backend::{DistributedContext, all_reduce};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..WORLD).map(device).collect();
    let ctx = DistributedContext::<Inner>::start(&devices, ReduceOperation::Sum);
    let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .map(|d| {
                let devices = &devices;
                s.spawn(move || {
                    let r = d.rank as f32;
                    let x: Tensor<B, 1> =
                        Tensor::from_data(TensorData::new(vec![r, 2.0 * r, 1.0], [3]), d)
                            .require_grad();
                    let y = all_reduce(x.clone() * 3.0, ReduceOperation::Sum, devices).resolve();
                    let grads = y.clone().sum().backward();
                    let gx = x.grad(&grads).unwrap();
                    (
                        y.into_data().to_vec::<f32>().unwrap(),
                        gx.into_data().to_vec::<f32>().unwrap(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(ctx);
    // Σ 3·[r, 2r, 1] over r = 0..4 = [18, 36, 12]; d(Σ y)/dx = 3 · all_reduce(ones) = 3 · 4.
    for (r, (y, gx)) in results.iter().enumerate() {
        assert_eq!(y, &vec![18.0, 36.0, 12.0], "rank {r}");
        assert_eq!(gx, &vec![12.0, 12.0, 12.0], "rank {r}");
    }
}

/// Runs `step` once on every rank's thread with its own copy of an MLP (marked distributed);
/// returns each rank's outcome, a panic as its message.
fn one_step_on_every_rank(
    devices: &[Dev],
    step: impl Fn(&Dev, Mlp) + Sync,
) -> Vec<Result<(), String>> {
    let init: Mlp = init_model();
    std::thread::scope(|s| {
        let step = &step;
        let hs: Vec<_> = devices
            .iter()
            .map(|d| {
                let model = init.clone().fork(d);
                // Marking is collective: each rank marks on its own thread.
                s.spawn(move || {
                    let model = mark_distributed::<B, Mlp>(model).expect("marking the model");
                    step(d, model)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().map_err(|p| {
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                })
            })
            .collect()
    })
}

#[test]
fn a_nan_gradient_fails_every_rank_naming_the_parameter_without_hanging() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..WORLD).map(device).collect();
    CollectiveOptions {
        timeout: std::time::Duration::from_secs(30),
        check_finite: true,
        ..CollectiveOptions::default()
    }
    .install::<NdArray>();
    Inner::start_communication_server(
        &devices,
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    let t0 = std::time::Instant::now();
    let outcomes = one_step_on_every_rank(&devices, |d, model| {
        let (mut x, y) = batch(0, 0, ROWS_PER_RANK, d);
        if d.rank == 2 {
            x = x.mul_scalar(f32::NAN);
        }
        let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
        let _ = loss.backward();
    });
    let waited = t0.elapsed();
    Inner::close_communication_server(&devices[0]);
    assert!(
        waited < std::time::Duration::from_secs(10),
        "took {waited:?}"
    );
    for (r, o) in outcomes.iter().enumerate() {
        let msg = o.as_ref().expect_err("every rank fails");
        assert!(
            msg.contains("0.weight") && msg.contains("NaN"),
            "rank {r}: {msg}"
        );
        if r == 2 {
            assert!(
                msg.starts_with("collective-fusion: rank 2: the gradient of 0.weight"),
                "{msg}"
            );
        } else {
            assert!(
                msg.contains("aborted") && msg.contains("rank 2"),
                "rank {r}: {msg}"
            );
        }
    }
}

/// One step on `WORLD` ranks under a server with `timeout`, in which rank 1 stops after its
/// forward pass (`panics`: with a panic; else its thread returns); each rank's outcome and how
/// long the step took.
fn rank_one_stops_mid_step(
    timeout: std::time::Duration,
    panics: bool,
) -> (Vec<Result<(), String>>, std::time::Duration) {
    let devices: Vec<_> = (0..WORLD).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            timeout,
            ..CollectiveOptions::default()
        },
        ReduceOperation::Mean,
    );
    let t0 = std::time::Instant::now();
    let outcomes = one_step_on_every_rank(&devices, |d, model| {
        let (x, y) = batch(0, 0, ROWS_PER_RANK, d);
        let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
        if d.rank == 1 {
            assert!(!panics, "rank 1 died in the middle of the step");
            return;
        }
        let _ = loss.backward();
    });
    let waited = t0.elapsed();
    Inner::close_communication_server(&devices[0]);
    (outcomes, waited)
}

/// A rank that leaves the step without its collectives (its thread returns early, as a loop
/// that runs out of data on one rank does): the others wait for it until their timeout, which
/// names it and says that no thread works for it any more.
#[test]
fn a_rank_that_leaves_mid_step_is_a_timeout_on_the_others_naming_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (outcomes, waited) = rank_one_stops_mid_step(std::time::Duration::from_millis(500), false);
    assert!(
        waited < std::time::Duration::from_secs(5),
        "took {waited:?}"
    );
    assert!(outcomes[1].is_ok(), "{:?}", outcomes[1]);
    for (r, o) in outcomes.iter().enumerate().filter(|(r, _)| *r != 1) {
        let msg = o.as_ref().expect_err("the other ranks fail");
        assert!(
            msg.contains("ranks [1] never arrived")
                && msg.contains("no thread works for rank(s) [1] any more"),
            "rank {r} names the missing rank: {msg}"
        );
    }
}

/// A rank whose thread panics mid-step (a bug in the user's code on one rank): every other
/// rank fails at once, well before its timeout, naming the rank, where its thread panicked and
/// the panic's message.
#[test]
fn a_rank_whose_thread_panics_fails_the_others_at_once_naming_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (outcomes, waited) = rank_one_stops_mid_step(std::time::Duration::from_secs(60), true);
    assert_eq!(
        outcomes[1].as_ref().expect_err("rank 1 panicked"),
        "rank 1 died in the middle of the step"
    );
    assert_the_others_name_rank_ones_panic(
        &outcomes,
        waited,
        "rank 1 died in the middle of the step",
    );
}

/// Every rank but 1 failed within 10 s (their timeout is 60 s) with an error that names rank
/// 1's panic, where it was (in this file) and its message `panic`.
fn assert_the_others_name_rank_ones_panic(
    outcomes: &[Result<(), String>],
    waited: std::time::Duration,
    panic: &str,
) {
    assert!(
        waited < std::time::Duration::from_secs(10),
        "took {waited:?} (the timeout is 60 s)"
    );
    for (r, o) in outcomes.iter().enumerate().filter(|(r, _)| *r != 1) {
        let msg = o.as_ref().expect_err("the other ranks fail");
        assert!(
            msg.contains("rank 1 aborted the group: its thread panicked at tests/backend.rs:")
                && msg.ends_with(&format!(": {panic}")),
            "rank {r}: {msg}"
        );
    }
}

#[test]
fn a_registered_parameter_whose_gradient_never_arrives_is_named() {
    use burn_backend::distributed::{DistributedParamId, DistributedParams, TensorRef};
    use burn_backend::ops::FloatTensorOps;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device(0);
    start_server(
        std::slice::from_ref(&d),
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(5),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Mean,
    );
    let params = |id: u64| DistributedParams {
        param_id: DistributedParamId::from(id),
    };
    let outcome = std::panic::catch_unwind(|| {
        let mut grad = Inner::float_from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &d);
        Inner::register_sync_parameters(&d, vec![params(11), params(22)]);
        Inner::submit_gradient_sync(TensorRef(&mut grad), params(11));
        Inner::submit_sync_collective(&d);
    });
    Inner::close_communication_server(&d);
    let err = outcome.expect_err("the sync fails");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("1 registered parameter(s) never arrived") && msg.contains("param.22"),
        "{msg}"
    );
    assert!(!msg.contains("param.11"), "{msg}");
}

/// Threads that outlive a server (a pool that trains again under a new one): a panic under
/// the second server still fails its other ranks at once.
#[test]
fn a_rank_thread_that_panics_under_a_second_server_fails_the_others_at_once() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..WORLD).map(device).collect();
    let options = || CollectiveOptions {
        timeout: std::time::Duration::from_secs(60),
        ..CollectiveOptions::default()
    };
    start_server(&devices, options(), ReduceOperation::Mean);
    let rounds = std::sync::Barrier::new(WORLD as usize + 1);
    let step = |d: &Dev, fail: bool| {
        let model = mark_distributed::<B, Mlp>(init_model::<Mlp>().fork(d)).expect("marking");
        let (x, y) = batch(0, 0, ROWS_PER_RANK, d);
        let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
        assert!(!fail, "rank 1 failed under the second server");
        let _ = loss.backward();
    };
    let t0 = std::cell::Cell::new(None);
    let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = devices
            .iter()
            .map(|d| {
                let (rounds, step) = (&rounds, &step);
                s.spawn(move || {
                    step(d, false);
                    rounds.wait();
                    rounds.wait();
                    step(d, d.rank == 1);
                })
            })
            .collect();
        rounds.wait();
        Inner::close_communication_server(&devices[0]);
        start_server(&devices, options(), ReduceOperation::Mean);
        t0.set(Some(std::time::Instant::now()));
        rounds.wait();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .map_err(|p| p.downcast_ref::<String>().cloned().unwrap_or_default())
            })
            .collect()
    });
    let waited = t0.get().expect("the second round started").elapsed();
    Inner::close_communication_server(&devices[0]);
    assert_the_others_name_rank_ones_panic(
        &outcomes,
        waited,
        "rank 1 failed under the second server",
    );
}

/// A rank that calls a hook after the server closed (a program that closed it while a rank
/// still trained) is told that it was closed, not that it was never started.
#[test]
fn a_hook_called_after_the_server_closed_says_so() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device(0);
    start_server(
        std::slice::from_ref(&d),
        CollectiveOptions::default(),
        ReduceOperation::Mean,
    );
    Inner::close_communication_server(&d);
    let outcome = std::panic::catch_unwind(|| Inner::submit_sync_collective(&d));
    let err = outcome.expect_err("no server is running");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("submit_sync_collective after close_communication_server"),
        "{msg}"
    );
}

/// Runs `f` once on every rank's thread; returns each rank's outcome, a panic as its message.
fn on_every_rank<T: Send>(devices: &[Dev], f: impl Fn(&Dev) -> T + Sync) -> Vec<Result<T, String>> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = devices.iter().map(|d| s.spawn(move || f(d))).collect();
        hs.into_iter()
            .map(|h| {
                h.join().map_err(|p| {
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                })
            })
            .collect()
    })
}

fn start_server(devices: &[Dev], options: CollectiveOptions, op: ReduceOperation) {
    options.install::<NdArray>();
    Inner::start_communication_server(devices, DistributedConfig { all_reduce_op: op });
}

/// One step of Burn's hooks on a rank: registers `registered`, submits `(id, values)` in order,
/// syncs, and returns the gradients as written back (a failed step panics with its message).
fn hook_step(d: &Dev, registered: &[u64], grads: &[(u64, Vec<f32>)]) -> Vec<Vec<f32>> {
    use burn_backend::distributed::{DistributedParamId, DistributedParams};
    Inner::register_sync_parameters(
        d,
        registered
            .iter()
            .map(|id| DistributedParams {
                param_id: DistributedParamId::from(*id),
            })
            .collect(),
    );
    match hook_step_outcome(d, grads) {
        (Ok(()), values) => values,
        (Err(msg), _) => std::panic::panic_any(msg),
    }
}

#[test]
fn zero_fill_reduces_a_parameter_some_ranks_lack_and_drops_one_no_rank_uses() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..WORLD).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(30),
            unused: UnusedParameters::ZeroFill,
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    // Per step, the ranks that have a gradient of parameter 2 (parameter 1: every rank;
    // parameter 3: registered, never any gradient).
    let has_p2: [&[u32]; 5] = [&[0, 1], &[0], &[], &[3], &[1, 3]];
    let outcomes = on_every_rank(&devices, |d| {
        let r = d.rank;
        let mut seen = Vec::new();
        for (step, ranks) in has_p2.iter().enumerate() {
            let mut grads = vec![(1, vec![(r + 1) as f32; 3])];
            if ranks.contains(&r) {
                grads.push((2, vec![10.0 * (r + 1) as f32 + step as f32]));
            }
            let out = hook_step(d, &[1, 2, 3], &grads);
            let slots = expected_plan::<NdArray>(r as usize)
                .map(|(p, _)| p.slots.iter().map(|s| s.param.clone()).collect::<Vec<_>>())
                .unwrap_or_default();
            seen.push((out, last_zero_filled::<NdArray>(r as usize), slots));
        }
        (seen, sync_stats::<NdArray>(r as usize))
    });
    Inner::close_communication_server(&devices[0]);
    for (r, o) in outcomes.into_iter().enumerate() {
        let (seen, stats) = o.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let mut zero_filled = 0;
        for (step, (out, zeroed, next_slots)) in seen.into_iter().enumerate() {
            let ranks = has_p2[step];
            assert_eq!(out[0], vec![10.0; 3], "rank {r} step {step}: parameter 1");
            let p2: f32 = ranks
                .iter()
                .map(|q| 10.0 * (q + 1) as f32 + step as f32)
                .sum();
            if ranks.contains(&(r as u32)) {
                assert_eq!(out[1], vec![p2], "rank {r} step {step}: parameter 2");
            }
            // A rank without parameter 2's gradient zero-fills it (at step 2 every rank does);
            // parameter 3, which no rank ever had a gradient of, is never filled.
            let filled = !ranks.contains(&(r as u32));
            assert_eq!(
                zeroed,
                if filled {
                    vec!["param.2".to_string()]
                } else {
                    vec![]
                },
                "rank {r} step {step}"
            );
            zero_filled += u64::from(filled);
            // Zero-filled on every rank at step 2: the next plan drops it; rank 3 brings it back.
            let want: &[&str] = if step == 2 {
                &["param.1"]
            } else {
                &["param.1", "param.2"]
            };
            assert_eq!(next_slots, want, "rank {r} plan after step {step}");
        }
        assert_eq!(stats.zero_filled, zero_filled, "rank {r}");
    }
}

#[test]
fn without_zero_fill_ranks_with_different_parameters_fail_together_naming_the_difference() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..2).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(30),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    let t0 = std::time::Instant::now();
    let outcomes = on_every_rank(&devices, |d| {
        let mut grads = vec![(1, vec![1.0; 4])];
        if d.rank == 0 {
            grads.push((2, vec![1.0; 8]));
        }
        hook_step(d, &[], &grads)
    });
    let waited = t0.elapsed();
    Inner::close_communication_server(&devices[0]);
    assert!(
        waited < std::time::Duration::from_secs(10),
        "took {waited:?}"
    );
    for (r, o) in outcomes.iter().enumerate() {
        let msg = o.as_ref().expect_err("every rank fails");
        assert!(
            msg.contains("mismatch") || msg.contains("differ"),
            "rank {r}: {msg}"
        );
    }
}

#[test]
fn no_sync_accumulates_micro_batches_and_the_next_backward_reduces_their_sum() {
    const MICRO: usize = 3;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..WORLD).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(30),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    let init: Mlp = init_model();
    let lr = 0.01;
    let step = |mut model: Mlp, batches: &[(usize, usize)], d: &Dev, distributed: bool| {
        let mut grads = None;
        for (k, rows) in batches.iter().enumerate() {
            if distributed {
                // Burn's autodiff forgets that a parameter is distributed once a backward pass
                // consumed it: mark the model again before each micro-batch.
                model = mark_distributed::<B, Mlp>(model).expect("marking the model");
            }
            let (x, y) = batch(0, rows.0, rows.1, d);
            let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Sum);
            if k + 1 < batches.len() {
                let _scope = no_sync::<NdArray>(d);
                let _ = loss.backward();
            } else {
                grads = Some(GradientsParams::from_grads(loss.backward(), &model));
            }
        }
        let mut optim = SgdConfig::new().init::<B, Mlp>();
        weights(&optim.step(lr, model, grads.expect("one batch at least")))
    };
    let outcomes = on_every_rank(&devices, |d| {
        let r = d.rank as usize;
        let rows: Vec<(usize, usize)> = (0..MICRO)
            .map(|k| {
                let start = (k * WORLD as usize + r) * ROWS_PER_RANK;
                (start, start + ROWS_PER_RANK)
            })
            .collect();
        step(init.clone().fork(d), &rows, d, true)
    });
    Inner::close_communication_server(&devices[0]);
    let ranks: Vec<Vec<f32>> = outcomes
        .into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect();
    for (r, w) in ranks.iter().enumerate().skip(1) {
        let differ: Vec<usize> = (0..w.len()).filter(|i| w[*i] != ranks[0][*i]).collect();
        assert!(
            differ.is_empty(),
            "rank {r} diverged from rank 0 at {} of {} weights, first {:?}",
            differ.len(),
            w.len(),
            differ.first()
        );
    }
    // Reference: one rank, every micro-batch of every rank in one batch, one backward.
    let all = (0, MICRO * WORLD as usize * ROWS_PER_RANK);
    let reference = step(init_model::<Mlp>(), &[all], &device(0), false);
    let initial = weights(&init_model::<Mlp>());
    // The updates (gradient times lr) are the same sums over 48 rows added in another order:
    // equal within 1e-5 relative, plus the rounding of the f32 weights they were applied to.
    let mut moved = 0.0f64;
    for (i, (a, b)) in ranks[0].iter().zip(&reference).enumerate() {
        let w0 = f64::from(initial[i]);
        let (a, b) = (f64::from(*a), f64::from(*b));
        let tol = 4.0 * f64::from(f32::EPSILON) * a.abs().max(b.abs()) + 1e-5 * (b - w0).abs();
        assert!((a - b).abs() <= tol, "weight {i}: {a} vs {b} (from {w0})");
        moved += (b - w0).abs();
    }
    assert!(moved > 1e-3, "training did not move the weights");
    // Without the scope's accumulation the last backward alone would be reduced: check that
    // this differs, so the test can tell.
    let last_only = step(
        init_model::<Mlp>(),
        &[(0, WORLD as usize * ROWS_PER_RANK)],
        &device(0),
        false,
    );
    assert_ne!(last_only, reference);
}

#[test]
fn a_gradient_accumulated_under_no_sync_that_the_synced_pass_lacks_is_named() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device(0);
    start_server(
        std::slice::from_ref(&d),
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(5),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    let outcome = std::panic::catch_unwind(|| {
        {
            let _scope = no_sync::<NdArray>(&d);
            let kept = hook_step(&d, &[], &[(1, vec![1.0, 2.0]), (2, vec![3.0])]);
            // Under the scope nothing is reduced: the gradients stay this pass's own.
            assert_eq!(kept, vec![vec![1.0, 2.0], vec![3.0]]);
        }
        hook_step(&d, &[], &[(2, vec![4.0])])
    });
    Inner::close_communication_server(&d);
    let err = outcome.expect_err("the sync fails");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("accumulated under no_sync") && msg.contains("param.1"),
        "{msg}"
    );
    assert!(!msg.contains("param.2"), "{msg}");
}

/// [`hook_step`] that survives the step failing: the step's outcome, and every gradient as the
/// caller's tensors hold it afterwards.
fn hook_step_outcome(d: &Dev, grads: &[(u64, Vec<f32>)]) -> (Result<(), String>, Vec<Vec<f32>>) {
    use burn_backend::distributed::{DistributedParamId, DistributedParams, TensorRef};
    use burn_backend::ops::FloatTensorOps;
    let params = |id: u64| DistributedParams {
        param_id: DistributedParamId::from(id),
    };
    let mut tensors: Vec<_> = grads
        .iter()
        .map(|(_, v)| Inner::float_from_data(TensorData::new(v.clone(), [v.len()]), d))
        .collect();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        for ((id, _), t) in grads.iter().zip(tensors.iter_mut()) {
            Inner::submit_gradient_sync(TensorRef(t), params(*id));
        }
        Inner::submit_sync_collective(d);
    }))
    .map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    });
    let values = tensors
        .into_iter()
        .map(|t| {
            let data = cubecl::future::block_on(Inner::float_into_data(t)).unwrap();
            data.to_vec::<f32>().unwrap()
        })
        .collect();
    (outcome, values)
}

#[test]
fn a_step_that_fails_after_some_buckets_were_reduced_leaves_every_gradient_as_it_was() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..2).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            config: small_buckets(BucketPolicy::PerParam),
            timeout: std::time::Duration::from_secs(10),
            check_finite: true,
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    let t0 = std::time::Instant::now();
    let outcomes = on_every_rank(&devices, |d| {
        let r = d.rank as f32;
        let good = vec![(1, vec![1.0 + r; 4]), (2, vec![10.0 + r; 4])];
        // Step 1 compiles the plan; step 2 follows it, reducing parameter 1 during "backward"
        // before rank 1's parameter 2 turns out to be NaN.
        let (first, _) = hook_step_outcome(d, &good);
        first.expect("the first step succeeds");
        let mut second = good.clone();
        if d.rank == 1 {
            second[1].1[2] = f32::NAN;
        }
        hook_step_outcome(d, &second)
    });
    let waited = t0.elapsed();
    Inner::close_communication_server(&devices[0]);
    assert!(
        waited < std::time::Duration::from_secs(5),
        "took {waited:?}"
    );
    let (outcome0, values0) = outcomes[0].as_ref().expect("rank 0 returns");
    let msg = outcome0.as_ref().expect_err("rank 0 fails too");
    assert!(msg.contains("aborted") && msg.contains("param.2"), "{msg}");
    // Parameter 1's all-reduce was launched during "backward" on both ranks (and usually done:
    // 1 + 2 = 3 would show), yet nothing was written back: both hold what rank 0 submitted.
    assert_eq!(values0, &vec![vec![1.0; 4], vec![10.0; 4]]);
    let (outcome1, values1) = outcomes[1].as_ref().expect("rank 1 returns");
    assert!(outcome1.is_err());
    assert_eq!(values1[0], vec![2.0; 4]);
}

#[test]
fn a_gradient_submitted_twice_in_a_step_is_named() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device(0);
    start_server(
        std::slice::from_ref(&d),
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(5),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    let (outcome, values) = hook_step_outcome(&d, &[(7, vec![1.0]), (7, vec![2.0])]);
    Inner::close_communication_server(&d);
    let msg = outcome.expect_err("the step fails");
    assert!(
        msg.contains("the gradient of param.7 was submitted twice in one step"),
        "{msg}"
    );
    assert_eq!(values, vec![vec![1.0], vec![2.0]]);
}

#[test]
fn a_parameter_whose_shape_differs_across_ranks_fails_every_rank_before_reducing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..2).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(10),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    let t0 = std::time::Instant::now();
    let outcomes = on_every_rank(&devices, |d| {
        let n = if d.rank == 0 { 4 } else { 6 };
        hook_step_outcome(d, &[(3, vec![1.0; n])])
    });
    let waited = t0.elapsed();
    Inner::close_communication_server(&devices[0]);
    assert!(
        waited < std::time::Duration::from_secs(5),
        "took {waited:?}"
    );
    for (r, o) in outcomes.iter().enumerate() {
        let (outcome, values) = o.as_ref().expect("returns");
        let msg = outcome.as_ref().expect_err("every rank fails");
        assert!(
            msg.contains("plans differ") && msg.contains("f32×4") && msg.contains("f32×6"),
            "rank {r}: {msg}"
        );
        assert_eq!(values[0], vec![1.0; if r == 0 { 4 } else { 6 }]);
    }
}

#[test]
fn a_gradient_submitted_after_the_last_sync_point_is_named_when_the_server_closes() {
    use burn_backend::distributed::{DistributedParamId, DistributedParams, TensorRef};
    use burn_backend::ops::FloatTensorOps;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device(0);
    start_server(
        std::slice::from_ref(&d),
        CollectiveOptions {
            timeout: std::time::Duration::from_millis(200),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Sum,
    );
    hook_step(&d, &[], &[(1, vec![1.0])]);
    let mut late = Inner::float_from_data(TensorData::new(vec![5.0f32], [1]), &d);
    Inner::submit_gradient_sync(
        TensorRef(&mut late),
        DistributedParams {
            param_id: DistributedParamId::from(9),
        },
    );
    let t0 = std::time::Instant::now();
    let err = std::panic::catch_unwind(|| Inner::close_communication_server(&d))
        .expect_err("closing reports the lost gradient");
    assert!(t0.elapsed() < std::time::Duration::from_secs(5));
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("after the last sync point") && msg.contains("rank 0: param.9"),
        "{msg}"
    );
}

/// Two ranks whose steps differ only in which parameters are reduced together: the same two
/// equal-size parameters in opposite order (one bucket each side), or different parameters of
/// one size. Before the members were part of the plan agreement, both summed unrelated
/// gradients without a word.
#[test]
fn ranks_that_reduce_different_members_fail_together_naming_them_and_write_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    /// A case: its name, each rank's submission order, the parameters the error must name.
    type Case<'a> = (&'a str, [&'a [u64]; 2], [&'a str; 2]);
    let cases: [Case<'_>; 2] = [
        (
            "opposite order",
            [&[901, 902], &[902, 901]],
            ["param.901", "param.902"],
        ),
        (
            "different parameters",
            [&[903], &[904]],
            ["param.903", "param.904"],
        ),
    ];
    for (case, order, names) in cases {
        let devices: Vec<_> = (0..2).map(device).collect();
        start_server(
            &devices,
            CollectiveOptions {
                timeout: std::time::Duration::from_secs(30),
                ..CollectiveOptions::default()
            },
            ReduceOperation::Sum,
        );
        let outcomes = on_every_rank(&devices, |d| {
            let grads: Vec<(u64, Vec<f32>)> = order[d.rank as usize]
                .iter()
                .map(|id| (*id, vec![*id as f32 + d.rank as f32; 16]))
                .collect();
            let (outcome, values) = hook_step_outcome(d, &grads);
            (outcome, values, grads)
        });
        Inner::close_communication_server(&devices[0]);
        for (r, o) in outcomes.into_iter().enumerate() {
            let (outcome, values, grads) = o.expect("the rank's thread returns");
            let msg = outcome.expect_err(&format!("{case}: rank {r} fails"));
            for n in names {
                assert!(msg.contains(n), "{case}: rank {r} names {n}: {msg}");
            }
            let before: Vec<Vec<f32>> = grads.into_iter().map(|(_, v)| v).collect();
            assert_eq!(values, before, "{case}: rank {r}: nothing written back");
        }
    }
}

/// `mark_distributed` names parameters by their module path, the same in every process that
/// builds the same model, however Burn numbered them.
#[test]
fn marked_parameters_are_named_by_their_module_path() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..1).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions::default(),
        ReduceOperation::Mean,
    );
    // Two models built apart (their `ParamId`s differ), as two processes would.
    let names = |m: Mlp| -> Vec<String> {
        let d = &devices[0];
        let m = mark_distributed::<B, Mlp>(m.fork(d)).expect("marking the model");
        let (x, y) = batch(0, 0, 4, d);
        let loss = MseLoss::new().forward(m.forward(x), y, Reduction::Mean);
        let _ = loss.backward();
        let g = recorded_step_graph::<NdArray>(0).expect("a recorded step");
        let text = print(&g);
        let mut names: Vec<String> = text
            .lines()
            .filter_map(|l| l.split("grad_sync \"").nth(1))
            .map(|rest| rest.split('"').next().unwrap().to_string())
            .collect();
        names.sort();
        names
    };
    let a = names(init_model());
    // A second model, built apart with `ParamId`s of its own: the same names.
    let b = names(init_model());
    Inner::close_communication_server(&devices[0]);
    assert_eq!(a, b, "two builds of one model");
    assert!(!a.is_empty());
    assert!(
        a.iter().all(|n| !n.starts_with("param.")),
        "path names, not ids: {a:?}"
    );
    assert_eq!(
        a,
        [
            "0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"
        ],
        "a Vec of three Linear layers"
    );
    let unique: std::collections::BTreeSet<_> = a.iter().collect();
    assert_eq!(unique.len(), a.len(), "names are unique: {a:?}");
}

/// A group of one rank: by default the sync leaves every gradient as backward made it (no
/// collective, no plan); `SingleRank::Run` runs the plan over the group of one. Both train to the
/// same bits as training without a server.
#[test]
fn a_single_rank_sync_leaves_the_gradients_alone_and_trains_alike() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device(0);
    let alone = weights(&train(init_model::<Mlp>(), (0, ROWS_PER_RANK), &d));
    for single_rank in [SingleRank::Skip, SingleRank::Run] {
        start_server(
            std::slice::from_ref(&d),
            CollectiveOptions {
                single_rank,
                record_collectives: true,
                ..CollectiveOptions::default()
            },
            ReduceOperation::Mean,
        );
        let hooks_before = hook_times(0);
        let model = mark_distributed::<B, Mlp>(init_model()).expect("marking the model");
        let synced = weights(&train(model, (0, ROWS_PER_RANK), &d));
        let stats = sync_stats::<NdArray>(0);
        let calls = recorded_collectives::<NdArray>(0).expect("recorded");
        let hooks = hook_times(0).since(&hooks_before);
        Inner::close_communication_server(&d);
        assert_eq!(synced, alone, "{single_rank:?}");
        // Three layers, a weight and a bias each, every step.
        assert_eq!(hooks.gradients, 6 * STEPS as u64, "{hooks:?}");
        assert_eq!(hooks.syncs, STEPS as u64, "{hooks:?}");
        assert!(hooks.sync_ns >= hooks.writeback_ns, "{hooks:?}");
        match single_rank {
            SingleRank::Skip => {
                assert_eq!(stats.local_steps, STEPS as u64, "{stats:?}");
                assert_eq!(stats.compiled, 0, "{stats:?}");
                assert!(calls.is_empty(), "{calls:?}");
                // Nothing is read, so nothing is computed or written back in the hooks, and no
                // collective is waited for.
                assert_eq!((hooks.force_ns, hooks.writeback_ns), (0, 0), "{hooks:?}");
                assert_eq!((hooks.collectives, hooks.waited_ns), (0, 0), "{hooks:?}");
            }
            SingleRank::Run => {
                assert_eq!(stats.local_steps, 0, "{stats:?}");
                assert_eq!(stats.eager_steps + stats.flushed_steps, STEPS as u64);
                assert!(!calls.is_empty());
                assert!(hooks.force_ns > 0 && hooks.writeback_ns > 0, "{hooks:?}");
                // Every step waited for its plan's collectives, within its sync point.
                assert!(hooks.collectives >= STEPS as u64, "{hooks:?}");
                assert!(hooks.waited_ns <= hooks.sync_ns, "{hooks:?}");
            }
        }
    }
}

#[test]
fn every_rank_measures_its_steps_and_fits_the_link() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..2).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            config: small_buckets(BucketPolicy::Ddp),
            probe_link: true,
            timeout: std::time::Duration::from_secs(30),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Mean,
    );
    let init: ConvNet = init_model();
    // Two convolutions and a linear layer, each a weight and a bias.
    let params = 6;
    let outcomes = on_every_rank(&devices, |d| {
        let model = mark_distributed::<B, ConvNet>(init.clone().fork(d)).expect("marking");
        let r = d.rank as usize;
        train(model, (r * ROWS_PER_RANK, (r + 1) * ROWS_PER_RANK), d);
    });
    let measured: Vec<_> = (0..2)
        .map(|r| {
            (
                measured_step::<NdArray>(r).expect("a measured step"),
                measured_link::<NdArray>(r),
                expected_plan::<NdArray>(r).expect("a plan").0,
            )
        })
        .collect();
    Inner::close_communication_server(&devices[0]);
    for o in outcomes {
        o.expect("training");
    }
    for (r, (step, link, plan)) in measured.iter().enumerate() {
        assert_eq!(step.world, 2);
        assert_eq!(step.gradients.len(), params, "rank {r}: {step:?}");
        let ready: Vec<f64> = step.gradients.iter().map(|g| g.ready_us).collect();
        assert!(
            ready.windows(2).all(|w| w[0] <= w[1]),
            "rank {r}: {ready:?}"
        );
        assert!(ready[0] >= 0.0, "rank {r}: {ready:?}");
        assert!(step.sync_us >= *ready.last().unwrap(), "rank {r}: {step:?}");
        assert!(step.end_us >= step.sync_us, "rank {r}: {step:?}");
        assert!(step.exposed_us() >= 0.0);
        // Every collective of the plan ran once in the step, after its launch.
        assert_eq!(
            step.collectives.len(),
            plan.collectives.len(),
            "rank {r}: {step:?}"
        );
        let mut ids: Vec<u32> = step.collectives.iter().map(|c| c.collective).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..plan.collectives.len() as u32).collect::<Vec<_>>());
        for c in &step.collectives {
            assert!(c.start_us >= c.launch_us, "rank {r}: {c:?}");
            assert!(c.end_us >= c.start_us, "rank {r}: {c:?}");
            assert!(c.bytes > 0 && c.wait_us >= 0.0, "rank {r}: {c:?}");
        }
        let bytes: u64 = step.collectives.iter().map(|c| c.bytes).sum();
        let grad_bytes: u64 = step.gradients.iter().map(|g| g.bytes).sum();
        assert_eq!(
            bytes, grad_bytes,
            "rank {r}: every gradient's bytes reduced once"
        );
        // The probe's three sizes and the buckets fit the link.
        let link = link.expect("a fitted link");
        assert!(link.sizes >= 3, "rank {r}: {link}");
        assert!(
            link.busbw_gbs > 0.0 && link.busbw_gbs.is_finite(),
            "rank {r}: {link}"
        );
        assert!(link.alpha_us >= 0.0, "rank {r}: {link}");
    }
}

/// Under the `cost` policy the plan follows the measured step: compiled from the first step's
/// measurement, perhaps again after the second (the first whose collectives can run under the
/// backward: a re-plan when they did, since what they paid there is news), and again once when
/// the backward pass grows (a batch 64 times larger from the third step), on every rank at the
/// same step (at the last check, perhaps once more for news); every rank runs the same plan at
/// every step.
#[test]
fn a_drifting_step_replans_on_every_rank_together() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices: Vec<_> = (0..2).map(device).collect();
    start_server(
        &devices,
        CollectiveOptions {
            config: small_buckets(BucketPolicy::Cost),
            // Checks after steps 1, 2, 4 and 8: the first plans, the second sees the cost of a
            // collective under the backward, the third the larger batch (a backward pass
            // about 50 times longer here), the fourth run-to-run noise.
            measured_plans: Some(MeasuredPlans {
                every_steps: 4,
                drift: 2.5,
            }),
            // A link fitted from the first step (as `run` does): otherwise the conv net's few
            // kilobytes leave the fit to noise, and a fit that first appears at a later check
            // rightly re-plans.
            probe_link: true,
            timeout: std::time::Duration::from_secs(30),
            ..CollectiveOptions::default()
        },
        ReduceOperation::Mean,
    );
    let init: ConvNet = init_model();
    const STEPS_HERE: usize = 8;
    let outcomes = on_every_rank(&devices, |d| {
        let mut model = mark_distributed::<B, ConvNet>(init.clone().fork(d)).expect("marking");
        let mut optim = SgdConfig::new().init::<B, ConvNet>();
        let r = d.rank as usize;
        let mut seen = Vec::new();
        for step in 0..STEPS_HERE {
            let rows = if step < 2 { 1 } else { 64 };
            let (x, y) = batch(step, r * rows, (r + 1) * rows, d);
            let loss = MseLoss::new().forward(model.forward(x), y, Reduction::Mean);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(0.05, model, grads);
            let stats = sync_stats::<NdArray>(r);
            let plan = expected_plan::<NdArray>(r).expect("a plan");
            let ready = measured_step::<NdArray>(r)
                .map(|m| m.gradients.last().map_or(0.0, |g| g.ready_us) - m.gradients[0].ready_us);
            seen.push((
                plan.0.to_string(),
                stats.measured_plans,
                stats.replans,
                ready,
            ));
        }
        seen
    });
    Inner::close_communication_server(&devices[0]);
    let seen: Vec<_> = outcomes.into_iter().map(|o| o.expect("training")).collect();
    let backward: Vec<_> = seen[0].iter().map(|s| s.3).collect();
    eprintln!("rank 0's backward passes (us): {backward:?}");
    assert!(seen.iter().all(|s| s.len() == STEPS_HERE));
    // After step 2: one plan, or a second one for what the collectives paid under the
    // backward (rank 0's measurement decides, the same on every rank).
    let early = seen[0][1].1;
    assert!(early == 1 || early == 2, "{:?}", seen[0][1]);
    for (step, (a, b)) in seen[0].iter().zip(&seen[1]).enumerate() {
        // The same plan on every rank after every step.
        assert_eq!(a.0, b.0, "step {}", step + 1);
        let counts = (a.1, a.2);
        assert_eq!(counts, (b.1, b.2), "step {}", step + 1);
        let want = match step + 1 {
            1 => (1, 0),
            2..=3 => (early, early - 1),
            _ => (early + 1, early),
        };
        // The check after step 8 sees run-to-run noise only, which a drift of 2.5 absorbs, but
        // it may also see news (a collective that ran under the backward this time and not in
        // step 4, or a link fit that moved with a few noisy samples on a loaded machine: one
        // CI run re-planned there), and a re-plan for that is right as long as every rank
        // makes it together, which the lines above check.
        let noisy = (want.0 + 1, want.1 + 1);
        assert!(
            counts == want || (step + 1 == STEPS_HERE && counts == noisy),
            "step {}: (measured plans, re-plans) {counts:?}, expected {want:?}; rank 0's \
             backward passes (us): {backward:?}",
            step + 1
        );
    }
    // The plans are the measured segment's.
    assert!(seen[0][3].0.contains("measured"), "{}", seen[0][3].0);
}

/// A recorded, measured and compiled step: the gradients of a recorded conv-net step on 4
/// ranks, with ready times and a link as a debug CPU run measures them (fixed here: a run's own
/// numbers vary), compiled by the `cost` policy under that measurement. Compute (the measured
/// time before each gradient, its ready time in its label) and collectives in the order they
/// run.
#[test]
fn a_recorded_measured_and_compiled_convnet_step_is_stable() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    train_data_parallel_inspect::<ConvNet>(BucketPolicy::Ddp, |_| {
        let recorded = recorded_step_graph::<NdArray>(0).expect("a recorded step");
        let mut entries: Vec<(u32, String, TensorType)> = recorded
            .node_ids()
            .filter_map(|n| match recorded.op(n) {
                Op::GradSync { param, ready, .. } => {
                    Some((*ready, param.clone(), recorded.node(n).results[0].clone()))
                }
                _ => None,
            })
            .collect();
        entries.sort_by_key(|e| e.0);
        let entries: Vec<(String, TensorType)> =
            entries.into_iter().map(|(_, p, t)| (p, t)).collect();
        assert_eq!(entries.len(), 6);
        let profile = MeasuredProfile {
            ready_us: vec![0.0, 210.0, 4350.0, 4480.0, 9120.0, 9230.0],
            link: Some(LinkFit {
                alpha_us: 45.0,
                busbw_gbs: 0.4,
                sizes: 5,
                samples: 16,
            }),
            alpha_split_us: [None; 2],
            interference_us: None,
            cores_free_us: None,
        };
        let mut config = CompileConfig {
            verify: true,
            ..small_buckets(BucketPolicy::Cost)
        };
        config.cost = CostModel::new(profile.system_profile(WORLD, &config.cost.system));
        let mut g = profile.segment(WORLD, ReduceOp::Mean, &entries);
        compile(&mut g, &config).expect("the measured step compiles");
        insta::assert_snapshot!(by_first_appearance(&print(&g)));
    });
}

/// A start-up failure is a typed error from `try_start_communication_server` (Burn's
/// `start_communication_server`, which cannot return one, panics with its message), and
/// leaves no server behind.
#[test]
fn a_start_up_failure_is_an_error_naming_what_was_given() {
    use collective_fusion::runtime::transport::StartError;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = |r| CollectiveDevice::new(NdArrayDevice::Cpu, r);
    let config = || DistributedConfig {
        all_reduce_op: ReduceOperation::Mean,
    };
    let err = Inner::try_start_communication_server(&[d(0), d(0)], config())
        .expect_err("rank 0 twice is no group");
    assert!(
        matches!(&err, StartError::Ranks { world: 2, given } if given == &[0, 0]),
        "{err}"
    );
    assert!(err.to_string().contains("[0, 0]"), "{err}");
    // Nothing was started: a correct start then works.
    Inner::try_start_communication_server(&[d(0), d(1)], config()).unwrap();
    Inner::close_communication_server(&d(0));
}

/// A device of `Collective` over a `Copy` device (NdArray's, Flex's) is `Copy` as well, so code
/// written for the inner device that copies it out of a reference (as Burn's own data loader
/// tests do, `*device`) compiles unchanged.
#[test]
fn a_device_over_a_copy_device_is_copied_out_of_a_reference() {
    fn batch_device(device: &Dev) -> Dev {
        *device
    }
    let d = device(3);
    let copied = batch_device(&d);
    assert_eq!((copied.inner, copied.rank), (NdArrayDevice::Cpu, 3));
    assert_eq!(copied, d);
}

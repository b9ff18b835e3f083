//! `Collective<B>` over one of Burn's CubeCL backends: `Autodiff<Collective<Wgpu>>` trains an MLP
//! data-parallel on 2 ranks (threads sharing the wgpu device; Mesa's software Vulkan driver in
//! CI) and ends where one rank trained on the concatenated batch ends. Its gradient buckets are
//! packed by the CubeCL kernels on the gradients' own buffers, and give the same bits as staging
//! every gradient through host memory. Both as Burn's users have it (`burn_wgpu::Wgpu`, with its
//! fusion layer) and as a bare `CubeBackend` without fusion.

mod common;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::module::RunningState;
use burn_core::tensor::{DType, Element, Tensor};
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use burn_wgpu::{CubeBackend, Wgpu, WgpuDevice, WgpuRuntime};
use collective_fusion::backend::{
    BufferSync, Collective, CollectiveDevice, CollectiveOptions, JoinOptions, SyncStats,
    mark_distributed, recorded_step_graph, sync_buffers, sync_stats,
};
use collective_fusion::graph::Graph;
use collective_fusion::train::{module_weights, synthetic_batch};

/// Burn's wgpu backend without its fusion layer.
type Unfused = CubeBackend<WgpuRuntime, f32, i32, u32>;
/// Burn's wgpu backend, fused, with f16 as its float type.
type Half = Wgpu<half::f16, i32, u32>;
type Dev = CollectiveDevice<WgpuDevice>;

const WORLD: u32 = 2;
const ROWS: usize = 4;
const STEPS: usize = 3;
const INPUTS: usize = 12;
const OUTPUTS: usize = 3;

/// Whether a wgpu adapter exists; without one, says so, unless `CF_REQUIRE_WGPU` is set (CI).
fn adapter() -> bool {
    common::cube::wgpu_client().is_some()
}

/// Every rank's device: the default adapter.
fn rank_devices() -> Vec<Dev> {
    (0..WORLD)
        .map(|r| CollectiveDevice::new(WgpuDevice::DefaultDevice, r))
        .collect()
}

/// Options with a 60 s timeout.
fn options_60s() -> CollectiveOptions {
    CollectiveOptions {
        timeout: std::time::Duration::from_secs(60),
        ..CollectiveOptions::default()
    }
}

/// The fused backend's server over [`rank_devices`] (a 60 s timeout), running while the guard
/// lives.
fn start_fused(
    op: ReduceOperation,
) -> (
    Vec<Dev>,
    collective_fusion::backend::DistributedContext<Collective<Wgpu>>,
) {
    let devices = rank_devices();
    options_60s().install::<Wgpu>();
    let ctx = collective_fusion::backend::DistributedContext::start(&devices, op);
    (devices, ctx)
}

/// A wgpu backend of Burn's: `Wgpu` (fused) or `Unfused`.
trait Inner: burn_backend::Backend<Device = WgpuDevice> {}
impl<W: burn_backend::Backend<Device = WgpuDevice>> Inner for W {}

type A<W> = Autodiff<Collective<W>>;
type Mlp<W> = Vec<Linear<A<W>>>;

fn init<W: Inner>(d: &Dev) -> Mlp<W> {
    <A<W> as burn_backend::Backend>::seed(d, 7);
    let m: Mlp<W> = [INPUTS, 16, OUTPUTS]
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(d))
        .collect();
    let _ = module_weights::<A<W>, Mlp<W>>(&m);
    m
}

fn forward<W: Inner>(m: &Mlp<W>, x: Tensor<A<W>, 2>) -> Tensor<A<W>, 2> {
    let h = burn_core::tensor::activation::relu(m[0].forward(x));
    m[1].forward(h)
}

fn train<W: Inner>(mut m: Mlp<W>, rows: (usize, usize), d: &Dev, distributed: bool) -> Vec<f32> {
    let mut optim = SgdConfig::new().init::<A<W>, Mlp<W>>();
    for step in 0..STEPS {
        if distributed {
            m = mark_distributed::<A<W>, Mlp<W>>(m).expect("marking the model");
        }
        let (x, y) = synthetic_batch::<A<W>>(step, rows, INPUTS, OUTPUTS, d);
        let loss = MseLoss::new().forward(forward(&m, x), y, Reduction::Mean);
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        m = optim.step(0.05, m, grads);
    }
    module_weights::<A<W>, Mlp<W>>(&m)
}

/// Trains on `WORLD` wgpu ranks (gradients kept on the device or read into host memory; reduced
/// gradients copied out of their bucket or views of it); returns each rank's final weights,
/// rank 0's sync statistics and recorded step.
fn distributed<W: Inner>(
    devices: &[Dev],
    device_buckets: bool,
    views: bool,
) -> (Vec<Vec<f32>>, SyncStats, Graph) {
    let mut options = CollectiveOptions {
        timeout: std::time::Duration::from_secs(60),
        device_buckets,
        ..CollectiveOptions::default()
    };
    options.config.gradient_as_bucket_view = views;
    options.install::<W>();
    Collective::<W>::start_communication_server(
        devices,
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    let start = init::<W>(&devices[0]);
    let ranks = common::ranks::forked_per_rank::<A<W>, _, _>(devices, &start, |m, d, r| {
        train(m, (r * ROWS, (r + 1) * ROWS), d, true)
    });
    let stats = sync_stats::<W>(0);
    let step = recorded_step_graph::<W>(0).expect("a recorded step");
    Collective::<W>::close_communication_server(&devices[0]);
    (ranks, stats, step)
}

/// Burn's default wgpu backend, its fusion layer on: gradients are resolved to their CubeCL
/// tensors through the fusion client and packed on the device.
#[test]
fn an_mlp_on_two_fused_wgpu_ranks_equals_one_rank_on_the_concatenated_batch() {
    if !adapter() {
        return;
    }
    equals_one_rank::<Wgpu>();
}

#[test]
fn an_mlp_on_two_unfused_wgpu_ranks_equals_one_rank_on_the_concatenated_batch() {
    if !adapter() {
        return;
    }
    equals_one_rank::<Unfused>();
}

/// A `SyncBatchNorm` on fused and unfused wgpu: its statistics' all-reduce (the user
/// collective's device path) and the one its backward issues inside backward, with the
/// gradient sync's buckets around them; the ranks train as one rank on the concatenated batch.
#[test]
fn a_synchronized_norm_on_two_wgpu_ranks_trains_as_one_rank() {
    if !adapter() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = rank_devices();
    common::sync_norm::assert_trains_as_one_rank::<Wgpu>(&devices, options_60s(), 1e-4);
    common::sync_norm::assert_trains_as_one_rank::<Unfused>(&devices, options_60s(), 1e-4);
}

/// Uneven inputs on wgpu ranks, fused and not: rank 0 has 2 batches, rank 1 has 3; both end
/// with rank 1's weights, where one rank ends that steps on the batches every rank had (the
/// unfused ranks dividing the step rank 0 sat out by the one rank that trained), and the step
/// rank 0 took part in with zero gradients was packed and reduced in device memory as its own
/// steps were (as many device buckets as rank 1's).
#[test]
fn ranks_with_uneven_inputs_on_wgpu_reduce_a_finished_ranks_zeros_on_the_device() {
    if !adapter() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = rank_devices();
    let steps = [2, 3];
    for ended in [
        common::join::assert_uneven_ranks_train_as_one_rank::<Wgpu>(
            &devices,
            &steps,
            options_60s(),
            JoinOptions::default(),
            1e-4,
        ),
        common::join::assert_uneven_ranks_train_as_one_rank::<Unfused>(
            &devices,
            &steps,
            options_60s(),
            JoinOptions {
                divide_by_initial_world_size: false,
            },
            1e-4,
        ),
    ] {
        let buckets: Vec<u64> = ended.iter().map(|e| e.stats.device_buckets).collect();
        assert!(buckets[0] > 0, "{buckets:?}");
        assert_eq!(buckets[0], buckets[1], "device buckets by rank");
    }
}

/// `sync_buffers` on fused wgpu ranks: each rank's BatchNorm statistics become rank 0's, bit
/// for bit (`Broadcast`), then the ranks' mean, the same bits on both (`Mean`), packed and
/// reduced as device buckets (nothing read to the host for them).
#[test]
fn buffers_are_made_alike_in_device_memory_on_fused_wgpu() {
    if !adapter() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (devices, ctx) = start_fused(ReduceOperation::Mean);
    let stats =
        |r: usize| -> Vec<f32> { (0..5).map(|i| 0.37 * i as f32 + 1.1 * r as f32).collect() };
    let before = sync_stats::<Wgpu>(0).device_buckets;
    let out = common::ranks::on_threads(devices.iter().collect(), |r, d| {
        let mut bn = BatchNormConfig::new(5).init::<A<Wgpu>>(d);
        bn.running_mean = RunningState::new(Tensor::from_floats(&stats(r)[..], d));
        let bits = |bn: &BatchNorm<A<Wgpu>>| -> Vec<u32> {
            let v = bn.running_mean.value().into_data().to_vec::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        let bn = sync_buffers::<A<Wgpu>, _>(bn, BufferSync::Broadcast).unwrap();
        let broadcast = bits(&bn);
        bn.running_mean
            .update(Tensor::from_floats(&stats(r + 2)[..], d));
        let bn = sync_buffers::<A<Wgpu>, _>(bn, BufferSync::Mean).unwrap();
        (broadcast, bits(&bn))
    });
    let after = sync_stats::<Wgpu>(0);
    let packed = after.device_buckets - before;
    drop(ctx);
    let rank0: Vec<u32> = stats(0).iter().map(|x| x.to_bits()).collect();
    for (r, (broadcast, mean)) in out.iter().enumerate() {
        assert_eq!(broadcast, &rank0, "rank {r} after Broadcast");
        assert_eq!(mean, &out[0].1, "rank {r} after Mean: the same bits");
    }
    let mean: Vec<f32> = out[0].1.iter().map(|b| f32::from_bits(*b)).collect();
    for (i, m) in mean.iter().enumerate() {
        let want = (stats(2)[i] + stats(3)[i]) / 2.0;
        assert!(
            (m - want).abs() <= 1e-6 * want.abs(),
            "mean[{i}]: {m} against {want}"
        );
    }
    assert!(
        packed >= 2,
        "one device bucket per call at least: {after:?}"
    );
}

/// Uneven inputs with BatchNorm statistics on fused wgpu
/// (`common::join::assert_a_finished_rank_takes_part_in_the_buffer_sync`).
#[test]
fn a_finished_rank_takes_part_in_the_buffer_sync_on_fused_wgpu() {
    if !adapter() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (devices, ctx) = start_fused(ReduceOperation::Mean);
    common::join::assert_a_finished_rank_takes_part_in_the_buffer_sync::<Wgpu>(&devices);
    drop(ctx);
}

/// Set in the child process that runs the f16 test.
const HALF_CHILD: &str = "CF_HALF_CHILD";

/// Half precision, as mixed-precision users have it: Burn's fused wgpu backend with f16 as its
/// float type, so parameters, activations and gradients are f16 and the buckets are f16 on the
/// device. (Without `shader-f16` on the adapter, wgpu has no f16: skipped, saying so.) It runs in
/// a child process of its own: Burn fixes a device's default dtypes once per process, from the
/// first backend that creates a tensor on it, and the f32 tests here use the same devices.
#[test]
fn an_f16_mlp_on_two_fused_wgpu_ranks_equals_one_rank_on_the_concatenated_batch() {
    if !adapter() {
        return;
    }
    if std::env::var_os(HALF_CHILD).is_none() {
        common::child_sides(
            "an_f16_mlp_on_two_fused_wgpu_ranks_equals_one_rank_on_the_concatenated_batch",
            HALF_CHILD,
            &["f16"],
            |_, _| {},
            |_| (),
        );
        return;
    }
    if !<Half as burn_backend::Backend>::supports_dtype(&WgpuDevice::DefaultDevice, DType::F16) {
        eprintln!("skipped: this wgpu adapter has no f16");
        return;
    }
    equals_one_rank::<Half>();
}

/// The tests share ranks 0 and 1, whose recorders are per process: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn equals_one_rank<W: Inner>() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = rank_devices();
    let (ranks, stats, step) = distributed::<W>(&devices, true, false);
    // The ops were recorded lazily on the wgpu backend too, and the last step's graph has them.
    let matmuls = collective_fusion::graph::print::print(&step)
        .matches(" kind=matmul ")
        .count();
    // Two layers: two forward `linear`s, three backward matmuls (`linear_weight_backward` twice,
    // `linear_x_backward` once: no input gradient for the first layer).
    assert_eq!(matmuls, 5, "forward and backward matmuls recorded");
    // Four parameters' gradients (two weights, two biases), each of the backend's float type.
    let float = format!(": {}[", <W::FloatElem as Element>::dtype().name());
    let text = collective_fusion::graph::print::print(&step);
    let grads: Vec<&str> = text.lines().filter(|l| l.contains("= gradient ")).collect();
    assert_eq!(grads.len(), 4, "{text}");
    assert!(
        grads.iter().all(|l| l.contains(&float)),
        "want {float}:\n{text}"
    );
    assert_eq!(
        stats.eager_steps + stats.flushed_steps,
        STEPS as u64,
        "{stats:?}"
    );
    // Every bucket of every step was packed by the CubeCL kernels on the gradients' buffers.
    assert!(stats.device_buckets >= STEPS as u64, "{stats:?}");
    assert_eq!(ranks[0], ranks[1], "the ranks diverged");
    // Staging every gradient through host memory instead gives the same bits.
    let (host, host_stats, _) = distributed::<W>(&devices, false, false);
    assert_eq!(host_stats.device_buckets, 0, "{host_stats:?}");
    for (i, (a, b)) in ranks[0].iter().zip(&host[0]).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "weight {i}: device {a} vs host {b}"
        );
    }
    // So does handing the reduced gradients back as views of their buckets
    // (`gradient_as_bucket_view`): the optimizer reads slices of the bucket.
    assert_eq!(stats.view_grads, 0, "{stats:?}");
    let (viewed, view_stats, _) = distributed::<W>(&devices, true, true);
    assert!(
        view_stats.view_grads >= 2 * STEPS as u64,
        "every step has a bucket of several gradients: {view_stats:?}"
    );
    for (i, (a, b)) in ranks[0].iter().zip(&viewed[0]).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "weight {i}: copied {a} vs views {b}"
        );
    }
    let reference = train::<W>(
        init::<W>(&devices[0]),
        (0, WORLD as usize * ROWS),
        &devices[0],
        false,
    );
    let initial = module_weights::<A<W>, Mlp<W>>(&init::<W>(&devices[0]));
    // Two half-batch means averaged vs one mean, on a GPU backend: rounding apart (f32's,
    // or a few units of f16's last place).
    let rel = match <W::FloatElem as Element>::dtype() {
        DType::F32 => 1e-5,
        _ => 4e-3,
    };
    common::ranks::assert_ends_as_one_rank(&ranks[0], &reference, &initial, rel, 1e-3);
}

/// The user's all-reduces on Burn's fused wgpu backend: three issued back to back are packed
/// by the CubeCL kernels into one bucket on the device, and each rank reads the sums.
#[test]
fn back_to_back_user_all_reduces_on_fused_wgpu_are_one_device_bucket() {
    if !adapter() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (devices, ctx) = start_fused(ReduceOperation::Sum);
    let sums: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let devices = &devices;
        let hs: Vec<_> = devices
            .iter()
            .map(|d| {
                s.spawn(move || {
                    let r = d.rank as f32;
                    let ts: Vec<_> = [1usize, 5, 300]
                        .iter()
                        .map(|n| {
                            let v: Vec<f32> = (0..*n).map(|i| i as f32 + 100.0 * r).collect();
                            let t = Tensor::<Collective<Wgpu>, 1>::from_data(
                                burn_core::tensor::TensorData::new(v, [*n]),
                                d,
                            );
                            collective_fusion::backend::all_reduce(t, ReduceOperation::Sum, devices)
                        })
                        .collect();
                    ts.into_iter()
                        .map(|t| t.resolve().into_data().to_vec::<f32>().unwrap())
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let stats = sync_stats::<Wgpu>(0);
    drop(ctx);
    for (r, rank) in sums.iter().enumerate() {
        for (t, n) in rank.iter().zip([1usize, 5, 300]) {
            let want: Vec<f32> = (0..n).map(|i| 2.0 * i as f32 + 100.0).collect();
            assert_eq!(t, &want, "rank {r}");
        }
    }
    assert_eq!(
        stats.device_buckets, 1,
        "one bucket packed on the device: {stats:?}"
    );
}

/// The overhead table of the step benchmark (`benches/step.rs`) as a CI proxy on Burn's fused
/// wgpu backend, tiny model, few steps: Burn alone, the lazy layer, and the model marked once
/// under a one-rank server, in turn. Not a timing check (the times are printed, never compared):
/// what it checks is that every row ran its steps and that the marked row synced every step
/// (Burn's optimizer marks the parameters it updates again), each through the one-rank path,
/// without a bucket or a read of a gradient.
#[test]
fn the_overhead_table_runs_on_fused_wgpu_and_a_marked_model_syncs_locally() {
    use collective_fusion::train::overhead::{Marking, StepRow, StepTable};
    use collective_fusion::train::{Mlp as NetMlp, RunModel};
    if !adapter() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    type Alone = Autodiff<Wgpu>;
    type Lazy = Autodiff<Collective<Wgpu>>;
    let d = WgpuDevice::DefaultDevice;
    let cd = CollectiveDevice::new(d.clone(), 0);
    CollectiveOptions::default().install::<Wgpu>();
    Collective::<Wgpu>::start_communication_server(
        std::slice::from_ref(&cd),
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    let before = sync_stats::<Wgpu>(0);
    let model = RunModel::Mlp {
        hidden_layers: 1,
        width: 32,
    };
    let rows = vec![
        StepRow::new::<Alone, NetMlp<Alone>>("Autodiff<Wgpu>", &d, model, 8, Marking::Unmarked),
        StepRow::new::<Lazy, NetMlp<Lazy>>(
            "Autodiff<Collective<Wgpu>>",
            &cd,
            model,
            8,
            Marking::Unmarked,
        ),
        StepRow::new::<Lazy, NetMlp<Lazy>>("  + sync, one rank", &cd, model, 8, Marking::Once),
    ];
    let table = StepTable::measure("fused wgpu, tiny mlp", rows, 1, 3);
    let stats = sync_stats::<Wgpu>(0);
    Collective::<Wgpu>::close_communication_server(&cd);
    eprint!("{table}");
    assert!(table.times.iter().all(|t| t.len() == 3));
    assert_eq!(
        stats.local_steps - before.local_steps,
        4,
        "every step of the marked row, warm-up included: {stats:?}"
    );
    assert_eq!(stats.device_buckets, before.device_buckets, "{stats:?}");
    assert_eq!(
        stats.eager_steps + stats.flushed_steps,
        before.eager_steps + before.flushed_steps
    );
}

/// Threads sharing one rank of `Collective<Wgpu>` (Burn's fusion keeps a stream per thread):
/// each runs its own ops. When a forced read ran every thread's queued ops on the reading
/// thread, this gave wrong values and then panics inside Burn's fusion server (found by Burn's
/// own backend test suite, which runs its tests on parallel threads).
#[test]
fn threads_sharing_a_fused_wgpu_rank_each_get_what_the_host_computes() {
    if !adapter() {
        return;
    }
    common::threads::check_threads_sharing_a_rank::<Wgpu>(|| Dev::new(WgpuDevice::default(), 7));
}

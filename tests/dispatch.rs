//! `Collective<Dispatch>`: Burn 0.21's runtime-selected backend (`burn::Dispatch`) as the inner
//! backend. Burn's own `Dispatch` has no data-parallel path (its `submit_gradient_sync` is
//! `unimplemented!()`); wrapped in `Collective`, 2 ranks train an MLP and end where one rank
//! trained on the concatenated batch ends, on Dispatch's NdArray device and on its wgpu device
//! (Mesa's software Vulkan in CI).
//!
//! With the `dispatch-autodiff` feature (and without `dispatch-ndarray`, which Burn 0.21 cannot
//! build beside it under `distributed`), a rank's device may be a `DispatchDevice::autodiff`
//! device, as Burn's own `Dispatch` training code makes it: `.ci/run` runs this file so too
//! (`cargo test --no-default-features --features dispatch-autodiff --test dispatch`).

mod common;

use std::sync::Mutex;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::tensor::Tensor;
use burn_dispatch::{Dispatch, DispatchDevice};
#[cfg(feature = "dispatch-ndarray")]
use burn_ndarray::NdArrayDevice;
use burn_nn::loss::{MseLoss, Reduction};
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, SyncStats, mark_distributed, sync_stats,
};
use collective_fusion::train::{module_weights, synthetic_batch};

type Inner = Collective<Dispatch>;
type A = Autodiff<Inner>;
type Dev = CollectiveDevice<DispatchDevice>;
type Mlp = Vec<Linear<A>>;

const WORLD: u32 = 2;
const ROWS: usize = 4;
const STEPS: usize = 3;
const INPUTS: usize = 12;
const OUTPUTS: usize = 3;

/// One communication server per backend type, and per-process recorders per rank: one test at
/// a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn init(d: &Dev) -> Mlp {
    <A as burn_backend::Backend>::seed(d, 7);
    let m: Mlp = [INPUTS, 16, OUTPUTS]
        .windows(2)
        .map(|w| LinearConfig::new(w[0], w[1]).init(d))
        .collect();
    let _ = module_weights::<A, Mlp>(&m);
    m
}

fn train(mut m: Mlp, rows: (usize, usize), d: &Dev, distributed: bool) -> Vec<f32> {
    let mut optim = SgdConfig::new().init::<A, Mlp>();
    for step in 0..STEPS {
        if distributed {
            m = mark_distributed::<A, Mlp>(m).expect("marking the model");
        }
        let (x, y) = synthetic_batch::<A>(step, rows, INPUTS, OUTPUTS, d);
        let h = burn_core::tensor::activation::relu(m[0].forward(x));
        let out: Tensor<A, 2> = m[1].forward(h);
        let loss = MseLoss::new().forward(out, y, Reduction::Mean);
        let grads = GradientsParams::from_grads(loss.backward(), &m);
        m = optim.step(0.05, m, grads);
    }
    module_weights::<A, Mlp>(&m)
}

/// 2 ranks on `device` (gradients packed on the device when `device_buckets` and the device
/// can): each rank's final weights and rank 0's sync counters.
fn two_ranks(device: &DispatchDevice, device_buckets: bool) -> (Vec<f32>, SyncStats) {
    let devices: Vec<Dev> = (0..WORLD)
        .map(|r| CollectiveDevice::new(device.clone(), r))
        .collect();
    CollectiveOptions {
        timeout: std::time::Duration::from_secs(60),
        device_buckets,
        ..CollectiveOptions::default()
    }
    .install::<Dispatch>();
    Inner::start_communication_server(
        &devices,
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    let start = init(&devices[0]);
    let ranks = common::ranks::forked_per_rank::<A, _, _>(&devices, &start, |m, d, r| {
        train(m, (r * ROWS, (r + 1) * ROWS), d, true)
    });
    let stats = sync_stats::<Dispatch>(0);
    Inner::close_communication_server(&devices[0]);
    assert_eq!(
        stats.eager_steps + stats.flushed_steps,
        STEPS as u64,
        "every step synced its gradients: {stats:?}"
    );
    assert_eq!(ranks[0], ranks[1], "the ranks diverged");
    (ranks.into_iter().next().unwrap_or_default(), stats)
}

/// 2 ranks on `device`, against one rank on the concatenated batch.
fn equals_one_rank(device: DispatchDevice) -> SyncStats {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (weights, stats) = two_ranks(&device, true);
    let devices: Vec<Dev> = vec![CollectiveDevice::new(device, 0)];
    let reference = train(
        init(&devices[0]),
        (0, WORLD as usize * ROWS),
        &devices[0],
        false,
    );
    let initial = module_weights::<A, Mlp>(&init(&devices[0]));
    common::ranks::assert_ends_as_one_rank(&weights, &reference, &initial, 1e-5, 1e-3);
    stats
}

#[cfg(feature = "dispatch-ndarray")]
#[test]
fn an_mlp_on_two_dispatch_ndarray_ranks_equals_one_rank_on_the_concatenated_batch() {
    let stats = equals_one_rank(DispatchDevice::NdArray(NdArrayDevice::Cpu));
    // NdArray's tensors are host memory: the host path packs them.
    assert_eq!(stats.device_buckets, 0, "{stats:?}");
}

#[test]
fn an_mlp_on_two_dispatch_wgpu_ranks_equals_one_rank_on_the_concatenated_batch() {
    if common::cube::wgpu_client().is_none() {
        return;
    }
    let device = DispatchDevice::Wgpu(burn_wgpu::WgpuDevice::DefaultDevice);
    let stats = equals_one_rank(device.clone());
    // Packed on the device by Dispatch's own ops, read to the host once per bucket.
    assert!(stats.device_buckets >= STEPS as u64, "{stats:?}");
    // The same bits as the host path, which reads every gradient on its own.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (on_device, _) = two_ranks(&device, true);
    let (on_host, host_stats) = two_ranks(&device, false);
    assert_eq!(host_stats.device_buckets, 0, "{host_stats:?}");
    let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&on_device),
        bits(&on_host),
        "device pack against host pack"
    );
}

/// The user's all-reduces of Dispatch tensors on its wgpu device, issued back to back (one
/// coalesced bucket, packed with Dispatch's ops) and alone: every rank gets the mean, in the
/// tensor's own shape.
#[test]
fn user_all_reduces_of_dispatch_wgpu_tensors_give_the_mean_in_their_shape() {
    use burn_core::tensor::TensorData;
    use collective_fusion::backend::{DistributedContext, all_reduce};
    if common::cube::wgpu_client().is_none() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let device = DispatchDevice::Wgpu(burn_wgpu::WgpuDevice::DefaultDevice);
    for coalesce in [true, false] {
        CollectiveOptions {
            timeout: std::time::Duration::from_secs(60),
            coalesce_user_collectives: coalesce,
            ..CollectiveOptions::default()
        }
        .install::<Dispatch>();
        let devices: Vec<Dev> = (0..WORLD)
            .map(|r| CollectiveDevice::new(device.clone(), r))
            .collect();
        let ctx = DistributedContext::<Inner>::start(&devices, ReduceOperation::Mean);
        let out: Vec<(Vec<f32>, Vec<usize>, f32)> = std::thread::scope(|s| {
            let devices = &devices;
            let ranks: Vec<_> = (0..WORLD as usize)
                .map(|r| {
                    s.spawn(move || {
                        let d = &devices[r];
                        let k = (r + 1) as f32;
                        let m: Tensor<Inner, 2> = Tensor::from_data(
                            TensorData::new((0..6).map(|i| i as f32 * k).collect(), [2, 3]),
                            d,
                        );
                        let v: Tensor<Inner, 1> =
                            Tensor::from_data(TensorData::new(vec![10.0 * k], [1]), d);
                        // Both issued before either is read.
                        let m = all_reduce(m, ReduceOperation::Mean, devices);
                        let v = all_reduce(v, ReduceOperation::Mean, devices);
                        let (m, v) = (m.resolve(), v.resolve());
                        let shape = m.dims().to_vec();
                        let m = m.into_data().to_vec::<f32>().expect("f32");
                        let v = v.into_data().to_vec::<f32>().expect("f32")[0];
                        (m, shape, v)
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (m, shape, v)) in out.iter().enumerate() {
            // The mean of i and 2i is 1.5i; of 10 and 20, 15.
            let want: Vec<f32> = (0..6).map(|i| 1.5 * i as f32).collect();
            assert_eq!(m, &want, "rank {r}, coalesce {coalesce}");
            assert_eq!(shape, &[2, 3], "rank {r}, coalesce {coalesce}");
            assert_eq!(*v, 15.0, "rank {r}, coalesce {coalesce}");
        }
        drop(ctx);
    }
}

/// Burn's own way to train on `Dispatch` puts autodiff in the device
/// (`DispatchDevice::autodiff(device)`, as Burn's MNIST example does). Under `Collective` the
/// outer `Autodiff` differentiates, so [`CollectiveDevice::new`] takes the inner device without
/// autodiff: 2 ranks train on the device a user passes as they did on Dispatch alone, bit for
/// bit as on the plain device, packing on the device.
#[cfg(feature = "dispatch-autodiff")]
#[test]
fn ranks_given_dispatch_autodiff_devices_train_as_on_the_plain_device() {
    use burn_backend::Backend;
    if common::cube::wgpu_client().is_none() {
        return;
    }
    let plain = DispatchDevice::Wgpu(burn_wgpu::WgpuDevice::DefaultDevice);
    let with_ad = DispatchDevice::autodiff(plain.clone());
    assert!(Dispatch::ad_enabled(&with_ad));
    let d = CollectiveDevice::new(with_ad.clone(), 0);
    assert!(!Dispatch::ad_enabled(&d.inner), "{d}");
    assert!(!Inner::ad_enabled(&d), "{d}");
    assert!(A::ad_enabled(&d), "{d}");
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (on_ad, stats) = two_ranks(&with_ad, true);
    assert!(stats.device_buckets >= STEPS as u64, "{stats:?}");
    let (on_plain, _) = two_ranks(&plain, true);
    let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&on_ad), bits(&on_plain));
}

/// A `CollectiveDevice` built by hand around an autodiff device (not through
/// [`CollectiveDevice::new`]) is refused at start-up with a typed error naming the rank.
#[cfg(feature = "dispatch-autodiff")]
#[test]
fn a_hand_built_rank_device_with_autodiff_on_is_refused_by_name() {
    use collective_fusion::runtime::transport::StartError;
    let plain = DispatchDevice::Wgpu(burn_wgpu::WgpuDevice::DefaultDevice);
    let devices = vec![
        CollectiveDevice::new(plain.clone(), 0),
        CollectiveDevice {
            inner: DispatchDevice::autodiff(plain),
            rank: 1,
        },
    ];
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let got = Inner::try_start_communication_server(
        &devices,
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    );
    match got {
        Err(e @ StartError::InnerAutodiff { rank: 1, .. }) => {
            assert!(e.to_string().contains("rank 1"), "{e}");
        }
        other => panic!("expected InnerAutodiff for rank 1, got {other:?}"),
    }
}

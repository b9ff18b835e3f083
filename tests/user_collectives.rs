//! The user's collectives are lazy: `all_reduce` returns at once, before a peer has called it;
//! the result's first read, `CollectiveTensor::resolve` and `sync_collective` wait for it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_core::tensor::{Tensor, TensorData};
use burn_ndarray::{NdArray, NdArrayDevice};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, DistributedContext, all_reduce,
    recorded_collectives,
};
use collective_fusion::runtime::agree::is_agreement;
use collective_fusion::runtime::comm::CollectiveDesc;

type Inner = Collective<NdArray>;
type Dev = CollectiveDevice<NdArrayDevice>;

/// One communication server per backend type: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn start(world: u32, timeout: Duration) -> (Vec<Dev>, DistributedContext<Inner>) {
    start_with(
        world,
        CollectiveOptions {
            timeout,
            ..CollectiveOptions::default()
        },
    )
}

fn start_with(world: u32, options: CollectiveOptions) -> (Vec<Dev>, DistributedContext<Inner>) {
    options.install::<NdArray>();
    let devices: Vec<Dev> = (0..world)
        .map(|r| CollectiveDevice::new(NdArrayDevice::Cpu, r))
        .collect();
    let ctx = DistributedContext::<Inner>::start(&devices, ReduceOperation::Sum);
    (devices, ctx)
}

fn values(d: &Dev, v: [f32; 3]) -> Tensor<Inner, 1> {
    Tensor::from_data(TensorData::new(v.to_vec(), [3]), d)
}

/// Rank 1 calls its all-reduce only once rank 0's returned: an all-reduce that waited for the
/// peer would never return, and rank 1 would give up.
#[test]
fn all_reduce_returns_before_a_peer_has_called_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (devices, ctx) = start(2, Duration::from_secs(10));
    let (tx, rx) = mpsc::channel::<()>();
    let out: Vec<Vec<f32>> = std::thread::scope(|s| {
        let devices = &devices;
        let zero = s.spawn(move || {
            let y = all_reduce(
                values(&devices[0], [1.0, 2.0, 3.0]),
                ReduceOperation::Sum,
                devices,
            );
            tx.send(()).unwrap();
            y.resolve().into_data().to_vec::<f32>().unwrap()
        });
        let one = s.spawn(move || {
            rx.recv_timeout(Duration::from_secs(5))
                .expect("rank 0's all_reduce returned before rank 1 called its own");
            let y = all_reduce(
                values(&devices[1], [10.0, 20.0, 30.0]),
                ReduceOperation::Sum,
                devices,
            );
            // Read without resolve: the first read waits too.
            // SAFETY: the read waits for the collective.
            unsafe { y.assume_resolved() }
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        });
        vec![zero.join().unwrap(), one.join().unwrap()]
    });
    drop(ctx);
    for (r, v) in out.iter().enumerate() {
        assert_eq!(v, &[11.0, 22.0, 33.0], "rank {r}");
    }
}

/// `sync_collective` waits for a peer that calls later.
#[test]
fn sync_collective_waits_for_the_peer() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (devices, ctx) = start(2, Duration::from_secs(10));
    let (tx, rx) = mpsc::channel::<()>();
    let peer_called = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (devices, peer_called) = (&devices, &peer_called);
        let zero = s.spawn(move || {
            let y = all_reduce(
                values(&devices[0], [1.0, 1.0, 1.0]),
                ReduceOperation::Sum,
                devices,
            );
            tx.send(()).unwrap();
            Inner::sync_collective(&devices[0]);
            let called = peer_called.load(Ordering::SeqCst);
            // SAFETY: synchronized above.
            let v = unsafe { y.assume_resolved() }
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            (called, v)
        });
        let one = s.spawn(move || {
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
            std::thread::sleep(Duration::from_millis(200));
            peer_called.store(true, Ordering::SeqCst);
            all_reduce(
                values(&devices[1], [2.0, 2.0, 2.0]),
                ReduceOperation::Sum,
                devices,
            )
            .resolve()
            .into_data()
            .to_vec::<f32>()
            .unwrap()
        });
        let (called, v) = zero.join().unwrap();
        assert!(
            called,
            "sync_collective returned before the peer's all_reduce"
        );
        assert_eq!(v, [3.0, 3.0, 3.0]);
        assert_eq!(one.join().unwrap(), [3.0, 3.0, 3.0]);
    });
    drop(ctx);
}

/// A peer that never calls: the all-reduce still returns at once, and the read that needs its
/// value fails with the timeout, naming the rank that never arrived.
#[test]
fn a_read_of_an_all_reduce_a_peer_never_joins_fails_naming_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (devices, ctx) = start(2, Duration::from_millis(500));
    let devices_ref = &devices;
    let msg = std::thread::scope(|s| {
        s.spawn(move || {
            let y = all_reduce(
                values(&devices_ref[0], [1.0, 2.0, 3.0]),
                ReduceOperation::Sum,
                devices_ref,
            );
            y.resolve().into_data()
        })
        .join()
        .expect_err("nobody joined")
    });
    drop(ctx);
    let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("rank 0") && msg.contains("timed out"), "{msg}");
    assert!(msg.contains("[1] never arrived"), "{msg}");
}

fn scalar(d: &Dev, v: f32) -> Tensor<Inner, 1> {
    Tensor::from_data(TensorData::new(vec![v], [1]), d)
}

fn read(t: Tensor<Inner, 1>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

/// The data collectives `rank` asked its communicator for (the agreement's and the queue-length
/// exchanges left out).
fn data_calls(rank: usize) -> Vec<CollectiveDesc> {
    recorded_collectives::<NdArray>(rank)
        .expect("the server records collectives")
        .into_iter()
        .filter(|d| !is_agreement(d))
        .collect()
}

fn recording(world: u32, coalesce: bool) -> (Vec<Dev>, DistributedContext<Inner>) {
    start_with(
        world,
        CollectiveOptions {
            timeout: Duration::from_secs(10),
            coalesce_user_collectives: coalesce,
            record_collectives: true,
            ..CollectiveOptions::default()
        },
    )
}

/// Three scalar metrics all-reduced back to back, with no use in between, are one collective
/// of three elements on every rank (twice: the second step reuses the agreed plan); coalescing
/// off, they are three.
#[test]
fn back_to_back_all_reduces_are_one_communicator_call() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for coalesce in [true, false] {
        let (devices, ctx) = recording(2, coalesce);
        let out: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let devices = &devices;
            let ranks: Vec<_> = (0..2usize)
                .map(|r| {
                    s.spawn(move || {
                        let d = &devices[r];
                        let mut steps = Vec::new();
                        for step in 0..2 {
                            let base = (r * 10 + step * 100) as f32;
                            let m: Vec<_> = (0..3)
                                .map(|i| {
                                    all_reduce(
                                        scalar(d, base + i as f32),
                                        ReduceOperation::Sum,
                                        devices,
                                    )
                                })
                                .collect();
                            steps.push(m.into_iter().flat_map(|m| read(m.resolve())).collect());
                        }
                        steps
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, steps) in out.iter().enumerate() {
            assert_eq!(steps[0], [10.0, 12.0, 14.0], "rank {r}, step 0");
            assert_eq!(steps[1], [210.0, 212.0, 214.0], "rank {r}, step 1");
            let calls = data_calls(r);
            if coalesce {
                assert_eq!(calls.len(), 2, "rank {r}: one call per step: {calls:?}");
                for c in &calls {
                    // Three elements, each aligned in the bucket.
                    assert!(c.count >= 3, "rank {r}: {c:?}");
                    assert_eq!(c.params, ["all_reduce.0", "all_reduce.1", "all_reduce.2"]);
                }
            } else {
                assert_eq!(calls.len(), 6, "rank {r}: one call each: {calls:?}");
                assert!(calls.iter().all(|c| c.count == 1), "rank {r}: {calls:?}");
            }
        }
        drop(ctx);
    }
}

/// Rank 0 reads its first metric before issuing the second; rank 1 issues both, then reads.
/// The ranks queue different numbers of all-reduces when they launch, so they launch the
/// fewer: both get the right sums.
#[test]
fn ranks_that_need_values_at_different_points_still_agree() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (devices, ctx) = recording(2, true);
    let out: Vec<Vec<f32>> = std::thread::scope(|s| {
        let devices = &devices;
        let zero = s.spawn(move || {
            let d = &devices[0];
            let a = read(all_reduce(scalar(d, 1.0), ReduceOperation::Sum, devices).resolve());
            let b = all_reduce(scalar(d, 2.0), ReduceOperation::Mean, devices);
            let c = all_reduce(scalar(d, 3.0), ReduceOperation::Mean, devices);
            [a, read(b.resolve()), read(c.resolve())].concat()
        });
        let one = s.spawn(move || {
            let d = &devices[1];
            let a = all_reduce(scalar(d, 10.0), ReduceOperation::Sum, devices);
            let b = all_reduce(scalar(d, 20.0), ReduceOperation::Mean, devices);
            let c = all_reduce(scalar(d, 30.0), ReduceOperation::Mean, devices);
            Inner::sync_collective(d);
            [read(a.resolve()), read(b.resolve()), read(c.resolve())].concat()
        });
        vec![zero.join().unwrap(), one.join().unwrap()]
    });
    for (r, v) in out.iter().enumerate() {
        assert_eq!(v, &[11.0, 11.0, 16.5], "rank {r}");
        let calls = data_calls(r);
        // The sum alone (rank 0 needed it first), then the two means together.
        let members: Vec<usize> = calls.iter().map(|c| c.params.len()).collect();
        assert_eq!(members, [1, 2], "rank {r}: {calls:?}");
    }
    drop(ctx);
}

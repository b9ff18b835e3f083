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
};

type Inner = Collective<NdArray>;
type Dev = CollectiveDevice<NdArrayDevice>;

/// One communication server per backend type: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn start(world: u32, timeout: Duration) -> (Vec<Dev>, DistributedContext<Inner>) {
    CollectiveOptions {
        timeout,
        ..CollectiveOptions::default()
    }
    .install::<NdArray>();
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

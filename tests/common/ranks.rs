//! Data-parallel training in a test: a thread per rank, and the check that the ranks end where
//! one rank trained on the concatenated batch ends.

use burn_backend::Backend;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_core::module::Module;
use collective_fusion::backend::{Collective, CollectiveDevice, CollectiveOptions};

/// Installs `options` for inner backend `I` and starts the communication server of `devices`
/// (rank `r` is `devices[r]`), reducing gradients with `op`.
pub fn start_server<I: Backend>(
    devices: &[CollectiveDevice<I::Device>],
    options: CollectiveOptions,
    op: ReduceOperation,
) {
    options.install::<I>();
    Collective::<I>::start_communication_server(devices, DistributedConfig { all_reduce_op: op });
}

/// `f(r, inputs[r])` for each rank `r`, each on a thread of its own, results in rank order.
pub fn on_threads<In: Send, T: Send>(inputs: Vec<In>, f: impl Fn(usize, In) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = inputs
            .into_iter()
            .enumerate()
            .map(|(r, x)| s.spawn(move || f(r, x)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Runs `train` on a thread per device (`devices[r]` is rank `r`), each given `start` forked to
/// its device and its rank; the results in rank order.
pub fn forked_per_rank<B: Backend, M: Module<B> + Send, T: Send>(
    devices: &[B::Device],
    start: &M,
    train: impl Fn(M, &B::Device, usize) -> T + Sync,
) -> Vec<T> {
    let train = &train;
    std::thread::scope(|s| {
        let hs: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(r, d)| {
                let m = start.clone().fork(d);
                s.spawn(move || train(m, d, r))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Asserts that every weight of `ranks` (one rank's weights after data-parallel training) is
/// within `rel` of `one_rank`'s (relative, floored at 1e-2: two half-batch means averaged
/// against one mean differ by rounding), that training moved the weights from `initial` by
/// more than `min_moved` in all, and that the gaps summed over all weights are under a
/// thousandth of that movement: rounding leaves gaps of ~1e-5 of it, while a wrong average (a
/// sum, one rank's gradient, a stale bucket) moves the weights by a share of the step itself.
pub fn assert_ends_as_one_rank(
    ranks: &[f32],
    one_rank: &[f32],
    initial: &[f32],
    rel: f64,
    min_moved: f64,
) {
    assert_eq!(ranks.len(), one_rank.len(), "weights of different models");
    let (mut moved, mut gaps) = (0.0f64, 0.0f64);
    for (i, ((a, b), w0)) in ranks.iter().zip(one_rank).zip(initial).enumerate() {
        let (a, b, w0) = (f64::from(*a), f64::from(*b), f64::from(*w0));
        assert!(
            (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-2),
            "weight {i}: {a} data-parallel vs {b} on one rank"
        );
        moved += (b - w0).abs();
        gaps += (a - b).abs();
    }
    assert!(
        moved > min_moved,
        "training did not move the weights: {moved}"
    );
    assert!(
        gaps <= 1e-3 * moved,
        "the weights differ from one rank's by {gaps} in all, against {moved} moved by training"
    );
}

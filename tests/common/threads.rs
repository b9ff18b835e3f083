//! Threads that share one rank of `Collective<B>`: each must get what the host computes, on any
//! inner backend (the wgpu tests in CI, the CUDA ones in `tests/gpu.rs`).

use burn_backend::Backend;
use burn_core::tensor::{IndexingUpdateOp, Int, Tensor};
use collective_fusion::backend::{Collective, CollectiveDevice};

/// A chain of `k` elementwise steps, a `select_assign` on a tensor and on its clone, and a
/// `take`, on `d`: whether every result is what the host computes.
pub fn threaded_work_is_right<B: Backend>(d: &CollectiveDevice<B::Device>, k: usize) -> bool {
    let base = [[0.0f32, 1.0, 2.0], [3.0, 4.0, 5.0]];
    let t = Tensor::<Collective<B>, 2>::from_data(base, d);
    let mut x = t.clone();
    for i in 0..k {
        x = (x * 2.0 + t.clone()).sub_scalar(i as f32);
    }
    let values = Tensor::<Collective<B>, 2>::from_data([[1.0, 2.0], [3.0, 4.0]], d);
    let indices = Tensor::<Collective<B>, 1, Int>::from_data([0, 2], d);
    let add = IndexingUpdateOp::Add;
    let neg = t
        .clone()
        .select_assign(-1, indices.clone(), values.clone(), add);
    let pos = t.clone().select_assign(1, indices, values, add);
    let row = Tensor::<Collective<B>, 1, Int>::from_data([1], d);
    let taken: Tensor<Collective<B>, 2> = t.take::<1, 2>(0, row);

    let mut want: Vec<f32> = base.concat();
    for i in 0..k {
        for (w, b) in want.iter_mut().zip(base.concat()) {
            *w = *w * 2.0 + b - i as f32;
        }
    }
    let read = |t: Tensor<Collective<B>, 2>| t.into_data().to_vec::<f32>().unwrap();
    read(x) == want
        && read(neg) == [1.0, 1.0, 4.0, 6.0, 4.0, 9.0]
        && read(pos) == [1.0, 1.0, 4.0, 6.0, 4.0, 9.0]
        && read(taken) == [3.0, 4.0, 5.0]
}

/// 8 threads, 24 rounds each of [`threaded_work_is_right`] on the device `device` makes: none
/// may differ from the host.
pub fn check_threads_sharing_a_rank<B: Backend>(
    device: impl Fn() -> CollectiveDevice<B::Device> + Sync,
) {
    let wrong: usize = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    let d = device();
                    (0..24)
                        .filter(|i| !threaded_work_is_right::<B>(&d, i % 7))
                        .count()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(wrong, 0, "results differing from the host's, of 8 × 24");
}

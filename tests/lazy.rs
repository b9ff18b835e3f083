//! Lazy recording of `Collective<I>`: ops record nodes and run only when a value is needed, in
//! record order, with the shapes their rules promise; results equal eager NdArray bitwise.
//!
//! Each test uses its own rank: the recorder and its counters are per rank and tests run in
//! parallel.

use burn_backend::{Backend, TensorMetadata};
use burn_core::tensor::activation::{relu, softmax};
use burn_core::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_ndarray::{NdArray, NdArrayDevice};
use burn_nn::conv::{Conv2dConfig, ConvTranspose2dConfig};
use burn_nn::{Linear, LinearConfig, PaddingConfig2d};
use collective_fusion::backend::{CTensor, Collective, CollectiveDevice, lazy_stats};

type C = Collective<NdArray>;

fn dev(rank: u32) -> CollectiveDevice<NdArrayDevice> {
    CollectiveDevice::new(NdArrayDevice::Cpu, rank)
}

fn data(n: usize, dims: Vec<usize>, seed: u32) -> TensorData {
    let v: Vec<f32> = (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 1000) as f32 / 250.0 - 2.0
        })
        .collect();
    TensorData::new(v, dims)
}

fn prim<const D: usize>(
    t: &Tensor<C, D>,
) -> CTensor<<NdArray as burn_backend::BackendTypes>::FloatTensorPrimitive> {
    match t.clone().into_primitive() {
        TensorPrimitive::Float(p) => p,
        TensorPrimitive::QFloat(_) => unreachable!("not quantized"),
    }
}

#[test]
fn ops_run_only_when_a_value_is_read_and_then_in_record_order() {
    let d = dev(101);
    let a: Tensor<C, 2> = Tensor::from_data(data(12, vec![3, 4], 1), &d);
    let b: Tensor<C, 2> = Tensor::from_data(data(12, vec![3, 4], 2), &d);
    let before = lazy_stats(101);
    let c = (a.clone() + b.clone()) * b.clone() - a.clone().exp();
    let s = c.clone().sum();
    let mid = lazy_stats(101);
    assert_eq!(
        mid.recorded - before.recorded,
        5,
        "add, mul, exp, sub, sum recorded"
    );
    assert_eq!(mid.executed, before.executed, "nothing ran before the read");
    assert!(prim(&c).is_pending());
    let got = s.into_data();
    let after = lazy_stats(101);
    assert_eq!(after.executed - mid.executed, 5);
    assert_eq!(
        after.forced_by_value - mid.forced_by_value,
        1,
        "one read ran the queue once"
    );
    assert!(!prim(&c).is_pending());

    let nd = NdArrayDevice::Cpu;
    let a: Tensor<NdArray, 2> = Tensor::from_data(data(12, vec![3, 4], 1), &nd);
    let b: Tensor<NdArray, 2> = Tensor::from_data(data(12, vec![3, 4], 2), &nd);
    let want = ((a.clone() + b.clone()) * b - a.exp()).sum().into_data();
    assert_eq!(got, want, "lazy equals eager bitwise");
}

#[test]
fn a_node_dropped_before_its_turn_never_runs() {
    let d = dev(102);
    let a: Tensor<C, 1> = Tensor::from_data(data(8, vec![8], 3), &d);
    let before = lazy_stats(102);
    let kept = a.clone() * 2.0;
    drop(a.clone().exp().log());
    C::sync(&d).unwrap();
    let after = lazy_stats(102);
    assert_eq!(after.recorded - before.recorded, 3);
    assert_eq!(
        after.executed - before.executed,
        1,
        "only the kept node ran"
    );
    assert_eq!(after.skipped - before.skipped, 2, "exp and log never ran");
    assert_eq!(after.forced_by_sync - before.forced_by_sync, 1);
    assert!(!prim(&kept).is_pending());
}

#[test]
fn recorded_shapes_and_dtypes_match_what_the_ops_compute() {
    let d = dev(103);
    let a: Tensor<C, 3> = Tensor::from_data(data(24, vec![2, 3, 4], 4), &d);
    let b: Tensor<C, 3> = Tensor::from_data(data(40, vec![2, 4, 5], 5), &d);
    let row: Tensor<C, 3> = Tensor::from_data(data(4, vec![1, 1, 4], 6), &d);
    let img: Tensor<C, 4> = Tensor::from_data(data(2 * 3 * 9 * 7, vec![2, 3, 9, 7], 7), &d);
    let conv = Conv2dConfig::new([3, 5], [3, 2])
        .with_stride([2, 1])
        .with_padding(PaddingConfig2d::Explicit(1, 2, 1, 2))
        .with_dilation([1, 2])
        .init::<C>(&d);
    let deconv = ConvTranspose2dConfig::new([3, 4], [3, 2])
        .with_stride([2, 3])
        .with_padding([1, 0])
        .with_padding_out([1, 2])
        .with_dilation([2, 1])
        .with_groups(1)
        .init::<C>(&d);
    let before = lazy_stats(103);
    let outs: Vec<(&str, CTensor<_>)> = vec![
        ("broadcast add", prim(&(a.clone() + row.clone()))),
        ("matmul", prim(&a.clone().matmul(b.clone()))),
        ("swap_dims", prim(&a.clone().swap_dims(0, 2))),
        ("permute", prim(&a.clone().permute([2, 0, 1]))),
        (
            "reshape",
            prim(&a.clone().reshape([4, 6]).reshape([2, 12, 1])),
        ),
        ("sum_dim", prim(&a.clone().sum_dim(1))),
        ("mean_dim", prim(&a.clone().mean_dim(2))),
        ("sum", prim(&a.clone().sum().reshape([1, 1, 1]))),
        ("relu", prim(&relu(a.clone()))),
        ("softmax", prim(&softmax(a.clone(), 2))),
        ("powf_scalar", prim(&a.clone().powf_scalar(2.0))),
        (
            "mask_where",
            prim(
                &a.clone()
                    .mask_where(a.clone().greater_elem(0.0), row.clone()),
            ),
        ),
        ("expand", prim(&row.clone().expand([2, 3, 4]))),
        ("conv2d", prim(&conv.forward(img.clone()))),
        ("conv_transpose2d", prim(&deconv.forward(img))),
    ];
    let mid = lazy_stats(103);
    assert_eq!(
        mid.executed, before.executed,
        "nothing ran to answer shapes"
    );
    for (what, t) in &outs {
        let (shape, dtype) = (t.shape(), t.dtype());
        let computed = t.inner();
        assert_eq!(shape, computed.shape(), "{what}: recorded shape");
        assert_eq!(dtype, computed.dtype(), "{what}: recorded dtype");
    }
    assert_eq!(
        lazy_stats(103).forced_by_metadata,
        before.forced_by_metadata
    );
}

#[test]
fn an_mlp_forward_is_lazy_and_equals_eager_ndarray_bitwise() {
    fn forward<B: Backend>(d: &B::Device) -> TensorData {
        B::seed(d, 11);
        let layers: Vec<Linear<B>> = [16, 32, 32, 4]
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(d))
            .collect();
        let mut h: Tensor<B, 2> = Tensor::from_data(data(8 * 16, vec![8, 16], 9), d);
        for (i, l) in layers.iter().enumerate() {
            h = l.forward(h);
            if i + 1 < layers.len() {
                h = relu(h);
            }
        }
        h.into_data()
    }
    let before = lazy_stats(104);
    let got = forward::<C>(&dev(104));
    let after = lazy_stats(104);
    assert_eq!(got, forward::<NdArray>(&NdArrayDevice::Cpu));
    assert!(
        after.recorded - before.recorded >= 8,
        "matmul, bias add and relu recorded"
    );
    assert_eq!(after.forced_by_metadata, before.forced_by_metadata);
}

#[test]
fn a_long_recording_without_reads_runs_its_older_half_at_the_bound() {
    let d = dev(105);
    let one: Tensor<C, 1> = Tensor::from_data(TensorData::new(vec![0.0f32], [1]), &d);
    let before = lazy_stats(105);
    let mut x = one.clone();
    for _ in 0..10_000 {
        x = x + 1.0;
    }
    let mid = lazy_stats(105).since(&before);
    assert!(mid.forced_by_bound >= 2, "{mid:?}");
    assert!(mid.executed >= 5_000, "{mid:?}");
    assert!(mid.executed < 10_000, "the newest stay pending: {mid:?}");
    assert_eq!(x.into_data().to_vec::<f32>().unwrap(), vec![10_000.0]);
}

#[test]
fn threads_forcing_one_rank_concurrently_each_get_their_value() {
    let d = dev(106);
    let base: Tensor<C, 1> = Tensor::from_data(TensorData::new(vec![1.0f32; 64], [64]), &d);
    let chains: Vec<Tensor<C, 1>> = (0..8)
        .map(|k| {
            let mut x = base.clone();
            for _ in 0..200 {
                x = x * 1.0 + k as f32;
            }
            x
        })
        .collect();
    let got: Vec<f32> = std::thread::scope(|s| {
        let hs: Vec<_> = chains
            .into_iter()
            .map(|x| s.spawn(move || x.into_data().to_vec::<f32>().unwrap()[0]))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want: Vec<f32> = (0..8).map(|k| 1.0 + 200.0 * k as f32).collect();
    assert_eq!(got, want);
}

#[test]
fn an_op_that_panics_when_it_runs_fails_every_reader_with_its_name_and_no_hang() {
    use burn_backend::ops::FloatTensorOps;
    let d = dev(107);
    let a: Tensor<C, 1> = Tensor::from_data(data(12, vec![12], 8), &d);
    // Straight to the backend, past Burn's shape checks: the inner backend panics when it runs.
    let bad = C::float_reshape(prim(&a), burn_std::Shape::new([5]));
    let other = bad.clone();
    let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bad.inner()));
    assert!(
        first.is_err(),
        "the inner backend's panic reaches the reader"
    );
    let second = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| other.inner()));
    let msg = second
        .err()
        .and_then(|p| p.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    assert!(
        msg.contains("float_reshape") && msg.contains("panicked while it ran"),
        "a later reader is told which op failed: {msg}"
    );
    // The rank's queue still works.
    let ok = (a + 1.0).sum().into_data().to_vec::<f32>().unwrap();
    assert_eq!(ok.len(), 1);
}

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
    assert_eq!(
        after.executed - mid.executed,
        7,
        "the two uploads (recorded before `before`) and the five ops"
    );
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
        2,
        "only the upload and the kept node ran"
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
    let idx3 = Tensor::<C, 3, burn_core::tensor::Int>::from_data(
        TensorData::new((0..12).map(|i| (i * 7 % 4) as i64).collect(), [2, 3, 2]),
        &d,
    );
    let idx1 = Tensor::<C, 1, burn_core::tensor::Int>::from_data(
        TensorData::new(vec![2i64, 0, 1, 1, 2], [5]),
        &d,
    );
    let vals: Tensor<C, 3> = Tensor::from_data(data(12, vec![2, 3, 2], 8), &d);
    let rows: Tensor<C, 3> = Tensor::from_data(data(40, vec![2, 5, 4], 9), &d);
    let before = lazy_stats(103);
    let outs: Vec<(&str, CTensor<_>)> = vec![
        ("gather", prim(&a.clone().gather(2, idx3.clone()))),
        (
            "scatter add",
            prim(
                &a.clone()
                    .scatter(2, idx3, vals, burn_backend::tensor::IndexingUpdateOp::Add),
            ),
        ),
        ("select", prim(&a.clone().select(1, idx1.clone()))),
        (
            "select add",
            prim(&a.clone().select_assign(
                1,
                idx1,
                rows,
                burn_backend::tensor::IndexingUpdateOp::Add,
            )),
        ),
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
fn a_thread_runs_its_own_ops_and_what_they_read_never_another_threads_others() {
    let d = dev(112);
    let a: Tensor<C, 1> = Tensor::from_data(data(16, vec![16], 3), &d);
    // Another thread records two ops on the same rank, and keeps them unread.
    let (shared, private) = std::thread::spawn({
        let a = a.clone();
        move || (a.clone().exp(), a * 3.0)
    })
    .join()
    .unwrap();
    assert!(prim(&shared).is_pending() && prim(&private).is_pending());
    // This thread records after them and reads only its own op: theirs stay queued.
    let mine = a.clone().sin();
    let got = mine.clone().into_data();
    assert!(!prim(&mine).is_pending());
    assert!(
        prim(&shared).is_pending() && prim(&private).is_pending(),
        "another thread's ops ran on this one"
    );
    // An op of this thread that reads one of theirs runs that one first, and only that one.
    let both = mine + shared.clone();
    let sum = both.into_data();
    assert!(!prim(&shared).is_pending());
    assert!(prim(&private).is_pending(), "an op nobody read here ran");
    let eager = |t: TensorData| Tensor::<NdArray, 1>::from_data(t, &NdArrayDevice::Cpu);
    let a0 = eager(data(16, vec![16], 3));
    got.assert_eq(&a0.clone().sin().into_data(), true);
    sum.assert_eq(&(a0.clone().sin() + a0.clone().exp()).into_data(), true);
    // `Backend::sync` on this thread runs what this thread recorded, not the other's.
    let later = a.clone().cos();
    C::sync(&d).unwrap();
    assert!(!prim(&later).is_pending());
    assert!(prim(&private).is_pending());
    private.into_data().assert_eq(&(a0 * 3.0).into_data(), true);
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

#[test]
fn a_step_with_norms_an_embedding_and_cross_entropy_records_no_eager_op() {
    use burn_autodiff::Autodiff;
    use burn_core::tensor::Int;
    use burn_nn::loss::CrossEntropyLossConfig;
    use burn_nn::{BatchNormConfig, EmbeddingConfig, LayerNormConfig};
    type A = Autodiff<C>;
    let d = dev(108);
    let conv = Conv2dConfig::new([2, 4], [3, 3])
        .with_padding(PaddingConfig2d::Same)
        .init::<A>(&d);
    let bn = BatchNormConfig::new(4).init::<A>(&d);
    let ln = LayerNormConfig::new(64).init::<A>(&d);
    let emb = EmbeddingConfig::new(10, 64).init::<A>(&d);
    let lin: Linear<A> = LinearConfig::new(64, 5).init(&d);
    let x: Tensor<A, 4> = Tensor::from_data(data(2 * 2 * 4 * 4, vec![2, 2, 4, 4], 3), &d);
    let tokens = Tensor::<A, 2, Int>::from_data(TensorData::new(vec![4i64, 7], [2, 1]), &d);
    let targets = Tensor::<A, 1, Int>::from_data(TensorData::new(vec![1i64, 3], [2]), &d);
    // Parameters initialize lazily; materialize them first.
    for w in [lin.weight.val().into_data(), emb.weight.val().into_data()] {
        assert!(!w.as_slice::<f32>().unwrap().is_empty());
    }
    let _ = conv.weight.val().into_data();
    let before = lazy_stats(108);
    let h = relu(bn.forward(conv.forward(x))).reshape([2, 64]);
    let h = ln.forward(h) + emb.forward(tokens).reshape([2, 64]);
    let logits = lin.forward(h);
    let loss = CrossEntropyLossConfig::new()
        .init(&d)
        .forward(logits, targets);
    let grads = loss.backward();
    let g = emb.weight.grad(&grads).unwrap().into_data();
    let after = lazy_stats(108).since(&before);
    // Conv, batch norm, relu, layer norm, embedding, linear, cross entropy and their backward
    // all recorded: the only thing that ran the queue is the read of the gradient.
    let forced: Vec<&str> = after.forced_by.keys().copied().collect();
    assert_eq!(forced, ["float_into_data"], "{after:?}");
    assert_eq!(after.forced_by_metadata, 0, "{after:?}");
    // The embedding's gradient is non-zero exactly on the two rows the tokens used.
    let g = g.to_vec::<f32>().unwrap();
    for row in 0..10 {
        let used = g[row * 64..][..64].iter().any(|v| *v != 0.0);
        assert_eq!(used, row == 4 || row == 7, "embedding row {row}");
    }
}

/// Ranges (`arange`, with and without a step, empty) and bool fills are recorded like the other
/// fills: nothing runs before a read, and the values are NdArray's.
#[test]
fn ranges_and_bool_fills_are_recorded() {
    use burn_core::tensor::{Bool, Int};
    type Made<B> = (Vec<Tensor<B, 1, Int>>, Vec<Tensor<B, 2, Bool>>);
    fn made<B: Backend>(d: &B::Device) -> Made<B> {
        let ints = vec![
            Tensor::arange(2..9, d),
            Tensor::arange_step(-3..8, 3, d),
            Tensor::arange(5..5, d),
        ];
        let bools = vec![
            Tensor::zeros([2, 3], d),
            Tensor::ones([2, 3], d),
            Tensor::full([1, 2], true, d),
        ];
        (ints, bools)
    }
    let d = dev(112);
    let before = lazy_stats(112);
    let (ints, bools) = made::<C>(&d);
    let mid = lazy_stats(112).since(&before);
    assert_eq!((mid.recorded, mid.executed), (6, 0), "{mid:?}");
    let (want_ints, want_bools) = made::<NdArray>(&NdArrayDevice::Cpu);
    for (got, want) in ints.into_iter().zip(want_ints) {
        assert_eq!(got.dims(), want.dims());
        let (got, want) = (got.into_data(), want.into_data());
        assert_eq!(got.to_vec::<i64>().unwrap(), want.to_vec::<i64>().unwrap());
    }
    for (got, want) in bools.into_iter().zip(want_bools) {
        let (got, want) = (got.into_data(), want.into_data());
        assert_eq!(
            got.to_vec::<bool>().unwrap(),
            want.to_vec::<bool>().unwrap()
        );
    }
    // A step of 0 panics at the call, as the inner backend's own does.
    let zero = std::panic::catch_unwind(|| Tensor::<C, 1, Int>::arange_step(0..4, 0, &d));
    assert!(zero.is_err(), "a step of 0 is refused at once");
}

/// Fills (`zeros`, `ones`, `full`, float and int) and moves (`to_device`) are recorded like any
/// op: they reach the inner backend in program order (a fusing backend fuses a fill with the
/// ops after it), nothing runs until a read, a moved tensor reports its target device and rank
/// without running, and the values are NdArray's.
#[test]
fn fills_and_moves_are_recorded_and_a_move_lands_on_its_target_rank() {
    use burn_core::tensor::{Bool, Int};
    let (d, e) = (dev(110), dev(111));
    let a: Tensor<C, 2> = Tensor::from_data(data(6, vec![2, 3], 4), &d);
    let _ = a.clone().into_data();
    let (before, before_e) = (lazy_stats(110), lazy_stats(111));
    let filled = a.clone() + Tensor::<C, 2>::full([2, 3], 2.5, &d)
        - Tensor::<C, 2>::ones([2, 3], &d)
        + Tensor::<C, 2>::zeros([2, 3], &d);
    let moved = filled.clone().to_device(&e);
    let mid = lazy_stats(110).since(&before);
    assert_eq!(mid.executed, 0, "nothing ran before a read: {mid:?}");
    assert_eq!(mid.recorded, 6, "3 fills, 3 ops: {mid:?}");
    let on_e = lazy_stats(111).since(&before_e);
    assert_eq!(
        (on_e.recorded, on_e.executed),
        (1, 0),
        "the move, recorded on its target rank: {on_e:?}"
    );
    assert!(prim(&moved).is_pending());
    assert_eq!(moved.device(), e, "the move's device, without running it");
    assert_eq!(
        lazy_stats(110).since(&before).executed,
        0,
        "asking the device ran nothing"
    );
    // Int fills, and moves of int and bool tensors (int arithmetic runs eagerly, which runs the
    // queue: after the float checks).
    let ints = Tensor::<C, 1, Int>::full([4], 7, &d) + Tensor::<C, 1, Int>::ones([4], &d)
        - Tensor::<C, 1, Int>::zeros([4], &d);
    let moved_ints = ints.clone().to_device(&e);
    let moved_mask = filled.clone().greater_elem(2.0).to_device(&e);
    assert_eq!(moved_ints.device(), e);
    assert_eq!(moved_mask.device(), e);
    // NdArray computes the same, eagerly.
    let nd = NdArrayDevice::Cpu;
    let a_nd: Tensor<NdArray, 2> = Tensor::from_data(data(6, vec![2, 3], 4), &nd);
    let want = a_nd + Tensor::<NdArray, 2>::full([2, 3], 2.5, &nd)
        - Tensor::<NdArray, 2>::ones([2, 3], &nd)
        + Tensor::<NdArray, 2>::zeros([2, 3], &nd);
    let got = moved.into_data();
    assert_eq!(got.dtype, want.clone().into_data().dtype);
    let (got, want) = (
        got.to_vec::<f32>().unwrap(),
        want.into_data().to_vec::<f32>().unwrap(),
    );
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let ints_nd = (Tensor::<NdArray, 1, Int>::full([4], 7, &nd)
        + Tensor::<NdArray, 1, Int>::ones([4], &nd))
    .into_data();
    assert_eq!(moved_ints.into_data(), ints_nd);
    let mask: Tensor<C, 2, Bool> = moved_mask;
    assert_eq!(
        mask.into_data().to_vec::<bool>().unwrap(),
        got.iter().map(|v| *v > 2.0).collect::<Vec<_>>()
    );
}

/// Slices (`slice`, `narrow`, `chunk`), slice assigns and concatenations are recorded: a
/// rotary embedding's shape of work (the halves of a row swapped, one negated, written back
/// into a copy, or concatenated) runs nothing until its read, reports its shapes without
/// running, and computes NdArray's values bit for bit.
#[test]
fn slices_and_slice_assigns_are_recorded_and_compute_ndarray_values() {
    type Rotated<Bk> = (Tensor<Bk, 2>, Tensor<Bk, 2>, Tensor<Bk, 2>);
    fn rotate<Bk: Backend>(x: Tensor<Bk, 2>) -> Rotated<Bk> {
        let halves = x.clone().chunk(2, 1);
        let cat = Tensor::cat(vec![-halves[1].clone(), halves[0].clone()], 1);
        let swapped = x
            .clone()
            .slice_assign([0..4, 0..3], -halves[1].clone())
            .slice_assign([0..4, 3..6], halves[0].clone());
        let corner = x.narrow(0, 1, 2).slice([0..2, 2..5]) * 2.0;
        (swapped, corner, cat)
    }
    let d = dev(119);
    let x: Tensor<C, 2> = Tensor::from_data(data(24, vec![4, 6], 7), &d);
    let _ = x.clone().into_data();
    let before = lazy_stats(119);
    let (swapped, corner, cat) = rotate(x);
    assert_eq!(swapped.dims(), [4, 6]);
    assert_eq!(corner.dims(), [2, 3]);
    assert_eq!(cat.dims(), [4, 6]);
    let mid = lazy_stats(119).since(&before);
    assert_eq!(mid.executed, 0, "nothing ran before the read: {mid:?}");
    assert_eq!(mid.forced_by_metadata, 0, "{mid:?}");
    let (got_swapped, got_corner, got_cat) =
        (swapped.into_data(), corner.into_data(), cat.into_data());
    let alone = NdArrayDevice::Cpu;
    let (want_swapped, want_corner, want_cat) =
        rotate::<NdArray>(Tensor::from_data(data(24, vec![4, 6], 7), &alone));
    let bits = |t: TensorData| -> Vec<u32> {
        t.to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(bits(got_swapped.clone()), bits(want_swapped.into_data()));
    assert_eq!(bits(got_corner), bits(want_corner.into_data()));
    assert_eq!(bits(got_cat.clone()), bits(want_cat.into_data()));
    assert_eq!(bits(got_cat), bits(got_swapped), "two ways to rotate");
}

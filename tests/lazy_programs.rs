//! Random programs of tensor ops run on `Collective<NdArray>` and on NdArray alone must see the
//! same shapes and read the same bits (NaNs compared as NaN). A program draws new tensors and
//! fills, picks rows by uploaded indices and fills by uploaded masks, applies unary, binary, shape
//! and reduction ops (many recorded by a rule, some eager), clones and drops handles, consumes an
//! operand's last handle (where the inner backend may work in place) or a clone of it, reads values
//! midway and syncs, under a lazy window drawn from 2 to 64 ops: the interplay of recording,
//! forcing, skipping and moving values out of nodes that a test of one op at a time does not reach.
//! The program is written once, generic over the backend, so both runs take the same decisions as
//! long as the shapes agree. The same programs run on Burn's fused wgpu backend too, checked
//! against NdArray where wgpu alone agrees with it (see `on_wgpu`).
//!
//! Left out: `recip`. NdArray's is not reproducible: a uniquely owned buffer is divided in place
//! with an approximate SIMD reciprocal over its aligned body and exactly at its unaligned ends
//! (macerator's `VRecip`, `align_to_mut`), so which elements are approximated follows the
//! buffer's address, and two runs of NdArray alone in one process read different bits.

mod common;

use burn_backend::Backend;
use burn_core::tensor::activation::{gelu, relu, sigmoid, softmax};
use burn_core::tensor::{Bool, Int, Tensor, TensorData};
use burn_ndarray::{NdArray, NdArrayDevice};
use collective_fusion::backend::{Collective, CollectiveDevice, set_lazy_window};
use proptest::prelude::*;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};

/// An op of one operand.
#[derive(Clone, Copy, Debug)]
enum Unary {
    Exp,
    Log,
    Neg,
    Abs,
    Tanh,
    Sqrt,
    Sin,
    Relu,
    Sigmoid,
    Gelu,
    Softmax(usize),
    MulScalar,
    AddScalar,
    PowfScalar,
    Clamp,
    Cumsum(usize),
    Transpose,
    Sum,
    SumDim(usize),
    MeanDim(usize),
    MaxDim(usize),
    ArgmaxSelect(usize),
    Reshape,
    Expand,
}

/// An op of two operands.
#[derive(Clone, Copy, Debug)]
enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    MaxPair,
    MaskWhere,
    Matmul,
    Cat,
    SliceAssign,
}

/// One step of a program. Operand indices are taken modulo the live handles.
#[derive(Clone, Debug)]
enum Step {
    New {
        rows: usize,
        cols: usize,
        seed: u32,
    },
    Fill {
        rows: usize,
        cols: usize,
        value: i8,
    },
    Unary {
        op: Unary,
        a: usize,
        take: bool,
    },
    Binary {
        op: Binary,
        a: usize,
        b: usize,
        take: bool,
    },
    Slice {
        a: usize,
        from: (usize, usize),
        take: bool,
    },
    /// Rows picked by indices uploaded from the host (an int upload).
    Pick {
        a: usize,
        seed: u32,
        take: bool,
    },
    /// Elements filled where a mask uploaded from the host is set (a bool upload).
    Mask {
        a: usize,
        seed: u32,
        take: bool,
    },
    Clone(usize),
    Drop(usize),
    Read(usize),
    Sync,
}

/// What a program saw: a shape, or a value's shape and bits.
#[derive(Debug, PartialEq)]
enum Seen {
    Shape(Vec<usize>),
    Value(Vec<usize>, Vec<u32>),
}

fn unary() -> impl Strategy<Value = Unary> {
    use Unary::*;
    let dim = 0usize..2;
    prop_oneof![
        prop::sample::select(vec![
            Exp, Log, Neg, Abs, Tanh, Sqrt, Sin, Relu, Sigmoid, Gelu, MulScalar, AddScalar,
            PowfScalar, Clamp, Transpose, Sum, Reshape, Expand,
        ]),
        dim.clone().prop_map(Softmax),
        dim.clone().prop_map(Cumsum),
        dim.clone().prop_map(SumDim),
        dim.clone().prop_map(MeanDim),
        dim.clone().prop_map(MaxDim),
        dim.prop_map(ArgmaxSelect),
    ]
}

fn binary() -> impl Strategy<Value = Binary> {
    use Binary::*;
    prop::sample::select(vec![
        Add,
        Sub,
        Mul,
        Div,
        MaxPair,
        MaskWhere,
        Matmul,
        Cat,
        SliceAssign,
    ])
}

fn step() -> impl Strategy<Value = Step> {
    let i = 0usize..16;
    prop_oneof![
        2 => (1usize..5, 1usize..5, any::<u32>())
            .prop_map(|(rows, cols, seed)| Step::New { rows, cols, seed }),
        1 => (1usize..5, 1usize..5, -2i8..3)
            .prop_map(|(rows, cols, value)| Step::Fill { rows, cols, value }),
        6 => (unary(), i.clone(), any::<bool>())
            .prop_map(|(op, a, take)| Step::Unary { op, a, take }),
        6 => (binary(), i.clone(), i.clone(), any::<bool>())
            .prop_map(|(op, a, b, take)| Step::Binary { op, a, b, take }),
        2 => (i.clone(), (0usize..4, 0usize..4), any::<bool>())
            .prop_map(|(a, from, take)| Step::Slice { a, from, take }),
        1 => (i.clone(), any::<u32>(), any::<bool>())
            .prop_map(|(a, seed, take)| Step::Pick { a, seed, take }),
        1 => (i.clone(), any::<u32>(), any::<bool>())
            .prop_map(|(a, seed, take)| Step::Mask { a, seed, take }),
        1 => i.clone().prop_map(Step::Clone),
        1 => i.clone().prop_map(Step::Drop),
        1 => i.prop_map(Step::Read),
        1 => Just(Step::Sync),
    ]
}

/// Values in [-2, 2) on a coarse grid, from a seed.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let x = i
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (x >> 8) as f32 % 64.0 / 16.0 - 2.0
        })
        .collect()
}

/// The handle at `i` (modulo the live ones): moved out of the pool when `take`, else a clone.
fn operand<B: Backend>(pool: &mut Vec<Tensor<B, 2>>, i: usize, take: bool) -> Tensor<B, 2> {
    let i = i % pool.len();
    if take {
        pool.remove(i)
    } else {
        pool[i].clone()
    }
}

fn dims<B: Backend>(t: &Tensor<B, 2>) -> [usize; 2] {
    t.dims()
}

fn seen<B: Backend>(t: Tensor<B, 2>) -> Seen {
    let shape = t.dims().to_vec();
    let bits = t
        .into_data()
        .to_vec::<f32>()
        .expect("f32 values")
        .into_iter()
        .map(|v| {
            if v.is_nan() {
                f32::NAN.to_bits()
            } else {
                v.to_bits()
            }
        })
        .collect();
    Seen::Value(shape, bits)
}

fn apply_unary<B: Backend>(op: Unary, t: Tensor<B, 2>) -> Tensor<B, 2> {
    let [rows, cols] = dims(&t);
    match op {
        Unary::Exp => t.exp(),
        Unary::Log => t.log(),
        Unary::Neg => t.neg(),
        Unary::Abs => t.abs(),
        Unary::Tanh => t.tanh(),
        Unary::Sqrt => t.sqrt(),
        Unary::Sin => t.sin(),
        Unary::Relu => relu(t),
        Unary::Sigmoid => sigmoid(t),
        Unary::Gelu => gelu(t),
        Unary::Softmax(d) => softmax(t, d),
        Unary::MulScalar => t.mul_scalar(-1.5),
        Unary::AddScalar => t.add_scalar(0.25),
        Unary::PowfScalar => t.powf_scalar(2.0),
        Unary::Clamp => t.clamp(-1.0, 0.5),
        Unary::Cumsum(d) => t.cumsum(d),
        Unary::Transpose => t.transpose(),
        Unary::Sum => t.sum().reshape([1, 1]),
        Unary::SumDim(d) => t.sum_dim(d),
        Unary::MeanDim(d) => t.mean_dim(d),
        Unary::MaxDim(d) => t.max_dim(d),
        Unary::ArgmaxSelect(d) => {
            // The arg-max along `d` (an int tensor) picks rows or columns back out of `t`.
            let picked: Tensor<B, 1, Int> = t.clone().argmax(d).flatten(0, 1);
            t.select(d, picked)
        }
        Unary::Reshape => t.reshape([cols, rows]),
        Unary::Expand if rows == 1 => t.expand([3, cols]),
        Unary::Expand if cols == 1 => t.expand([rows, 2]),
        Unary::Expand => t.swap_dims(0, 1),
    }
}

/// `a op b`; where the shapes do not fit the op, a fitting fallback (broadcast needs equal
/// dims or a 1; a matmul, inner dims that agree).
fn apply_binary<B: Backend>(op: Binary, a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    let ([ar, ac], [br, bc]) = (dims(&a), dims(&b));
    let broadcasts = (ar == br || ar == 1 || br == 1) && (ac == bc || ac == 1 || bc == 1);
    match op {
        Binary::Matmul if ac == br => a.matmul(b),
        Binary::Matmul if ac == bc => a.matmul(b.transpose()),
        Binary::Cat if ac == bc => Tensor::cat(vec![a, b], 0),
        Binary::Cat if ar == br => Tensor::cat(vec![a, b], 1),
        Binary::SliceAssign if br <= ar && bc <= ac => {
            let (r, c) = (ar - br, ac - bc);
            a.slice_assign([r..ar, c..ac], b.mul_scalar(3.0))
        }
        _ if !broadcasts => a.clone().add_scalar(1.0).mul(a),
        Binary::Add => a.add(b),
        Binary::Sub => a.sub(b),
        Binary::Mul => a.mul(b),
        Binary::Div => a.div(b),
        Binary::MaxPair => a.max_pair(b),
        Binary::MaskWhere => {
            let shape = [ar.max(br), ac.max(bc)];
            let (a, b) = (a.expand(shape), b.expand(shape));
            a.clone().mask_where(a.greater(b.clone()), b)
        }
        _ => a.sub(b).abs(),
    }
}

/// Runs `program` on `device` over the handles in `pool`, returning what it saw: each result's
/// shape and each read's value.
fn steps<B: Backend>(
    pool: &mut Vec<Tensor<B, 2>>,
    program: &[Step],
    device: &B::Device,
) -> Vec<Seen> {
    let mut log = Vec::new();
    for step in program {
        let made = match *step {
            Step::New { rows, cols, seed } => Some(Tensor::from_data(
                TensorData::new(values(rows * cols, seed), [rows, cols]),
                device,
            )),
            Step::Fill { rows, cols, value } => Some(match value {
                0 => Tensor::zeros([rows, cols], device),
                1 => Tensor::ones([rows, cols], device),
                v => Tensor::full([rows, cols], v as f32 * 0.75, device),
            }),
            _ if pool.is_empty() => None,
            Step::Unary { op, a, take } => {
                let t = operand(pool, a, take);
                Some(apply_unary(op, t))
            }
            Step::Binary { op, a, b, take } => {
                let x = operand(pool, a, take);
                let y = if pool.is_empty() {
                    x.clone()
                } else {
                    operand(pool, b, false)
                };
                Some(apply_binary(op, x, y))
            }
            Step::Slice { a, from, take } => {
                let t = operand(pool, a, take);
                let [rows, cols] = dims(&t);
                let (r, c) = (from.0 % rows, from.1 % cols);
                Some(t.slice([r..rows, c..cols]))
            }
            Step::Pick { a, seed, take } => {
                let t = operand(pool, a, take);
                let rows = dims(&t)[0] as u32;
                let picks: Vec<i32> = (0..1 + seed % 4)
                    .map(|k| (seed / 4 + 7 * k) % rows)
                    .map(|r| r as i32)
                    .collect();
                let n = picks.len();
                let picks = Tensor::<B, 1, Int>::from_data(TensorData::new(picks, [n]), device);
                Some(t.select(0, picks))
            }
            Step::Mask { a, seed, take } => {
                let t = operand(pool, a, take);
                let [rows, cols] = dims(&t);
                let set: Vec<bool> = (0..(rows * cols) as u32)
                    .map(|k| (seed >> (k % 32)) & 1 == 1)
                    .collect();
                let mask = TensorData::new(set, [rows, cols]);
                Some(t.mask_fill(Tensor::<B, 2, Bool>::from_data(mask, device), 0.5))
            }
            Step::Clone(a) => {
                let t = operand(pool, a, false);
                Some(t)
            }
            Step::Drop(a) => {
                drop(operand(pool, a, true));
                None
            }
            Step::Read(a) => {
                log.push(seen(operand(pool, a, false)));
                None
            }
            Step::Sync => {
                B::sync(device).expect("sync");
                None
            }
        };
        if let Some(t) = made {
            log.push(Seen::Shape(dims(&t).to_vec()));
            pool.push(t);
        }
    }
    log
}

/// What `program` sees from an empty pool, and then every live handle's value.
fn run<B: Backend>(program: &[Step], device: &B::Device) -> Vec<Seen> {
    let mut pool = Vec::new();
    let mut log = steps::<B>(&mut pool, program, device);
    log.extend(pool.into_iter().map(seen));
    log
}

/// `start` from an empty pool, then `left` on this thread and `right` on another at the same
/// time, each from its own clones of the handles `start` left (nothing of `start` has to have
/// run). What each of the two saw, its live handles' values at the end included.
fn two_threads<B: Backend>(
    start: &[Step],
    left: &[Step],
    right: &[Step],
    device: &B::Device,
) -> (Vec<Seen>, Vec<Seen>) {
    let mut pool = Vec::new();
    steps::<B>(&mut pool, start, device);
    let mut other = pool.clone();
    std::thread::scope(|scope| {
        let right = scope.spawn(|| {
            let mut log = steps(&mut other, right, device);
            log.extend(other.into_iter().map(seen));
            log
        });
        let mut log = steps(&mut pool, left, device);
        log.extend(pool.into_iter().map(seen));
        (log, right.join().expect("the second thread"))
    })
}

/// One rank for every case of a test (its cases run one after another); the next for the other
/// test.
const RANK: u32 = 240;

/// The tests here take turns, one case at a time: the lazy window is one setting for the whole
/// process, and what Burn's fusion layer computes can hang on what it saw before on the device
/// (the fifth program in `docs/burn.md`), so two at once would make each other's runs differ
/// from one test run to the next.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_programs_see_what_ndarray_sees(
        program in prop::collection::vec(step(), 1..48),
        window in prop::sample::select(vec![2usize, 3, 5, 8, 64]),
    ) {
        let _one_at_a_time = turn();
        let want = run::<NdArray>(&program, &NdArrayDevice::Cpu);
        set_lazy_window(window);
        let device = CollectiveDevice::new(NdArrayDevice::Cpu, RANK);
        let got = run::<Collective<NdArray>>(&program, &device);
        prop_assert_eq!(got, want);
    }

    /// Two threads of one rank share handles whose ops neither has run yet: a thread that needs
    /// one forces it (and what it reads) and nothing else of the other thread's.
    #[test]
    fn two_threads_sharing_pending_handles_see_what_ndarray_sees(
        start in prop::collection::vec(step(), 1..16),
        left in prop::collection::vec(step(), 1..32),
        right in prop::collection::vec(step(), 1..32),
        window in prop::sample::select(vec![2usize, 3, 5, 8, 64]),
    ) {
        let _one_at_a_time = turn();
        let want = two_threads::<NdArray>(&start, &left, &right, &NdArrayDevice::Cpu);
        set_lazy_window(window);
        let device = CollectiveDevice::new(NdArrayDevice::Cpu, RANK + 1);
        let got = two_threads::<Collective<NdArray>>(&start, &left, &right, &device);
        prop_assert_eq!(got, want);
    }
}

/// A thing seen, its values as numbers (for messages).
fn shown(seen: &Seen) -> String {
    match seen {
        Seen::Shape(dims) => format!("shape {dims:?}"),
        Seen::Value(dims, bits) => {
            let values: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
            format!("{dims:?} {values:?}")
        }
    }
}

/// Whether what a wgpu run saw agrees with what NdArray saw (`want`) as far as two backends'
/// float math may differ: the same shape, and values equal (0 as -0) or apart by at most 1e-3
/// of the larger magnitude (of 1 below it). Where NdArray reads NaN or an infinity, anything
/// goes: WGSL does not promise them (on lavapipe, `0 / 0` of a zero fill reads NaN or 0.0 by
/// which kernel Burn's fusion layer runs it in, and that hangs on what it ran before).
fn close(got: &Seen, want: &Seen) -> bool {
    let near = |(x, y): (&u32, &u32)| {
        let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
        !y.is_finite() || x == y || (x - y).abs() <= 1e-3 * x.abs().max(y.abs()).max(1.0)
    };
    match (got, want) {
        (Seen::Shape(x), Seen::Shape(y)) => x == y,
        (Seen::Value(sx, x), Seen::Value(sy, y)) => sx == sy && x.iter().zip(y).all(near),
        _ => false,
    }
}

/// The programs above on Burn's default wgpu backend (fusion on) are compared with NdArray
/// within float tolerance, not bitwise against wgpu alone: Burn 0.21's fused wgpu computes some
/// programs wrong by itself (`docs/burn.md`), and its fused blocks may round the last bits
/// differently where `Collective` hands it the same ops. So the property is: wherever wgpu
/// alone reads what NdArray reads, `Collective<Wgpu>` does too. A program that breaks it is
/// one that `Collective` turns from right to wrong, whoever's code computes the wrong value.
/// The programs are drawn from a fixed seed (set `PROPTEST_RNG_SEED` and `PROPTEST_CASES` to
/// hunt with others), so a run in CI is the same run every time.
fn on_wgpu() -> ProptestConfig {
    ProptestConfig {
        cases: 24,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x00c0_11ec),
        ..ProptestConfig::default()
    }
}

/// Set when Burn's fused wgpu panicked by itself (`docs/burn.md`: a `select` and a reduction of
/// one tensor fused together): its device answers nothing after that, so the cases left have no
/// reference to compare with.
static BURN_PANICKED: AtomicBool = AtomicBool::new(false);

proptest! {
    #![proptest_config(on_wgpu())]

    #[test]
    fn random_programs_on_fused_wgpu_are_right_where_wgpu_alone_is(
        program in prop::collection::vec(step(), 1..32),
        window in prop::sample::select(vec![2usize, 3, 5, 8, 64]),
    ) {
        if common::cube::wgpu_client().is_none() {
            return Ok(());
        }
        let _one_at_a_time = turn();
        type W = burn_wgpu::Wgpu;
        if BURN_PANICKED.load(Ordering::Relaxed) {
            return Ok(());
        }
        let device = burn_wgpu::WgpuDevice::DefaultDevice;
        let want = run::<NdArray>(&program, &NdArrayDevice::Cpu);
        let alone = std::panic::catch_unwind(AssertUnwindSafe(|| run::<W>(&program, &device)));
        let Ok(alone) = alone else {
            BURN_PANICKED.store(true, Ordering::Relaxed);
            eprintln!(
                "wgpu alone panicked on {program:?} (Burn's own failure: its device is unusable \
                 after it); the cases left are skipped"
            );
            return Ok(());
        };
        set_lazy_window(window);
        let got = run::<Collective<W>>(&program, &CollectiveDevice::new(device, RANK + 3));
        prop_assert_eq!(got.len(), want.len());
        for (i, want) in want.iter().enumerate() {
            if close(&alone[i], want) {
                prop_assert!(
                    close(&got[i], want),
                    "seen #{}: Collective<Wgpu> {}, wgpu alone {}, NdArray {}",
                    i, shown(&got[i]), shown(&alone[i]), shown(want)
                );
            }
        }
    }
}

/// The pick of the largest value of a row through `argmax` and `select`, with a tensor uploaded
/// and used after it, under `Collective` over Burn's fused wgpu backend. Burn 0.21's fusion
/// layer returns the row's first value instead when the upload reaches it between the `argmax`
/// and the `select` (it does so without `Collective` too: `docs/burn.md`). Uploads used to run at
/// once, ahead of the ops queued before them, and made that order here; they are recorded now,
/// so the inner backend sees this program in its own order.
#[test]
fn an_upload_reaches_fused_wgpu_in_program_order() {
    if common::cube::wgpu_client().is_none() {
        return;
    }
    let _one_at_a_time = turn();
    type W = burn_wgpu::Wgpu;
    set_lazy_window(2);
    let device = CollectiveDevice::new(burn_wgpu::WgpuDevice::DefaultDevice, RANK + 2);
    let a: Tensor<Collective<W>, 2> =
        Tensor::from_data(TensorData::new(values(9, 798_618_331), [3, 3]), &device);
    let s = a.sum_dim(0);
    let x = s.clone().exp();
    let c1 = s.clone().cumsum(0);
    let c2 = x.clone().cumsum(0);
    let picked: Tensor<Collective<W>, 1, Int> = c2.clone().argmax(1).flatten(0, 1);
    let y = c2.clone().select(1, picked.clone());
    let e: Tensor<Collective<W>, 2> =
        Tensor::from_data(TensorData::new(values(2, 0), [1, 2]), &device);
    let m = e.clone().add_scalar(1.0).mul(e);
    let read = |t: Tensor<Collective<W>, 2>| t.into_data().to_vec::<f32>().expect("f32");
    let row = read(x);
    let (_, _, _) = (read(s), read(c1), read(c2));
    let largest = row.iter().copied().fold(f32::MIN, f32::max);
    assert!(
        row[0] < largest,
        "the row's first value is not its largest: {row:?}"
    );
    assert_eq!(read(y), vec![largest], "the largest of {row:?}");
    assert_eq!(read(m).len(), 2);
}

/// Two programs the wgpu property above found. An index upload (`Pick`) and a mask upload
/// (`Mask`) used to run at once, so they reached Burn's fused wgpu ahead of the ops queued
/// before them; Burn 0.21 panicked in its fuser on the first order and read wrong values on the
/// second, where both programs in their own order are right (`docs/burn.md`). Uploads of every
/// kind are recorded now and reach it in program order.
#[test]
fn index_and_mask_uploads_reach_fused_wgpu_in_program_order() {
    if common::cube::wgpu_client().is_none() {
        return;
    }
    let _one_at_a_time = turn();
    use Step::{Binary as B, Mask, New, Pick, Slice, Unary as U};
    let (f, t) = (false, true);
    let index = vec![
        New {
            rows: 4,
            cols: 4,
            seed: 1_578_170_142,
        },
        B {
            op: Binary::Add,
            a: 6,
            b: 9,
            take: f,
        },
        B {
            op: Binary::Add,
            a: 0,
            b: 10,
            take: f,
        },
        U {
            op: Unary::ArgmaxSelect(1),
            a: 13,
            take: f,
        },
        U {
            op: Unary::Sigmoid,
            a: 7,
            take: f,
        },
        New {
            rows: 1,
            cols: 3,
            seed: 337_217_911,
        },
        Slice {
            a: 13,
            from: (2, 1),
            take: f,
        },
        U {
            op: Unary::MeanDim(0),
            a: 10,
            take: t,
        },
        U {
            op: Unary::MaxDim(0),
            a: 11,
            take: t,
        },
        U {
            op: Unary::Exp,
            a: 1,
            take: f,
        },
        New {
            rows: 3,
            cols: 4,
            seed: 3_129_117_790,
        },
        Pick {
            a: 14,
            seed: 3_099_680_360,
            take: f,
        },
        Pick {
            a: 2,
            seed: 3_707_985_314,
            take: f,
        },
        U {
            op: Unary::Log,
            a: 2,
            take: t,
        },
        U {
            op: Unary::Softmax(1),
            a: 15,
            take: f,
        },
        B {
            op: Binary::MaskWhere,
            a: 11,
            b: 12,
            take: t,
        },
    ];
    let mask = vec![
        New {
            rows: 4,
            cols: 4,
            seed: 3_058_166_453,
        },
        Pick {
            a: 11,
            seed: 3_490_260_036,
            take: f,
        },
        Mask {
            a: 14,
            seed: 3_519_962_739,
            take: t,
        },
        Pick {
            a: 14,
            seed: 2_720_510_219,
            take: t,
        },
    ];
    type W = burn_wgpu::Wgpu;
    let device = CollectiveDevice::new(burn_wgpu::WgpuDevice::DefaultDevice, RANK + 4);
    for (name, program) in [("index", index), ("mask", mask)] {
        let want = run::<NdArray>(&program, &NdArrayDevice::Cpu);
        set_lazy_window(2);
        let got = run::<Collective<W>>(&program, &device);
        assert_eq!(got.len(), want.len());
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            let (ok, got, want) = (close(got, want), shown(got), shown(want));
            assert!(ok, "{name} program, seen #{i}: {got}, NdArray {want}");
        }
    }
}

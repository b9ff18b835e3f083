//! `Collective<I>` computes exactly what `I` computes: every method of Burn's op traits, required
//! or with a default body, is passed to the inner backend (recorded first where `op_table.rs`
//! has a rule), so Burn's generic default bodies never replace the inner backend's own.
//!
//! The differential tests run the same program on `NdArray` and on `Collective<NdArray>` and
//! compare the bits. The listing test reads Burn's traits and the inner backends' impls from
//! their sources, so it fails when Burn gains a method nobody forwards.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn_autodiff::Autodiff;
use burn_backend::Backend;
use burn_backend::tensor::IndexingUpdateOp;
use burn_core::tensor::{Bool, Int, Tensor, TensorData, linalg};
use burn_ndarray::{NdArray, NdArrayDevice};
use collective_fusion::backend::{Collective, CollectiveDevice};

type C = Collective<NdArray>;

fn cdev(rank: u32) -> CollectiveDevice<NdArrayDevice> {
    CollectiveDevice::new(NdArrayDevice::Cpu, rank)
}

/// Seeded values in [-2, 2), with exact zeros and repeats mixed in.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 16) as f32 / 4.0 - 2.0
        })
        .collect()
}

fn bits(d: &TensorData) -> (Vec<usize>, Vec<u64>) {
    let v: Vec<u64> = match d.dtype {
        burn_std::DType::F32 => d
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        burn_std::DType::Bool(_) => d
            .to_vec::<bool>()
            .unwrap()
            .iter()
            .map(|b| *b as u64)
            .collect(),
        _ => d
            .to_vec::<i64>()
            .unwrap()
            .iter()
            .map(|x| *x as u64)
            .collect(),
    };
    (d.shape.to_vec(), v)
}

/// Asserts that `f` on NdArray and on `Collective<NdArray>` gives the same bits, result by
/// result.
fn same_bits(
    rank: u32,
    f_nd: impl FnOnce(&NdArrayDevice) -> Vec<(&'static str, TensorData)>,
    f_c: impl FnOnce(&CollectiveDevice<NdArrayDevice>) -> Vec<(&'static str, TensorData)>,
) {
    let want = f_nd(&NdArrayDevice::Cpu);
    let got = f_c(&cdev(rank));
    assert_eq!(want.len(), got.len());
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        assert_eq!(
            bits(w),
            bits(g),
            "{name}: Collective<NdArray> differs from NdArray"
        );
    }
}

/// The ops whose Burn default differs from NdArray's own, or which NdArray overrides.
fn defaulted_ops<B: Backend>(d: &B::Device) -> Vec<(&'static str, TensorData)> {
    let a: Tensor<B, 2> = Tensor::from_data(TensorData::new(values(24, 3), [4, 6]), d);
    let b: Tensor<B, 2> = Tensor::from_data(TensorData::new(values(24, 7), [4, 6]), d);
    let neg: Tensor<B, 1> = Tensor::from_data([-3.0f32, 4.0, -5.0, 1.0], d);
    let sixty: Tensor<B, 1> = Tensor::from_data([3.0f32, 4.0, 5.0], d);
    let int: Tensor<B, 2, Int> = a.clone().mul_scalar(4).int();
    let flags: Tensor<B, 2, Bool> = a.clone().greater_elem(0.0);
    let (top, top_idx) = a.clone().topk_with_indices(2, 1);
    let (sorted, sort_idx) = a.clone().sort_with_indices(1);
    let (max, max_idx) = a.clone().max_dim_with_indices(1);
    vec![
        ("prod (negative inputs)", neg.clone().prod().into_data()),
        ("prod of 3·4·5", sixty.prod().into_data()),
        ("prod_dim", a.clone().prod_dim(1).into_data()),
        ("neg", a.clone().neg().into_data()),
        ("transpose", a.clone().transpose().into_data()),
        ("clamp", a.clone().clamp(-1.0, 1.0).into_data()),
        ("clamp_min", a.clone().clamp_min(0.5).into_data()),
        ("clamp_max", a.clone().clamp_max(-0.5).into_data()),
        ("mean", a.clone().mean().into_data()),
        ("max", a.clone().max().into_data()),
        ("min_dim", a.clone().min_dim(0).into_data()),
        ("max_dim", max.into_data()),
        ("max_dim indices", max_idx.into_data()),
        ("max_abs", a.clone().max_abs().into_data()),
        ("sign", a.clone().sign().into_data()),
        ("powi", a.clone().powi_scalar(3).into_data()),
        ("powf_scalar", a.clone().abs().powf_scalar(0.5).into_data()),
        (
            "cat",
            Tensor::cat(vec![a.clone(), b.clone()], 1).into_data(),
        ),
        ("repeat_dim", a.clone().repeat_dim(0, 2).into_data()),
        ("not_equal", a.clone().not_equal(b.clone()).into_data()),
        ("is_nan", a.clone().div(b.clone()).is_nan().into_data()),
        ("any", flags.clone().any().into_data()),
        ("all_dim", flags.clone().all_dim(1).into_data()),
        (
            "bool cat",
            Tensor::cat(vec![flags.clone(), flags], 0).into_data(),
        ),
        (
            "int cat",
            Tensor::cat(vec![int.clone(), int.clone()], 0).into_data(),
        ),
        ("int clamp", int.clone().clamp(-2, 2).into_data()),
        ("int max_dim", int.clone().max_dim(1).into_data()),
        ("int sign", int.sign().into_data()),
        ("topk", top.into_data()),
        ("topk indices", top_idx.into_data()),
        ("sort", sorted.into_data()),
        ("argsort", sort_idx.into_data()),
        ("cumsum", a.clone().cumsum(1).into_data()),
        (
            "softmin",
            burn_core::tensor::activation::softmin(a.clone(), 1).into_data(),
        ),
        (
            "hard_sigmoid",
            burn_core::tensor::activation::hard_sigmoid(a, 0.2, 0.5).into_data(),
        ),
    ]
}

#[test]
fn defaulted_ops_compute_what_the_inner_backend_computes() {
    same_bits(201, defaulted_ops::<NdArray>, defaulted_ops::<C>);
}

fn products_and_det<B: Backend>(d: &B::Device) -> Vec<(&'static str, TensorData)> {
    let neg: Tensor<B, 2> = Tensor::from_data([[-1.0f32, 2.0, -3.0], [4.0, -5.0, 6.0]], d);
    let m: Tensor<B, 3> = Tensor::from_data(
        [
            [[1.0f32, 2.0], [3.0, 4.0]],
            [[-2.0, 0.0], [0.0, 3.0]],
            [[5.0, -6.0], [7.0, 8.0]],
        ],
        d,
    );
    let m3: Tensor<B, 3> = Tensor::from_data(
        [[[-2.0f32, 1.0, 3.0], [0.5, -4.0, 1.0], [2.0, 2.0, -1.0]]],
        d,
    );
    vec![
        ("prod", neg.clone().prod().into_data()),
        ("prod_dim 0", neg.clone().prod_dim(0).into_data()),
        ("prod_dim 1", neg.prod_dim(1).into_data()),
        ("det 2x2 batch", linalg::det::<B, 3, 2, 1>(m).into_data()),
        ("det 3x3", linalg::det::<B, 3, 2, 1>(m3).into_data()),
    ]
}

#[test]
fn prod_and_det_of_negative_inputs_are_exact() {
    same_bits(202, products_and_det::<NdArray>, products_and_det::<C>);
    // And right: Burn's default (`exp(sum(log x))`) gives NaN here and 60.000004 for 3·4·5.
    let d = cdev(202);
    let p = Tensor::<C, 1>::from_data([-3.0f32, 4.0, -5.0], &d).prod();
    assert_eq!(p.into_data().to_vec::<f32>().unwrap(), vec![60.0]);
    let p = Tensor::<C, 1>::from_data([3.0f32, 4.0, 5.0], &d).prod();
    assert_eq!(p.into_data().to_vec::<f32>().unwrap(), vec![60.0]);
}

fn nd_indexing<B: Backend>(d: &B::Device) -> Vec<(&'static str, TensorData)> {
    let data: Tensor<B, 3> = Tensor::from_data(TensorData::new(values(24, 11), [2, 3, 4]), d);
    let idx: Tensor<B, 2, Int> = Tensor::from_data([[0i64, 1], [1, 2], [0, 0]], d);
    let gathered: Tensor<B, 2> = data.clone().gather_nd(idx.clone());
    let upd: Tensor<B, 2> = Tensor::from_data(TensorData::new(values(12, 5), [3, 4]), d);
    let scattered = data
        .clone()
        .scatter_nd(idx.clone(), upd.clone(), IndexingUpdateOp::Add);
    let assigned = data
        .clone()
        .scatter_nd(idx.clone(), upd, IndexingUpdateOp::Assign);
    let ints: Tensor<B, 3, Int> = data.mul_scalar(4).int();
    let int_gathered: Tensor<B, 2, Int> = ints.clone().gather_nd(idx.clone());
    let int_upd: Tensor<B, 2, Int> = Tensor::from_data(TensorData::new(vec![7i64; 12], [3, 4]), d);
    let int_scattered = ints.scatter_nd(idx, int_upd, IndexingUpdateOp::Add);
    vec![
        ("float_gather_nd", gathered.into_data()),
        ("float_scatter_nd add", scattered.into_data()),
        ("float_scatter_nd assign", assigned.into_data()),
        ("int_gather_nd", int_gathered.into_data()),
        ("int_scatter_nd", int_scattered.into_data()),
    ]
}

#[test]
fn gather_nd_and_scatter_nd_reach_the_inner_backend() {
    // Burn's defaults panic ("not implemented for this backend"); NdArray implements them.
    same_bits(203, nd_indexing::<NdArray>, nd_indexing::<C>);
}

#[test]
fn gather_nd_backward_scatters_the_gradient() {
    type A = Autodiff<C>;
    let d = cdev(204);
    let data: Tensor<A, 2> =
        Tensor::from_data(TensorData::new(values(12, 1), [3, 4]), &d).require_grad();
    let idx: Tensor<A, 2, Int> = Tensor::from_data([[2i64], [0], [2]], &d);
    let out: Tensor<A, 2> = data.clone().gather_nd(idx);
    let w: Tensor<A, 2> = Tensor::from_data(TensorData::new(values(12, 9), [3, 4]), &d);
    let grads = (out * w.clone()).sum().backward();
    let g = data.grad(&grads).expect("data has a gradient").into_data();
    // Rows 0 and 2 of `data` were gathered (row 2 twice): their gradients are the matching rows
    // of `w` (summed for row 2); row 1 gets nothing.
    let w = w.into_data().to_vec::<f32>().unwrap();
    let mut want = vec![0.0f32; 12];
    for (out_row, src_row) in [(0, 2), (1, 0), (2, 2)] {
        for c in 0..4 {
            want[src_row * 4 + c] += w[out_row * 4 + c];
        }
    }
    assert_eq!(g.to_vec::<f32>().unwrap(), want);
}

fn linear_forward<B: Backend>(d: &B::Device) -> Vec<(&'static str, TensorData)> {
    let x: Tensor<B, 3> = Tensor::from_data(TensorData::new(values(36, 2), [2, 3, 6]), d);
    let w: Tensor<B, 2> = Tensor::from_data(TensorData::new(values(30, 4), [6, 5]), d);
    let b: Tensor<B, 1> = Tensor::from_data(TensorData::new(values(5, 8), [5]), d);
    vec![
        (
            "linear",
            burn_core::tensor::module::linear(x.clone(), w.clone(), Some(b)).into_data(),
        ),
        (
            "linear without bias",
            burn_core::tensor::module::linear(x, w, None).into_data(),
        ),
    ]
}

#[test]
fn linear_is_one_recorded_node_with_the_inner_backends_result() {
    same_bits(205, linear_forward::<NdArray>, linear_forward::<C>);
    let d = cdev(205);
    let x: Tensor<C, 3> = Tensor::from_data(TensorData::new(values(36, 2), [2, 3, 6]), &d);
    let w: Tensor<C, 2> = Tensor::from_data(TensorData::new(values(30, 4), [6, 5]), &d);
    let before = collective_fusion::backend::lazy_stats(205);
    let y = burn_core::tensor::module::linear(x, w, None);
    let recorded = collective_fusion::backend::lazy_stats(205).recorded - before.recorded;
    assert_eq!(recorded, 1, "linear records one node");
    assert_eq!(y.dims(), [2, 3, 5], "its shape is known before it runs");
}

// ---- the listing: every method of Burn's `Backend` and op traits is forwarded ----

const TRAITS: [(&str, &str); 8] = [
    ("backend/base.rs", "Backend"),
    ("backend/ops/tensor.rs", "FloatTensorOps"),
    ("backend/ops/int_tensor.rs", "IntTensorOps"),
    ("backend/ops/bool_tensor.rs", "BoolTensorOps"),
    ("backend/ops/qtensor.rs", "QTensorOps"),
    ("backend/ops/modules/base.rs", "ModuleOps"),
    ("backend/ops/activation.rs", "ActivationOps"),
    ("backend/ops/transaction.rs", "TransactionOps"),
];

/// Where cargo keeps the source of package `name` this project depends on.
fn package_src(name: &str) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // This machine's packages only: they were all fetched to build this test.
    let rustc = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc runs");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("rustc -vV names the host");
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", &host])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let pkg = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("{name} is not a dependency"));
    Path::new(pkg["manifest_path"].as_str().unwrap())
        .parent()
        .unwrap()
        .join("src")
}

/// The body of the block that opens at the first `{` at or after `from`.
fn block(s: &str, from: usize) -> &str {
    let open = from + s[from..].find('{').unwrap();
    let mut depth = 0;
    for (i, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &s[open + 1..open + i];
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced block")
}

fn strip_comments(s: &str) -> String {
    s.lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Methods at the block's top level (four spaces in): `(name, has a default body)`.
fn methods(body: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(i) = body[pos..].find("\n    fn ") {
        let start = pos + i + "\n    fn ".len();
        let name: String = body[start..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The signature ends at the first `;` (required) or `{` (default body) outside parens.
        let mut depth = 0i32;
        let mut default = false;
        for c in body[start..].chars() {
            match c {
                '(' | '<' | '[' => depth += 1,
                ')' | '>' | ']' => depth -= 1,
                ';' if depth <= 0 => break,
                '{' if depth <= 0 => {
                    default = true;
                    break;
                }
                _ => {}
            }
        }
        out.push((name, default));
        pos = start;
    }
    out
}

/// Where the word `word` (not the tail or head of a longer name) first occurs in `s` followed by
/// one of `after`, at or after `from`.
fn find_word(s: &str, word: &str, after: &[&str], from: usize) -> Option<usize> {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut pos = from;
    while let Some(i) = s[pos..].find(word) {
        let at = pos + i;
        let rest = &s[at + word.len()..];
        if !s[..at].ends_with(ident) && after.iter().any(|a| rest.starts_with(a)) {
            return Some(at);
        }
        pos = at + word.len();
    }
    None
}

/// The methods of every `impl .. {trait}<..> for ..` or `impl .. {trait} for ..` block in the
/// `.rs` files under `dir`.
fn impl_methods(dir: &Path, trait_name: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let s = strip_comments(&std::fs::read_to_string(&p).unwrap());
                let mut pos = 0;
                while let Some(at) = find_word(&s, trait_name, &["<", " for "], pos) {
                    let line_start = s[..at].rfind('\n').map_or(0, |n| n + 1);
                    if s[line_start..at].trim_start().starts_with("impl") {
                        found.extend(methods(block(&s, at)).into_iter().map(|(n, _)| n));
                    }
                    pos = at + trait_name.len();
                }
            }
        }
    }
    found
}

#[test]
fn every_method_of_burns_op_traits_is_forwarded() {
    let burn = package_src("burn-backend");
    let ours = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend");
    let inner = [
        ("NdArray", package_src("burn-ndarray")),
        ("CubeBackend", package_src("burn-cubecl")),
        ("Fusion", package_src("burn-fusion")),
    ];
    let mut overridden = 0;
    let mut total = 0;
    for (file, tr) in TRAITS {
        let src = strip_comments(&std::fs::read_to_string(burn.join(file)).unwrap());
        let at = find_word(&src, &format!("pub trait {tr}"), &["<", ":", " "], 0).unwrap();
        let all = methods(block(&src, at));
        assert!(!all.is_empty(), "{tr}: the scan found no methods");
        total += all.len();
        let forwarded = impl_methods(&ours, tr);
        let missing: Vec<&str> = all
            .iter()
            .filter(|(n, _)| !forwarded.contains(n))
            .map(|(n, _)| n.as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "{tr}: Collective does not forward {missing:?}: {}",
            if tr == "Backend" {
                "forward them in src/backend/mod.rs"
            } else {
                "run scripts/gen_backend_ops.py"
            }
        );
        // The defaulted methods an inner backend implements itself: Collective must reach them.
        for (who, dir) in &inner {
            let theirs = impl_methods(dir, tr);
            for (n, _) in all.iter().filter(|(n, d)| *d && theirs.contains(n)) {
                assert!(forwarded.contains(n), "{who} overrides {tr}::{n}");
                overridden += 1;
            }
        }
    }
    assert!(total > 400, "the scan found only {total} methods");
    // NdArray and CubeBackend override dozens of defaults (gather_nd, prod, cat, ...).
    assert!(
        overridden > 40,
        "only {overridden} overridden defaults found"
    );
}

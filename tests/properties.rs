//! Property tests on random graphs: the verifier holds after every pass, every gradient is
//! reduced exactly once, printing is deterministic and round-trips. And a fuzzer of the
//! command line's loaders: valid inputs (graph text, a model profile, a link profile), mutated
//! byte by byte, load to a result or an error and are profiled or refused, never a panic.

mod common;

use collective_fusion::config::BucketPolicy;
use collective_fusion::graph::parse::parse;
use collective_fusion::graph::print::print;
use collective_fusion::passes::{compile, reduced_params};
use common::{bucket, config};
use proptest::prelude::*;

/// A random backward-like graph: a compute chain; per step some gradients of random size, dtype,
/// reduce op and group; some computes read an earlier reduced gradient (a dependency the
/// bucketing must respect).
fn random_graph() -> impl Strategy<Value = String> {
    let grad = (1u64..5000, 0usize..3, any::<bool>(), 0usize..2);
    let step = (
        prop::collection::vec(grad, 0..4),
        prop::option::weighted(0.15, any::<prop::sample::Index>()),
    );
    prop::collection::vec(step, 1..30).prop_map(|steps| {
        let mut s = String::from("graph \"r\" {\n  group g0 size=4\n  group g1 size=2\n");
        s.push_str("  %0 = input \"loss.grad\" : f32[8]\n");
        let mut n = 1usize;
        let mut prev = 0usize;
        let mut syncs: Vec<usize> = Vec::new();
        let mut ready = 0;
        for (k, (grads, dep)) in steps.into_iter().enumerate() {
            let extra = match (dep, syncs.is_empty()) {
                (Some(ix), false) => format!(", %{}", syncs[ix.index(syncs.len())]),
                _ => String::new(),
            };
            s.push_str(&format!(
                "  %{n} = compute \"c{k}\" kind=matmul flops={} (%{prev}{extra}) : f32[8]\n",
                1_000_000_000u64 * (k as u64 % 7 + 1)
            ));
            prev = n;
            n += 1;
            for (j, (numel, dt, mean, group)) in grads.into_iter().enumerate() {
                let ty = format!("{}[{numel}]", ["f32", "bf16", "f16"][dt]);
                let name = format!("p{k}_{j}");
                s.push_str(&format!("  %{n} = gradient \"{name}\" (%{prev}) : {ty}\n"));
                s.push_str(&format!(
                    "  %{} = grad_sync \"{name}\" reduce={} group=g{group} ready={ready} (%{n}) : {ty}\n",
                    n + 1,
                    if mean { "mean" } else { "sum" }
                ));
                syncs.push(n + 1);
                ready += 1;
                n += 2;
            }
        }
        let used: Vec<String> = syncs.iter().map(|x| format!("%{x}")).collect();
        s.push_str(&format!("  %{n} = sync ({})\n}}\n", used.join(", ")));
        s
    })
}

fn policy() -> impl Strategy<Value = BucketPolicy> {
    prop_oneof![
        Just(BucketPolicy::PerParam),
        Just(BucketPolicy::Ddp),
        Just(BucketPolicy::Cost)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn pipeline_keeps_invariants(
        text in random_graph(),
        policy in policy(),
        cap in 64u64..40_000,
        first in 16u64..10_000,
        overlap in any::<bool>(),
        cast in any::<bool>(),
    ) {
        let mut g = parse(&text).unwrap();
        let before = reduced_params(&g);
        let mut cfg = config(bucket(policy, first, cap), overlap);
        if cast {
            cfg.reduce_dtype = Some(collective_fusion::graph::DType::BF16);
        }
        // verify is on: the manager checks every invariant after every pass that changed the graph.
        compile(&mut g, &cfg).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        let after = reduced_params(&g);
        prop_assert_eq!(&after, &before);
        prop_assert!(after.values().all(|n| *n == 1));
        let printed = print(&g);
        prop_assert_eq!(&print(&g), &printed);
        prop_assert_eq!(print(&parse(&printed).unwrap()), printed.clone());
        // Compiling the same input again gives the same text: what every rank would see.
        let mut g2 = parse(&text).unwrap();
        compile(&mut g2, &cfg).unwrap();
        prop_assert_eq!(print(&g2), printed);
    }
}

/// A small valid model profile (the schema of `models/*.json`).
const MODEL_JSON: &str = r#"{"model": "m", "dtype": "f32",
 "layers": [{"name": "l0", "type": "Linear", "params": [0, 1], "in_shape": [8, 16], "out_shape": [8, 4], "bwd_flops": 2048},
            {"name": "l1", "type": "Linear", "params": [2], "in_shape": [8, 4], "out_shape": [8, 2], "bwd_flops": 128}],
 "params": [{"i": 0, "name": "l0.w", "shape": [16, 4], "numel": 64, "bytes": 256, "layer": 0},
            {"i": 1, "name": "l0.b", "shape": [4], "numel": 4, "bytes": 16, "layer": 0},
            {"i": 2, "name": "l1.w", "shape": [4, 2], "numel": 8, "bytes": 32, "layer": 1}],
 "grad_ready_order": [2, 0, 1]}"#;

const LINK_JSON: &str = r#"{"profiles": [{"name": "l", "description": "d", "world": 4,
 "alpha_us": 10.0, "busbw_gbs": 100.0, "compute_tflops": 50.0, "mem_gbs": 1000.0}]}"#;

/// One edit of a text: delete, insert or replace at a position, or replace the number there
/// with an extreme one.
#[derive(Clone, Debug)]
enum Edit {
    Delete(prop::sample::Index),
    Insert(prop::sample::Index, char),
    Number(prop::sample::Index, &'static str),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let chars = prop::sample::select(
        "0123456789-.e[]{}\",:%=() \nfbgx"
            .chars()
            .collect::<Vec<_>>(),
    );
    let numbers = prop::sample::select(vec![
        "0",
        "-1",
        "4294967296",
        "18446744073709551615",
        "18446744073709551616",
        "1e308",
        "-1e308",
        "1e-320",
        "99999999999999999999999",
    ]);
    let edit = prop_oneof![
        any::<prop::sample::Index>().prop_map(Edit::Delete),
        (any::<prop::sample::Index>(), chars).prop_map(|(i, c)| Edit::Insert(i, c)),
        (any::<prop::sample::Index>(), numbers).prop_map(|(i, n)| Edit::Number(i, n)),
    ];
    prop::collection::vec(edit, 1..6)
}

fn mutate(text: &str, edits: &[Edit]) -> String {
    let mut b: Vec<char> = text.chars().collect();
    for e in edits {
        match e {
            Edit::Delete(i) if !b.is_empty() => {
                b.remove(i.index(b.len()));
            }
            Edit::Insert(i, c) => b.insert(i.index(b.len() + 1), *c),
            Edit::Number(i, n) if !b.is_empty() => {
                // The digit run at or after the position, replaced.
                let at = i.index(b.len());
                if let Some(start) = (at..b.len()).find(|k| b[*k].is_ascii_digit()) {
                    let end = (start..b.len())
                        .find(|k| !b[*k].is_ascii_digit())
                        .unwrap_or(b.len());
                    b.splice(start..end, n.chars());
                }
            }
            _ => {}
        }
    }
    b.into_iter().collect()
}

/// What `profile` does with a file, minus the printing: graph text is parsed, verified and
/// profiled; anything else is a model profile, built and profiled. An error is fine.
fn load_and_profile(text: &str, link: &str) -> Result<(), String> {
    use collective_fusion::cost::{CostModel, SystemProfile};
    use collective_fusion::model::ModelProfile;
    use collective_fusion::profile::{ProfileOptions, StepSource, compare_step};
    let system = SystemProfile::from_json("link", link).map_err(|e| e.to_string())?;
    let mut cfg = config(bucket(BucketPolicy::Ddp, 1 << 10, 1 << 16), true);
    cfg.cost = CostModel::new(system.clone());
    let opts = ProfileOptions {
        world: system.world,
        batch: 8,
        reduce: collective_fusion::graph::ReduceOp::Mean,
        config: cfg,
    };
    let graph;
    let profile;
    let source = if collective_fusion::profile::is_graph_text(text) {
        graph = collective_fusion::profile::recorded_step("fuzz", text)?;
        StepSource::Recorded {
            name: "fuzz",
            graph: &graph,
        }
    } else {
        profile = ModelProfile::from_json("fuzz", text).map_err(|e| e.to_string())?;
        StepSource::Profile(&profile)
    };
    compare_step(source, &opts, BucketPolicy::Cost, |_| {}).map_err(|e| e.to_string())?;
    Ok(())
}

fn no_panic(text: &str, link: &str) -> Result<(), TestCaseError> {
    match std::panic::catch_unwind(|| load_and_profile(text, link)) {
        Ok(_) => Ok(()),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(TestCaseError::fail(format!(
                "panicked: {msg}\n--- input ---\n{text}\n--- link ---\n{link}"
            )))
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mutated_graph_text_never_panics(text in random_graph(), e in edits()) {
        no_panic(&mutate(&text, &e), LINK_JSON)?;
    }

    #[test]
    fn mutated_model_profiles_never_panic(e in edits()) {
        no_panic(&mutate(MODEL_JSON, &e), LINK_JSON)?;
    }

    #[test]
    fn mutated_link_profiles_never_panic(e in edits()) {
        no_panic(MODEL_JSON, &mutate(LINK_JSON, &e))?;
    }
}

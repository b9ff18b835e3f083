//! Property tests on random graphs: the verifier holds after every pass, every gradient is
//! reduced exactly once, printing is deterministic and round-trips.

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

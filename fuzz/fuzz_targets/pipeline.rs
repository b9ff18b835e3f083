//! The pass pipeline and the lowering on random backward graphs (like the property test
//! `pipeline_keeps_invariants`, driven by the fuzzer): compiling under any policy, caps,
//! overlap and reduce dtype succeeds, every gradient stays reduced exactly once, the printed
//! result is deterministic and round-trips, and the plan lowers with every slot reduced.
#![no_main]

use arbitrary::Arbitrary;
use collective_fusion::codegen::plan::lower;
use collective_fusion::config::{BucketConfig, BucketPolicy, CompileConfig};
use collective_fusion::graph::DType;
use collective_fusion::graph::parse::parse;
use collective_fusion::graph::print::print;
use collective_fusion::passes::{compile, reduced_params};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Grad {
    numel: u16,
    dtype: u8,
    mean: bool,
    group: bool,
}

#[derive(Arbitrary, Debug)]
struct Step {
    flops: u8,
    grads: Vec<Grad>,
    /// Read an earlier reduced gradient (a dependency bucketing must respect).
    reads: Option<u16>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    steps: Vec<Step>,
    policy: u8,
    cap: u32,
    first: u32,
    overlap: bool,
    cast: Option<bool>,
}

fn text(input: &Input) -> String {
    let mut s = String::from("graph \"f\" {\n  group g0 size=4\n  group g1 size=2\n");
    s.push_str("  %0 = input \"loss.grad\" : f32[8]\n");
    let (mut n, mut prev, mut ready) = (1usize, 0usize, 0u32);
    let mut syncs: Vec<usize> = Vec::new();
    for (k, step) in input.steps.iter().take(64).enumerate() {
        let extra = match step.reads {
            Some(i) if !syncs.is_empty() => format!(", %{}", syncs[i as usize % syncs.len()]),
            _ => String::new(),
        };
        s.push_str(&format!(
            "  %{n} = compute \"c{k}\" kind=matmul flops={} (%{prev}{extra}) : f32[8]\n",
            u64::from(step.flops) * 10_000_000
        ));
        prev = n;
        n += 1;
        for (j, g) in step.grads.iter().take(8).enumerate() {
            let ty = format!(
                "{}[{}]",
                ["f32", "bf16", "f16", "f64"][g.dtype as usize % 4],
                g.numel
            );
            let name = format!("p{k}_{j}");
            s.push_str(&format!("  %{n} = gradient \"{name}\" (%{prev}) : {ty}\n"));
            s.push_str(&format!(
                "  %{} = grad_sync \"{name}\" reduce={} group=g{} ready={ready} (%{n}) : {ty}\n",
                n + 1,
                if g.mean { "mean" } else { "sum" },
                u8::from(g.group)
            ));
            syncs.push(n + 1);
            ready += 1;
            n += 2;
        }
    }
    let used: Vec<String> = syncs.iter().map(|x| format!("%{x}")).collect();
    s.push_str(&format!("  %{n} = sync ({})\n}}\n", used.join(", ")));
    s
}

fuzz_target!(|input: Input| {
    let text = text(&input);
    let mut graph = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let before = reduced_params(&graph);
    let config = CompileConfig {
        bucket: BucketConfig {
            policy: [BucketPolicy::PerParam, BucketPolicy::Ddp, BucketPolicy::Cost]
                [input.policy as usize % 3],
            cap_bytes: u64::from(input.cap % 100_000) + 1,
            first_bucket_bytes: u64::from(input.first % 100_000) + 1,
        },
        overlap: input.overlap,
        reduce_dtype: input.cast.map(|b| if b { DType::BF16 } else { DType::F16 }),
        verify: true,
        ..CompileConfig::default()
    };
    compile(&mut graph, &config).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let after = reduced_params(&graph);
    assert_eq!(after, before);
    assert!(after.values().all(|n| *n == 1));
    let printed = print(&graph);
    assert_eq!(print(&parse(&printed).unwrap()), printed);
    let plan = lower(&graph).unwrap_or_else(|e| panic!("{e}\n{printed}"));
    assert_eq!(plan.slots.len(), before.len());
    // Compiling the same input again gives the same text: what every rank would see.
    let mut again = parse(&text).unwrap();
    compile(&mut again, &config).unwrap();
    assert_eq!(print(&again), printed);
});

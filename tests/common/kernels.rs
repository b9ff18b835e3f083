//! Which kernels a training step launches and compiles, from CubeCL's own log
//! (`CUBECL_DEBUG_LOG`, `CUBECL_DEBUG_OPTION=profile`), for the checks that `Collective<B>` asks
//! `B` for exactly the work it does alone. CubeCL reads those variables once per process, so
//! each side runs in a child process: the test binary run again on one test, [`CHILD`] naming
//! the side.

use std::collections::BTreeMap;
use std::path::Path;

use burn_autodiff::Autodiff;
use burn_backend::Backend;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use collective_fusion::backend::{Collective, CollectiveDevice, sync_stats};
use collective_fusion::train::overhead::{Marking, StepRow, StepTable};
use collective_fusion::train::{Mlp, RunModel};

/// Which side a child process runs: `alone`, `collective` or `marked`.
pub const CHILD: &str = "CF_KERNEL_PROBE";

/// The sides, in the order [`compare`] runs them.
pub const SIDES: [&str; 3] = ["alone", "collective", "marked"];

const MODEL: RunModel = RunModel::Mlp {
    hidden_layers: 2,
    width: 32,
};

/// The child's part, when [`CHILD`] is set: three training steps of a small MLP on `B` alone
/// (`alone`), under `Collective` (`collective`), or marked under a one-rank server (`marked`,
/// which also checks that the three syncs left the gradients as they were).
pub fn child<B>(device: B::Device)
where
    B: Backend + DistributedBackend,
{
    let Ok(side) = std::env::var(CHILD) else {
        return;
    };
    let row = if side == "alone" {
        type A<B> = Autodiff<B>;
        StepRow::new::<A<B>, Mlp<A<B>>>("alone", &device, MODEL, 8, Marking::Unmarked)
    } else {
        type C<B> = Autodiff<Collective<B>>;
        let cd = CollectiveDevice::new(device, 0);
        let marked = side == "marked";
        if marked {
            Collective::<B>::start_communication_server(
                std::slice::from_ref(&cd),
                DistributedConfig {
                    all_reduce_op: ReduceOperation::Mean,
                },
            );
        }
        let marking = if marked {
            Marking::Once
        } else {
            Marking::Unmarked
        };
        StepRow::new::<C<B>, Mlp<C<B>>>(&side, &cd, MODEL, 8, marking)
    };
    let _ = StepTable::measure(&side, vec![row], 0, 3);
    if side == "marked" {
        let stats = sync_stats::<B>(0);
        assert_eq!(stats.local_steps, 3, "{stats:?}");
    }
}

/// What one side's log says: launches per kernel name, and the ids of the compiled kernels.
#[derive(Debug, PartialEq)]
pub struct Kernels {
    /// Launches per kernel name.
    pub launches: BTreeMap<String, usize>,
    /// The compiled kernels' ids, sorted.
    pub compiled: Vec<String>,
}

fn read_log(path: &Path) -> Kernels {
    let text = std::fs::read_to_string(path).expect("CubeCL's log");
    let mut launches = BTreeMap::new();
    // A profiled launch: `| 37.4µs | ElemwiseFuse | WgpuRuntime`.
    for line in text.lines().filter(|l| l.starts_with("| ")) {
        let name = line.split('|').nth(2).unwrap_or("").trim().to_string();
        *launches.entry(name).or_default() += 1;
    }
    let mut compiled: Vec<String> = text
        .split("[START_KERNEL_COMPILATION]")
        .skip(1)
        .map(|block| {
            let id = block.find("id:").map_or("", |i| &block[i..]);
            let id = id.find("source").map_or(id, |j| &id[..j]);
            id.split_whitespace().collect::<Vec<_>>().join(" ")
        })
        .collect();
    compiled.sort();
    Kernels { launches, compiled }
}

/// Runs test `child_test` of this binary once per side of [`SIDES`] with CubeCL's log on, and
/// returns each side's kernels. When the sides differ, every side runs once more and the second
/// round is returned: a difference must show twice. (CubeCL on Mesa's software driver is not
/// the same from one process to the next on every machine: one fresh-clone CI logged a slice
/// kernel fewer for Burn alone's side, which this crate's code does not run.)
pub fn sides(child_test: &str) -> Vec<Kernels> {
    let first = run_sides(child_test);
    let agree = first
        .iter()
        .all(|k| k.launches == first[0].launches && k.compiled == first[0].compiled);
    if agree {
        return first;
    }
    eprintln!("{child_test}: the sides differ; every side runs once more. First round: {first:?}");
    run_sides(child_test)
}

fn run_sides(child_test: &str) -> Vec<Kernels> {
    super::child_sides(
        child_test,
        CHILD,
        &SIDES,
        |cmd, log| {
            cmd.env("CUBECL_DEBUG_LOG", log)
                .env("CUBECL_DEBUG_OPTION", "profile");
        },
        read_log,
    )
}

/// Asserts that every side of `kernels` (from [`sides`]) launched and compiled what `alone` did,
/// and that the log has the steps' matrix products.
pub fn assert_same(kernels: &[Kernels]) {
    let alone = &kernels[0];
    let total: usize = alone.launches.values().sum();
    assert!(total >= 3, "the log has the steps' launches: {alone:?}");
    assert!(
        alone.launches.keys().any(|k| k.contains("Matmul")),
        "{alone:?}"
    );
    for (side, k) in SIDES.iter().zip(kernels).skip(1) {
        assert_eq!(k.launches, alone.launches, "{side}: kernel launches differ");
        assert_eq!(
            k.compiled, alone.compiled,
            "{side}: compiled kernels differ"
        );
    }
}

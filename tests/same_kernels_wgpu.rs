//! `Collective<B>` asks the inner backend for exactly the work `B` does alone: three training
//! steps of an MLP on Burn's fused wgpu backend launch the same kernels, as many times each, and
//! compile the same kernels (CubeCL's kernel ids, in-place variants included), with and without
//! `Collective`, and with the model marked under a one-rank server (whose sync leaves the
//! gradients as they are). What is compared is CubeCL's own log (`CUBECL_DEBUG_LOG`,
//! `CUBECL_DEBUG_OPTION=profile`), which a process reads once at start-up: each side runs in a
//! child process, this test binary run again on [`kernel_probe_child`].

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_wgpu::{Wgpu, WgpuDevice};
use collective_fusion::backend::{Collective, CollectiveDevice};
use collective_fusion::train::overhead::{StepRow, StepTable};
use collective_fusion::train::{Mlp, RunModel};

/// Which side a child process runs: `alone`, `collective` or `marked`.
const CHILD: &str = "CF_KERNEL_PROBE";

const MODEL: RunModel = RunModel::Mlp {
    hidden_layers: 2,
    width: 32,
};

/// The child's part, run only with [`CHILD`] set (as the parent test runs it): three steps.
#[test]
fn kernel_probe_child() {
    let Ok(side) = std::env::var(CHILD) else {
        return;
    };
    let d = WgpuDevice::DefaultDevice;
    let row = match side.as_str() {
        "alone" => {
            type A = Autodiff<Wgpu>;
            StepRow::new::<A, Mlp<A>>("alone", &d, MODEL, 8, false)
        }
        _ => {
            type C = Autodiff<Collective<Wgpu>>;
            let cd = CollectiveDevice::new(d, 0);
            let marked = side == "marked";
            if marked {
                Collective::<Wgpu>::start_communication_server(
                    std::slice::from_ref(&cd),
                    DistributedConfig {
                        all_reduce_op: ReduceOperation::Mean,
                    },
                );
            }
            StepRow::new::<C, Mlp<C>>(&side, &cd, MODEL, 8, marked)
        }
    };
    let _ = StepTable::measure(&side, vec![row], 0, 3);
    if side == "marked" {
        let stats = collective_fusion::backend::sync_stats::<Wgpu>(0);
        assert_eq!(stats.local_steps, 3, "{stats:?}");
    }
}

/// What one side's log says: launches per kernel name, and the ids of the compiled kernels.
#[derive(Debug, PartialEq)]
struct Kernels {
    launches: BTreeMap<String, usize>,
    compiled: Vec<String>,
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

#[test]
fn a_training_step_under_collective_runs_the_kernels_burn_alone_runs_marked_or_not() {
    if std::env::var_os(CHILD).is_some() || common::cube::wgpu_client().is_none() {
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let dir = std::env::temp_dir().join(format!("cf-kernel-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let side = |which: &str| {
        let log = dir.join(format!("{which}.log"));
        let out = std::process::Command::new(&exe)
            .args([
                "--exact",
                "kernel_probe_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, which)
            .env("CUBECL_DEBUG_LOG", &log)
            .env("CUBECL_DEBUG_OPTION", "profile")
            .output()
            .expect("running the child");
        assert!(
            out.status.success(),
            "{which}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        read_log(&log)
    };
    let alone = side("alone");
    let collective = side("collective");
    let marked = side("marked");
    let _ = std::fs::remove_dir_all(&dir);
    let total: usize = alone.launches.values().sum();
    assert!(total >= 3, "the log has the steps' launches: {alone:?}");
    assert!(
        alone.launches.keys().any(|k| k.contains("Matmul")),
        "{alone:?}"
    );
    assert_eq!(
        collective.launches, alone.launches,
        "kernel launches differ"
    );
    assert_eq!(
        collective.compiled, alone.compiled,
        "compiled kernels differ"
    );
    assert_eq!(
        marked, alone,
        "kernels differ with the model marked under a one-rank server"
    );
}

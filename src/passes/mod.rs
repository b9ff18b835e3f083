//! Graph passes and the pass manager.
//!
//! A pass is a named unit that rewrites a graph and says whether it changed anything. The
//! [`PassManager`] runs a list of them with: verification of the input and after every pass that
//! changed something (the error names the pass) together with a check that the set of reduced
//! gradients never changes, graph text kept after all passes or after changes, passes disabled by name, and
//! per-pass timing. [`Fixpoint`] repeats a group of passes until none changes anything, up to an
//! iteration limit.
//!
//! The default pipeline ([`pipeline`]) is:
//! `hoist-producers → bucket-gradients → fuse-bucket-io → async-collectives → schedule-overlap →
//! cleanup` (the first and the two scheduling passes only when collectives overlap compute).

pub mod async_collectives;
pub mod bucket_gradients;
pub mod cleanup;
pub mod fuse_bucket_io;
pub mod hoist_producers;
pub mod schedule_overlap;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::config::{CompileConfig, PrintAfter};
use crate::graph::verify::{VerifyError, VerifyOptions, reductions_of, verify};
use crate::graph::{CycleError, Graph, Op, print};

/// A graph rewrite.
pub trait Pass {
    /// Stable kebab-case name, used to disable the pass and in messages.
    fn name(&self) -> &'static str;
    /// Rewrites the graph; returns whether anything changed.
    fn run(&self, graph: &mut Graph) -> Result<bool, PassError>;
    /// The passes it runs inside it (a [`Fixpoint`]'s), which can be disabled by name too.
    fn nested(&self) -> Vec<&'static str> {
        Vec::new()
    }
    /// [`Pass::run`] under a manager's options: a group skips its disabled members and
    /// verifies after each member that changed the graph. Other passes just run.
    fn run_managed(&self, graph: &mut Graph, _cx: &RunContext<'_>) -> Result<bool, PassError> {
        self.run(graph)
    }
}

/// What a [`PassManager`] hands the passes it runs.
#[derive(Clone, Copy, Debug)]
pub struct RunContext<'a> {
    /// Pass names to skip.
    pub disabled: &'a [String],
    /// Verify after every change with these options; `None` when verification is off.
    pub verify: Option<&'a VerifyOptions>,
}

/// A pass could not do its work.
#[derive(Debug, Error, PartialEq)]
pub enum PassError {
    /// The graph has a cycle.
    #[error("graph has a cycle (node index {})", .0.node.index())]
    Cycle(#[from] CycleError),
    /// The graph is not what the pass requires; the message names the node or value.
    #[error("{0}")]
    Unsupported(String),
    /// A pass inside a group broke an invariant.
    #[error("after nested pass '{pass}': {error}")]
    Verify {
        /// The nested pass.
        pass: String,
        /// The violations.
        error: VerifyError,
    },
    /// A fixpoint group did not converge.
    #[error("fixpoint '{name}' still changed the graph after {limit} iterations")]
    NoFixpoint {
        /// The group's name.
        name: String,
        /// Its iteration limit.
        limit: usize,
    },
}

/// Compilation failed.
#[derive(Debug, Error)]
pub enum CompileError {
    /// The graph broke an invariant: on input (`after` is `None`) or after the named pass.
    #[error("{} {error}", match after { Some(p) => format!("after pass '{p}':"), None => "input graph:".to_string() })]
    Verify {
        /// The pass that ran last, if any.
        after: Option<String>,
        /// The violations.
        error: VerifyError,
    },
    /// A pass failed.
    #[error("pass '{pass}' failed: {error}")]
    Pass {
        /// The pass.
        pass: String,
        /// Its error.
        error: PassError,
        /// The graph's text as the pass left it (not in the message; logged at debug level).
        graph: String,
    },
    /// A pass changed which gradients get reduced.
    #[error("after pass '{pass}': the reduced gradients changed: {detail}")]
    LostGradient {
        /// The pass.
        pass: String,
        /// Which parameters were gained or lost.
        detail: String,
    },
    /// A pass name given to disable is unknown.
    #[error("cannot disable unknown pass '{0}' (known: {1})")]
    UnknownPass(String, String),
}

/// Time and effect of one pass run.
#[derive(Clone, Debug, PartialEq)]
pub struct PassTiming {
    /// Pass name.
    pub name: &'static str,
    /// Wall time of the pass itself (not of verification).
    pub duration: Duration,
    /// Whether it changed the graph.
    pub changed: bool,
}

/// What a pipeline run did.
#[derive(Clone, Debug, Default)]
pub struct PassReport {
    /// One entry per pass run, in order (disabled passes are absent).
    pub timings: Vec<PassTiming>,
    /// Graph text after passes, as requested by `print_after`: `(pass name, text)`.
    pub dumps: Vec<(String, String)>,
}

/// Options of a [`PassManager`].
#[derive(Clone, Debug, Default)]
pub struct ManagerOptions {
    /// Verify the input and after each change.
    pub verify: bool,
    /// Options for the verifier.
    pub verify_options: VerifyOptions,
    /// Keep graph text after passes.
    pub print_after: PrintAfter,
    /// Pass names to skip.
    pub disabled: Vec<String>,
}

/// Runs passes in order. See the module doc.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    opts: ManagerOptions,
}

/// The parameters whose gradients are reduced, with how many reductions each flows into.
pub fn reduced_params(graph: &Graph) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for id in graph.node_ids() {
        let Op::Gradient { param } = graph.op(id) else {
            continue;
        };
        let n = reductions_of(graph, id);
        if n > 0 {
            out.insert(param.clone(), n);
        }
    }
    out
}

fn diff_reduced(before: &BTreeMap<String, usize>, after: &BTreeMap<String, usize>) -> String {
    let mut parts = Vec::new();
    for (p, n) in before {
        match after.get(p) {
            None => parts.push(format!("\"{p}\" no longer reduced")),
            Some(m) if m != n => parts.push(format!("\"{p}\" reduced {m} times, was {n}")),
            _ => {}
        }
    }
    for p in after.keys().filter(|p| !before.contains_key(*p)) {
        parts.push(format!("\"{p}\" newly reduced"));
    }
    parts.truncate(5);
    parts.join(", ")
}

impl PassManager {
    /// A manager running `passes` in order.
    pub fn new(passes: Vec<Box<dyn Pass>>, opts: ManagerOptions) -> Self {
        PassManager { passes, opts }
    }

    /// Names of the passes, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Names of the passes and of the passes nested in them, in order.
    pub fn all_names(&self) -> Vec<&'static str> {
        self.passes
            .iter()
            .flat_map(|p| std::iter::once(p.name()).chain(p.nested()))
            .collect()
    }

    /// Runs the pipeline on `graph`.
    pub fn run(&self, graph: &mut Graph) -> Result<PassReport, CompileError> {
        let names = self.all_names();
        for d in &self.opts.disabled {
            if !names.contains(&d.as_str()) {
                return Err(CompileError::UnknownPass(d.clone(), names.join(", ")));
            }
        }
        if self.opts.verify {
            verify(graph, &self.opts.verify_options)
                .map_err(|error| CompileError::Verify { after: None, error })?;
        }
        // The reduced-set check is part of verification: off with it, it costs nothing.
        let mut reduced = if self.opts.verify {
            reduced_params(graph)
        } else {
            BTreeMap::new()
        };
        let mut report = PassReport::default();
        for pass in &self.passes {
            let name = pass.name();
            if self.opts.disabled.iter().any(|d| d == name) {
                tracing::debug!(pass = name, "disabled");
                continue;
            }
            let t0 = Instant::now();
            let cx = RunContext {
                disabled: &self.opts.disabled,
                verify: self.opts.verify.then_some(&self.opts.verify_options),
            };
            let changed = pass.run_managed(graph, &cx).map_err(|error| {
                let text = print::print(graph);
                tracing::debug!(pass = name, %error, "pass failed; the graph as it left it:\n{text}");
                CompileError::Pass {
                    pass: name.to_string(),
                    error,
                    graph: text,
                }
            })?;
            let duration = t0.elapsed();
            tracing::debug!(pass = name, changed, ?duration, "ran");
            report.timings.push(PassTiming {
                name,
                duration,
                changed,
            });
            if changed {
                if self.opts.verify {
                    verify(graph, &self.opts.verify_options).map_err(|error| {
                        CompileError::Verify {
                            after: Some(name.to_string()),
                            error,
                        }
                    })?;
                }
                if self.opts.verify {
                    let now = reduced_params(graph);
                    if now != reduced {
                        return Err(CompileError::LostGradient {
                            pass: name.to_string(),
                            detail: diff_reduced(&reduced, &now),
                        });
                    }
                    reduced = now;
                }
            }
            let keep = match self.opts.print_after {
                PrintAfter::Never => false,
                PrintAfter::All => true,
                PrintAfter::Change => changed,
            };
            if keep {
                let text = print::print(graph);
                tracing::trace!(pass = name, "graph after pass:\n{text}");
                report.dumps.push((name.to_string(), text));
            }
        }
        Ok(report)
    }
}

/// Runs a group of passes repeatedly until none changes the graph, at most `limit` rounds.
pub struct Fixpoint {
    name: &'static str,
    passes: Vec<Box<dyn Pass>>,
    limit: usize,
}

impl Fixpoint {
    /// A fixpoint group named `name` of `passes`, with an iteration limit.
    pub fn new(name: &'static str, passes: Vec<Box<dyn Pass>>, limit: usize) -> Self {
        Fixpoint {
            name,
            passes,
            limit,
        }
    }
}

impl Pass for Fixpoint {
    fn name(&self) -> &'static str {
        self.name
    }

    fn run(&self, graph: &mut Graph) -> Result<bool, PassError> {
        self.run_managed(
            graph,
            &RunContext {
                disabled: &[],
                verify: None,
            },
        )
    }

    fn nested(&self) -> Vec<&'static str> {
        self.passes
            .iter()
            .flat_map(|p| std::iter::once(p.name()).chain(p.nested()))
            .collect()
    }

    /// Rounds of its enabled members until none changes the graph; with verification on, the
    /// graph is verified after every member that changed it, naming that member.
    fn run_managed(&self, graph: &mut Graph, cx: &RunContext<'_>) -> Result<bool, PassError> {
        let mut any = false;
        for _ in 0..self.limit {
            let mut changed = false;
            for p in &self.passes {
                if cx.disabled.iter().any(|d| d == p.name()) {
                    continue;
                }
                let c = p.run_managed(graph, cx)?;
                if c && let Some(opts) = cx.verify {
                    verify(graph, opts).map_err(|error| PassError::Verify {
                        pass: format!("{}/{}", self.name, p.name()),
                        error,
                    })?;
                }
                changed |= c;
            }
            if !changed {
                return Ok(any);
            }
            any = true;
        }
        Err(PassError::NoFixpoint {
            name: self.name.to_string(),
            limit: self.limit,
        })
    }
}

/// The default pipeline for a configuration.
pub fn pipeline(config: &CompileConfig) -> PassManager {
    let mut passes: Vec<Box<dyn Pass>> = Vec::new();
    if config.overlap {
        passes.push(Box::new(hoist_producers::HoistProducers {
            max_deferred_bytes: config.hoist_bytes,
        }));
    }
    passes.extend::<[Box<dyn Pass>; 2]>([
        Box::new(bucket_gradients::BucketGradients::new(
            config.bucket,
            config.cost.clone(),
        )),
        Box::new(fuse_bucket_io::FuseBucketIo::new(
            fuse_bucket_io::FuseConfig {
                reduce_dtype: config.reduce_dtype,
                prescale: true,
                align_bytes: config.pack_align_bytes,
                views: config.gradient_as_bucket_view,
            },
        )),
    ]);
    if config.overlap {
        passes.push(Box::new(async_collectives::AsyncCollectives));
        passes.push(Box::new(schedule_overlap::ScheduleOverlap));
    }
    passes.push(Box::new(Fixpoint::new(
        "cleanup",
        vec![Box::new(cleanup::Cleanup)],
        8,
    )));
    PassManager::new(
        passes,
        ManagerOptions {
            verify: config.verify,
            verify_options: VerifyOptions {
                bucket_cap_bytes: match config.bucket.policy {
                    crate::config::BucketPolicy::PerParam => None,
                    // DDP lets the first bucket take its own limit, even above the cap.
                    _ => Some(
                        config
                            .bucket
                            .cap_bytes
                            .max(config.bucket.first_bucket_bytes),
                    ),
                },
            },
            print_after: config.print_after,
            disabled: config.disabled_passes.clone(),
        },
    )
}

/// Compiles a graph in place with the default pipeline.
pub fn compile(graph: &mut Graph, config: &CompileConfig) -> Result<PassReport, CompileError> {
    pipeline(config).run(graph)
}

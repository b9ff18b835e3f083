//! Executing a [`Plan`] on one rank.
//!
//! The calling thread is the compute stream: it runs the plan's compute steps in order (the
//! step's own work through [`StepHooks`], pack and unpack through the host kernels). The comm
//! stream is the communicator's own thread: recording `ready#c` enqueues collective `c` there
//! (the plan's comm stream lists the same collectives in the same order, which is checked before
//! anything runs), and `wait done#c` waits for it, bounded by the timeout. Communication thus
//! overlaps whatever compute the plan puts between a bucket's ready and done.

use std::time::{Duration, Instant};

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, CommSpan, Communicator, PendingReduce};
use super::host::{self, KernelError};
use crate::codegen::plan::{Event, Plan, PlanCollective, Step};
use crate::graph::DType;

/// Why a plan could not run.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The plan is inconsistent (a bug in lowering, or a hand-edited plan).
    #[error("plan {plan:?}: {why}")]
    Plan {
        /// Plan name.
        plan: String,
        /// What is wrong.
        why: String,
    },
    /// A gradient given to the plan does not match its slot.
    #[error("rank {rank}: gradient of parameter {param} is {got}, the plan expects {expected}")]
    Gradient {
        /// The rank.
        rank: usize,
        /// Parameter name.
        param: String,
        /// Slot type.
        expected: String,
        /// What was given.
        got: String,
    },
    /// The plan's group does not match the communicator.
    #[error(
        "rank {rank}: {what} runs on a group of {group_size} ranks, the communicator has {world}"
    )]
    Group {
        /// The rank.
        rank: usize,
        /// The collective.
        what: CollectiveDesc,
        /// Group size in the plan.
        group_size: u32,
        /// Ranks in the communicator.
        world: usize,
    },
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A bucket kernel failed.
    #[error("rank {rank}: {source}")]
    Kernel {
        /// The rank.
        rank: usize,
        /// The failure.
        source: KernelError,
    },
}

/// Options of a run.
#[derive(Clone, Copy, Debug)]
pub struct ExecOptions {
    /// Bound on every wait for a collective.
    pub timeout: Duration,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            timeout: super::inprocess::DEFAULT_TIMEOUT,
        }
    }
}

/// What the executor calls for the parts of a step it does not own.
pub trait StepHooks {
    /// Run the step's own compute (`Step::Compute`).
    fn compute(&mut self, _name: &str, _flops: u64) {}
    /// A gradient became final in `grads[slot]`.
    fn gradient(&mut self, _slot: u32, _param: &str, _grad: &mut HostBuffer) {}
}

/// Hooks that do nothing: gradients are given up front.
pub struct NoHooks;
impl StepHooks for NoHooks {}

/// A timed span on a stream, for traces.
#[derive(Clone, Debug)]
pub struct Span {
    /// `compute` or `comm`.
    pub stream: &'static str,
    /// What ran (`pack b3`, `all_reduce #3`, `wait done#3`, a compute label).
    pub name: String,
    /// Start.
    pub start: Instant,
    /// End.
    pub end: Instant,
}

/// What a run did, for traces and tests.
#[derive(Clone, Debug, Default)]
pub struct ExecReport {
    /// Spans in the order they ended on each stream.
    pub spans: Vec<Span>,
    /// Collectives in the order this rank enqueued them.
    pub launched: Vec<u32>,
}

fn desc_of(
    plan: &Plan,
    c: &PlanCollective,
    count: u64,
    dtype: DType,
    slots: &[u32],
) -> CollectiveDesc {
    CollectiveDesc {
        collective: c.id,
        bucket: c.bucket,
        op: c.op,
        dtype,
        count,
        params: slots
            .iter()
            .map(|s| plan.slots[*s as usize].param.clone())
            .collect(),
    }
}

/// Checks that the comm stream runs the collectives in the order the compute stream makes them
/// ready, that each is waited for, and that groups match the communicator.
fn check_plan(plan: &Plan, rank: usize, world: usize) -> Result<(), ExecError> {
    let bad = |why: String| ExecError::Plan {
        plan: plan.name.clone(),
        why,
    };
    let readies: Vec<u32> = plan
        .compute
        .iter()
        .filter_map(|s| match s {
            Step::Record(Event::Ready(c)) => Some(*c),
            _ => None,
        })
        .collect();
    let calls: Vec<u32> = plan
        .comm
        .iter()
        .filter_map(|s| match s {
            Step::AllReduce { collective } => Some(*collective),
            _ => None,
        })
        .collect();
    if readies != calls {
        return Err(bad(format!(
            "the comm stream calls collectives in order {calls:?}, the compute stream readies them in order {readies:?}"
        )));
    }
    for c in &plan.collectives {
        if c.group_size as usize != world {
            let (count, dtype) = (c.layout.numel, c.wire_dtype());
            return Err(ExecError::Group {
                rank,
                what: desc_of(plan, c, count, dtype, &c.slots),
                group_size: c.group_size,
                world,
            });
        }
        let waits = plan
            .compute
            .iter()
            .filter(|s| **s == Step::Wait(Event::Done(c.id)))
            .count();
        if waits != 1 {
            return Err(bad(format!(
                "collective #{} is waited for {waits} times",
                c.id
            )));
        }
    }
    Ok(())
}

fn check_grads(plan: &Plan, rank: usize, grads: &[HostBuffer]) -> Result<(), ExecError> {
    if grads.len() != plan.slots.len() {
        return Err(ExecError::Plan {
            plan: plan.name.clone(),
            why: format!(
                "{} gradients given for {} slots",
                grads.len(),
                plan.slots.len()
            ),
        });
    }
    for (g, s) in grads.iter().zip(&plan.slots) {
        check_slot(s, rank, g)?;
    }
    Ok(())
}

fn check_slot(
    s: &crate::codegen::plan::Slot,
    rank: usize,
    g: &HostBuffer,
) -> Result<(), ExecError> {
    if g.dtype() != s.ty.dtype || g.len() as u64 != s.ty.numel() {
        return Err(ExecError::Gradient {
            rank,
            param: s.param.clone(),
            expected: s.ty.to_string(),
            got: format!("{}[{}]", g.dtype(), g.len()),
        });
    }
    Ok(())
}

enum InFlight {
    /// One packed bucket.
    Bucket(PendingReduce),
    /// One call per slot.
    Slots(Vec<(u32, PendingReduce)>),
}

/// Bucket buffers kept from one step to the next, so a steady-state step allocates nothing.
#[derive(Default)]
pub struct Workspace {
    plan_hash: u64,
    buffers: Vec<HostBuffer>,
}

/// Runs `plan` on this rank: `grads[i]` is the gradient of slot `i` and holds the reduced
/// gradient when this returns `Ok`.
pub fn execute(
    plan: &Plan,
    comm: &dyn Communicator,
    grads: &mut [HostBuffer],
    hooks: &mut dyn StepHooks,
    opts: ExecOptions,
) -> Result<ExecReport, ExecError> {
    execute_in(plan, comm, grads, hooks, opts, &mut Workspace::default())
}

/// [`execute`], packing into the buffers of `ws` (kept for the next step of the same plan).
pub fn execute_in(
    plan: &Plan,
    comm: &dyn Communicator,
    grads: &mut [HostBuffer],
    hooks: &mut dyn StepHooks,
    opts: ExecOptions,
    ws: &mut Workspace,
) -> Result<ExecReport, ExecError> {
    if ws.plan_hash != plan.graph_hash || ws.buffers.len() != plan.collectives.len() {
        ws.plan_hash = plan.graph_hash;
        ws.buffers = vec![HostBuffer::default(); plan.collectives.len()];
    }
    let rank = comm.rank();
    check_plan(plan, rank, comm.world())?;
    check_grads(plan, rank, grads)?;
    let kerr = |source| ExecError::Kernel { rank, source };
    let mut report = ExecReport::default();
    let mut packed: Vec<Option<HostBuffer>> = vec![None; plan.collectives.len()];
    let mut flight: Vec<Option<InFlight>> = (0..plan.collectives.len()).map(|_| None).collect();
    let span = |report: &mut ExecReport, stream, name: String, start: Instant| {
        report.spans.push(Span {
            stream,
            name,
            start,
            end: Instant::now(),
        })
    };
    let comm_span = |report: &mut ExecReport, name: String, s: CommSpan| {
        report.spans.push(Span {
            stream: "comm",
            name,
            start: s.start,
            end: s.end,
        })
    };
    for step in &plan.compute {
        let t = Instant::now();
        match step {
            Step::Compute { name, flops, .. } => {
                hooks.compute(name, *flops);
                span(&mut report, "compute", name.clone(), t);
            }
            Step::Gradient { slot } => {
                let s = *slot as usize;
                hooks.gradient(*slot, &plan.slots[s].param, &mut grads[s]);
                check_slot(&plan.slots[s], rank, &grads[s])?;
            }
            Step::Pack { collective } => {
                let c = &plan.collectives[*collective as usize];
                let members: Vec<&HostBuffer> =
                    c.slots.iter().map(|s| &grads[*s as usize]).collect();
                let mut buf = std::mem::take(&mut ws.buffers[c.id as usize]);
                host::pack_into(&c.layout, &members, c.layout.scale_div, &mut buf).map_err(kerr)?;
                packed[c.id as usize] = Some(buf);
                span(
                    &mut report,
                    "compute",
                    format!("pack {}", bucket_name(c)),
                    t,
                );
            }
            Step::Record(Event::Ready(cid)) => {
                let c = &plan.collectives[*cid as usize];
                let f = if c.packed {
                    let buf = packed[c.id as usize]
                        .take()
                        .ok_or_else(|| ExecError::Plan {
                            plan: plan.name.clone(),
                            why: format!("collective #{} is ready before its pack", c.id),
                        })?;
                    let what = desc_of(plan, c, buf.len() as u64, buf.dtype(), &c.slots);
                    InFlight::Bucket(comm.all_reduce(buf, what)?)
                } else {
                    let mut calls = Vec::with_capacity(c.slots.len());
                    for s in &c.slots {
                        let buf = std::mem::take(&mut grads[*s as usize]);
                        let what = desc_of(plan, c, buf.len() as u64, buf.dtype(), &[*s]);
                        calls.push((*s, comm.all_reduce(buf, what)?));
                    }
                    InFlight::Slots(calls)
                };
                report.launched.push(c.id);
                flight[c.id as usize] = Some(f);
            }
            Step::Wait(Event::Done(cid)) => {
                let c = &plan.collectives[*cid as usize];
                match flight[c.id as usize].take() {
                    Some(InFlight::Bucket(p)) => {
                        let (buf, s) = p.wait(opts.timeout)?;
                        comm_span(&mut report, format!("all_reduce {}", bucket_name(c)), s);
                        packed[c.id as usize] = Some(buf);
                    }
                    Some(InFlight::Slots(calls)) => {
                        for (slot, p) in calls {
                            let (buf, s) = p.wait(opts.timeout)?;
                            comm_span(&mut report, format!("all_reduce {}", bucket_name(c)), s);
                            grads[slot as usize] = buf;
                        }
                    }
                    None => {
                        return Err(ExecError::Plan {
                            plan: plan.name.clone(),
                            why: format!("waits for collective #{} before it was launched", c.id),
                        });
                    }
                }
                span(
                    &mut report,
                    "compute",
                    format!("wait {}", bucket_name(c)),
                    t,
                );
            }
            Step::Unpack { collective } => {
                let c = &plan.collectives[*collective as usize];
                let buf = packed[c.id as usize]
                    .take()
                    .ok_or_else(|| ExecError::Plan {
                        plan: plan.name.clone(),
                        why: format!("unpack of collective #{} before it finished", c.id),
                    })?;
                let mut members = disjoint_mut(grads, &c.slots).ok_or_else(|| ExecError::Plan {
                    plan: plan.name.clone(),
                    why: format!("collective #{} lists a slot twice", c.id),
                })?;
                host::unpack(&c.layout, &buf, &mut members).map_err(kerr)?;
                ws.buffers[c.id as usize] = buf;
                span(
                    &mut report,
                    "compute",
                    format!("unpack {}", bucket_name(c)),
                    t,
                );
            }
            Step::Sync { .. } => {}
            Step::Record(Event::Done(_)) | Step::Wait(Event::Ready(_)) | Step::AllReduce { .. } => {
                return Err(ExecError::Plan {
                    plan: plan.name.clone(),
                    why: format!("comm-stream step {step:?} on the compute stream"),
                });
            }
        }
    }
    if let Some(c) = flight.iter().position(Option::is_some) {
        return Err(ExecError::Plan {
            plan: plan.name.clone(),
            why: format!("collective #{c} is never waited for"),
        });
    }
    Ok(report)
}

fn bucket_name(c: &PlanCollective) -> String {
    match c.bucket {
        Some(b) => format!("b{b}"),
        None => format!("#{}", c.id),
    }
}

/// Mutable references to `slots` of `grads`, in that order; `None` if a slot repeats or is out
/// of range.
fn disjoint_mut<'a>(grads: &'a mut [HostBuffer], slots: &[u32]) -> Option<Vec<&'a mut HostBuffer>> {
    let mut order: Vec<(usize, usize)> = slots
        .iter()
        .enumerate()
        .map(|(i, s)| (*s as usize, i))
        .collect();
    order.sort_unstable();
    if order.windows(2).any(|w| w[0].0 == w[1].0)
        || order.last().is_some_and(|l| l.0 >= grads.len())
    {
        return None;
    }
    let mut out: Vec<Option<&'a mut HostBuffer>> = (0..slots.len()).map(|_| None).collect();
    let mut rest: &'a mut [HostBuffer] = grads;
    let mut base = 0;
    for (s, i) in order {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(s - base);
        let (first, tail) = tail.split_first_mut()?;
        out[i] = Some(first);
        rest = tail;
        base = s + 1;
    }
    out.into_iter().collect()
}

/// Runs `plan` on `grads.len()` ranks of an in-process group, one thread per rank; returns each
/// rank's reduced gradients and report.
pub fn run_in_process(
    plan: &Plan,
    grads: Vec<Vec<HostBuffer>>,
    opts: ExecOptions,
) -> Result<Vec<(Vec<HostBuffer>, ExecReport)>, ExecError> {
    let world = grads.len();
    let comms = super::inprocess::InProcessGroup::ranks(world, opts.timeout);
    let results: Vec<Result<(Vec<HostBuffer>, ExecReport), ExecError>> =
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .iter()
                .zip(grads)
                .map(|(comm, mut g)| {
                    scope.spawn(move || {
                        let r = execute(plan, comm, &mut g, &mut NoHooks, opts);
                        if let Err(e) = &r {
                            comm.abort(&e.to_string());
                        }
                        r.map(|rep| (g, rep))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
    results.into_iter().collect()
}

//! Executing a [`Plan`] on one rank.
//!
//! The calling thread is the compute stream: it runs the plan's compute steps in order (the
//! step's own work through [`StepHooks`]; pack and unpack by the device's kernels when a
//! bucket's gradients are all device buffers ([`DeviceGrad`]), by the host kernels otherwise). The comm
//! stream is the communicator's own thread: recording `ready#c` enqueues collective `c` there
//! (the plan's comm stream lists the same collectives in the same order, which is checked before
//! anything runs), and `wait done#c` waits for it, bounded by the timeout. Communication thus
//! overlaps whatever compute the plan puts between a bucket's ready and done.

use std::time::{Duration, Instant};

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, CommSpan, Communicator};
use super::grad::{DeviceGrad, Grad, Handed, Packed};
use super::host::{self, KernelError};
use crate::codegen::plan::{Event, Plan, PlanCollective, Step};
use crate::trace::SpanKind;

mod arrive;
mod check;
mod in_process;
mod launch;
mod workspace;
use check::{check_grads, check_plan};
pub use in_process::{run_in_process, run_in_process_grads};
pub use launch::UserAllReduce;
use launch::{InFlight, Pending, desc_of, launch_slots};
pub use workspace::Workspace;

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
    fn gradient(&mut self, _slot: u32, _param: &str, _grad: &mut Grad) {}
}

/// Hooks that do nothing: gradients are given up front.
pub struct NoHooks;
impl StepHooks for NoHooks {}

/// A timed span on a stream, for traces.
#[derive(Clone, Debug)]
pub struct Span {
    /// What it is (and so its stream, [`SpanKind::stream`]).
    pub kind: SpanKind,
    /// Bytes it moved (a bucket's, for a pack, an unpack or a collective; 0 otherwise).
    pub bytes: u64,
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
    /// Buckets packed (and unpacked) by the device's kernels on the gradients' own buffers.
    pub device_packs: u32,
    /// Collectives the communicator reduced in place in device memory (NCCL on the
    /// gradients' GPU): device-packed buckets, and copies of device gradients that have an
    /// all-reduce of their own. Every other collective crossed to the host and back.
    pub device_collectives: u32,
    /// Reduced gradients handed back as views of their device bucket rather than copied out
    /// of it (a plan collective's `views`).
    pub view_grads: u32,
    /// Each collective's times, in the order this rank finished waiting for them.
    pub timings: Vec<CollectiveTiming>,
}

/// When one plan collective ran, as this rank saw it: what the link and the overlap are
/// measured from (one clock read at the launch and two at the wait; nothing synchronised).
#[derive(Clone, Copy, Debug)]
pub struct CollectiveTiming {
    /// The plan collective.
    pub collective: u32,
    /// Bytes each rank contributes (the flat bucket, or the members' bytes together).
    pub bytes: u64,
    /// This rank launched it (its compute stream reached the launch).
    pub launched: Instant,
    /// On the communication stream: every rank had joined → the result was here (of the
    /// earliest and latest call, for a collective of several calls).
    pub comm: CommSpan,
    /// The compute stream started and ended waiting for it: the part of the collective this
    /// rank did not overlap is `wait_end - wait_start`.
    pub wait_start: Instant,
    /// See `wait_start`.
    pub wait_end: Instant,
}

/// Runs `plan` on this rank: `grads[i]` is the gradient of slot `i` and holds the reduced
/// gradient when this returns `Ok`. On an error every buffer is as it was: the plan runs on
/// copies, which replace the caller's buffers only once every collective finished (the cost is
/// one copy of the gradients; the backend's incremental path, [`Execution`], writes back only
/// after success without one).
pub fn execute(
    plan: &Plan,
    comm: &dyn Communicator,
    grads: &mut [HostBuffer],
    hooks: &mut dyn StepHooks,
    opts: ExecOptions,
) -> Result<ExecReport, ExecError> {
    let mut slots: Vec<Grad> = grads.iter().map(|g| Grad::Host(g.clone())).collect();
    let report = execute_in(
        plan,
        comm,
        &mut slots,
        hooks,
        opts,
        &mut Workspace::default(),
    )?;
    let reduced = slots
        .into_iter()
        .map(Grad::into_host)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| ExecError::Kernel {
            rank: comm.rank(),
            source,
        })?;
    for (g, r) in grads.iter_mut().zip(reduced) {
        *g = r;
    }
    Ok(report)
}

/// [`execute`] on gradient slots that may be device buffers, packing host buckets into the
/// buffers of `ws` (kept for the next step of the same plan).
pub fn execute_in(
    plan: &Plan,
    comm: &dyn Communicator,
    grads: &mut [Grad],
    hooks: &mut dyn StepHooks,
    opts: ExecOptions,
    ws: &mut Workspace,
) -> Result<ExecReport, ExecError> {
    check_grads(plan, comm.rank(), grads)?;
    let mut ex = Execution::new(plan, comm, ws, opts)?;
    let ready = vec![true; plan.slots.len()];
    ex.run(plan, comm, grads, &ready, hooks, opts, ws, true)?;
    ex.finish()
}

/// A plan being run step by step, so that a caller who receives gradients one at a time (Burn's
/// `submit_gradient_sync`) can pack and launch each bucket the moment its last gradient arrives,
/// while the rest of backward still runs, and wait only at the sync point.
pub struct Execution {
    /// Graph hash of the plan it runs (every call must pass that plan).
    plan_hash: u64,
    steps: usize,
    rank: usize,
    /// Next compute-stream step.
    pc: usize,
    packed: Vec<Option<Packed>>,
    flight: Vec<Option<InFlight>>,
    /// When each collective was launched, and its bytes.
    launched: Vec<Option<(Instant, u64)>>,
    report: ExecReport,
    /// Unpack steps leave their reduced bucket for [`Execution::unpack`].
    defer_unpacks: bool,
    /// The collectives whose unpack was left for [`Execution::unpack`], in plan order.
    deferred: Vec<u32>,
    /// Slots copied into their bucket as they arrived, their own copy let go.
    copied: Vec<bool>,
}

impl Execution {
    /// Checks `plan` against the communicator and prepares `ws` for it. Before a plan's first
    /// run on `ws`, the ranks agree on its collective sequence ([`agree`](super::agree)).
    pub fn new(
        plan: &Plan,
        comm: &dyn Communicator,
        ws: &mut Workspace,
        opts: ExecOptions,
    ) -> Result<Self, ExecError> {
        check_plan(plan, comm.rank(), comm.world())?;
        if !ws.ready_for(plan) {
            ws.agreed = false;
        }
        if !ws.agreed {
            super::agree::agree(plan, comm, opts.timeout)?;
            ws.agreed = true;
        }
        Ok(Execution {
            plan_hash: plan.graph_hash,
            steps: plan.compute.len(),
            rank: comm.rank(),
            pc: 0,
            packed: (0..plan.collectives.len()).map(|_| None).collect(),
            flight: (0..plan.collectives.len()).map(|_| None).collect(),
            launched: vec![None; plan.collectives.len()],
            report: ExecReport::default(),
            defer_unpacks: false,
            deferred: Vec::new(),
            copied: vec![false; plan.slots.len()],
        })
    }

    /// From here on, an unpack step leaves its collective's reduced bucket where it is, for
    /// [`Execution::unpack`]: a caller that hands the reduced gradients back in place of the
    /// ones they were reduced from can then unpack a bucket right before its members replace
    /// theirs, so that one bucket's copies live beside the gradients at a time, not all of them.
    pub fn defer_unpacks(&mut self) {
        self.defer_unpacks = true;
    }

    /// The collectives whose unpack was left for [`Execution::unpack`], in plan order.
    pub fn deferred(&self) -> &[u32] {
        &self.deferred
    }

    /// Unpacks collective `c`, whose unpack step was deferred, handing each member's reduced
    /// gradient to `hand` (its slot, the gradient) as soon as it exists, in layout order: a
    /// bucket in host memory member by member, each as a [`Handed::Member`] of the bucket, for
    /// `hand` to copy where it goes (its time counts as the unpack's); a device bucket by its one
    /// unpack kernel, then its members, each a [`Handed::Grad`]. An error of `hand` ends the
    /// unpack with it.
    #[allow(clippy::too_many_arguments)]
    pub fn unpack(
        &mut self,
        plan: &Plan,
        comm: &dyn Communicator,
        grads: &mut [Grad],
        opts: ExecOptions,
        ws: &mut Workspace,
        c: u32,
        hand: &mut dyn FnMut(u32, Handed<'_>) -> Result<(), KernelError>,
    ) -> Result<(), ExecError> {
        self.same_plan(plan)?;
        let Some(at) = self.deferred.iter().position(|d| *d == c) else {
            return Err(ExecError::Plan {
                plan: plan.name.clone(),
                why: format!("collective #{c} has no unpack left to do"),
            });
        };
        self.deferred.remove(at);
        let col = &plan.collectives[c as usize];
        let on_device = col
            .slots
            .iter()
            .all(|s| grads[*s as usize].device().is_some());
        if let (false, Some(Packed::Host(_))) = (on_device, &self.packed[c as usize])
            && let Some(Packed::Host(buf)) = self.packed[c as usize].take()
        {
            let rank = self.rank;
            let start = Instant::now();
            host::check_flat(&col.layout, buf.len(), buf.dtype())
                .map_err(|source| ExecError::Kernel { rank, source })?;
            let mut handed = Ok(());
            for (j, s) in col.slots.iter().enumerate() {
                grads[*s as usize] = Grad::default();
                let member = Handed::Member {
                    layout: &col.layout,
                    member: j,
                    bucket: &buf,
                };
                handed = hand(*s, member);
                if handed.is_err() {
                    break;
                }
            }
            ws.buffers[c as usize] = buf;
            self.report.spans.push(Span {
                kind: SpanKind::Unpack,
                bytes: col.layout.bytes,
                name: format!("unpack {}", bucket_name(col)),
                start,
                end: Instant::now(),
            });
            return handed.map_err(|source| ExecError::Kernel { rank, source });
        }
        self.unpack_now(plan, c, comm, grads, opts, ws)?;
        for s in &col.slots {
            hand(*s, Handed::Grad(std::mem::take(&mut grads[*s as usize]))).map_err(|source| {
                ExecError::Kernel {
                    rank: self.rank,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// Runs the unpack step of collective `c` now, deferring or not.
    fn unpack_now(
        &mut self,
        plan: &Plan,
        c: u32,
        comm: &dyn Communicator,
        grads: &mut [Grad],
        opts: ExecOptions,
        ws: &mut Workspace,
    ) -> Result<(), ExecError> {
        let defer = std::mem::replace(&mut self.defer_unpacks, false);
        let step = Step::Unpack { collective: c };
        let done = self.step(plan, &step, comm, grads, &mut NoHooks, opts, ws);
        self.defer_unpacks = defer;
        done
    }

    /// The slot of the next gradient the plan expects, if any is still to come: the first one
    /// not `ready` from where the run stopped (a caller may hold gradients back from the run).
    pub fn next_gradient(&self, plan: &Plan, ready: &[bool]) -> Option<u32> {
        plan.gradient_from(self.pc, |slot| {
            !ready.get(slot as usize).copied().unwrap_or(false)
        })
    }

    /// Whether every step has run.
    pub fn is_done(&self) -> bool {
        self.pc == self.steps
    }

    fn same_plan(&self, plan: &Plan) -> Result<(), ExecError> {
        if plan.graph_hash != self.plan_hash || plan.compute.len() != self.steps {
            return Err(ExecError::Plan {
                plan: plan.name.clone(),
                why: "an execution was resumed with another plan".into(),
            });
        }
        Ok(())
    }

    /// Runs compute-stream steps in order. Stops before a gradient whose `ready[slot]` is false,
    /// and, unless `block`, before a wait for a collective (so that a caller inside backward never
    /// blocks on communication).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        plan: &Plan,
        comm: &dyn Communicator,
        grads: &mut [Grad],
        ready: &[bool],
        hooks: &mut dyn StepHooks,
        opts: ExecOptions,
        ws: &mut Workspace,
        block: bool,
    ) -> Result<(), ExecError> {
        self.same_plan(plan)?;
        while let Some(step) = plan.compute.get(self.pc) {
            match step {
                Step::Gradient { slot } if !ready[*slot as usize] => return Ok(()),
                Step::Wait(_) if !block => return Ok(()),
                _ => {}
            }
            self.step(plan, step, comm, grads, hooks, opts, ws)?;
            self.pc += 1;
        }
        Ok(())
    }

    /// Completes the collectives already launched (wait, unpack) and nothing else; returns the
    /// slots they reduced. For a step that stopped following the plan: what was launched is
    /// finished on every rank alike, the rest is the caller's to reduce.
    pub fn drain(
        &mut self,
        plan: &Plan,
        comm: &dyn Communicator,
        grads: &mut [Grad],
        opts: ExecOptions,
        ws: &mut Workspace,
    ) -> Result<Vec<u32>, ExecError> {
        self.same_plan(plan)?;
        let mut reduced = Vec::new();
        let launched: Vec<u32> = (0..self.flight.len() as u32)
            .filter(|c| self.flight[*c as usize].is_some())
            .collect();
        for c in std::mem::take(&mut self.deferred) {
            self.unpack_now(plan, c, comm, grads, opts, ws)?;
            reduced.extend(&plan.collectives[c as usize].slots);
        }
        for c in launched {
            self.step(
                plan,
                &Step::Wait(Event::Done(c)),
                comm,
                grads,
                &mut NoHooks,
                opts,
                ws,
            )?;
            if plan.collectives[c as usize].packed {
                self.unpack_now(plan, c, comm, grads, opts, ws)?;
            }
            reduced.extend(&plan.collectives[c as usize].slots);
        }
        // The members of collectives never launched that were copied into their bucket are
        // given back as they were, for the caller to reduce otherwise.
        for c in &plan.collectives {
            if self.report.launched.contains(&c.id) {
                continue;
            }
            for (j, s) in c.slots.iter().enumerate() {
                let s = *s as usize;
                if !std::mem::take(&mut self.copied[s]) {
                    continue;
                }
                let flat = match &self.packed[c.id as usize] {
                    Some(Packed::Host(b)) => b,
                    _ => &ws.buffers[c.id as usize],
                };
                let back = host::unpack_member(&c.layout, j, flat).map_err(|source| {
                    ExecError::Kernel {
                        rank: self.rank,
                        source,
                    }
                })?;
                grads[s] = Grad::Host(back);
            }
        }
        self.pc = self.steps;
        Ok(reduced)
    }

    /// The report, once every step ran.
    pub fn finish(self) -> Result<ExecReport, ExecError> {
        if !self.is_done() {
            return Err(ExecError::Plan {
                plan: format!("{:016x}", self.plan_hash),
                why: format!("stopped at step {} of {}", self.pc, self.steps),
            });
        }
        if let Some(c) = self.flight.iter().position(Option::is_some) {
            return Err(ExecError::Plan {
                plan: format!("{:016x}", self.plan_hash),
                why: format!("collective #{c} is never waited for"),
            });
        }
        if let Some(c) = self.deferred.first() {
            return Err(ExecError::Plan {
                plan: format!("{:016x}", self.plan_hash),
                why: format!("collective #{c} is never unpacked"),
            });
        }
        Ok(self.report)
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        plan: &Plan,
        step: &Step,
        comm: &dyn Communicator,
        grads: &mut [Grad],
        hooks: &mut dyn StepHooks,
        opts: ExecOptions,
        ws: &mut Workspace,
    ) -> Result<(), ExecError> {
        let rank = self.rank;
        let kerr = |source| ExecError::Kernel { rank, source };
        let t = Instant::now();
        let report = &mut self.report;
        let span = |report: &mut ExecReport, kind, bytes, name: String| {
            report.spans.push(Span {
                kind,
                bytes,
                name,
                start: t,
                end: Instant::now(),
            })
        };
        let comm_span = |report: &mut ExecReport, bytes, name: String, s: CommSpan| {
            report.spans.push(Span {
                kind: SpanKind::AllReduce,
                bytes,
                name,
                start: s.start,
                end: s.end,
            })
        };
        match step {
            Step::Compute { name, flops, .. } => {
                hooks.compute(name, *flops);
                span(report, SpanKind::Compute, 0, name.clone());
            }
            Step::Gradient { slot } => self.arrive(plan, *slot as usize, grads, hooks, ws)?,
            Step::Pack { collective } => {
                let c = &plan.collectives[*collective as usize];
                let on_device: Option<Vec<&dyn DeviceGrad>> = c
                    .slots
                    .iter()
                    .map(|s| grads[*s as usize].device())
                    .collect();
                let device = match on_device.as_deref() {
                    Some(m @ [first, ..]) => first.pack(&c.layout, m, c.layout.scale_div),
                    _ => Ok(None),
                }
                .map_err(kerr)?;
                let packed = match device {
                    Some(bucket) => {
                        report.device_packs += 1;
                        Packed::Device(bucket)
                    }
                    None => {
                        // Host kernels; device members are read into host memory first, so the
                        // unpack runs on the host too.
                        // Members copied in as they arrived are in the buffer already.
                        let copied = &self.copied;
                        for s in c.slots.iter().filter(|s| !copied[**s as usize]) {
                            grads[*s as usize].host_mut().map_err(kerr)?;
                        }
                        let members: Vec<Option<&HostBuffer>> = c
                            .slots
                            .iter()
                            .map(|s| match &grads[*s as usize] {
                                _ if copied[*s as usize] => Ok(None),
                                Grad::Host(b) => Ok(Some(b)),
                                Grad::Device(_) => Err(ExecError::Plan {
                                    plan: plan.name.clone(),
                                    why: format!("slot {s} stayed on its device for a host pack"),
                                }),
                            })
                            .collect::<Result<_, _>>()?;
                        let mut buf = std::mem::take(ws.bucket(c.id, &c.layout).map_err(kerr)?);
                        host::pack_rest(&c.layout, &members, c.layout.scale_div, &mut buf)
                            .map_err(kerr)?;
                        Packed::Host(buf)
                    }
                };
                self.packed[c.id as usize] = Some(packed);
                span(
                    report,
                    SpanKind::Pack,
                    c.layout.bytes,
                    format!("pack {}", bucket_name(c)),
                );
            }
            Step::Record(Event::Ready(cid)) => {
                let c = &plan.collectives[*cid as usize];
                let f = if c.packed {
                    let buf = self.packed[c.id as usize]
                        .take()
                        .ok_or_else(|| ExecError::Plan {
                            plan: plan.name.clone(),
                            why: format!("collective #{} is ready before its pack", c.id),
                        })?;
                    let mut buf = buf;
                    if let Packed::Host(b) = &mut buf {
                        // The members copied in as they arrived get the pack's scaling now
                        // (until here they could be read back exactly, see `drain`).
                        let copied: Vec<usize> = (0..c.slots.len())
                            .filter(|j| self.copied[c.slots[*j] as usize])
                            .collect();
                        host::scale_copied(&c.layout, &copied, c.layout.scale_div, b)
                            .map_err(kerr)?;
                        // The bucket holds the members' values: the other members' host copies
                        // go now too (the unpack makes new ones), so a step keeps one copy of
                        // its gradients beside Burn's, the buckets, not two.
                        for s in &c.slots {
                            if let Grad::Host(b) = &mut grads[*s as usize] {
                                *b = HostBuffer::default();
                            }
                        }
                    }
                    let what = desc_of(plan, c, buf.len() as u64, buf.dtype(), &c.slots);
                    let bytes = buf.len() as u64 * buf.dtype().size();
                    self.launched[c.id as usize] = Some((Instant::now(), bytes));
                    InFlight::Bucket(Pending::launch(comm, buf, what, report)?)
                } else {
                    // The calls of one collective launch together (one NCCL group).
                    let bytes = c
                        .slots
                        .iter()
                        .map(|s| plan.slots[*s as usize].ty.bytes())
                        .sum();
                    self.launched[c.id as usize] = Some((Instant::now(), bytes));
                    let grouped = c.slots.len() > 1;
                    if grouped {
                        comm.group(true);
                    }
                    let launched = launch_slots(plan, c, comm, grads, report, rank);
                    if grouped {
                        comm.group(false);
                    }
                    InFlight::Slots(launched?)
                };
                report.launched.push(c.id);
                self.flight[c.id as usize] = Some(f);
            }
            Step::Wait(Event::Done(cid)) => {
                let c = &plan.collectives[*cid as usize];
                let mut whole: Option<CommSpan> = None;
                match self.flight[c.id as usize].take() {
                    Some(InFlight::Bucket(p)) => {
                        let (buf, s) = p.wait(super::comm::wait_bound(opts.timeout))?;
                        comm_span(
                            report,
                            c.layout.bytes,
                            format!("all_reduce {}", bucket_name(c)),
                            s,
                        );
                        whole = Some(s);
                        self.packed[c.id as usize] = Some(buf);
                    }
                    Some(InFlight::Slots(calls)) => {
                        for (slot, p) in calls {
                            let (buf, s) = p.wait(super::comm::wait_bound(opts.timeout))?;
                            let g = match buf {
                                Packed::Host(b) => Grad::Host(b),
                                Packed::Device(bucket) => {
                                    if bucket.len() != plan.slots[slot as usize].ty.numel() as usize
                                    {
                                        return Err(ExecError::Plan {
                                            plan: plan.name.clone(),
                                            why: format!(
                                                "collective #{} returned {}[{}] for slot {slot}",
                                                c.id,
                                                bucket.dtype(),
                                                bucket.len()
                                            ),
                                        });
                                    }
                                    Grad::Device(bucket.into_grad())
                                }
                            };
                            comm_span(
                                report,
                                c.layout.bytes,
                                format!("all_reduce {}", bucket_name(c)),
                                s,
                            );
                            whole = Some(whole.map_or(s, |w| CommSpan {
                                start: w.start.min(s.start),
                                end: w.end.max(s.end),
                                // The whole began on the link when its first call did.
                                joined: match (w.joined, s.joined) {
                                    (Some(a), Some(b)) => Some(a.min(b)),
                                    (a, b) => a.or(b),
                                },
                                cpu_us: w.cpu_us + s.cpu_us,
                            }));
                            grads[slot as usize] = g;
                        }
                    }
                    None => {
                        return Err(ExecError::Plan {
                            plan: plan.name.clone(),
                            why: format!("waits for collective #{} before it was launched", c.id),
                        });
                    }
                }
                let wait_end = Instant::now();
                if let (Some((launched, bytes)), Some(comm)) =
                    (self.launched[c.id as usize].take(), whole)
                {
                    report.timings.push(CollectiveTiming {
                        collective: c.id,
                        bytes,
                        launched,
                        comm,
                        wait_start: t,
                        wait_end,
                    });
                }
                span(
                    report,
                    SpanKind::Wait,
                    0,
                    format!("wait {}", bucket_name(c)),
                );
            }
            Step::Unpack { collective } => {
                let c = &plan.collectives[*collective as usize];
                let early = || ExecError::Plan {
                    plan: plan.name.clone(),
                    why: format!("unpack of collective #{} before it finished", c.id),
                };
                if self.defer_unpacks {
                    // The reduced bucket stays in `packed` for `unpack`.
                    if self.packed[c.id as usize].is_none() {
                        return Err(early());
                    }
                    self.deferred.push(c.id);
                    return Ok(());
                }
                let buf = self.packed[c.id as usize].take().ok_or_else(early)?;
                let on_device: Option<Vec<&dyn DeviceGrad>> = c
                    .slots
                    .iter()
                    .map(|s| grads[*s as usize].device())
                    .collect();
                if let Some(m @ [first, ..]) = on_device.as_deref() {
                    // Packed on the device (a host pack leaves no device member behind).
                    let out = first.unpack(&c.layout, m, &buf, c.views).map_err(kerr)?;
                    report.view_grads += out.views;
                    for (s, g) in c.slots.iter().zip(out.grads) {
                        grads[*s as usize] = Grad::Device(g);
                    }
                } else {
                    let members = disjoint_mut(grads, &c.slots).ok_or_else(|| ExecError::Plan {
                        plan: plan.name.clone(),
                        why: format!("collective #{} lists a slot twice", c.id),
                    })?;
                    let mut members: Vec<&mut HostBuffer> = members
                        .into_iter()
                        .map(Grad::host_mut)
                        .collect::<Result<_, _>>()
                        .map_err(kerr)?;
                    let buf = buf.into_host().map_err(kerr)?;
                    if members.iter().all(|m| m.is_empty()) {
                        // Let go at the launch (above): new copies.
                        let out = host::unpack_new(&c.layout, &buf).map_err(kerr)?;
                        for (m, o) in members.iter_mut().zip(out) {
                            **m = o;
                        }
                    } else {
                        host::unpack(&c.layout, &buf, &mut members).map_err(kerr)?;
                    }
                    ws.buffers[c.id as usize] = buf;
                }
                span(
                    report,
                    SpanKind::Unpack,
                    c.layout.bytes,
                    format!("unpack {}", bucket_name(c)),
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
        Ok(())
    }
}

fn bucket_name(c: &PlanCollective) -> String {
    match c.bucket {
        Some(b) => format!("b{b}"),
        None => format!("#{}", c.id),
    }
}

/// Mutable references to `slots` of `grads`, in that order; `None` if a slot repeats or is out
/// of range.
fn disjoint_mut<'a, T>(grads: &'a mut [T], slots: &[u32]) -> Option<Vec<&'a mut T>> {
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
    let mut out: Vec<Option<&'a mut T>> = (0..slots.len()).map(|_| None).collect();
    let mut rest: &'a mut [T] = grads;
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

//! A step's gradient path on one rank: gradients taken in as they arrive (following a plan
//! when the step has one), the sync point that reduces what is left and writes every gradient
//! back, and what the step leaves for the next one. The module doc of [`super`] says how.

use std::sync::Arc;
use std::time::Instant;

use burn_backend::distributed::TensorRef;
use burn_backend::{Backend, TensorMetadata};

use super::{Live, RankState, SYNCS_TOTAL, Session, Submitted};
use crate::backend::distributed::graph_dtype;
use crate::backend::hook_times::SyncTimes;
use crate::backend::host_io::{from_host, read_host, with_host_slice, write_in_place};
use crate::backend::options::{SingleRank, UnusedParameters};
use crate::backend::record::StepRecord;
use crate::backend::{CTensor, Collective, CollectiveDevice};
use crate::codegen::plan::Plan;
use crate::graph::TensorType;
use crate::runtime::exec::{Execution, NoHooks, Workspace, execute_in};
use crate::runtime::{Grad, Handed};

impl<I: Backend> Session<I> {
    /// Takes in one gradient, of the parameter named `name` (Burn's `submit_gradient_sync`);
    /// returns how long computing its value took (the queued ops that produce it), for
    /// [`crate::backend::hook_times`].
    pub(in crate::backend) fn submit(
        &self,
        tref: TensorRef<Collective<I>>,
        name: String,
    ) -> std::time::Duration {
        // SAFETY: Burn keeps the pointer valid until submit_sync_collective returns.
        let t: &CTensor<I::FloatTensorPrimitive> = unsafe { &*tref.0 };
        let rank = t.rank as usize;
        let mut guard = self.state(rank, "submit_gradient_sync");
        let st = &mut *guard;
        let Some(dtype) = graph_dtype(t.dtype()) else {
            self.fail(
                rank,
                format!(
                    "gradient of {name} has dtype {:?}, which is not a float",
                    t.dtype()
                ),
            );
        };
        let dims: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
        let ty = TensorType::new(dtype, &dims);
        if st.index.contains_key(&name) {
            self.fail(
                rank,
                format!("the gradient of {name} was submitted twice in one step"),
            );
        }
        let seq = t.seq();
        let i = st.submitted.len();
        let local = *st.step_local.get_or_insert_with(|| {
            self.world == 1
                && self.options.single_rank == SingleRank::Skip
                && !self.options.check_finite
                && !st.no_sync
                && st.accumulated.is_empty()
        });
        if i == 0 && !local && !st.no_sync {
            // Before anything of the step reaches the communicator.
            self.start_join_round(rank, st);
        }
        if local {
            // A sum or mean over one rank is the gradient itself: nothing to read or reduce.
            st.index.insert(name.clone(), i);
            st.submitted.push(Submitted {
                tref,
                name,
                ty,
                data: None,
                seq,
            });
            return std::time::Duration::ZERO;
        }
        st.index.insert(name.clone(), i);
        // A gradient reduced as it is (not checked, not accumulated under no_sync).
        let plain =
            !self.options.check_finite && !st.no_sync && !st.accumulated.contains_key(&name);
        let on_device = self.options.device_buckets && plain;
        // Not locked while the gradient is computed: the ops that produce it may wait for a
        // user all-reduce, whose launch may release this step's held buckets.
        drop(guard);
        // The gradient's producers first (the `hoist-producers` rule), so its bucket can start
        // before the ops it does not read.
        let hoist = if self
            .options
            .config
            .disabled_passes
            .iter()
            .any(|p| p == "hoist-producers")
            || !self.options.config.overlap
        {
            0
        } else {
            self.options.config.hoist_bytes
        };
        let forcing = Instant::now();
        let inner = t.inner_hoisted("gradient sync", hoist);
        let forced = forcing.elapsed();
        // A CPU backend's gradient whose values lie in row-major order stays where it is until
        // the step's plan says where it goes: its bucket, copied into straight from there. (Where
        // it goes nowhere else, it is read under the lock below: a read of memory that waits for
        // nothing, unlike a device read, which may wait for queued work.)
        let (grad, mut in_place) = match on_device
            .then(|| crate::backend::device::device_grad::<I>(&inner))
            .flatten()
        {
            Some(g) => (Grad::Device(g), None),
            None if plain && with_host_slice(&inner, |_| ()).is_some() => {
                (Grad::default(), Some(inner))
            }
            None => (
                Grad::Host(self.read_gradient(rank, &name, &ty, inner)),
                None,
            ),
        };
        let mut guard = self.state(rank, "submit_gradient_sync");
        let st = &mut *guard;
        let grad = match in_place.take_if(|_| st.no_sync || st.accumulated.contains_key(&name)) {
            Some(inner) => Grad::Host(self.read_gradient(rank, &name, &ty, inner)),
            None => grad,
        };
        let grad = match grad {
            Grad::Host(mut buf) => {
                if st.no_sync {
                    // Accumulate locally; the gradient Burn holds stays this backward's own.
                    match st.accumulated.get_mut(&name) {
                        Some((t, acc)) if *t == ty => {
                            acc.accumulate(&buf);
                        }
                        Some((t, _)) => {
                            let t = t.clone();
                            self.fail(
                                rank,
                                format!(
                                    "the gradient of {name} is {ty}, but earlier backward passes under no_sync accumulated {t}"
                                ),
                            )
                        }
                        None => {
                            st.accumulated.insert(name.clone(), (ty.clone(), buf));
                        }
                    }
                    return forced;
                }
                if let Some((t, mut acc)) = st.accumulated.remove(&name) {
                    if t != ty {
                        self.fail(
                            rank,
                            format!(
                                "the gradient of {name} is {ty}, but the backward passes under no_sync accumulated {t}"
                            ),
                        );
                    }
                    // The micro-batches in order: the accumulated ones, then this one.
                    acc.accumulate(&buf);
                    buf = acc;
                }
                Grad::Host(buf)
            }
            device => device,
        };
        // Its value exists: the one clock read of a gradient.
        self.clock(rank).gradient(&name, ty.bytes());
        // The first gradient of a step starts following a plan: the one of the segment that
        // came after the last one last time, when it starts with this gradient; else the
        // previous step's. The user's all-reduces issued before it launch first.
        if st.live.is_none() && i == 0 {
            // (The previous step's plan predicted again is just the previous step's plan.)
            let predicted = (self.options.unused != UnusedParameters::ZeroFill)
                .then(|| st.history.predicted(&name, &ty))
                .flatten()
                .filter(|(p, _)| {
                    st.expected
                        .as_ref()
                        .is_none_or(|e| e.graph_hash != p.graph_hash)
                })
                .map(|(p, g)| (Arc::clone(p), g.clone()));
            if let Some((plan, segment)) = predicted {
                let mut live = self.start_live(rank, st, plan);
                live.predicted = Some(segment);
                st.live = Some(live);
            } else if let Some(plan) = st.expected.clone() {
                st.live = Some(self.start_live(rank, st, plan));
            }
            if let Some(live) = st.live.as_mut() {
                live.held = self.hold_for_user(rank);
            }
        }
        let mut data = Some(grad);
        if let Some(live) = st.live.as_mut().filter(|l| !l.diverged) {
            let next = live.exec.next_gradient(&live.plan, &live.ready);
            match next.map(|s| (s, &live.plan.slots[s as usize])) {
                Some((slot, s)) if s.param == name && s.ty == ty => {
                    let copied = in_place.as_ref().and_then(|t| {
                        with_host_slice(t, |v| {
                            live.exec.copy_in(&live.plan, slot, v, &mut st.workspace)
                        })
                    });
                    match copied {
                        Some(Ok(true)) => {
                            in_place = None;
                            st.read_into_buckets += 1;
                        }
                        Some(Err(e)) => self.fail(rank, e.to_string()),
                        Some(Ok(false)) | None => {}
                    }
                    if let Some(inner) = in_place.take() {
                        data = Some(Grad::Host(self.read_gradient(rank, &name, &ty, inner)));
                    }
                    live.grads[slot as usize] = data.take().unwrap_or_default();
                    live.ready[slot as usize] = true;
                    live.source[slot as usize] = Some(i);
                    // Pack and launch every bucket this gradient completes; never wait here.
                    if live.held && self.poll_user(rank) {
                        live.held = false;
                    }
                    if !live.held {
                        self.advance_live(rank, live, &mut st.workspace, false);
                    }
                }
                _ => live.diverged = true,
            }
        }
        if let Some(inner) = in_place {
            data = Some(Grad::Host(self.read_gradient(rank, &name, &ty, inner)));
        }
        st.submitted.push(Submitted {
            tref,
            name,
            ty,
            data,
            seq,
        });
        forced
    }

    /// Reads the gradient of `name` into host memory, checked for values that are not finite
    /// when the options ask; an error fails the step.
    fn read_gradient(
        &self,
        rank: usize,
        name: &str,
        ty: &TensorType,
        inner: I::FloatTensorPrimitive,
    ) -> crate::runtime::HostBuffer {
        let buf = match read_host::<I>(inner) {
            Ok(h) => h,
            Err(e) => self.fail(rank, format!("reading the gradient of {name}: {e}")),
        };
        if self.options.check_finite
            && let Some((at, v)) = buf.first_non_finite()
        {
            self.fail(
                rank,
                format!("the gradient of {name} ({ty}) has {v} at element {at}"),
            );
        }
        buf
    }

    /// Runs a live execution as far as its gradients allow (`to_end`: to the end, waiting for
    /// its collectives); an error fails the step on every rank.
    pub(in crate::backend) fn advance_live(
        &self,
        rank: usize,
        live: &mut Live,
        ws: &mut Workspace,
        to_end: bool,
    ) {
        if let Err(e) = live.exec.run(
            &live.plan,
            self.comm(rank),
            &mut live.grads,
            &live.ready,
            &mut NoHooks,
            self.opts(),
            ws,
            to_end,
        ) {
            self.fail(rank, e.to_string());
        }
    }

    /// Agrees with every rank on `plan` unless they did before (`agreed` holds the hashes of
    /// the plans they did); a workspace that runs it then needs [`Workspace::agreed`]. Call it
    /// where every rank's training thread gets to, outside backward: Burn's autodiff ends each
    /// backward pass by locking every thread's graph, so a rank waiting inside backward for
    /// another rank's thread can wait for a thread that waits for it.
    pub(in crate::backend) fn agree_once(
        &self,
        rank: usize,
        agreed: &mut hashbrown::HashSet<u64>,
        plan: &Plan,
    ) {
        if agreed.insert(plan.graph_hash) {
            let timeout = self.options.timeout;
            if let Err(e) = crate::runtime::agree::agree(plan, self.comm(rank), timeout) {
                self.fail(rank, e.to_string());
            }
        }
    }

    /// Starts running `plan` for this step, during backward: a plan the ranks agreed on at a
    /// sync point ([`Session::agree_ahead`]).
    pub(in crate::backend) fn start_live(
        &self,
        rank: usize,
        st: &mut RankState<I>,
        plan: Arc<Plan>,
    ) -> Live {
        self.agree_once(rank, &mut st.agreed, &plan);
        st.workspace.agreed(&plan);
        match Execution::new(&plan, self.comm(rank), &mut st.workspace, self.opts()) {
            Ok(exec) => {
                let n = plan.slots.len();
                Live {
                    exec,
                    grads: (0..n).map(|_| Grad::default()).collect(),
                    ready: vec![false; n],
                    source: vec![None; n],
                    diverged: false,
                    predicted: None,
                    held: false,
                    held_to_sync: false,
                    plan,
                }
            }
            Err(e) => self.fail(rank, e.to_string()),
        }
    }

    /// Runs the rest of a live execution, waiting for its collectives, and leaves its unpacks to
    /// the hand-back ([`Session::hand_back_live`], which records its spans).
    pub(in crate::backend) fn finish_live(&self, rank: usize, live: &mut Live, ws: &mut Workspace) {
        live.exec.defer_unpacks();
        self.advance_live(rank, live, ws, true);
    }

    /// Records a live execution's spans once every step ran and counts its step as eager or
    /// held (`launched_early`).
    fn end_live(
        &self,
        rank: usize,
        exec: Execution,
        held_to_sync: bool,
        st: &mut RankState<I>,
        launched_early: bool,
    ) {
        match exec.finish() {
            Ok(report) => self.record(rank, &report),
            Err(e) => self.fail(rank, e.to_string()),
        }
        if launched_early {
            *if held_to_sync {
                &mut st.held_steps
            } else {
                &mut st.eager_steps
            } += 1;
        }
    }

    /// Hands back the gradients of a live execution that ran to its end with its unpacks
    /// deferred ([`Execution::defer_unpacks`]): each reduced gradient replaces the one Burn holds
    /// the moment it is unpacked (a host bucket member by member, copied over the gradient's own
    /// memory where nothing else shares it, else into a new tensor; a device bucket after its one
    /// unpack kernel), so the step holds the reduced copies of at most one gradient (one device
    /// bucket) beside the gradients at a time rather than all of them: at most the gradients and
    /// the buckets, what DDP holds. With `launched_early` the step counts as eager, or as held
    /// when it was held to the sync point. Returns the time the unpacks took.
    fn hand_back_live(
        &self,
        rank: usize,
        st: &mut RankState<I>,
        mut live: Live,
        launched_early: bool,
    ) -> std::time::Duration {
        let (comm, opts) = (self.comm(rank), self.opts());
        let (mut unpacking, mut writing) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        let mut handed = vec![false; live.grads.len()];
        for c in live.exec.deferred().to_vec() {
            let t = Instant::now();
            let (source, submitted) = (&live.source, &st.submitted);
            let mut hand = |s: u32, g: Handed<'_>| {
                handed[s as usize] = true;
                let Some(i) = source[s as usize] else {
                    return Ok(());
                };
                // Over the memory of the gradient it replaces where nothing else shares it
                // (the copy out of the bucket is the unpack); else into a new tensor.
                if Self::write_in_place(&submitted[i], &g) {
                    return Ok(());
                }
                let g = g.into_grad()?;
                let w = Instant::now();
                self.write_back(rank, &submitted[i], g);
                writing += w.elapsed();
                Ok(())
            };
            let unpacked = live.exec.unpack(
                &live.plan,
                comm,
                &mut live.grads,
                opts,
                &mut st.workspace,
                c,
                &mut hand,
            );
            if let Err(e) = unpacked {
                self.fail(rank, e.to_string());
            }
            unpacking += t.elapsed();
        }
        // Gradients with an all-reduce of their own.
        for (s, g) in live.grads.iter_mut().enumerate() {
            if let (false, Some(i)) = (handed[s], live.source[s]) {
                self.write_back(rank, &st.submitted[i], std::mem::take(g));
            }
        }
        self.end_live(rank, live.exec, live.held_to_sync, st, launched_early);
        unpacking.saturating_sub(writing)
    }

    /// Writes a reduced member of a host bucket over the memory of the gradient Burn holds for
    /// `sub`, where nothing else shares that memory (an NdArray or Flex gradient: see
    /// [`write_in_place`]); false, nothing written, where it cannot.
    fn write_in_place(sub: &Submitted<I>, g: &Handed<'_>) -> bool {
        // SAFETY: as in `write_back`.
        let t: &mut CTensor<I::FloatTensorPrimitive> = unsafe { &mut *sub.tref.0 };
        t.write_in_place(|p| write_in_place(p, g))
    }

    /// Writes the reduced gradient `g` over the one Burn holds for `sub`.
    fn write_back(&self, rank: usize, sub: &Submitted<I>, g: Grad) {
        // SAFETY: Burn keeps the pointer valid until the sync hook returns; nothing else
        // touches the gradient meanwhile.
        let t: &mut CTensor<I::FloatTensorPrimitive> = unsafe { &mut *sub.tref.0 };
        let buf = match g {
            Grad::Host(buf) => buf,
            Grad::Device(g) => {
                // The reduced gradient, in a new buffer of the tensor's own device.
                let like = t.inner_for("gradient write-back");
                match crate::backend::device::tensor_from::<I>(&like, g).map_err(|g| g.read()) {
                    Ok(p) => {
                        t.set(p);
                        return;
                    }
                    Err(Ok(buf)) => buf,
                    Err(Err(e)) => self.fail(rank, format!("{}: {e}", sub.name)),
                }
            }
        };
        let data = from_host(buf, t.shape());
        let dev = t.device(|p| I::float_device(p));
        t.set(I::float_from_data(data, &dev));
    }

    /// A sync point (Burn's `submit_sync_collective`, or a step a rank that ran out of inputs
    /// takes part in, [`crate::backend::join`]): the user's all-reduces issued before it, then
    /// [`sync`](Self::sync), then the ranks' meeting after a backward that waited inside.
    pub(in crate::backend) fn sync_point(&self, device: &CollectiveDevice<I::Device>) -> SyncTimes {
        let rank = device.rank as usize;
        self.note_held(rank);
        self.flush_user(rank, None);
        let parts = self.sync(device);
        self.meet_after_backward(rank);
        parts
    }

    /// Reduces what is left of a step and writes every reduced gradient back; returns how long
    /// the write-back took and how long the step waited for how many collectives, for
    /// [`crate::backend::hook_times`].
    pub(in crate::backend) fn sync(&self, device: &CollectiveDevice<I::Device>) -> SyncTimes {
        let rank = device.rank as usize;
        let mut guard = self.state(rank, "submit_sync_collective");
        let st = &mut *guard;
        let log = crate::backend::lazy::take_log(device.rank);
        self.clock(rank).sync_point();
        if st.no_sync {
            self.clock(rank).discard();
            // A backward pass under no_sync: its gradients were accumulated, nothing to reduce.
            st.step_local = None;
            st.submitted.clear();
            st.index.clear();
            st.registered.clear();
            return SyncTimes::default();
        }
        if !st.accumulated.is_empty() {
            let mut names: Vec<&str> = st.accumulated.keys().map(String::as_str).collect();
            names.sort_unstable();
            let msg = format!(
                "gradients accumulated under no_sync were not submitted by the backward pass that synchronizes them: {}",
                names.join(", ")
            );
            self.fail(rank, msg);
        }
        if st.step_local.take() == Some(true) {
            if self.options.unused == UnusedParameters::Error {
                self.check_registered(rank, st);
            }
            st.local_steps += 1;
            self.finish_step(rank, st, log, false);
            return SyncTimes::default();
        }
        if self.options.probe_link && !st.probed && self.world > 1 {
            // Every rank's first synced step, before any of its collectives.
            st.probed = true;
            match crate::runtime::probe::probe_link(self.comm(rank), self.options.timeout) {
                Ok(runs) => {
                    let mut c = self.clock(rank);
                    for (bytes, us) in runs {
                        c.link.add(bytes, us);
                    }
                }
                Err(e) => self.fail(rank, format!("probing the link: {e}")),
            }
        }
        let (reduced, live) = if self.options.unused == UnusedParameters::ZeroFill {
            self.reduce_zero_fill(rank, st)
        } else {
            self.reduce_following(rank, st)
        };
        // Write back in place, through the pointers Burn gave us; only now, once every
        // collective of the step finished.
        let writeback = self.clock(rank).handback();
        for (sub, g) in st.submitted.iter().zip(reduced) {
            if let Some(g) = g {
                self.write_back(rank, sub, g);
            }
        }
        let mut unpacking = std::time::Duration::ZERO;
        if let Some((live, launched_early)) = live {
            unpacking = self.hand_back_live(rank, st, live, launched_early);
            // The unpacks are the plan's copies (measured as such), not the hand-back's.
            self.clock(rank).handback_later(unpacking);
        }
        let writeback = writeback.elapsed().saturating_sub(unpacking);
        self.end_join_round(rank, st);
        self.finish_step(rank, st, log, true);
        self.agree_ahead(rank, st);
        // The step just measured (`finish_step` ended it on the clock).
        let (collectives, waited_us) = self.clock(rank).last.as_ref().map_or((0, 0.0), |m| {
            (m.collectives.len() as u64, m.waited_at_sync_us())
        });
        SyncTimes {
            writeback,
            collectives,
            waited: std::time::Duration::from_secs_f64(waited_us.max(0.0) * 1e-6),
        }
    }

    /// At a sync point, where every rank's training thread gets to: agrees on the plans the
    /// next step may follow during backward (the previous step's, the predicted one) unless
    /// the ranks did before, so following one never waits for another rank.
    fn agree_ahead(&self, rank: usize, st: &mut RankState<I>) {
        let next = st.history.next_plan();
        for plan in st.expected.clone().into_iter().chain(next) {
            self.agree_once(rank, &mut st.agreed, &plan);
        }
    }

    /// Ends a step (`synced`: its gradients were reduced): keeps its recorded graph and the
    /// plan its segment ran with, forgets its gradients.
    fn finish_step(
        &self,
        rank: usize,
        st: &mut RankState<I>,
        log: crate::backend::lazy::StepLog,
        synced: bool,
    ) {
        self.clock(rank).end_step(self.world, self.clocks.len());
        st.last_ran = (log.ran, log.entries.iter().map(|e| e.seq).collect());
        // The step's gradients leave it: their names and types move into its record.
        let grads = st
            .submitted
            .drain(..)
            .map(|x| (x.name, x.ty, x.seq))
            .collect();
        st.last_step = Some(StepRecord {
            world: self.world as u32,
            reduce: self.reduce,
            grads,
            log: log.entries,
        });
        self.plan_from_measured(rank, st);
        if synced
            && self.options.unused != UnusedParameters::ZeroFill
            && let (Some(plan), Some(segment), Some(record)) =
                (&st.expected, &st.expected_segment, &st.last_step)
        {
            let key = crate::backend::follow::segment_key(
                record.grads.iter().map(|(n, t, _)| (n.as_str(), t)),
            );
            st.history.synced(key, plan, segment);
        }
        st.index.clear();
        st.registered.clear();
        SYNCS_TOTAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The default sync: every registered gradient must have arrived; the step follows its plan
    /// as far as its gradients came in that plan's order, and reduces the
    /// rest with a plan of its own. Returns the reduced gradients by submission index and, when
    /// the step followed its plan to the end, that live execution, whose unpacks are left to the
    /// hand-back ([`Session::hand_back_live`]; its gradients are not in the first), with whether
    /// it launched during backward (it did).
    pub(in crate::backend) fn reduce_following(
        &self,
        rank: usize,
        st: &mut RankState<I>,
    ) -> (Vec<Option<Grad>>, Option<(Live, bool)>) {
        self.check_registered(rank, st);
        if st.submitted.is_empty() {
            return (Vec::new(), None);
        }
        let opts = self.opts();
        let comm = self.comm(rank);
        // Reduced gradients by submission index.
        let mut reduced: Vec<Option<Grad>> = (0..st.submitted.len()).map(|_| None).collect();
        let mut complete_live = None;
        if let Some(mut live) = st.live.take() {
            let complete = !live.diverged
                && live.ready.iter().all(|r| *r)
                && live.plan.slots.len() == st.submitted.len();
            if complete {
                if let Some(segment) = live.predicted.take() {
                    // This step ran the predicted plan: the next one follows from there.
                    st.expected = Some(Arc::clone(&live.plan));
                    st.expected_segment = Some(segment);
                    st.planner.stale = st.planner.base.is_some();
                }
                self.finish_live(rank, &mut live, &mut st.workspace);
                // A step that followed its plan to the end launched during backward.
                complete_live = Some((live, true));
            } else {
                // Finish what was launched (every rank launched the same), give the rest back.
                let done = match live.exec.drain(
                    &live.plan,
                    comm,
                    &mut live.grads,
                    opts,
                    &mut st.workspace,
                ) {
                    Ok(d) => d,
                    Err(e) => self.fail(rank, e.to_string()),
                };
                if let Ok(report) = live.exec.finish() {
                    self.record(rank, &report);
                }
                let mut is_done = vec![false; live.grads.len()];
                for s in done {
                    is_done[s as usize] = true;
                }
                for (slot, buf) in live.grads.into_iter().enumerate() {
                    if let Some(i) = live.source[slot] {
                        if is_done[slot] {
                            reduced[i] = Some(buf);
                        } else {
                            st.submitted[i].data = Some(buf);
                        }
                    }
                }
            }
        }
        // Whatever is not reduced yet: compile (cached) and run its own plan, in ready order.
        let mut pending = vec![false; st.submitted.len()];
        for i in complete_live
            .iter()
            .flat_map(|(l, _)| l.source.iter().flatten())
        {
            pending[*i] = true;
        }
        let left: Vec<usize> = (0..st.submitted.len())
            .filter(|i| reduced[*i].is_none() && !pending[*i])
            .collect();
        if !left.is_empty() {
            let owned: Vec<(String, TensorType)> = left
                .iter()
                .map(|i| (st.submitted[*i].name.clone(), st.submitted[*i].ty.clone()))
                .collect();
            let (_, plan) = self.compile_segment(rank, &mut st.cache, &owned);
            let mut grads: Vec<Grad> = Vec::with_capacity(plan.slots.len());
            let mut source = Vec::with_capacity(plan.slots.len());
            for s in &plan.slots {
                let i = left[owned.iter().position(|(n, _)| *n == s.param).unwrap_or(0)];
                grads.push(st.submitted[i].data.take().unwrap_or_default());
                source.push(i);
            }
            let ws = if left.len() == st.submitted.len() {
                &mut st.workspace
            } else {
                &mut st.leftover_workspace
            };
            self.agree_once(rank, &mut st.agreed, &plan);
            ws.agreed(&plan);
            match execute_in(&plan, comm, &mut grads, &mut NoHooks, opts, ws) {
                Ok(report) => self.record(rank, &report),
                Err(e) => self.fail(rank, e.to_string()),
            }
            for (buf, i) in grads.into_iter().zip(source) {
                reduced[i] = Some(buf);
            }
            st.flushed_steps += 1;
        }
        if left.is_empty() || left.len() == st.submitted.len() {
            // No rest reduced with a plan of its own: the buckets a step did so for go.
            st.leftover_workspace.let_go();
        }
        // The next step follows this step's order.
        if st.expected.is_none() || !left.is_empty() {
            let owned: Vec<(String, TensorType)> = st
                .submitted
                .iter()
                .map(|s| (s.name.clone(), s.ty.clone()))
                .collect();
            let (g, plan) = self.compile_segment(rank, &mut st.cache, &owned);
            st.expected = Some(plan);
            st.expected_segment = Some(g);
            st.planner.stale = st.planner.base.is_some();
        }
        (reduced, complete_live)
    }

    /// Every parameter Burn registered for this step's sync must have sent its gradient; else
    /// the step fails naming the missing ones.
    fn check_registered(&self, rank: usize, st: &RankState<I>) {
        let missing: Vec<&str> = st
            .registered
            .iter()
            .filter(|n| !st.index.contains_key(*n))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            let shown: Vec<&str> = missing.iter().take(8).copied().collect();
            let msg = format!(
                "the gradients of {} registered parameter(s) never arrived before the sync point: {}{}",
                missing.len(),
                shown.join(", "),
                if missing.len() > shown.len() {
                    ", …"
                } else {
                    ""
                }
            );
            self.fail(rank, msg);
        }
    }
}

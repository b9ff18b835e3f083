//! Uneven inputs: ranks that run out of batches at different steps, like PyTorch's `Join`
//! context for DDP.
//!
//! Without it, a rank that ends its loop early leaves the others waiting in their next gradient
//! sync until the collective timeout fails them. Inside a [`join`] scope every synced step
//! starts with a round: one tiny all-reduce in which each rank says whether it still trains.
//! A rank that ran out of inputs calls [`Join::finish`], which takes part in the others' steps
//! until none trains: each round that reports a rank still training, it runs the gradient sync
//! of its own last step again with zero gradients (the same gradients, shapes, dtypes and ready
//! order, so the same plan: the same buckets and collectives as the others), which adds nothing
//! to their sums. With [`ReduceOperation::Mean`](burn_backend::distributed::ReduceOperation)
//! the sum is divided by the whole world by default (PyTorch's
//! `divide_by_initial_world_size=True`): a step of fewer ranks moves the model by the
//! gradients of the ranks that trained, weighted as in a full step. [`join_with`] and
//! [`JoinOptions`] divide it by the ranks that trained instead (`False`): the reduced
//! gradients of such a step are scaled by `world / trained` at its sync point. A loop that makes
//! its buffers alike before each forward pass ([`sync_buffers`](super::sync_buffers)) finishes
//! with [`Join::finish_model`], which syncs the model's buffers before each round as well.
//! [`Join::finished_ranks`] tells every training rank, after each step, which ranks have run
//! out, so that a loop can stop every rank at the first (PyTorch's
//! `throw_on_early_termination`).
//!
//! Requires: every rank enters the scope before the same step and calls `finish` (or
//! `finish_model`) after its own last step; every rank synced at least one step before it
//! finishes (its last step is what it replays); while a rank has finished, the others' steps
//! communicate through the gradient sync and, before their forward pass, the buffer sync only
//! (anything else, a user `all_reduce` or a `SyncBatchNorm`, meets the finished rank's round
//! and fails every rank with the communicator's mismatch error, or times out), and sync the
//! same parameters as the finished rank's last step; every rank's scope has the same
//! [`JoinOptions`] (each round checks). Guarantees: every rank's `finish`
//! returns once every rank has finished, each knowing the ranks that trained last
//! ([`JoinReport::authority`]: their model has every update, which [`Join::finish_model`]
//! gives every rank); a failed round is an error on every rank, never a hang.

use std::sync::Arc;

use burn_backend::distributed::TensorRef;
use burn_backend::{Backend, Scalar};
use burn_core::module::AutodiffModule;
use burn_core::tensor::backend::AutodiffBackend;
use burn_std::{FloatDType, Shape};

use super::rank_threads::works_for;
use super::replicas::{BufferSync, Reduce, ReplicaError};
use super::session::{RankState, Session, lock, session};
use super::{CTensor, Collective, CollectiveDevice};
use crate::graph::ReduceOp;
use crate::runtime::agree::{PendingCounts, start_join_round};
use crate::runtime::comm::CommError;

/// How a [`join`] scope averages the steps some ranks sat out; every rank's scope has the same
/// (each round checks: ranks that differ fail with [`JoinError::Options`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinOptions {
    /// With the gradient sync's mean, divide the sum of a step that only some ranks trained by
    /// the whole world (`true`, the default, PyTorch's `divide_by_initial_world_size=True`: the
    /// gradients of the ranks that trained weigh as in a full step) or by the ranks that
    /// trained (`false`: the step moves the model as far as a full one; its reduced gradients
    /// are scaled by `world / trained` at the sync point, which rounds once more than a full
    /// step's mean does). No effect with the sum.
    pub divide_by_initial_world_size: bool,
}

impl Default for JoinOptions {
    fn default() -> Self {
        Self {
            divide_by_initial_world_size: true,
        }
    }
}

impl JoinOptions {
    /// What a rank says in a round: bit 0 whether it trains, bit 1 whether it divides by the
    /// ranks that trained.
    fn round_value(self, training: bool) -> u64 {
        u64::from(training) | u64::from(!self.divide_by_initial_world_size) << 1
    }
}

/// A rank's rounds inside a [`join`] scope.
pub(super) struct JoinState {
    options: JoinOptions,
    /// The rank still trains: each of its synced steps starts a round saying so.
    training: bool,
    /// The round this step started, waited for at its sync point.
    pending: Option<PendingCounts>,
    /// Rounds so far (synced steps of any rank inside the scope).
    rounds: u64,
    /// The ranks still training in the latest round that had any.
    last_trained: Vec<usize>,
    /// How this rank's latest step inside the scope made its buffers alike
    /// ([`sync_buffers`](super::sync_buffers)), which [`Join::finish_model`] does again before
    /// each round it waits in.
    buffers: Option<BufferSync>,
}

/// An uneven-inputs scope of one rank (see [`join`]); it ends with [`Join::finish`] (or when
/// it drops, without waiting for the others: then a rank still training waits in vain).
#[must_use = "a rank that runs out of inputs calls finish, which waits for the others"]
pub struct Join<I: Backend> {
    device: CollectiveDevice<I::Device>,
    session: Arc<Session<I>>,
}

/// What a rank's [`Join::finish`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinReport {
    /// The rank reporting.
    pub rank: usize,
    /// Steps of other ranks this rank took part in with zero gradients, after its last input.
    pub shadowed_steps: u64,
    /// Synced steps of any rank inside the scope (rounds).
    pub rounds: u64,
    /// The ranks that trained in the last round that had any, in rank order (empty when no
    /// rank synced a step inside the scope).
    pub last_trained: Vec<usize>,
    /// The lowest of them (0 when none): its model has every update.
    pub authority: usize,
}

/// Why [`Join::finish`] failed; every rank gets an error (the group is aborted).
#[derive(Clone, Debug, thiserror::Error)]
pub enum JoinError {
    /// A round failed: a rank that neither trains nor finishes within the timeout, a rank that
    /// launched another collective (anything but the gradient sync) while this one waited, an
    /// aborted group.
    #[error("{source} (in a round of uneven inputs, after rank {rank}'s last input)")]
    Round {
        /// The rank reporting.
        rank: usize,
        /// The communicator's error.
        source: Box<CommError>,
    },
    /// The rank has no synced step to replay while others train.
    #[error(
        "rank {rank}: ran out of inputs before it synced any step while rank(s) {training:?} still train: a finished rank takes part in their steps with the gradients of its own last step, so every rank syncs at least one"
    )]
    NoStep {
        /// The rank reporting.
        rank: usize,
        /// The ranks still training.
        training: Vec<usize>,
    },
    /// The ranks' scopes have different [`JoinOptions`]: their models would part.
    #[error(
        "rank {rank}: the ranks' join scopes divide a step that only some ranks trained differently: rank(s) {by_world:?} by the initial world size, rank(s) {by_trained:?} by the ranks that trained (JoinOptions::divide_by_initial_world_size must be the same on every rank)"
    )]
    Options {
        /// The rank reporting.
        rank: usize,
        /// The ranks whose scope divides by the world.
        by_world: Vec<usize>,
        /// The ranks whose scope divides by the ranks that trained.
        by_trained: Vec<usize>,
    },
    /// Giving every rank the authority's model failed ([`Join::finish_model`]).
    #[error(transparent)]
    Replica(#[from] ReplicaError),
}

/// Starts an uneven-inputs scope on `device`'s rank, like PyTorch's `Join([ddp_model])`: every
/// rank enters it before the same step, trains on its own inputs, however many, and calls
/// [`Join::finish`] after its last step; see the module docs for what a finished rank does
/// while others train, and what it requires. Costs one tiny all-reduce per synced step.
/// Nothing is communicated with one rank. A step that only some ranks trained divides the
/// gradient sync's mean by the whole world ([`JoinOptions::default`]; see [`join_with`]).
///
/// # Panics
/// Without a communication server for `Collective<I>` (as every hook).
pub fn join<I: Backend>(device: &CollectiveDevice<I::Device>) -> Join<I> {
    join_with(device, JoinOptions::default())
}

/// [`join`] with `options`, which every rank's scope must share (PyTorch's `Join(...,
/// divide_by_initial_world_size=...)`).
///
/// # Panics
/// Without a communication server for `Collective<I>` (as every hook).
pub fn join_with<I: Backend>(
    device: &CollectiveDevice<I::Device>,
    options: JoinOptions,
) -> Join<I> {
    let session = session::<I>("join");
    let rank = device.rank as usize;
    if session.world > 1 {
        session.state(rank, "join").join = Some(JoinState {
            options,
            training: true,
            pending: None,
            rounds: 0,
            last_trained: Vec::new(),
            buffers: None,
        });
    }
    Join {
        device: device.clone(),
        session,
    }
}

impl<I: Backend> Session<I> {
    /// At a step's first gradient inside a join scope: starts its round (this rank trains).
    pub(super) fn start_join_round(&self, rank: usize, st: &mut RankState<I>) {
        if let Some(j) = st
            .join
            .as_mut()
            .filter(|j| j.training && j.pending.is_none())
        {
            match start_join_round(self.comm(rank), j.options.round_value(true)) {
                Ok(p) => j.pending = Some(p),
                Err(e) => self.fail(rank, e.to_string()),
            }
        }
    }

    /// At the sync point, after the write-back: the step's round, done long since (it went
    /// before the step's collectives), tells which ranks still train; where fewer than all
    /// did and the scope divides by them, the step's reduced gradients are scaled to their
    /// mean.
    pub(super) fn end_join_round(&self, rank: usize, st: &mut RankState<I>) {
        let Some(j) = st.join.as_mut() else {
            return;
        };
        let Some(p) = j.pending.take() else {
            return;
        };
        let counts = match p.wait(self.options.timeout) {
            Ok(counts) => counts,
            Err(e) => self.fail(rank, e.to_string()),
        };
        if let Err(e) = j.saw(rank, &counts) {
            self.fail(rank, e.to_string());
        }
        let trained = j.last_trained.len();
        if j.options.divide_by_initial_world_size
            || self.reduce != ReduceOp::Mean
            || trained == 0
            || trained >= self.world
        {
            return;
        }
        let scale = Scalar::Float(f64::from(self.world as f32 / trained as f32));
        for sub in &st.submitted {
            // SAFETY: as in the write-back just before: Burn keeps the pointer valid until the
            // sync hook returns.
            let t: &mut CTensor<I::FloatTensorPrimitive> = unsafe { &mut *sub.tref.0 };
            let g = t.inner_for("scaling a step that some ranks sat out");
            t.set(I::float_mul_scalar(g, scale));
        }
    }

    /// A buffer sync of `rank` ([`sync_buffers`](super::sync_buffers)): what it gives every
    /// rank. [`BufferSync::Broadcast`] is rank 0's values, and inside a join scope after a
    /// round, those of the lowest rank that trained the latest step (PyTorch's authoritative
    /// rank: a rank that has run out of inputs holds older statistics, and every rank knows
    /// the same round). Inside a scope, a training rank's sync is remembered for the shadow.
    pub(super) fn buffer_reduce(&self, rank: usize, how: BufferSync) -> Reduce {
        let mut root = 0;
        if let Some(j) = self.state(rank, "sync_buffers").join.as_mut() {
            if j.training {
                j.buffers = Some(how);
            }
            root = j.last_trained.first().copied().unwrap_or(0);
        }
        match how {
            BufferSync::Broadcast => Reduce::From(root),
            BufferSync::Mean => Reduce::Mean,
        }
    }
}

impl JoinState {
    /// Takes in a round's counts: which ranks train, and that every rank's options are this
    /// rank's.
    fn saw(&mut self, rank: usize, counts: &[u64]) -> Result<(), JoinError> {
        self.rounds += 1;
        self.last_trained = training(counts);
        let (by_trained, by_world): (Vec<usize>, Vec<usize>) =
            (0..counts.len()).partition(|r| counts[*r] & 2 != 0);
        if by_trained.is_empty() || by_world.is_empty() {
            return Ok(());
        }
        Err(JoinError::Options {
            rank,
            by_world,
            by_trained,
        })
    }
}

fn training(counts: &[u64]) -> Vec<usize> {
    (0..counts.len()).filter(|r| counts[*r] & 1 != 0).collect()
}

impl<I: Backend> Join<I> {
    fn rank(&self) -> usize {
        self.device.rank as usize
    }

    /// The ranks that had run out of inputs in this rank's latest synced step (its round, read
    /// at the step's sync point, so known once its backward returns); empty before the first
    /// and while every rank trains. Every rank of a step sees the same, so a loop that stops
    /// when this is not empty stops every rank after the same step (the one in which the first
    /// rank out of inputs took part with zeros) and their `finish` returns at once: PyTorch's
    /// `throw_on_early_termination`, as a value instead of an exception.
    pub fn finished_ranks(&self) -> Vec<usize> {
        let s = &self.session;
        match s.state(self.rank(), "finished_ranks").join.as_ref() {
            Some(j) if j.rounds > 0 => (0..s.world)
                .filter(|r| !j.last_trained.contains(r))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// After this rank's last step: takes part in every step the other ranks still sync, with
    /// zero gradients, and returns once no rank trains.
    ///
    /// # Errors
    /// [`JoinError::Round`] when a round fails (a rank that neither trains nor finishes within
    /// the timeout, another collective met, an aborted group), [`JoinError::NoStep`] when the
    /// others train and this rank never synced a step; the group is aborted, so every rank
    /// fails. A failure inside a replayed step panics as a failed gradient sync does. A loop
    /// that makes its buffers alike each step ([`sync_buffers`](super::sync_buffers)) finishes
    /// with [`finish_model`](Self::finish_model), which takes part in that too: here the
    /// others' buffer sync meets this rank's round, and every rank fails with the mismatch.
    pub fn finish(self) -> Result<JoinReport, JoinError> {
        self.rounds((), |(), _| Ok(())).map(|((), report)| report)
    }

    /// [`finish`](Self::finish)'s rounds, each after `sync_buffers(state, how)` where this
    /// rank's latest step inside the scope made its buffers alike with `how`.
    fn rounds<T>(
        self,
        mut state: T,
        mut sync_buffers: impl FnMut(T, BufferSync) -> Result<T, JoinError>,
    ) -> Result<(T, JoinReport), JoinError> {
        let (s, rank) = (&self.session, self.rank());
        works_for(s, rank);
        let mut shadowed_steps = 0;
        if s.world > 1 {
            let (options, buffers) = match s.state(rank, "join").join.as_mut() {
                Some(j) => {
                    j.training = false;
                    (j.options, j.buffers)
                }
                None => (JoinOptions::default(), None),
            };
            loop {
                // The others' step makes its buffers alike before its round (which its first
                // gradient starts).
                if let Some(how) = buffers {
                    state = sync_buffers(state, how).map_err(|e| self.failed(e))?;
                }
                let round = start_join_round(s.comm(rank), options.round_value(false))
                    .and_then(|p| p.wait(s.options.timeout))
                    .map_err(|e| {
                        let source = Box::new(e);
                        self.failed(JoinError::Round { rank, source })
                    })?;
                let training = training(&round);
                if training.is_empty() {
                    break;
                }
                let grads = {
                    let mut st = s.state(rank, "join");
                    let saw = st.join.as_mut().map_or(Ok(()), |j| j.saw(rank, &round));
                    if let Err(e) = saw {
                        drop(st);
                        return Err(self.failed(e));
                    }
                    st.last_step.as_ref().map(|r| {
                        r.grads
                            .iter()
                            .map(|(name, ty, _)| (name.clone(), ty.clone()))
                            .collect::<Vec<_>>()
                    })
                };
                let grads =
                    grads.ok_or_else(|| self.failed(JoinError::NoStep { rank, training }))?;
                self.shadow(grads);
                shadowed_steps += 1;
            }
        }
        let (rounds, last_trained) = s
            .state(rank, "join")
            .join
            .take()
            .map_or((0, Vec::new()), |j| (j.rounds, j.last_trained));
        let report = JoinReport {
            rank,
            shadowed_steps,
            rounds,
            authority: last_trained.first().copied().unwrap_or(0),
            last_trained,
        };
        Ok((state, report))
    }

    /// [`finish`](Self::finish), taking part in the others' buffer syncs too where this rank's
    /// steps made `model`'s buffers alike ([`sync_buffers`](super::sync_buffers): its
    /// [`BufferSync::Broadcast`] then sends the statistics of the lowest rank that trained the
    /// step before, never a finished rank's older ones; with [`BufferSync::Mean`] this rank's
    /// statistics, as they are, count in the mean), as PyTorch's DDP join hook shadows its
    /// buffer broadcast. Then every rank's `model` takes the authority's values (its trained
    /// parameters and its buffers: [`replicate_from`](super::replicate_from)), as PyTorch's
    /// `Join` does for DDP: a rank that finished early missed the last updates.
    ///
    /// # Errors
    /// As [`finish`](Self::finish), and [`JoinError::Replica`] when the ranks' models differ or
    /// their exchange fails.
    pub fn finish_model<B, M>(self, model: M) -> Result<(M, JoinReport), JoinError>
    where
        B: AutodiffBackend<InnerBackend = Collective<I>>,
        M: AutodiffModule<B>,
    {
        let (model, report) = self.rounds(model, |m, how| {
            Ok(super::params::sync_buffers::<B, M>(m, how)?)
        })?;
        let model = super::params::replicate_from::<B, M>(model, report.authority)?;
        Ok((model, report))
    }

    /// Fails the group with `e` (so that no rank waits for this one) and returns it.
    fn failed(&self, e: JoinError) -> JoinError {
        if let Some(j) = self.session.state(self.rank(), "join").join.as_mut() {
            j.pending = None;
        }
        self.session.abort_group(self.rank(), &e.to_string());
        e
    }

    /// One step of the others, taken part in with zero gradients of this rank's last step.
    fn shadow(&self, grads: Vec<(String, crate::graph::TensorType)>) {
        let (s, rank) = (&self.session, self.rank());
        let inner = &self.device.inner;
        let mut zeros: Vec<CTensor<I::FloatTensorPrimitive>> = grads
            .iter()
            .map(|(_, ty)| {
                let shape = Shape::from(ty.shape.iter().map(|d| *d as usize).collect::<Vec<_>>());
                // A gradient's dtype is a float one (its submission checked).
                let dtype = super::ops_grad::float_dtype(ty.dtype).unwrap_or(FloatDType::F32);
                CTensor::new(I::float_zeros(shape, inner, dtype), rank as u32)
            })
            .collect();
        s.state(rank, "join").registered = grads.iter().map(|(n, _)| n.clone()).collect();
        for (z, (name, _)) in zeros.iter_mut().zip(grads) {
            // `zeros` outlives the sync point, where the reduced zeros are written back.
            s.submit(TensorRef::<Collective<I>>(std::ptr::from_mut(z)), name);
        }
        s.sync_point(&self.device);
        drop(zeros);
    }
}

impl<I: Backend> Drop for Join<I> {
    fn drop(&mut self) {
        // A scope left without finishing: this rank's next steps start no round.
        if let Some(r) = self.session.ranks.get(self.rank()) {
            lock(r).join = None;
        }
    }
}

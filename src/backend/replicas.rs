//! Replicas that start alike: what [`mark_distributed`](super::mark_distributed) and
//! [`sync_buffers`](super::sync_buffers) do when a communication server is running for
//! `Collective<I>`.
//!
//! Under a launcher every process builds its own model, from its own random initialization
//! unless the user seeded them alike. Data-parallel training is only right if every replica
//! starts from the same weights (PyTorch DDP broadcasts rank 0's parameters when it wraps a
//! model, after checking that every process's parameters have the same shapes). Here, marking a
//! model:
//!
//! 1. exchanges a fingerprint of its parameter list (each parameter's stable name, dtype and
//!    shape, in walk order) with every rank. Ranks whose lists differ all fail together with
//!    [`ReplicaError::ModelsDiffer`], naming the first parameter where they differ on each side
//!    (the lists are gathered on a mismatch);
//! 2. then, with [`InitialWeights::Broadcast`] (the default), gives every rank rank 0's values:
//!    bucketed like the gradients (`CompileConfig`'s bucket cap, one dtype per bucket), each
//!    bucket one sum all-reduce of the group's communicator to which rank 0 contributes its
//!    values and every other rank negative zeros, which leaves rank 0's bits unchanged (see
//!    [`HostBuffer::neg_zeros`]). With [`InitialWeights::Verify`] (for jobs that load one
//!    checkpoint everywhere) the ranks compare a hash of each parameter's bits instead and fail
//!    together, naming the first parameter that differs from rank 0's, with
//!    [`ReplicaError::WeightsDiffer`].
//!
//! Requires: every rank marks at the same point of its program, each on its own thread (the
//! exchange is a collective). Guarantees: after a successful marking every rank's parameters
//! are bit for bit rank 0's (or were checked to be); marking again parameters already
//! replicated (a backward pass consumes Burn's mark, so a loop that accumulates gradients marks
//! before each) communicates nothing; a new model (new parameters) is replicated again, and so are
//! parameters that keep their ids but whose values were drawn again since (initialized by this
//! marking, or trained parameters whose value derives from a random draw the ranks did not agree
//! on since: [`CTensor::is_drawn`]). Running statistics (no gradient) drawn from dropped-out
//! activations stay each rank's own. Values cross in host memory (a one-time cost per model;
//! the device path is the gradients').
//!
//! `sync_buffers` makes a module's floats that take no gradient (its buffers: BatchNorm's
//! running statistics) alike, each time it is called: the ranks compare their buffer lists as a
//! marking compares parameter lists, then every rank takes rank 0's values
//! ([`BufferSync::Broadcast`], a sum to which the other ranks contribute negative zeros) or the
//! mean of every rank's ([`BufferSync::Mean`], the same bits on every rank), through the rank's
//! own lazy all-reduces: bucketed like gradients and, on a device backend, packed and reduced in
//! device memory, so the values never cross to the host. Requires what a marking requires.
//! Guarantees: afterwards every rank's buffers are bit for bit alike; trained parameters are left
//! as they are.
//!
//! `replicate_from` gives every rank one rank's floats, trained parameters and buffers: the same
//! list check over every float, then the same lazy all-reduces, to which the root contributes
//! its values and the others negative zeros (what [`Join::finish_model`](super::Join) does
//! after uneven inputs). Requires what a marking requires, and a root below the world size.

use std::any::Any;
use std::collections::HashSet;
use std::hash::Hasher;
use std::ops::Range;
use std::sync::Arc;

use burn_backend::distributed::ReduceOperation;
use burn_backend::ops::FloatTensorOps;
use burn_backend::{Backend, TensorMetadata};

use super::distributed::graph_dtype;
use super::host_io::{from_host, read_host};
use super::params::Marked;
use super::session::{Session, running};
use super::{CTensor, Collective, CollectiveDevice};
use crate::graph::{Fnv64, ReduceOp, TensorType};
use crate::runtime::HostBuffer;
use crate::runtime::agree::{WEIGHT_BROADCAST, all_gather_bytes, all_gather_u64};
use crate::runtime::comm::{CollectiveDesc, CommError, Communicator, wait_bound};

/// What marking a model does about the ranks' parameter values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InitialWeights {
    /// Every rank takes rank 0's values (PyTorch DDP's behaviour).
    #[default]
    Broadcast,
    /// Every rank keeps its values, which must equal rank 0's bit for bit (one checkpoint
    /// loaded everywhere): a hash of each parameter is compared, and a difference fails every
    /// rank.
    Verify,
}

/// How [`sync_buffers`](super::sync_buffers) makes the ranks' buffers (a module's floats that
/// take no gradient: BatchNorm's running statistics) alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BufferSync {
    /// Every rank takes rank 0's values, bit for bit (PyTorch DDP's `broadcast_buffers=True`).
    #[default]
    Broadcast,
    /// Every rank takes the mean of the ranks' values, the same bits on every rank (statistics
    /// of every rank's data, as before an evaluation).
    Mean,
}

/// Why marking a model for data-parallel training, or making its buffers alike, failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ReplicaError {
    /// The ranks' models have different parameters (names, dtypes, shapes or number), or at
    /// `sync_buffers` different buffers.
    #[error(
        "rank {rank}: the ranks' models differ at parameter {index}: rank {rank} has {}, rank {other_rank} has {} ({mine_count} parameters on rank {rank}, {theirs_count} on rank {other_rank})",
        mine.as_deref().unwrap_or("nothing"),
        theirs.as_deref().unwrap_or("nothing")
    )]
    ModelsDiffer {
        /// The rank reporting.
        rank: usize,
        /// Position of the first differing parameter in walk order (among the floats without a
        /// gradient at `sync_buffers`).
        index: usize,
        /// This rank's parameter there (`name dtype[shape]`; none: its list is shorter).
        mine: Option<String>,
        /// The first rank whose list differs from this rank's.
        other_rank: usize,
        /// That rank's parameter there.
        theirs: Option<String>,
        /// Parameters on this rank.
        mine_count: usize,
        /// Parameters on the other rank.
        theirs_count: usize,
    },
    /// Under [`InitialWeights::Verify`], a parameter's values differ from rank 0's.
    #[error(
        "rank {rank}: the initial weights differ across ranks: {param} on rank {other_rank} is not bit for bit rank 0's (initial weights are verified, not broadcast)"
    )]
    WeightsDiffer {
        /// The rank reporting.
        rank: usize,
        /// The first parameter (walk order) that differs, with its type.
        param: String,
        /// The first rank whose values of it differ from rank 0's.
        other_rank: usize,
    },
    /// A parameter cannot be replicated (a dtype that is not a float, a tensor of another rank).
    #[error("rank {rank}: {call}: {why}")]
    Unsupported {
        /// The rank reporting.
        rank: usize,
        /// The call that failed (`mark_distributed`, `sync_buffers`).
        call: &'static str,
        /// What is wrong, naming the parameter.
        why: String,
    },
    /// The exchange itself failed (a rank that never marked its model within the timeout, an
    /// aborted group).
    #[error("{0} (while replicating the initial weights at mark_distributed)")]
    Comm(#[from] CommError),
    /// The ranks' check of their buffer lists at [`sync_buffers`](super::sync_buffers) failed
    /// (a rank that never called it within the timeout, an aborted group); the values then
    /// cross as the rank's own all-reduces, whose failure is a panic where a value is needed.
    #[error("{0} (while making the ranks' buffers alike at sync_buffers)")]
    BufferComm(Box<CommError>),
    /// The ranks' check of their float lists failed (a rank that never called it within the
    /// timeout, an aborted group).
    #[error("{source} (while checking the ranks' models at {call})")]
    Exchange {
        /// The call that failed (`replicate_from`).
        call: &'static str,
        /// The communicator's error.
        source: Box<CommError>,
    },
}

/// What a rank remembers of its markings.
#[derive(Default)]
pub(super) struct ReplicaState {
    /// Parameter ids already replicated.
    synced: HashSet<u64>,
    /// Fingerprint of the parameter list the ranks last agreed on.
    agreed: Option<u64>,
}

/// One parameter as this rank holds it.
struct Entry<'a, P> {
    name: &'a str,
    ty: TensorType,
    tensor: &'a CTensor<P>,
}

impl<P> Entry<'_, P> {
    fn line(&self) -> String {
        format!("{} {}", self.name, self.ty)
    }
}

/// What a walk over a module's floats asks of the ranks.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Replicate {
    /// [`mark_distributed`](super::mark_distributed): the parameter lists compared, new
    /// parameters made rank 0's (or verified).
    Marking,
    /// [`sync_buffers`](super::sync_buffers): the floats without a gradient made alike.
    Buffers(BufferSync),
    /// [`replicate_from`](super::replicate_from): every float takes this rank's values.
    FromRank(usize),
}

impl Replicate {
    fn call(self) -> &'static str {
        match self {
            Replicate::Marking => "mark_distributed",
            Replicate::Buffers(_) => "sync_buffers",
            Replicate::FromRank(_) => "replicate_from",
        }
    }
}

/// Replicates the parameters `params` (values of `Collective<I>`'s float primitive, in walk
/// order) across the running server's ranks as `what` asks: `Some` new value for each parameter
/// this rank takes, `None` where it keeps its own (no server, one rank, rank 0, nothing new, a
/// trained parameter at a buffer sync).
pub(super) fn replicate<I: Backend>(
    params: &[Marked],
    what: Replicate,
) -> Result<Vec<Option<Box<dyn Any>>>, ReplicaError> {
    let keep = || params.iter().map(|_| None).collect::<Vec<_>>();
    let Some(session) = running::<I>() else {
        return Ok(keep());
    };
    // The rank is its first trained parameter's: Burn's `fork` gives each copy of a model its
    // own parameters, but shares a running statistic's state between the copies (one object,
    // moved to whichever rank's device forked last).
    let trained = params.iter().find(|m| m.requires_grad);
    let Some(first) = trained.or_else(|| params.first()) else {
        return Ok(keep());
    };
    let first_tensor = tensor::<I::FloatTensorPrimitive>(first);
    // Buffers alone may be shared with another rank's copy: the rank this thread works for, if
    // one, says more.
    let rank = match (trained, super::rank_threads::thread_rank(&session)) {
        (None, Some(rank)) => rank,
        _ => first_tensor.map_or(0, |t| t.rank as usize),
    };
    super::rank_threads::works_for(&session, rank);
    if session.world <= 1 {
        return Ok(keep());
    }
    let call = what.call();
    if let Replicate::FromRank(root) = what
        && root >= session.world
    {
        return Err(ReplicaError::Unsupported {
            rank,
            call,
            why: format!(
                "rank {root} is not one of the server's {} ranks",
                session.world
            ),
        });
    }
    // The floats this call makes alike, with their positions in `params`.
    let (at, picked): (Vec<usize>, Vec<&Marked>) = params
        .iter()
        .enumerate()
        .filter(|(_, m)| !matches!(what, Replicate::Buffers(_)) || !m.requires_grad)
        .unzip();
    // A module without buffers communicates nothing at a buffer sync (a rank whose module has
    // some waits for the others, and times out naming the call).
    if picked.is_empty() {
        return Ok(keep());
    }
    // The user's all-reduces issued before go first, on every rank alike.
    session.flush_user(rank, None);
    let entries = entries::<I>(&picked, rank, first, call)?;
    let listing: String = entries.iter().map(|e| e.line() + "\n").collect();
    let fingerprint = {
        let mut h = Fnv64::default();
        h.write(listing.as_bytes());
        h.finish()
    };
    if matches!(what, Replicate::Marking)
        && !new_to_replicas(&session, rank, params, &entries, fingerprint)
    {
        return Ok(keep());
    }
    let comm = session.comm(rank);
    let timeout = session.options.timeout;
    let cap = session.options.config.bucket.cap_bytes;
    let result = (|| {
        let prints = all_gather_u64(comm, fingerprint, timeout)?;
        if prints.iter().any(|p| *p != prints[0]) {
            return Err(models_differ(comm, rank, &listing, &prints, timeout));
        }
        // What this rank takes lands on its own device (a shared statistic may be on another's).
        let device = match first_tensor {
            Some(t) => t.device(|p| I::float_device(p)),
            None => return Ok(entries.iter().map(|_| None).collect()),
        };
        match what {
            Replicate::Marking => match session.options.initial_weights {
                InitialWeights::Broadcast => {
                    broadcast::<I>(comm, &entries, &device, cap, timeout, call)
                }
                InitialWeights::Verify => verify::<I>(comm, &entries, timeout, call)
                    .map(|()| entries.iter().map(|_| None).collect()),
            },
            Replicate::Buffers(how) => {
                let how = session.buffer_reduce(rank, how);
                Ok(reduce_values(&session, rank, &entries, &device, how))
            }
            Replicate::FromRank(root) => Ok(reduce_values(
                &session,
                rank,
                &entries,
                &device,
                Reduce::From(root),
            )),
        }
    })()
    .map(|mut values| {
        // Values this rank keeps are now agreed on: marked so, so that marking them again
        // (before every backward pass) sees nothing new.
        for (v, e) in values.iter_mut().zip(&entries) {
            if v.is_none() && e.tensor.is_drawn() {
                *v = Some(Box::new(e.tensor.agreed()));
            }
        }
        // Back to one value (or none) per parameter of `params`.
        let mut out = keep();
        for (i, v) in at.iter().zip(values) {
            out[*i] = v;
        }
        out
    });
    match &result {
        Ok(_) if matches!(what, Replicate::Marking) => {
            let mut st = session.state(rank, "mark_distributed");
            st.replicas.synced.extend(params.iter().map(|m| m.id));
            st.replicas.agreed = Some(fingerprint);
        }
        // Every rank saw the same lists or hashes and fails alike; a failed exchange fails the
        // group, so that no rank waits for this one.
        Err(ReplicaError::Comm(e)) => comm.abort(&e.to_string()),
        _ => {}
    }
    result.map_err(|e| match (e, what) {
        (ReplicaError::Comm(e), Replicate::Buffers(_)) => ReplicaError::BufferComm(Box::new(e)),
        (ReplicaError::Comm(e), Replicate::FromRank(_)) => ReplicaError::Exchange {
            call,
            source: Box::new(e),
        },
        (e, _) => e,
    })
}

/// The value of a marked float, if it is one of `Collective<I>`'s.
fn tensor<P: 'static>(m: &Marked) -> Option<&CTensor<P>> {
    m.value.downcast_ref::<CTensor<P>>()
}

/// The floats `picked` as this rank holds them: each a float tensor of the server's backend, a
/// trained one on `rank`, the rank of the walk's `first` trained parameter.
fn entries<'a, I: Backend>(
    picked: &[&'a Marked],
    rank: usize,
    first: &Marked,
    call: &'static str,
) -> Result<Vec<Entry<'a, I::FloatTensorPrimitive>>, ReplicaError> {
    let unsupported = |why: String| ReplicaError::Unsupported { rank, call, why };
    let mut entries = Vec::with_capacity(picked.len());
    for m in picked {
        let t = tensor::<I::FloatTensorPrimitive>(m).ok_or_else(|| {
            unsupported(format!(
                "{} is not a tensor of this communication server's backend",
                m.name
            ))
        })?;
        // A float without a gradient on another rank is a running statistic that Burn's `fork`
        // shares between the copies of a model: one object, alike by construction.
        if t.rank as usize != rank && m.requires_grad {
            return Err(unsupported(format!(
                "{} is on rank {}, the model's first trained parameter ({}) on rank {rank}: a model is marked on one rank",
                m.name, t.rank, first.name
            )));
        }
        let dtype = graph_dtype(t.dtype()).ok_or_else(|| {
            unsupported(format!(
                "{} has dtype {:?}, which is not a float",
                m.name,
                t.dtype()
            ))
        })?;
        let dims: Vec<u64> = t.shape().iter().map(|d| *d as u64).collect();
        entries.push(Entry {
            name: &m.name,
            ty: TensorType::new(dtype, &dims),
            tensor: t,
        });
    }
    Ok(entries)
}

/// Whether a marking has anything to replicate: a parameter list the ranks have not agreed on,
/// a parameter not replicated before, or one whose values were drawn again since (a lazily
/// initialized model forked again, a layer initialized again: the ids are the same, the values
/// each rank's own). Running statistics (no gradient) may differ by design and are left out.
fn new_to_replicas<I: Backend>(
    session: &super::session::Session<I>,
    rank: usize,
    params: &[Marked],
    entries: &[Entry<'_, I::FloatTensorPrimitive>],
    fingerprint: u64,
) -> bool {
    let drawn_again = params
        .iter()
        .zip(entries)
        .any(|(m, e)| m.initialized_now || (m.requires_grad && e.tensor.is_drawn()));
    let st = session.state(rank, "mark_distributed");
    st.replicas.agreed != Some(fingerprint)
        || drawn_again
        || params.iter().any(|m| !st.replicas.synced.contains(&m.id))
}

/// The error of ranks whose parameter lists differ: gathers every rank's listing and names the
/// first line where this rank's and the first differing rank's part.
fn models_differ(
    comm: &dyn Communicator,
    rank: usize,
    listing: &str,
    prints: &[u64],
    timeout: std::time::Duration,
) -> ReplicaError {
    let other_rank = (0..prints.len())
        .find(|r| prints[*r] != prints[rank])
        .unwrap_or(rank);
    let listings = match all_gather_bytes(comm, listing.as_bytes(), timeout) {
        Ok(l) => l,
        Err(e) => return e.into(),
    };
    let theirs_text = String::from_utf8_lossy(&listings[other_rank]).into_owned();
    let mine: Vec<&str> = listing.lines().collect();
    let theirs: Vec<&str> = theirs_text.lines().collect();
    let index = (0..mine.len().max(theirs.len()))
        .find(|i| mine.get(*i) != theirs.get(*i))
        .unwrap_or(0);
    ReplicaError::ModelsDiffer {
        rank,
        index,
        mine: mine.get(index).map(|s| s.to_string()),
        other_rank,
        theirs: theirs.get(index).map(|s| s.to_string()),
        mine_count: mine.len(),
        theirs_count: theirs.len(),
    }
}

/// The parameter's values in host memory.
fn read<I: Backend>(
    rank: usize,
    e: &Entry<'_, I::FloatTensorPrimitive>,
    call: &'static str,
) -> Result<HostBuffer, ReplicaError> {
    read_host::<I>(e.tensor.inner_for(call)).map_err(|err| ReplicaError::Unsupported {
        rank,
        call,
        why: format!("reading {}: {err}", e.name),
    })
}

/// Consecutive entries of one dtype, at most `cap` bytes each (at least one entry).
fn buckets<P>(entries: &[Entry<'_, P>], cap: u64) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    let mut bytes = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let b = e.ty.bytes();
        match out.last_mut() {
            Some(r)
                if entries[r.start].ty.dtype == e.ty.dtype && bytes.saturating_add(b) <= cap =>
            {
                r.end = i + 1;
                bytes += b;
            }
            _ => {
                out.push(i..i + 1);
                bytes = b;
            }
        }
    }
    out
}

/// Rank 0's values of `entries` on every rank: one sum all-reduce per bucket (launch indices
/// from [`WEIGHT_BROADCAST`]) to which rank 0 contributes its values and the others negative
/// zeros, which leaves rank 0's bits; what the other ranks take is made on `device`.
fn broadcast<I: Backend>(
    comm: &dyn Communicator,
    entries: &[Entry<'_, I::FloatTensorPrimitive>],
    device: &I::Device,
    cap: u64,
    timeout: std::time::Duration,
    call: &'static str,
) -> Result<Vec<Option<Box<dyn Any>>>, ReplicaError> {
    let rank = comm.rank();
    let unsupported = |e: &Entry<'_, _>, ty: String| ReplicaError::Unsupported {
        rank,
        call,
        why: format!("{} cannot be exchanged ({ty})", e.name),
    };
    let mut pending = Vec::new();
    for (k, range) in buckets(entries, cap.max(1)).into_iter().enumerate() {
        let members = &entries[range.clone()];
        let dtype = members[0].ty.dtype;
        let count: u64 = members.iter().map(|e| e.ty.numel()).sum();
        let buffer = if rank == 0 {
            let mut bytes = Vec::new();
            for e in members {
                bytes.extend_from_slice(read::<I>(rank, e, call)?.as_bytes());
            }
            HostBuffer::from_le_bytes(dtype, &bytes)
        } else {
            HostBuffer::neg_zeros(dtype, count as usize)
        };
        let buffer = buffer.ok_or_else(|| unsupported(&members[0], dtype.to_string()))?;
        let what = CollectiveDesc {
            collective: WEIGHT_BROADCAST + k as u32,
            bucket: Some(k as u32),
            op: ReduceOp::Sum,
            dtype,
            count,
            params: members.iter().map(|e| e.name.to_string()).collect(),
        };
        pending.push((range, comm.all_reduce(buffer, what)?));
    }
    let mut out: Vec<Option<Box<dyn Any>>> = entries.iter().map(|_| None).collect();
    for (range, p) in pending {
        let (reduced, _) = p.wait(wait_bound(timeout))?;
        if rank == 0 {
            continue;
        }
        let bytes = reduced.as_bytes();
        let mut at = 0usize;
        for i in range {
            let e = &entries[i];
            let len = e.ty.bytes() as usize;
            let member = HostBuffer::from_le_bytes(e.ty.dtype, &bytes[at..at + len])
                .ok_or_else(|| unsupported(e, e.ty.to_string()))?;
            at += len;
            let value = I::float_from_data(from_host(member, e.tensor.shape()), device);
            out[i] = Some(Box::new(CTensor::new(value, rank as u32)));
        }
    }
    Ok(out)
}

/// What [`reduce_values`] gives every rank.
#[derive(Clone, Copy)]
pub(super) enum Reduce {
    /// This rank's values.
    From(usize),
    /// The mean of every rank's.
    Mean,
}

/// The values of a buffer sync or of [`replicate_from`](super::replicate_from): an all-reduce of
/// each float among the rank's own (`user_collectives`), lazy and coalesced into buckets by the
/// same passes as gradients, packed and reduced where the gradients are (on a GPU, in device
/// memory: nothing is read to the host and nothing waits for the device here), launched before
/// returning. [`Reduce::From`]: a sum to which the root contributes its values and the others
/// negative zeros, which leaves the root's bits; [`Reduce::Mean`]: every rank's values, averaged
/// (the same bits on every rank). Every rank takes the result, on its own device (a statistic
/// Burn's `fork` shares may be on another's).
fn reduce_values<I: Backend>(
    session: &Arc<Session<I>>,
    rank: usize,
    entries: &[Entry<'_, I::FloatTensorPrimitive>],
    device: &I::Device,
    how: Reduce,
) -> Vec<Option<Box<dyn Any>>> {
    let on_rank = CollectiveDevice::new(device.clone(), rank as u32);
    let ids = on_rank.group_ids(session.world);
    let (op, contributes) = match how {
        Reduce::From(root) => (ReduceOperation::Sum, rank == root),
        Reduce::Mean => (ReduceOperation::Mean, true),
    };
    // Every input first: an all-reduce's result is a recorded node that waits for it (and
    // launches the rank's queue), and a later input recorded after it would run it, launching
    // the all-reduces one at a time instead of as one bucketed plan.
    let inputs: Vec<_> = entries
        .iter()
        .map(|e| {
            if contributes {
                Collective::<I>::float_to_device(e.tensor.clone(), &on_rank)
            } else {
                let dtype = e.tensor.dtype().into();
                let zeros = Collective::<I>::float_zeros(e.tensor.shape(), &on_rank, dtype);
                Collective::<I>::float_neg(zeros)
            }
        })
        .collect();
    let values = inputs
        .into_iter()
        .map(|input| {
            let reduced =
                super::user_collectives::all_reduce(session.clone(), input, op, ids.clone());
            // SAFETY: a `Collective` tensor that results from an all-reduce waits for it when it
            // is first needed.
            Some(Box::new(unsafe { reduced.assume_resolved() }) as Box<dyn Any>)
        })
        .collect();
    // Launched now, not when a value is first needed: the values of a statistic Burn's `fork`
    // shares between ranks are put in its one place by each rank in turn, and a rank whose
    // value was replaced would never need it, and never launch what the others wait for.
    session.flush_user(rank, None);
    values
}

/// Checks that every rank's values are rank 0's: a hash of each parameter's bits, gathered.
fn verify<I: Backend>(
    comm: &dyn Communicator,
    entries: &[Entry<'_, I::FloatTensorPrimitive>],
    timeout: std::time::Duration,
    call: &'static str,
) -> Result<(), ReplicaError> {
    let rank = comm.rank();
    let mut mine = Vec::with_capacity(entries.len() * 8);
    for e in entries {
        let mut h = Fnv64::default();
        h.write(read::<I>(rank, e, call)?.as_bytes());
        mine.extend_from_slice(&h.finish().to_le_bytes());
    }
    let all = all_gather_bytes(comm, &mine, timeout)?;
    let hash = |r: usize, i: usize| all[r].get(i * 8..i * 8 + 8);
    for (i, e) in entries.iter().enumerate() {
        if let Some(other_rank) = (1..all.len()).find(|r| hash(*r, i) != hash(0, i)) {
            return Err(ReplicaError::WeightsDiffer {
                rank,
                param: e.line(),
                other_rank,
            });
        }
    }
    Ok(())
}

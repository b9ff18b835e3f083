//! Plan agreement: before a new plan's first collective, the ranks exchange its collective
//! sequence (per call: launch index, bucket, reduce op, dtype, element count, and a 48-bit hash
//! of its ordered member parameters) and compare. A rank whose sequence differs would otherwise
//! launch a mismatched collective and hang, or reduce garbage (two equal-size parameters in
//! opposite order inside one bucket, or different parameters of one size, sum unrelated
//! gradients); here every rank fails at once with [`CommError::PlanMismatch`], before anything
//! is launched. The error names the first differing collective on each side with its members
//! and the first member that differs: on a mismatch the ranks gather the member names of the
//! first call where they disagree (the same call on every rank, found from the same data).
//!
//! The exchange is two all-reduces of the plan's own communicator (a sum over zero-filled
//! buffers where each rank writes only its own segment is an all-gather): the sequence lengths,
//! then the sequences, padded to the longest; on a mismatch, two more for the names.

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, Communicator, PendingReduce, Purpose};
use crate::codegen::plan::Plan;
use crate::graph::{DType, Fnv64, ReduceOp};

/// Launch indices of the agreement's own all-reduces (far from any plan's).
const AGREE_LEN: u32 = u32::MAX - 1_000_000;
const AGREE_SEQ: u32 = AGREE_LEN + 1;
/// Launch indices of [`all_gather_bytes`]'s two all-reduces.
const GATHER_LEN: u32 = AGREE_LEN + 2;
const GATHER_BYTES: u32 = AGREE_LEN + 3;
/// Launch index of [`gather_counts`]'s all-reduce.
const GATHER_COUNTS: u32 = AGREE_LEN + 4;
/// Launch index of [`share_from_root`]'s all-reduce.
const SHARE_ROOT: u32 = AGREE_LEN + 5;
/// [`barrier`].
const BARRIER: u32 = AGREE_LEN + 6;
/// [`start_join_round`]'s all-reduce.
const JOIN_ROUND: u32 = AGREE_LEN + 7;
/// [`all_gather_u64`]'s all-reduce.
const GATHER_U64: u32 = AGREE_LEN + 8;

/// Launch indices of the agreement's own all-reduces and of [`all_gather_bytes`]'s,
/// [`gather_counts`]'s, [`share_from_root`]'s, [`barrier`]'s, [`start_join_round`]'s and
/// [`all_gather_u64`]'s ([`Purpose::Agreement`]).
pub const AGREEMENT_IDS: std::ops::RangeInclusive<u32> = AGREE_LEN..=GATHER_U64;

/// What the exchange of agreement-range launch index `collective` is, for messages.
pub fn agreement_exchange(collective: u32) -> &'static str {
    match collective {
        AGREE_LEN | AGREE_SEQ => "the plan agreement exchange",
        GATHER_LEN | GATHER_BYTES => "an all-gather of the ranks' lists",
        GATHER_COUNTS => "the ranks' exchange of queue lengths",
        SHARE_ROOT => "rank 0's share of a value",
        BARRIER => "a barrier",
        JOIN_ROUND => "the uneven-inputs round (which ranks still train)",
        GATHER_U64 => "an all-gather of the ranks' fingerprints",
        _ => "an agreement exchange",
    }
}

/// Whether `d` is one of the agreement's (or [`all_gather_bytes`]'s, [`gather_counts`]'s or
/// [`share_from_root`]'s) own all-reduces.
pub fn is_agreement(d: &CollectiveDesc) -> bool {
    d.purpose() == Purpose::Agreement
}

/// Launch indices of the bucket all-reduces that broadcast rank 0's initial weights when a
/// model is marked for data-parallel training (far from any plan's and from the agreement's).
pub const WEIGHT_BROADCAST: u32 = u32::MAX - 2_000_000;

/// Whether `d` is one of the initial-weight broadcast's all-reduces.
pub fn is_weight_broadcast(d: &CollectiveDesc) -> bool {
    d.purpose() == Purpose::WeightBroadcast
}

/// What the agreement's exchanges carry as their parameter list (for messages).
const AGREEMENT_LABEL: &str = "(plan agreement)";

/// Fields per call in the exchange.
const FIELDS: usize = 6;

/// The ordered member parameters of a call as 48 bits (exact in an `f64`).
fn members_hash(params: &[String]) -> f64 {
    use std::hash::Hasher;
    let mut h = Fnv64::default();
    for p in params {
        h.write(p.as_bytes());
        h.write_u8(0xff);
    }
    (h.finish() >> 16) as f64
}

/// The calls `plan` makes, in launch order (one per NCCL call: a bucket, or each unbucketed slot).
pub fn plan_sequence(plan: &Plan) -> Vec<CollectiveDesc> {
    let mut out = Vec::new();
    for c in &plan.collectives {
        if c.packed {
            out.push(CollectiveDesc {
                collective: c.id,
                bucket: c.bucket,
                op: c.op,
                dtype: c.wire_dtype(),
                count: c.layout.numel,
                params: c
                    .slots
                    .iter()
                    .map(|s| plan.slots[*s as usize].param.clone())
                    .collect(),
            });
        } else {
            for (s, m) in c.slots.iter().zip(&c.layout.members) {
                out.push(CollectiveDesc {
                    collective: c.id,
                    bucket: c.bucket,
                    op: c.op,
                    dtype: DType::from_name(&m.dtype).unwrap_or(DType::F32),
                    count: m.numel,
                    params: vec![plan.slots[*s as usize].param.clone()],
                });
            }
        }
    }
    out
}

fn encode(d: &CollectiveDesc) -> [f64; FIELDS] {
    [
        f64::from(d.collective),
        d.bucket.map_or(0.0, |b| f64::from(b) + 1.0),
        f64::from(d.op.code()),
        f64::from(d.dtype.code()),
        d.count as f64,
        members_hash(&d.params),
    ]
}

fn decode(f: &[f64]) -> Option<CollectiveDesc> {
    if f.iter().all(|x| *x == 0.0) {
        return None;
    }
    Some(CollectiveDesc {
        collective: f[0] as u32,
        bucket: (f[1] > 0.0).then(|| (f[1] - 1.0) as u32),
        op: ReduceOp::from_code(f[2] as u8).unwrap_or(ReduceOp::Sum),
        dtype: DType::from_code(f[3] as u8).unwrap_or(DType::F32),
        count: f[4] as u64,
        params: Vec::new(),
    })
}

/// What an agreement exchange of `len` values is, to the communicator.
fn exchange_desc(collective: u32, len: usize) -> CollectiveDesc {
    CollectiveDesc {
        collective,
        bucket: None,
        op: ReduceOp::Sum,
        dtype: DType::F64,
        count: len as u64,
        params: vec![AGREEMENT_LABEL.to_string()],
    }
}

fn exchange(
    comm: &dyn Communicator,
    collective: u32,
    data: Vec<f64>,
    timeout: std::time::Duration,
) -> Result<Vec<f64>, CommError> {
    let what = exchange_desc(collective, data.len());
    let (buf, _) = comm
        .all_reduce(HostBuffer::F64(data), what)?
        .wait(super::comm::wait_bound(timeout))?;
    match buf {
        HostBuffer::F64(v) => Ok(v),
        _ => Ok(Vec::new()),
    }
}

/// Gathers a small byte string from every rank of `comm` (rank order), with the same two
/// all-reduces as the plan agreement: the lengths, then the bytes, one per element. For
/// metadata only (a step's parameter manifest), not for tensors.
pub fn all_gather_bytes(
    comm: &dyn Communicator,
    mine: &[u8],
    timeout: std::time::Duration,
) -> Result<Vec<Vec<u8>>, CommError> {
    let (rank, world) = (comm.rank(), comm.world());
    if world <= 1 {
        return Ok(vec![mine.to_vec()]);
    }
    let mut lens = vec![0.0; world];
    lens[rank] = mine.len() as f64;
    let lens = exchange(comm, GATHER_LEN, lens, timeout)?;
    let width = lens.iter().fold(0.0f64, |a, b| a.max(*b)) as usize;
    let mut all = vec![0.0; world * width];
    for (d, b) in all[rank * width..].iter_mut().zip(mine) {
        *d = f64::from(*b);
    }
    let all = exchange(comm, GATHER_BYTES, all, timeout)?;
    Ok((0..world)
        .map(|r| {
            all[r * width..][..lens[r] as usize]
                .iter()
                .map(|x| *x as u8)
                .collect()
        })
        .collect())
}

/// Every rank's `mine` (rank order), in one small all-reduce (each value as two 32-bit halves,
/// exact in an f64): a fixed-size fingerprint, which [`all_gather_bytes`] would gather in two
/// (the lengths, then the bytes). A rank that calls it waits for every rank.
pub fn all_gather_u64(
    comm: &dyn Communicator,
    mine: u64,
    timeout: std::time::Duration,
) -> Result<Vec<u64>, CommError> {
    let (rank, world) = (comm.rank(), comm.world());
    if world <= 1 {
        return Ok(vec![mine]);
    }
    let mut all = vec![0.0; 2 * world];
    all[2 * rank] = (mine >> 32) as f64;
    all[2 * rank + 1] = (mine & 0xffff_ffff) as f64;
    let all = exchange(comm, GATHER_U64, all, timeout)?;
    Ok(all
        .chunks(2)
        .map(|h| ((h[0] as u64) << 32) | h[1] as u64)
        .collect())
}

/// Every rank's `mine` (rank order), in one small all-reduce: how many user all-reduces each
/// rank has queued, before they launch together.
pub fn gather_counts(
    comm: &dyn Communicator,
    mine: u64,
    timeout: std::time::Duration,
) -> Result<Vec<u64>, CommError> {
    start_gather_counts(comm, mine)?.wait(timeout)
}

/// Whether `d` is a [`barrier`]'s all-reduce.
pub fn is_barrier(d: &CollectiveDesc) -> bool {
    d.collective == BARRIER
}

/// Returns once every rank of `comm` has called it (one tiny all-reduce).
pub fn barrier(comm: &dyn Communicator, timeout: std::time::Duration) -> Result<(), CommError> {
    if comm.world() > 1 {
        exchange(comm, BARRIER, vec![0.0], timeout)?;
    }
    Ok(())
}

/// [`gather_counts`] started, not waited for: for a rank that must not wait where it is (inside
/// backward), and looks again later ([`PendingCounts::try_take`]) or waits where it may.
pub fn start_gather_counts(comm: &dyn Communicator, mine: u64) -> Result<PendingCounts, CommError> {
    start_counts(comm, GATHER_COUNTS, mine)
}

/// One round of uneven inputs ([`crate::backend::join`]): every rank says what it is (whether
/// it still trains or has run out of inputs, and how its scope averages: bits of `mine`);
/// started, not waited for. A launch index of its own, so that a rank waiting in a round and a
/// rank in any other exchange fail with the communicator's mismatch error instead of reading
/// each other's numbers.
pub fn start_join_round(comm: &dyn Communicator, mine: u64) -> Result<PendingCounts, CommError> {
    start_counts(comm, JOIN_ROUND, mine)
}

fn start_counts(
    comm: &dyn Communicator,
    collective: u32,
    mine: u64,
) -> Result<PendingCounts, CommError> {
    let (rank, world) = (comm.rank(), comm.world());
    if world <= 1 {
        return Ok(PendingCounts {
            pending: None,
            mine,
        });
    }
    let mut all = vec![0.0; world];
    // Exact in an f64 up to 2^53.
    all[rank] = mine as f64;
    Ok(PendingCounts {
        pending: Some(comm.all_reduce(HostBuffer::F64(all), exchange_desc(collective, world))?),
        mine,
    })
}

/// A count exchange in flight ([`start_gather_counts`]).
pub struct PendingCounts {
    /// `None` in a group of one.
    pending: Option<PendingReduce>,
    /// This rank's count.
    pub mine: u64,
}

impl PendingCounts {
    fn counts(buf: HostBuffer) -> Vec<u64> {
        match buf {
            HostBuffer::F64(v) => v.iter().map(|c| *c as u64).collect(),
            _ => Vec::new(),
        }
    }

    /// Every rank's count when the exchange is over, without waiting; `None` while it runs.
    pub fn try_take(&self) -> Option<Result<Vec<u64>, CommError>> {
        match &self.pending {
            None => Some(Ok(vec![self.mine])),
            Some(p) => p.try_take().map(|r| r.map(|(b, _)| Self::counts(b))),
        }
    }

    /// Every rank's count, waiting at most `timeout`.
    pub fn wait(self, timeout: std::time::Duration) -> Result<Vec<u64>, CommError> {
        match self.pending {
            None => Ok(vec![self.mine]),
            Some(p) => Ok(Self::counts(p.wait(super::comm::wait_bound(timeout))?.0)),
        }
    }
}

/// Rank 0's `values` and every rank's `flag`, on every rank, in one small all-reduce (rank 0
/// writes its values, the others zeros; each rank its own flag). `values` must have the same
/// length on every rank (a different one is the communicator's mismatch error). What a
/// decision every rank must make alike is made from: rank 0 decides, the others follow.
pub fn share_from_root(
    comm: &dyn Communicator,
    values: &[f64],
    flag: bool,
    timeout: std::time::Duration,
) -> Result<(Vec<f64>, Vec<bool>), CommError> {
    let (rank, world) = (comm.rank(), comm.world());
    if world <= 1 {
        return Ok((values.to_vec(), vec![flag]));
    }
    let n = values.len();
    let mut all = vec![0.0; n + world];
    if rank == 0 {
        all[..n].copy_from_slice(values);
    }
    all[n + rank] = if flag { 1.0 } else { 0.0 };
    let all = exchange(comm, SHARE_ROOT, all, timeout)?;
    // The communicator checked every rank gave the same length.
    let all = if all.len() == n + world {
        all
    } else {
        vec![0.0; n + world]
    };
    Ok((
        all[..n].to_vec(),
        all[n..].iter().map(|f| *f != 0.0).collect(),
    ))
}

/// Exchanges `plan`'s collective sequence with every rank of `comm` and checks they are equal.
pub fn agree(
    plan: &Plan,
    comm: &dyn Communicator,
    timeout: std::time::Duration,
) -> Result<(), CommError> {
    let (rank, world) = (comm.rank(), comm.world());
    if world <= 1 {
        return Ok(());
    }
    let mine = plan_sequence(plan);
    let mut lens = vec![0.0; world];
    lens[rank] = mine.len() as f64;
    let lens = exchange(comm, AGREE_LEN, lens, timeout)?;
    let longest = lens.iter().fold(0.0f64, |a, b| a.max(*b)) as usize;
    let width = longest * FIELDS;
    let mut all = vec![0.0; world * width];
    for (i, d) in mine.iter().enumerate() {
        all[rank * width + i * FIELDS..][..FIELDS].copy_from_slice(&encode(d));
    }
    let all = exchange(comm, AGREE_SEQ, all, timeout)?;
    let slot = |r: usize, i: usize| &all[r * width + i * FIELDS..][..FIELDS];
    // The first call where any two ranks differ: the same index on every rank.
    let Some(index) = (0..longest).find(|i| (1..world).any(|r| slot(r, *i) != slot(0, *i))) else {
        return Ok(());
    };
    // Every rank differs from some rank there; name the first.
    let other = (0..world)
        .find(|r| slot(*r, index) != slot(rank, index))
        .unwrap_or(rank);
    // Gather everyone's member names at that call, so both sides of the error are named.
    let ours = mine.get(index).cloned();
    let names = ours.as_ref().map_or(String::new(), |d| d.params.join("\n"));
    let gathered = all_gather_bytes(comm, names.as_bytes(), timeout)?;
    let theirs = decode(slot(other, index)).map(|mut d| {
        let text = String::from_utf8_lossy(&gathered[other]).into_owned();
        d.params = text.lines().map(str::to_string).collect();
        d
    });
    Err(CommError::PlanMismatch {
        rank,
        index,
        mine: ours,
        other_rank: other,
        theirs,
    })
}

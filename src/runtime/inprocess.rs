//! The in-process communicator: N ranks as threads of one process over host memory.
//!
//! Each rank has a communication thread (its stream) that runs the rank's collectives in the
//! order they were enqueued. A collective is a rendezvous: every rank posts its buffer; once all
//! are there, the ranks' threads claim chunks of the elements one at a time, reduce each chunk
//! across all ranks' buffers in one pass and write the result into every buffer. The work is
//! spread over whichever threads are running (more ranks than cores do not wait on the OS to
//! schedule each rank's share), and each element is read and written once per rank. Every
//! element is reduced in rank order
//! (`((x0 + x1) + x2) + …`, each contribution divided by the group size first for a mean), so the
//! result does not depend on timing, chunking or which thread reduced it.
//!
//! Arrival is bounded by a timeout: a rank that does not arrive turns into
//! [`CommError::Timeout`] on the ranks that did, and aborts the group so later collectives fail
//! at once instead of hanging. Once every rank has arrived nothing external is awaited: the rest
//! is memory arithmetic on buffers the ranks hold.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use super::buffer::{Element, HostBuffer};
use super::comm::{CollectiveDesc, CommError, CommSpan, Job, thread_cpu_us};
use super::comm_thread::{CommThread, GroupState, QueuedComm};
use crate::graph::ReduceOp;

/// Default bound on a rank's wait for the others.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Elements reduced per block (fits L1 with the accumulator).
const BLOCK: usize = 2048;

/// Elements a rank claims at a time.
const CHUNK: usize = 16 * 1024;

/// How long a rank spins before it sleeps on a barrier.
const SPIN: Duration = Duration::from_micros(50);

#[derive(Clone, Copy)]
struct RawBuf(*mut u8);
// SAFETY: the pointer is only dereferenced between the arrival and departure barriers of one
// collective, while its owner blocks in that collective, on element ranges no other thread
// touches (see `reduce_chunk`).
unsafe impl Send for RawBuf {}

struct Posted {
    ptr: RawBuf,
    what: CollectiveDesc,
}

struct State {
    /// Sequence number of the collective now gathering.
    round: u64,
    arrived: usize,
    finished: usize,
    departed: usize,
    posted: Vec<Option<Posted>>,
    /// The last rank of the collective now gathering arrived.
    joined: Option<Instant>,
    aborted: Option<String>,
}

/// What the ranks of an in-process group share: the rendezvous of each collective.
pub struct InProcessShared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    /// The next unclaimed chunk of the collective now reducing; reset when the last rank
    /// departs, under the lock every rank takes before it claims.
    next_chunk: AtomicUsize,
}

impl InProcessShared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated in a way that
        // matters more than the abort it causes; keep going with the data.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits while `pending` holds, until `deadline` if one is given; returns the guard and
    /// whether the deadline passed. Spins for a few microseconds first: the ranks of a
    /// collective usually arrive close together, and a sleep and wake-up costs tens of
    /// microseconds.
    fn wait_while<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        pending: impl Fn(&State) -> bool,
        deadline: Option<Instant>,
    ) -> (MutexGuard<'a, State>, bool) {
        let spin_until = Instant::now() + SPIN;
        while pending(&st) {
            let now = Instant::now();
            if now < spin_until {
                drop(st);
                thread::yield_now();
                st = self.lock();
                continue;
            }
            st = match deadline {
                Some(d) if now >= d => return (st, true),
                Some(d) => {
                    self.cv
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.cv.wait(st).unwrap_or_else(|e| e.into_inner()),
            };
        }
        (st, false)
    }

    fn abort(&self, reason: String) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(reason);
        }
        self.cv.notify_all();
    }

    /// Runs collective number `seq` of `rank` on `buf`; returns when this rank saw every rank
    /// arrived and when the last one did.
    fn run(
        &self,
        rank: usize,
        seq: u64,
        buf: &mut HostBuffer,
        what: &CollectiveDesc,
    ) -> Result<(Instant, Option<Instant>), CommError> {
        let t0 = Instant::now();
        let deadline = t0 + self.timeout;
        let aborted = |reason: &str| CommError::Aborted {
            rank,
            what: what.clone(),
            reason: reason.to_string(),
        };
        let mut st = self.lock();
        // Wait for the previous collective to be left by everyone.
        let (g, late) = self.wait_while(
            st,
            |st| st.round != seq && st.aborted.is_none(),
            Some(deadline),
        );
        st = g;
        if late {
            let err = CommError::Timeout {
                rank,
                what: what.clone(),
                waited: t0.elapsed(),
                missing: Vec::new(),
            };
            st.aborted.get_or_insert_with(|| err.to_string());
            self.cv.notify_all();
            return Err(err);
        }
        if let Some(r) = &st.aborted {
            return Err(aborted(r));
        }
        let ptr = with_buf_ptr(buf);
        st.posted[rank] = Some(Posted {
            ptr,
            what: what.clone(),
        });
        st.arrived += 1;
        if st.arrived == self.world {
            st.joined = Some(Instant::now());
            self.cv.notify_all();
        }
        let world = self.world;
        let (g, late) = self.wait_while(
            st,
            |st| st.arrived < world && st.aborted.is_none(),
            Some(deadline),
        );
        st = g;
        if late {
            let missing: Vec<usize> = (0..self.world)
                .filter(|r| st.posted[*r].is_none())
                .collect();
            st.posted[rank] = None;
            st.arrived -= 1;
            let err = CommError::Timeout {
                rank,
                what: what.clone(),
                waited: t0.elapsed(),
                missing,
            };
            st.aborted.get_or_insert_with(|| err.to_string());
            self.cv.notify_all();
            return Err(err);
        }
        if st.arrived < self.world {
            st.posted[rank] = None;
            st.arrived -= 1;
            let r = st.aborted.clone().unwrap_or_default();
            return Err(aborted(&r));
        }
        // Everyone is here. All ranks check the same descriptors and reach the same verdict.
        let descs: Vec<&CollectiveDesc> = st
            .posted
            .iter()
            .map(|p| &p.as_ref().expect("arrived").what)
            .collect();
        // If any two ranks disagree, every rank disagrees with someone: all of them fail.
        if let Some(other) = (0..self.world).find(|r| !same_call(descs[*r], what)) {
            let err = CommError::Mismatch {
                rank,
                mine: what.clone(),
                other_rank: other,
                theirs: descs[other].clone(),
            };
            // Depart without touching memory; the group is unusable after this.
            st.aborted.get_or_insert_with(|| err.to_string());
            self.depart(st);
            return Err(err);
        }
        let ptrs: Vec<RawBuf> = st
            .posted
            .iter()
            .map(|p| p.as_ref().expect("arrived").ptr)
            .collect();
        let started = Instant::now();
        let joined = st.joined;
        drop(st);

        let count = what.count as usize;
        let chunks = count.div_ceil(CHUNK);
        // Chunks are claimed, not assigned: whichever ranks' threads are running do the work,
        // so a rank whose thread the OS has not scheduled yet (more ranks than cores) does not
        // hold the others up.
        loop {
            let c = self.next_chunk.fetch_add(1, Ordering::Relaxed);
            if c >= chunks {
                break;
            }
            let lo = c * CHUNK;
            let hi = count.min(lo + CHUNK);
            // SAFETY: every rank's buffer has `count` elements of `what.dtype` (checked above),
            // its owner is blocked in this call until all ranks depart, and chunk `c` was
            // claimed by this thread alone: no other thread reads or writes `[lo, hi)` during
            // this collective.
            unsafe {
                match buf {
                    HostBuffer::F32(_) => reduce_chunk::<f32>(&ptrs, lo, hi, what.op),
                    HostBuffer::F64(_) => reduce_chunk::<f64>(&ptrs, lo, hi, what.op),
                    HostBuffer::F16(_) => reduce_chunk::<half::f16>(&ptrs, lo, hi, what.op),
                    HostBuffer::BF16(_) => reduce_chunk::<half::bf16>(&ptrs, lo, hi, what.op),
                }
            }
        }

        let mut st = self.lock();
        st.finished += 1;
        if st.finished == self.world {
            self.cv.notify_all();
        }
        // No timeout here: all ranks are inside this collective doing bounded arithmetic.
        let world = self.world;
        let (st, _) = self.wait_while(st, |st| st.finished < world, None);
        self.depart(st);
        Ok((started, joined))
    }

    fn depart(&self, mut st: MutexGuard<'_, State>) {
        st.departed += 1;
        if st.departed == self.world {
            st.arrived = 0;
            st.finished = 0;
            st.departed = 0;
            st.posted.iter_mut().for_each(|p| *p = None);
            st.joined = None;
            self.next_chunk.store(0, Ordering::Relaxed);
            st.round += 1;
            self.cv.notify_all();
        }
    }
}

fn same_call(a: &CollectiveDesc, b: &CollectiveDesc) -> bool {
    a.collective == b.collective && a.op == b.op && a.dtype == b.dtype && a.count == b.count
}

fn with_buf_ptr(buf: &mut HostBuffer) -> RawBuf {
    RawBuf(match buf {
        HostBuffer::F32(v) => v.as_mut_ptr().cast(),
        HostBuffer::F64(v) => v.as_mut_ptr().cast(),
        HostBuffer::F16(v) => v.as_mut_ptr().cast(),
        HostBuffer::BF16(v) => v.as_mut_ptr().cast(),
    })
}

/// Reduces elements `[lo, hi)` across all buffers, in rank order, and writes the result into
/// every buffer.
///
/// Groups of up to [`MAX_FUSED`] ranks take one fused pass per element (read every rank's value,
/// add in rank order, store the sum to every rank), with the group size a constant so the loop
/// vectorizes; it moves each byte once, twice as fast as accumulating a block and copying it out.
/// Larger groups accumulate block by block.
///
/// # Safety
/// Every pointer addresses at least `hi` elements of `E`, the pointers are distinct, and no other
/// thread accesses `[lo, hi)` of any of them during the call.
unsafe fn reduce_chunk<E: Element>(ptrs: &[RawBuf], lo: usize, hi: usize, op: ReduceOp) {
    macro_rules! fused {
        ($($w:literal)*) => {
            match ptrs.len() {
                // SAFETY: the caller's contract.
                $($w => unsafe { reduce_fused::<E, $w>(ptrs, lo, hi, op) },)*
                // SAFETY: the caller's contract.
                _ => unsafe { reduce_blocked::<E>(ptrs, lo, hi, op) },
            }
        };
    }
    fused!(1 2 3 4 5 6 7 8)
}

/// Largest group reduced by [`reduce_fused`].
const MAX_FUSED: usize = 8;

/// [`reduce_chunk`] for exactly `W` ranks.
///
/// # Safety
/// As [`reduce_chunk`], and `ptrs.len() == W`.
unsafe fn reduce_fused<E: Element, const W: usize>(
    ptrs: &[RawBuf],
    lo: usize,
    hi: usize,
    op: ReduceOp,
) {
    debug_assert!(W <= MAX_FUSED && ptrs.len() == W);
    let div = W as u32;
    let mut start = lo;
    while start < hi {
        let n = BLOCK.min(hi - start);
        // SAFETY: in bounds, and the W buffers are distinct and exclusively ours on this range
        // (the caller's contract), so the W mutable slices do not alias.
        let mut s: [&mut [E]; W] = std::array::from_fn(|r| unsafe {
            std::slice::from_raw_parts_mut(ptrs[r].0.cast::<E>().add(start), n)
        });
        match op {
            ReduceOp::Sum => {
                for i in 0..n {
                    let mut a = s[0][i];
                    for x in &s[1..] {
                        a = a.add(x[i]);
                    }
                    for x in s.iter_mut() {
                        x[i] = a;
                    }
                }
            }
            ReduceOp::Mean => {
                for i in 0..n {
                    let mut a = s[0][i].scale_div(div);
                    for x in &s[1..] {
                        a = a.add(x[i].scale_div(div));
                    }
                    for x in s.iter_mut() {
                        x[i] = a;
                    }
                }
            }
        }
        start += n;
    }
}

/// [`reduce_chunk`] for any number of ranks: a block is accumulated in rank order, then copied
/// to every rank.
///
/// # Safety
/// As [`reduce_chunk`].
unsafe fn reduce_blocked<E: Element>(ptrs: &[RawBuf], lo: usize, hi: usize, op: ReduceOp) {
    let mut acc = [E::ZERO; BLOCK];
    let div = ptrs.len() as u32;
    let mut start = lo;
    while start < hi {
        let n = BLOCK.min(hi - start);
        let acc = &mut acc[..n];
        for (r, p) in ptrs.iter().enumerate() {
            // SAFETY: in bounds and exclusively ours (the caller's contract).
            let src = unsafe { std::slice::from_raw_parts(p.0.cast::<E>().add(start), n) };
            fold_term(acc, src, r == 0, op, div);
        }
        for p in ptrs {
            // SAFETY: as above; the reads of this block are done.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.0.cast::<E>().add(start), n) };
            dst.copy_from_slice(acc);
        }
        start += n;
    }
}

/// One term of the rank-order reduction: `src` folded into `acc` (`acc = src` for the first
/// rank, `acc = acc + src` after it; each term divided by the group size `div` first for a
/// mean).
#[inline]
fn fold_term<E: Element>(acc: &mut [E], src: &[E], first: bool, op: ReduceOp, div: u32) {
    match (first, op) {
        (true, ReduceOp::Sum) => acc.copy_from_slice(src),
        (true, ReduceOp::Mean) => {
            for (a, x) in acc.iter_mut().zip(src) {
                *a = x.scale_div(div);
            }
        }
        (false, ReduceOp::Sum) => {
            for (a, x) in acc.iter_mut().zip(src) {
                *a = a.add(*x);
            }
        }
        (false, ReduceOp::Mean) => {
            for (a, x) in acc.iter_mut().zip(src) {
                *a = a.add(x.scale_div(div));
            }
        }
    }
}

/// A term of [`fold_bytes`].
#[derive(Clone, Copy)]
pub(crate) enum Term<'a> {
    /// The accumulator's own values are the first rank's term.
    Own,
    /// The first rank's values.
    First(&'a [u8]),
    /// A later rank's values.
    Next(&'a [u8]),
}

/// One term of the rank-order reduction of a group of `world` ranks folded into `acc`, both
/// little-endian bytes of `dtype` (as [`HostBuffer::as_bytes`]): the terms of every rank, in
/// rank order, give the bits of the in-process group's reduction (a transport that reads the
/// ranks' values off the wire folds them as they come, without holding every rank's buffer). `false` (and `acc` unchanged) for a dtype that is not reduced, lengths that
/// differ or bytes not aligned to the element.
pub(crate) fn fold_bytes(
    dtype: crate::graph::DType,
    acc: &mut [u8],
    term: Term<'_>,
    op: ReduceOp,
    world: usize,
) -> bool {
    fn fold<E: Element + bytemuck::Pod>(
        acc: &mut [u8],
        term: Term<'_>,
        op: ReduceOp,
        div: u32,
    ) -> bool {
        let Ok(acc) = bytemuck::try_cast_slice_mut::<u8, E>(acc) else {
            return false;
        };
        let (src, first) = match term {
            Term::Own => {
                if op == ReduceOp::Mean {
                    for a in acc.iter_mut() {
                        *a = a.scale_div(div);
                    }
                }
                return true;
            }
            Term::First(src) => (src, true),
            Term::Next(src) => (src, false),
        };
        match bytemuck::try_cast_slice::<u8, E>(src) {
            Ok(src) if src.len() == acc.len() => {
                fold_term(acc, src, first, op, div);
                true
            }
            _ => false,
        }
    }
    let div = world as u32;
    match dtype {
        crate::graph::DType::F32 => fold::<f32>(acc, term, op, div),
        crate::graph::DType::F64 => fold::<f64>(acc, term, op, div),
        crate::graph::DType::F16 => fold::<half::f16>(acc, term, op, div),
        crate::graph::DType::BF16 => fold::<half::bf16>(acc, term, op, div),
        _ => false,
    }
}

/// Builds the ranks of an in-process group.
pub struct InProcessGroup;

impl InProcessGroup {
    /// `world` communicators, one per rank, each waiting at most `timeout` for the others.
    pub fn ranks(world: usize, timeout: Duration) -> Vec<InProcessComm> {
        let shared = Arc::new(InProcessShared {
            world,
            timeout,
            state: Mutex::new(State {
                round: 0,
                arrived: 0,
                finished: 0,
                departed: 0,
                posted: (0..world).map(|_| None).collect(),
                joined: None,
                aborted: None,
            }),
            cv: Condvar::new(),
            next_chunk: AtomicUsize::new(0),
        });
        (0..world)
            .map(|rank| {
                let sh = Arc::clone(&shared);
                let thread = CommThread::spawn(rank, format!("cf-comm-r{rank}"), move |rx| {
                    for (seq, job) in rx.into_iter().enumerate() {
                        let Job {
                            contribution,
                            what,
                            reply,
                        } = job;
                        let out = match contribution.into_host(rank, &what) {
                            Ok(mut buffer) => {
                                let cpu = thread_cpu_us();
                                sh.run(rank, seq as u64, &mut buffer, &what).map(
                                    |(start, joined)| {
                                        (buffer, CommSpan::joined_until_now(start, joined, cpu))
                                    },
                                )
                            }
                            Err(e) => {
                                // This rank will not arrive: the others stop waiting.
                                sh.abort(e.to_string());
                                Err(e)
                            }
                        };
                        let _ = reply.send(out);
                    }
                })
                .expect("spawning a communication thread");
                QueuedComm::new(rank, world, Arc::clone(&shared), thread)
            })
            .collect()
    }
}

/// One rank of an in-process group.
pub type InProcessComm = QueuedComm<InProcessShared>;

impl GroupState for InProcessShared {
    fn abort(&self, reason: String) {
        InProcessShared::abort(self, reason);
    }

    fn closing(&self, rank: usize) {
        // Whatever the other ranks still wait for from this rank will not come.
        InProcessShared::abort(self, format!("rank {rank} closed its communicator"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::DType;

    /// Every buffer reduced in place by the group's own kernel ([`reduce_chunk`]).
    fn reduced_by_the_group(bufs: &mut [HostBuffer], op: ReduceOp) {
        let ptrs: Vec<RawBuf> = bufs.iter_mut().map(with_buf_ptr).collect();
        let count = bufs[0].len();
        // SAFETY: every buffer holds `count` elements of one dtype (made so below), they are
        // distinct allocations, and the exclusive borrow keeps anyone else off them.
        unsafe {
            match bufs[0].dtype() {
                DType::F32 => reduce_chunk::<f32>(&ptrs, 0, count, op),
                DType::F64 => reduce_chunk::<f64>(&ptrs, 0, count, op),
                DType::F16 => reduce_chunk::<half::f16>(&ptrs, 0, count, op),
                DType::BF16 => reduce_chunk::<half::bf16>(&ptrs, 0, count, op),
                d => panic!("{d} is not reduced"),
            }
        }
    }

    /// `terms` folded in rank order: into a copy of rank 0's (`own`), or into a buffer that held
    /// other values.
    fn folded(terms: &[HostBuffer], own: bool, op: ReduceOp) -> HostBuffer {
        let (dtype, world) = (terms[0].dtype(), terms.len());
        let mut acc = terms[if own { 0 } else { world - 1 }].clone();
        let bytes = acc.as_bytes_mut();
        let first = match own {
            true => Term::Own,
            false => Term::First(terms[0].as_bytes()),
        };
        assert!(fold_bytes(dtype, bytes, first, op, world));
        for t in &terms[1..] {
            assert!(fold_bytes(
                dtype,
                bytes,
                Term::Next(t.as_bytes()),
                op,
                world
            ));
        }
        acc
    }

    #[test]
    fn folded_terms_give_the_bits_of_the_group() {
        // Worlds reduced by the fused kernel (up to 8) and by the blocked one, lengths past
        // and short of a block, every float dtype, both ops.
        let mut rng = crate::runtime::synthetic::SplitMix64(7);
        for world in [1, 2, 3, 5, 8, 9, 11] {
            for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
                for op in [ReduceOp::Sum, ReduceOp::Mean] {
                    for len in [1, 7, BLOCK + 3] {
                        let mut bufs: Vec<HostBuffer> = (0..world)
                            .map(|_| {
                                let v: Vec<f64> = (0..len).map(|_| rng.next_value()).collect();
                                HostBuffer::from_f64(dtype, &v).unwrap()
                            })
                            .collect();
                        let terms = bufs.clone();
                        reduced_by_the_group(&mut bufs, op);
                        let case = format!("{world} ranks, {dtype}, {op:?}, {len} elements");
                        assert!(folded(&terms, false, op).bits_eq(&bufs[0]), "{case}");
                        assert!(folded(&terms, true, op).bits_eq(&bufs[0]), "own: {case}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_term_of_another_length_or_dtype_is_refused() {
        let mut acc = HostBuffer::from_f64(DType::F32, &[1.0, 2.0]).unwrap();
        let short = HostBuffer::from_f64(DType::F32, &[1.0]).unwrap();
        let before = acc.clone();
        let (short, same) = (Term::Next(short.as_bytes()), Term::First(before.as_bytes()));
        assert!(!fold_bytes(
            DType::F32,
            acc.as_bytes_mut(),
            short,
            ReduceOp::Sum,
            2
        ));
        assert!(!fold_bytes(
            DType::I32,
            acc.as_bytes_mut(),
            same,
            ReduceOp::Mean,
            2
        ));
        assert!(acc.bits_eq(&before));
    }
}

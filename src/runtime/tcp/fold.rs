//! A rank-order reduction folded off the wire: each rank's values are read a chunk at a time
//! into one small scratch buffer and folded into the accumulator at once, so a collective never
//! holds every rank's buffer (rank 0 of the star used to allocate `world − 1` buffers of the
//! collective's size for each call, the mesh `world` shards).
//!
//! Requires: the terms come in rank order, the first rank's first ([`Fold::own`] or
//! [`Fold::read`] with `first`), each as long as the accumulator. Guarantees: the accumulator
//! ends with the bits of the in-process group's reduction of the same values (every element
//! summed in rank order, each term divided by the group size first for a mean); a read that
//! fails leaves the accumulator partly folded, and the caller then returns no result.

use std::net::TcpStream;
use std::time::Instant;

use super::read_by;
use crate::graph::{DType, ReduceOp};
use crate::runtime::buffer::HostBuffer;
use crate::runtime::inprocess::{Term, fold_bytes};

/// Bytes read off a connection per fold: small enough to stay in a core's cache between the
/// read and the fold.
const CHUNK_BYTES: usize = 256 * 1024;

/// The scratch and arithmetic of one reduction (see the module doc).
pub(super) struct Fold {
    dtype: DType,
    op: ReduceOp,
    world: usize,
    /// Up to [`CHUNK_BYTES`] of one rank's values, as read.
    scratch: HostBuffer,
}

impl Fold {
    /// The fold of a group of `world` ranks for accumulators of at most `len` elements of
    /// `dtype`; `None` for a dtype that is not reduced.
    pub(super) fn new(dtype: DType, op: ReduceOp, world: usize, len: usize) -> Option<Fold> {
        let chunk = (CHUNK_BYTES / dtype.size() as usize).min(len).max(1);
        Some(Fold {
            dtype,
            op,
            world,
            scratch: HostBuffer::zeros(dtype, chunk)?,
        })
    }

    fn fold(&self, acc: &mut [u8], term: Term<'_>) -> std::io::Result<()> {
        folded(
            self.dtype,
            fold_bytes(self.dtype, acc, term, self.op, self.world),
        )
    }

    /// The accumulator's own values are the first rank's term.
    pub(super) fn own(&self, acc: &mut [u8]) -> std::io::Result<()> {
        self.fold(acc, Term::Own)
    }

    /// `values`, held here, are the next rank's term.
    pub(super) fn next(&self, acc: &mut [u8], values: &[u8]) -> std::io::Result<()> {
        self.fold(acc, Term::Next(values))
    }

    /// Reads one rank's term of `acc`'s length off `s` by `deadline`, folding it in a chunk at
    /// a time (`first`: the first rank's).
    pub(super) fn read(
        &mut self,
        s: &TcpStream,
        acc: &mut [u8],
        first: bool,
        deadline: Instant,
    ) -> std::io::Result<()> {
        let Fold {
            dtype,
            op,
            world,
            scratch,
        } = self;
        let chunk = scratch.as_bytes().len();
        for acc in acc.chunks_mut(chunk) {
            let got = &mut scratch.as_bytes_mut()[..acc.len()];
            read_by(s, got, deadline)?;
            let term = if first {
                Term::First(got)
            } else {
                Term::Next(got)
            };
            folded(*dtype, fold_bytes(*dtype, acc, term, *op, *world))?;
        }
        Ok(())
    }
}

/// A fold that failed: only a caller's error (terms of another length or dtype) makes one.
fn folded(dtype: DType, ok: bool) -> std::io::Result<()> {
    if ok {
        return Ok(());
    }
    Err(std::io::Error::other(format!(
        "a term of another length than the accumulator's, or not aligned to {dtype}"
    )))
}

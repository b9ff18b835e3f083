//! A rank-order reduction folded off the wire: the ranks' values are read a chunk at a time
//! into a small scratch buffer and folded into a running sum at once, so a collective never
//! holds another rank's buffer (rank 0 of the star used to allocate `world − 1` buffers of the
//! collective's size for each call, each rank of the mesh `world` shards).
//!
//! Requires: `acc` is this rank's own values, and every other rank sends as many bytes of the
//! same dtype. Rank 0's sum runs in `acc` itself; a later rank's runs in a second chunk, since
//! rank 0's term comes before its own. Guarantees: `acc` ends with the bits of the in-process
//! group's reduction of the same values (every element summed in rank order, each term divided
//! by the group size first for a mean); a read that fails leaves `acc` partly folded, and the
//! caller then returns no result.

use std::net::TcpStream;
use std::time::Instant;

use super::read_by;
use crate::graph::{DType, ReduceOp};
use crate::runtime::buffer::HostBuffer;
use crate::runtime::inprocess::{Term, fold_bytes};

/// Bytes folded at a time: small enough for the read and the sum to stay in a core's cache.
pub(super) const CHUNK_BYTES: usize = 256 * 1024;

/// The scratch and arithmetic of one rank's reduction (see the module doc).
pub(super) struct Fold {
    dtype: DType,
    op: ReduceOp,
    /// This rank's, and the group's size.
    rank: usize,
    world: usize,
    /// Up to [`CHUNK_BYTES`] of one rank's values, as read.
    read: HostBuffer,
    /// The running sum of a chunk, on a rank after the first (rank 0's own values are the
    /// first term, so its sum runs where they lie).
    sum: Option<HostBuffer>,
}

impl Fold {
    /// The fold of `rank` of a group of `world` ranks for buffers of at most `len` elements of
    /// `dtype`; `None` for a dtype that is not reduced.
    pub(super) fn new(
        dtype: DType,
        op: ReduceOp,
        (rank, world): (usize, usize),
        len: usize,
    ) -> Option<Fold> {
        let chunk = (CHUNK_BYTES / dtype.size() as usize).min(len).max(1);
        Some(Fold {
            dtype,
            op,
            rank,
            world,
            read: HostBuffer::zeros(dtype, chunk)?,
            sum: match rank {
                0 => None,
                _ => Some(HostBuffer::zeros(dtype, chunk)?),
            },
        })
    }

    /// Reduces `acc`, this rank's values, with every other rank `r`'s, read off `link(r)` by
    /// `deadline`: chunk by chunk, each chunk the terms of ranks 0, 1, … in turn. An error
    /// names the rank whose values could not be read.
    pub(super) fn reduce<'s>(
        &mut self,
        acc: &mut [u8],
        link: impl Fn(usize) -> Option<&'s TcpStream>,
        deadline: Instant,
    ) -> Result<(), (usize, std::io::Error)> {
        let Fold {
            dtype,
            op,
            rank,
            world,
            read,
            sum,
        } = self;
        let (dtype, op, rank, world) = (*dtype, *op, *rank, *world);
        let fold = |acc: &mut [u8], term: Term<'_>, r: usize| {
            if fold_bytes(dtype, acc, term, op, world) {
                return Ok(());
            }
            let why = format!("values that are not {} bytes of {dtype}", acc.len());
            Err((r, std::io::Error::other(why)))
        };
        let chunk = read.as_bytes().len();
        for acc in acc.chunks_mut(chunk) {
            let n = acc.len();
            let Some(sum) = sum else {
                // Rank 0: its own values are the first term, where they lie.
                fold(acc, Term::Own, 0)?;
                for r in 1..world {
                    let t = read_term(read, n, (r, link(r)), deadline)?;
                    fold(acc, Term::Next(t), r)?;
                }
                continue;
            };
            let sum = &mut sum.as_bytes_mut()[..n];
            for r in 0..world {
                let t = match r == rank {
                    true => &*acc,
                    false => read_term(read, n, (r, link(r)), deadline)?,
                };
                let t = if r == 0 {
                    Term::First(t)
                } else {
                    Term::Next(t)
                };
                fold(sum, t, r)?;
            }
            acc.copy_from_slice(sum);
        }
        Ok(())
    }
}

/// The next `n` bytes of rank `r`'s values off its link, read into `read` by `deadline`.
fn read_term<'a>(
    read: &'a mut HostBuffer,
    n: usize,
    (r, link): (usize, Option<&TcpStream>),
    deadline: Instant,
) -> Result<&'a [u8], (usize, std::io::Error)> {
    let s = link.ok_or_else(|| (r, std::io::Error::other("no connection")))?;
    let got = &mut read.as_bytes_mut()[..n];
    read_by(s, got, deadline).map_err(|e| (r, e))?;
    Ok(got)
}

//! A rank-order reduction folded off the wire: the ranks' values are read a chunk at a time
//! into a small scratch buffer and folded into a running sum at once, so a collective never
//! holds another rank's buffer (rank 0 of the star used to allocate `world − 1` buffers of the
//! collective's size for each call, each rank of the mesh `world` shards).
//!
//! Requires: `acc` is this rank's own values, and every other rank sends as many bytes of the
//! same dtype. Guarantees: `acc` ends with the bits of the in-process group's reduction of the
//! same values (every element summed in rank order, each term divided by the group size first
//! for a mean); a read that fails leaves `acc` partly folded, and the caller then returns no
//! result.

use std::net::TcpStream;
use std::time::Instant;

use super::read_by;
use crate::graph::{DType, ReduceOp};
use crate::runtime::buffer::HostBuffer;
use crate::runtime::inprocess::{Term, fold_bytes};

/// Bytes folded at a time: small enough for the read and the sum to stay in a core's cache.
const CHUNK_BYTES: usize = 256 * 1024;

/// The scratch and arithmetic of one reduction (see the module doc).
pub(super) struct Fold {
    dtype: DType,
    op: ReduceOp,
    world: usize,
    /// Up to [`CHUNK_BYTES`] of one rank's values, as read.
    read: HostBuffer,
    /// The running sum of a chunk.
    sum: HostBuffer,
}

impl Fold {
    /// The fold of a group of `world` ranks for buffers of at most `len` elements of `dtype`;
    /// `None` for a dtype that is not reduced.
    pub(super) fn new(dtype: DType, op: ReduceOp, world: usize, len: usize) -> Option<Fold> {
        let chunk = (CHUNK_BYTES / dtype.size() as usize).min(len).max(1);
        Some(Fold {
            dtype,
            op,
            world,
            read: HostBuffer::zeros(dtype, chunk)?,
            sum: HostBuffer::zeros(dtype, chunk)?,
        })
    }

    /// Reduces `acc`, this rank's (`own`) values, with every other rank `r`'s, read off
    /// `link(r)` by `deadline`: chunk by chunk, each chunk the terms of ranks 0, 1, … in turn.
    /// An error names the rank whose values could not be read.
    pub(super) fn reduce<'s>(
        &mut self,
        acc: &mut [u8],
        own: usize,
        link: impl Fn(usize) -> Option<&'s TcpStream>,
        deadline: Instant,
    ) -> Result<(), (usize, std::io::Error)> {
        let Fold {
            dtype,
            op,
            world,
            read,
            sum,
        } = self;
        let chunk = read.as_bytes().len();
        for acc in acc.chunks_mut(chunk) {
            let sum = &mut sum.as_bytes_mut()[..acc.len()];
            for r in 0..*world {
                let term: &[u8] = if r == own {
                    acc
                } else {
                    let s = link(r).ok_or_else(|| (r, std::io::Error::other("no connection")))?;
                    let got = &mut read.as_bytes_mut()[..acc.len()];
                    read_by(s, got, deadline).map_err(|e| (r, e))?;
                    got
                };
                let term = if r == 0 {
                    Term::First(term)
                } else {
                    Term::Next(term)
                };
                if !fold_bytes(*dtype, sum, term, *op, *world) {
                    let why = format!("values that are not {} bytes of {dtype}", sum.len());
                    return Err((r, std::io::Error::other(why)));
                }
            }
            acc.copy_from_slice(sum);
        }
        Ok(())
    }
}

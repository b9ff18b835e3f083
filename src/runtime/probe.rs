//! The link probe: a few all-reduces of known sizes, timed, so that a job that has run only
//! collectives of one size (a model that fits one bucket) still has a link to fit. Every rank
//! runs it at the same point (the first gradient sync), under launch ids of its own.

use std::time::{Duration, Instant};

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, Communicator};
use crate::graph::{DType, ReduceOp};

/// Launch indices of the probe's all-reduces (far from any plan's, the agreement's and the
/// weight broadcast's).
pub const LINK_PROBE: u32 = u32::MAX - 3_000_000;

/// Bytes of each probe size, smallest first: the fixed cost, then the bandwidth.
pub const PROBE_BYTES: [u64; 3] = [4 << 10, 1 << 20, 16 << 20];

/// Runs each size of [`PROBE_BYTES`] twice (the second run starts with the ranks aligned by
/// the first) and returns `(bytes, µs)` of every run, as this rank saw it: from the later of
/// its call and the last rank's arrival (where the communicator tells,
/// [`CommSpan::joined`](super::comm::CommSpan::joined)) to the result. The buffer of a size is
/// written before its first run and reused by the second, so the probe times the link, not
/// the first touch of fresh memory (a page fault per 4 KiB page, tens of milliseconds at
/// 16 MiB where faults are dear).
pub fn probe_link(
    comm: &dyn Communicator,
    timeout: Duration,
) -> Result<Vec<(u64, f64)>, CommError> {
    let mut out = Vec::with_capacity(PROBE_BYTES.len() * 2);
    let mut id = LINK_PROBE;
    for bytes in PROBE_BYTES {
        let count = (bytes / DType::F32.size()) as usize;
        let mut buf = HostBuffer::zeros(DType::F32, count).unwrap_or_default();
        buf.as_bytes_mut().fill(0);
        for _ in 0..2 {
            let what = CollectiveDesc {
                collective: id,
                bucket: None,
                op: ReduceOp::Sum,
                dtype: DType::F32,
                count: count as u64,
                params: vec!["(link probe)".to_string()],
            };
            id += 1;
            let t0 = Instant::now();
            let (back, span) = comm
                .all_reduce(buf, what)?
                .wait(super::comm::wait_bound(timeout))?;
            buf = back;
            let from = span.joined.map_or(t0, |j| j.max(t0));
            out.push((
                bytes,
                span.end.saturating_duration_since(from).as_secs_f64() * 1e6,
            ));
        }
    }
    Ok(out)
}

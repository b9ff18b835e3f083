//! Page-locked (pinned) host memory through which the comm thread moves host buffers to and from
//! the GPU.
//!
//! A copy from ordinary (pageable) host memory is not asynchronous: CUDA first waits for
//! everything queued on the stream, and a copy back returns only once it is done. Through pinned
//! memory both copies are queued like kernels, so a batch of host-buffer collectives is one
//! stream of host → device, `ncclAllReduce`, device → host per buffer, waited for once, and the
//! copies run at the link's DMA bandwidth. The only host work is a `memcpy` into the staging
//! memory before and out of it after.
//!
//! One buffer per comm thread, grown (never shrunk) to the largest batch it has carried, so a
//! training job allocates pinned memory in its first steps only.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaContext, PinnedHostSlice};

/// Each buffer's place in the staging memory starts on this many bytes.
const ALIGN: usize = 256;

/// The comm thread's staging memory.
pub(super) struct Staging {
    ctx: Arc<CudaContext>,
    pinned: Option<PinnedHostSlice<u8>>,
    /// Whether copies queued on the stream may still read or write it (a batch that did not
    /// complete: timed out or failed). Then it is never freed or reused; see [`Drop`].
    in_flight: bool,
}

impl Staging {
    pub(super) fn new(ctx: Arc<CudaContext>) -> Self {
        Self {
            ctx,
            pinned: None,
            in_flight: false,
        }
    }

    /// Places buffers of these byte sizes one after another (each aligned), growing the memory
    /// when it is smaller than their total. Refused while copies may still use it (after a
    /// batch that never completed, which aborts the rank, so this is a second line of defence).
    pub(super) fn place(&mut self, sizes: &[usize]) -> Result<Vec<Range<usize>>, String> {
        if self.in_flight {
            return Err("the staging memory may still be in use by an unfinished batch".into());
        }
        let mut end = 0usize;
        let places: Vec<Range<usize>> = sizes
            .iter()
            .map(|n| {
                let start = end.next_multiple_of(ALIGN);
                end = start + n;
                start..end
            })
            .collect();
        if self.pinned.as_ref().is_none_or(|p| p.len() < end) {
            // Free the old memory first: pinned memory is a scarce resource.
            self.pinned = None;
            // Cached, not write-combined (cudarc's default): the results are read back by the CPU.
            // SAFETY: the memory is uninitialized; every byte of it is written (by the CPU or a
            // copy from the device) before it is read.
            let pinned = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(end, 0) };
            self.pinned = Some(pinned.map_err(|e| format!("{e:?} ({end} bytes)"))?);
        }
        Ok(places)
    }

    /// The bytes at `place`, for the CPU to write or read, or for a copy to be queued with.
    ///
    /// # Safety
    /// No copy queued on the stream may be using `place` while the slice is read or written by
    /// the CPU; a slice handed to a queued copy must stay unused until the stream has passed it.
    pub(super) unsafe fn bytes(&mut self, place: Range<usize>) -> &mut [u8] {
        let p = self.pinned.as_mut().expect("placed before use");
        assert!(place.end <= p.len());
        // SAFETY: `place` lies inside the allocation; the caller's contract covers the device.
        // `as_mut_ptr` would wait on cudarc's own event, which only its safe copies record.
        let base = p.as_mut_ptr().expect("the staging memory's event");
        unsafe { std::slice::from_raw_parts_mut(base.add(place.start), place.len()) }
    }

    /// Marks copies as queued on the staging memory (`true`) or the stream as past them.
    pub(super) fn set_in_flight(&mut self, queued: bool) {
        self.in_flight = queued;
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.in_flight {
            // A copy the device may still run (its batch never completed) could write into freed
            // host memory: keep the memory instead, once, at the end of a failed communicator.
            std::mem::forget(self.pinned.take());
        }
    }
}

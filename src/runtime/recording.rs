//! A communicator wrapper that records every collective it is asked for, in order, then lets the
//! wrapped communicator do the work. Tests use it to see exactly what a plan launched.

use std::sync::{Arc, Mutex};

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, Communicator, DeviceLaunch, PendingReduce};
use super::grad::DeviceBucket;

/// Records calls, delegates work.
pub struct Recording<C> {
    inner: C,
    calls: CallLog,
    /// Groups as ranges of call indices; an open one as its start.
    groups: Mutex<(Vec<std::ops::Range<usize>>, Option<usize>)>,
}

impl<C: Communicator> Recording<C> {
    /// Wraps `inner`.
    pub fn new(inner: C) -> Self {
        Recording {
            inner,
            calls: CallLog::default(),
            groups: Mutex::new((Vec::new(), None)),
        }
    }

    /// The groups closed so far ([`Communicator::group`]), as ranges of indices into
    /// [`Recording::calls`].
    pub fn groups(&self) -> Vec<std::ops::Range<usize>> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// The collectives asked for so far, in order.
    pub fn calls(&self) -> Vec<CollectiveDesc> {
        self.calls.calls()
    }

    /// A handle on the record that outlives this wrapper (once it is boxed away).
    pub fn log(&self) -> CallLog {
        self.calls.clone()
    }

    fn note(&self, what: &CollectiveDesc) {
        self.calls
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(what.clone());
    }
}

/// The record of a [`Recording`], shared.
#[derive(Clone, Default)]
pub struct CallLog(Arc<Mutex<Vec<CollectiveDesc>>>);

impl CallLog {
    /// The collectives asked for so far, in order.
    pub fn calls(&self) -> Vec<CollectiveDesc> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl<C: Communicator> Communicator for Recording<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        self.note(&what);
        self.inner.all_reduce(buffer, what)
    }

    fn group(&self, open: bool) {
        let n = self.calls.0.lock().unwrap_or_else(|e| e.into_inner()).len();
        let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        match (open, g.1.take()) {
            (true, _) => g.1 = Some(n),
            (false, Some(start)) => g.0.push(start..n),
            (false, None) => {}
        }
        drop(g);
        self.inner.group(open)
    }

    fn reduces_device_memory(&self) -> bool {
        self.inner.reduces_device_memory()
    }

    fn all_reduce_device(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<DeviceLaunch, CommError> {
        let launch = self.inner.all_reduce_device(bucket, what.clone())?;
        // A declined bucket comes back through `all_reduce_read`, which records it then.
        if let DeviceLaunch::Launched(_) = launch {
            self.note(&what);
        }
        Ok(launch)
    }

    fn all_reduce_read(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        self.note(&what);
        self.inner.all_reduce_read(bucket, what)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

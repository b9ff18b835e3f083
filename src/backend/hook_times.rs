//! Host time the gradient-sync hooks spend, per rank, whatever the inner backend: what the step
//! tables (`train::overhead`) print beside each step's phases, so a marked step's extra time can
//! be told apart (running the gradients' producers, our own work per gradient, the sync point).
//!
//! Guarantees: every call of `submit_gradient_sync` and `submit_sync_collective` on a rank adds
//! its wall time here, split as [`HookTimes`] says; the counters only grow, so a reader takes
//! the difference around what it measures ([`HookTimes::since`]).

use std::sync::Mutex;
use std::time::Duration;

/// What the gradient-sync hooks of one rank spent so far, in nanoseconds of wall time on the
/// calling (training) thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HookTimes {
    /// Gradients submitted (`submit_gradient_sync` calls).
    pub gradients: u64,
    /// Of their time: computing each gradient's value (the queued ops that produce it run; on a
    /// device backend, their launches).
    pub force_ns: u64,
    /// The rest of `submit_gradient_sync`: reading or packing the gradient, launching the
    /// collectives the plan can start.
    pub submit_ns: u64,
    /// Sync points (`submit_sync_collective` calls).
    pub syncs: u64,
    /// Their time: the collectives still running waited for, the rest reduced, every reduced
    /// gradient written back.
    pub sync_ns: u64,
    /// Of `sync_ns`: writing the reduced gradients back into their tensors.
    pub writeback_ns: u64,
    /// Collectives the synced steps waited for (launched during backward or at the sync
    /// point; none in a step that left its gradients as they were).
    pub collectives: u64,
    /// Of `sync_ns`: blocked waiting for those collectives' results (the union of the waits
    /// inside the sync point, [`MeasuredStep::waited_at_sync_us`]): on a GPU, the training
    /// thread idle until the device finished backward, the packs and the all-reduces. The rest
    /// of the sync point is host work (reducing what was left, launching, the write-back).
    ///
    /// [`MeasuredStep::waited_at_sync_us`]: crate::measure::MeasuredStep::waited_at_sync_us
    pub waited_ns: u64,
}

impl HookTimes {
    /// What happened between `before` and `self`.
    pub fn since(&self, before: &HookTimes) -> HookTimes {
        HookTimes {
            gradients: self.gradients - before.gradients,
            force_ns: self.force_ns - before.force_ns,
            submit_ns: self.submit_ns - before.submit_ns,
            syncs: self.syncs - before.syncs,
            sync_ns: self.sync_ns - before.sync_ns,
            writeback_ns: self.writeback_ns - before.writeback_ns,
            collectives: self.collectives - before.collectives,
            waited_ns: self.waited_ns - before.waited_ns,
        }
    }

    /// Adds `other`'s counts and times to these.
    pub fn add(&mut self, other: &HookTimes) {
        self.gradients += other.gradients;
        self.force_ns += other.force_ns;
        self.submit_ns += other.submit_ns;
        self.syncs += other.syncs;
        self.sync_ns += other.sync_ns;
        self.writeback_ns += other.writeback_ns;
        self.collectives += other.collectives;
        self.waited_ns += other.waited_ns;
    }
}

/// Ranks whose times sit in a fixed table; a higher rank's are in a map ([`times_of`]).
const RANKS: usize = 256;

const ZERO: HookTimes = HookTimes {
    gradients: 0,
    force_ns: 0,
    submit_ns: 0,
    syncs: 0,
    sync_ns: 0,
    writeback_ns: 0,
    collectives: 0,
    waited_ns: 0,
};

/// The times of `rank`, each rank's under a lock of its own: every gradient of every rank
/// adds to them, and ranks that share a process (threads, one per GPU) must not take turns at
/// one lock for it.
fn times_of(rank: usize) -> &'static Mutex<HookTimes> {
    static LOW: [Mutex<HookTimes>; RANKS] = [const { Mutex::new(ZERO) }; RANKS];
    static HIGH: Mutex<Option<hashbrown::HashMap<usize, &'static Mutex<HookTimes>>>> =
        Mutex::new(None);
    if let Some(t) = LOW.get(rank) {
        return t;
    }
    // A panic while a lock was held left at worst a counter short.
    let mut high = HIGH.lock().unwrap_or_else(|e| e.into_inner());
    high.get_or_insert_with(Default::default)
        .entry(rank)
        .or_insert_with(|| Box::leak(Box::new(Mutex::new(ZERO))))
}

fn update(rank: usize, f: impl FnOnce(&mut HookTimes)) {
    f(&mut times_of(rank).lock().unwrap_or_else(|e| e.into_inner()));
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// One `submit_gradient_sync` on `rank`: `total` of wall time, `force` of it computing the
/// gradient.
pub(super) fn submitted(rank: usize, total: Duration, force: Duration) {
    update(rank, |h| {
        h.gradients += 1;
        h.force_ns += ns(force);
        h.submit_ns += ns(total.saturating_sub(force));
    });
}

/// What one sync point spent, besides its whole time: see [`HookTimes`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SyncTimes {
    /// Writing the reduced gradients back.
    pub writeback: Duration,
    /// Collectives the step waited for.
    pub collectives: u64,
    /// Blocked waiting for their results.
    pub waited: Duration,
}

/// One `submit_sync_collective` on `rank`: `total` of wall time, split as `parts` says.
pub(super) fn synced(rank: usize, total: Duration, parts: SyncTimes) {
    update(rank, |h| {
        h.syncs += 1;
        h.sync_ns += ns(total);
        h.writeback_ns += ns(parts.writeback);
        h.collectives += parts.collectives;
        h.waited_ns += ns(parts.waited);
    });
}

/// The hook times of `rank` so far (all zero for a rank that never synced).
pub fn hook_times(rank: u32) -> HookTimes {
    *times_of(rank as usize)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_times_add_up_per_rank_and_split_as_measured() {
        // Ranks no other test uses, one in the fixed table and one past it: the table is the
        // process's.
        for rank in [(RANKS - 1) as u32, 9_001] {
            let before = hook_times(rank);
            submitted(
                rank as usize,
                Duration::from_micros(30),
                Duration::from_micros(10),
            );
            submitted(
                rank as usize,
                Duration::from_micros(5),
                Duration::from_micros(7),
            );
            synced(
                rank as usize,
                Duration::from_micros(50),
                SyncTimes {
                    writeback: Duration::from_micros(20),
                    collectives: 3,
                    waited: Duration::from_micros(25),
                },
            );
            let d = hook_times(rank).since(&before);
            assert_eq!(
                d,
                HookTimes {
                    gradients: 2,
                    // A force longer than its call (clock granularity) leaves no negative rest.
                    force_ns: 17_000,
                    submit_ns: 20_000,
                    syncs: 1,
                    sync_ns: 50_000,
                    writeback_ns: 20_000,
                    collectives: 3,
                    waited_ns: 25_000,
                },
                "rank {rank}"
            );
            assert_eq!(hook_times(rank + 1), HookTimes::default(), "rank {rank}");
        }
    }
}

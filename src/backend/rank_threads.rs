//! Threads that work for a rank, and what their panic does: the group fails at once, every
//! rank's error naming the rank whose thread panicked, where and why, instead of the others
//! waiting for it until their timeout and then reporting that it never arrived.
//!
//! A thread works for rank `r` once it called one of the rank's collective hooks (backward's
//! registration of its parameters, a gradient sync, a sync point, an all-reduce,
//! `sync_collective`) or marked a model for it. A process panic hook, installed once in front
//! of the hook in place (which still runs, after ours), aborts the communicators of the ranks
//! the panicking thread works for, unless the group already failed (a failure of ours aborts
//! first and then panics). A panic the thread catches fails the group too: the rank may have
//! left a collective half done. A thread that only recorded ops for a rank's device (the main
//! thread that built the model) does not work for it.
//!
//! The server also counts the threads working for each rank ([`ThreadCounts`]): a failure then
//! names the ranks whose threads all ended without a panic (a loop that ran out of data before
//! the other ranks' did), which the others otherwise know only as late.

use std::cell::RefCell;
use std::panic::PanicHookInfo;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Once, Weak};

use smallvec::SmallVec;

/// A running server as the threads that work for its ranks see it: it fails its group when one
/// of them panics, and counts them.
pub(super) trait RankServer: Send + Sync {
    /// Aborts `rank`'s communicator with `reason`, unless the group already failed.
    fn abort_for_panic(&self, rank: usize, reason: &str);
    /// One more thread works for `rank`.
    fn thread_started(&self, rank: usize);
    /// A thread that worked for `rank` ended.
    fn thread_ended(&self, rank: usize);
}

/// Threads working for each rank of a server, and the ranks that had some and have none left
/// without a panic (a rank whose loop ended early, as on uneven data, is then named as such in
/// errors; one whose thread panicked is named by the abort).
pub(super) struct ThreadCounts(Vec<RankThreads>);

#[derive(Default)]
struct RankThreads {
    live: AtomicUsize,
    gone: AtomicBool,
    panicked: AtomicBool,
}

impl ThreadCounts {
    /// Counts for `world` ranks.
    pub(super) fn new(world: usize) -> Self {
        ThreadCounts((0..world).map(|_| RankThreads::default()).collect())
    }

    pub(super) fn started(&self, rank: usize) {
        if let Some(t) = self.0.get(rank) {
            t.live.fetch_add(1, SeqCst);
            t.gone.store(false, SeqCst);
        }
    }

    pub(super) fn ended(&self, rank: usize) {
        if let Some(t) = self.0.get(rank)
            && t.live.fetch_sub(1, SeqCst) == 1
        {
            t.gone.store(true, SeqCst);
        }
    }

    /// A thread of `rank` panicked.
    pub(super) fn panicked(&self, rank: usize) {
        if let Some(t) = self.0.get(rank) {
            t.panicked.store(true, SeqCst);
        }
    }

    /// The ranks whose threads all ended (each had one) and none panicked.
    pub(super) fn gone(&self) -> Vec<usize> {
        (self.0.iter().enumerate())
            .filter(|(_, t)| t.gone.load(SeqCst) && !t.panicked.load(SeqCst))
            .map(|(r, _)| r)
            .collect()
    }
}

/// A rank this thread works for: its server and the rank.
struct Entry {
    server: Weak<dyn RankServer>,
    rank: usize,
}

/// The ranks the thread works for; when the thread ends, each live server hears it.
struct WorksFor(RefCell<SmallVec<[Entry; 1]>>);

impl Drop for WorksFor {
    fn drop(&mut self) {
        for e in self.0.get_mut().drain(..) {
            if let Some(server) = e.server.upgrade() {
                server.thread_ended(e.rank);
            }
        }
    }
}

thread_local! {
    static WORKS_FOR: WorksFor = const { WorksFor(RefCell::new(SmallVec::new_const())) };
}

/// Notes that the calling thread works for `rank` of `server` (cheap when it already did: a
/// thread-local look at one or two entries).
pub(super) fn works_for<S: RankServer + 'static>(server: &Arc<S>, rank: usize) {
    // A hook called while this thread unwinds (from a destructor) changes nothing: the panic
    // hook has run already, and it may not be installed from a panicking thread.
    if std::thread::panicking() {
        return;
    }
    let _ = WORKS_FOR.try_with(|w| {
        let Ok(mut w) = w.0.try_borrow_mut() else {
            return;
        };
        // An entry's weak reference keeps its server's allocation, so no other server has
        // that address while the entry is listed.
        let listed = |e: &Entry| std::ptr::addr_eq(e.server.as_ptr(), Arc::as_ptr(server));
        if w.iter().any(|e| e.rank == rank && listed(e)) {
            return;
        }
        // Servers that have closed leave no entry behind.
        w.retain(|e| e.server.strong_count() > 0);
        server.thread_started(rank);
        let weak: Weak<S> = Arc::downgrade(server);
        w.push(Entry { server: weak, rank });
        install_hook();
    });
}

/// The rank of `server` the calling thread works for, where it works for exactly one.
pub(super) fn thread_rank<S: RankServer + 'static>(server: &Arc<S>) -> Option<usize> {
    WORKS_FOR
        .try_with(|w| {
            let w = w.0.try_borrow().ok()?;
            let mut ranks = w
                .iter()
                .filter(|e| std::ptr::addr_eq(e.server.as_ptr(), Arc::as_ptr(server)))
                .map(|e| e.rank);
            let rank = ranks.next()?;
            ranks.next().is_none().then_some(rank)
        })
        .ok()
        .flatten()
}

/// Installs the process's panic hook (once), in front of the hook in place.
fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            on_panic(info);
            previous(info);
        }));
    });
}

/// The hook's work: abort the group of each rank the panicking thread works for.
fn on_panic(info: &PanicHookInfo<'_>) {
    let servers: SmallVec<[(Arc<dyn RankServer>, usize); 1]> = WORKS_FOR
        .try_with(|w| {
            w.0.try_borrow()
                .map(|w| {
                    w.iter()
                        .filter_map(|e| e.server.upgrade().map(|s| (s, e.rank)))
                        .collect()
                })
                .unwrap_or_default()
        })
        .unwrap_or_default();
    if servers.is_empty() {
        return;
    }
    let reason = panic_reason(info);
    for (server, rank) in servers {
        server.abort_for_panic(rank, &reason);
    }
}

/// "its thread panicked at FILE:LINE:COL: MESSAGE".
fn panic_reason(info: &PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let message = payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a panic without a message)");
    match info.location() {
        Some(l) => format!("its thread panicked at {l}: {message}"),
        None => format!("its thread panicked: {message}"),
    }
}

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

use std::cell::RefCell;
use std::panic::PanicHookInfo;
use std::sync::{Arc, Once, Weak};

use smallvec::SmallVec;

/// A running server that can fail its group because a thread of one of its ranks panicked.
pub(super) trait AbortOnPanic: Send + Sync {
    /// Aborts `rank`'s communicator with `reason`, unless the group already failed.
    fn abort_for_panic(&self, rank: usize, reason: &str);
}

/// A rank this thread works for: its server (by address, to tell servers apart without
/// upgrading) and the rank.
struct Entry {
    server: Weak<dyn AbortOnPanic>,
    addr: usize,
    rank: usize,
}

thread_local! {
    static WORKS_FOR: RefCell<SmallVec<[Entry; 1]>> = const { RefCell::new(SmallVec::new_const()) };
}

/// Notes that the calling thread works for `rank` of `server` (cheap when it already did: a
/// thread-local look at one or two entries).
pub(super) fn works_for<S: AbortOnPanic + 'static>(server: &Arc<S>, rank: usize) {
    // A hook called while this thread unwinds (from a destructor) changes nothing: the panic
    // hook has run already, and it may not be installed from a panicking thread.
    if std::thread::panicking() {
        return;
    }
    let addr = Arc::as_ptr(server) as *const () as usize;
    let _ = WORKS_FOR.try_with(|w| {
        let Ok(mut w) = w.try_borrow_mut() else {
            return;
        };
        // An entry's weak reference keeps its server's allocation, so no other server has
        // that address while the entry is listed.
        if w.iter().any(|e| e.addr == addr && e.rank == rank) {
            return;
        }
        // Servers that have closed leave no entry behind.
        w.retain(|e| e.server.strong_count() > 0);
        let server: Arc<dyn AbortOnPanic> = server.clone();
        w.push(Entry {
            server: Arc::downgrade(&server),
            addr,
            rank,
        });
        install_hook();
    });
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
    let servers: SmallVec<[(Arc<dyn AbortOnPanic>, usize); 1]> = WORKS_FOR
        .try_with(|w| {
            w.try_borrow()
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

//! Which ranks of a multi-process group are still there: the rendezvous connections, kept open
//! after rank 0's bytes were shared, as a star of liveness channels (rank 0 to every peer).
//!
//! A transport whose data path cannot say which rank failed (NCCL: a collective waiting for a
//! killed process just never completes) asks this watch. The operating system closes a
//! process's sockets when it ends, however it ends, so:
//! - a rank that closes its watch on purpose (its communicator dropped) first says goodbye: it
//!   has **left**;
//! - a connection that closes without a goodbye (the process was killed, crashed, or exited
//!   without dropping its communicator) means that rank is **gone**.
//!
//! Rank 0 watches every peer and tells the other peers when one departs; a peer watches rank 0
//! (and hears about the others from it). A departure is only a hint until something waits on
//! the departed rank: a collective that has not completed some time after a departure of one
//! of its ranks never will (the transport then fails it naming that rank, instead of waiting
//! for its whole timeout and saying nothing). A rank on another machine that vanishes without
//! its kernel closing the connection (a power cut) is not seen here; the timeouts still apply.
//!
//! Every link carries a heartbeat every [`HEARTBEAT`], so that a middlebox that reaps idle
//! connections does not close one under a long job (which would read as a rank gone).
//!
//! Wire format, after the rendezvous answer: messages of 5 bytes, a kind (`B`: goodbye from the
//! sender; `H`: heartbeat; `G`, `L`: from rank 0, the rank that follows is gone or left) and a
//! rank `u32` (little endian).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often each side of a link says it is there.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// How a rank departed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DepartureKind {
    /// It closed its communicator (said goodbye).
    Left,
    /// Its connection closed without a goodbye: the process was killed or crashed.
    Gone,
}

/// A rank that departed, and when this process learnt of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Departure {
    /// The rank.
    pub rank: usize,
    /// How.
    pub kind: DepartureKind,
    /// When this process learnt it.
    pub at: Instant,
}

impl std::fmt::Display for Departure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            DepartureKind::Left => write!(
                f,
                "rank {} closed its communicator (it said goodbye {:?} ago)",
                self.rank,
                self.at.elapsed()
            ),
            DepartureKind::Gone => write!(
                f,
                "rank {}'s process is gone: its connection closed without a goodbye {:?} ago (killed or crashed)",
                self.rank,
                self.at.elapsed()
            ),
        }
    }
}

/// State shared with the watching threads.
struct Shared {
    rank: usize,
    /// The first departure of each rank (this process's own entry stays `None`).
    departed: Mutex<Vec<Option<Departure>>>,
    /// Set when this process closes the watch: its own connections closing are no news.
    closing: AtomicBool,
    /// Whether any rank departed (a cheap check for a polling loop).
    any: AtomicBool,
    /// Rank 0: the write ends to every peer (to pass departures on); a peer: to rank 0.
    links: Mutex<Vec<(usize, TcpStream)>>,
}

impl Shared {
    /// Records `rank`'s departure (the first one stands); true if it is news.
    fn record(&self, rank: usize, kind: DepartureKind) -> bool {
        let Ok(mut d) = self.departed.lock() else {
            return false;
        };
        match d.get_mut(rank) {
            Some(slot @ None) if rank != self.rank => {
                *slot = Some(Departure {
                    rank,
                    kind,
                    at: Instant::now(),
                });
                self.any.store(true, Ordering::SeqCst);
                true
            }
            _ => false,
        }
    }
}

/// This process's view of which ranks are still there. Dropping it says goodbye to the others.
pub struct PeerWatch {
    shared: Arc<Shared>,
}

fn message(kind: u8, rank: usize) -> [u8; 5] {
    let r = (rank as u32).to_le_bytes();
    [kind, r[0], r[1], r[2], r[3]]
}

impl PeerWatch {
    /// Rank 0's watch over its peers' connections (`(rank, stream)`, every peer once).
    pub(crate) fn rank_zero(world: usize, peers: Vec<(usize, TcpStream)>) -> std::io::Result<Self> {
        Self::start(0, world, peers)
    }

    /// A peer's watch over its connection to rank 0.
    pub(crate) fn peer(
        rank: usize,
        world: usize,
        to_rank_zero: TcpStream,
    ) -> std::io::Result<Self> {
        Self::start(rank, world, vec![(0, to_rank_zero)])
    }

    fn start(rank: usize, world: usize, links: Vec<(usize, TcpStream)>) -> std::io::Result<Self> {
        let mut readers = Vec::with_capacity(links.len());
        for (r, s) in &links {
            s.set_read_timeout(None)?;
            s.set_nonblocking(false)?;
            readers.push((*r, s.try_clone()?));
        }
        let shared = Arc::new(Shared {
            rank,
            departed: Mutex::new(vec![None; world]),
            closing: AtomicBool::new(false),
            any: AtomicBool::new(false),
            links: Mutex::new(links),
        });
        for (r, s) in readers {
            let sh = shared.clone();
            std::thread::Builder::new()
                .name(format!("cf-watch-rank{r}"))
                .spawn(move || watch(&sh, r, s))?;
        }
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("cf-watch-heartbeat".into())
            .spawn(move || heartbeat(&sh))?;
        Ok(PeerWatch { shared })
    }

    /// Every rank that departed so far, in the order of their ranks.
    pub fn departed(&self) -> Vec<Departure> {
        self.shared
            .departed
            .lock()
            .map(|d| d.iter().flatten().cloned().collect())
            .unwrap_or_default()
    }

    /// The departure this process learnt of first, if any.
    pub fn first_departure(&self) -> Option<Departure> {
        if !self.shared.any.load(Ordering::SeqCst) {
            return None;
        }
        self.departed().into_iter().min_by_key(|d| d.at)
    }

    /// The first departure, once `grace` has passed since this process learnt of it: what a
    /// collective still waiting then fails with (the grace lets a collective its peers finished
    /// just before ending complete here too).
    pub fn departed_for(&self, grace: Duration) -> Option<Departure> {
        self.first_departure().filter(|d| d.at.elapsed() >= grace)
    }
}

/// Reads one connection until it closes: rank 0 reads a peer's goodbye; a peer reads rank 0's
/// news of others and its goodbye.
fn watch(shared: &Shared, from: usize, mut s: TcpStream) {
    let mut m = [0u8; 5];
    loop {
        let got = s.read_exact(&mut m);
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        let (rank, kind) = match got {
            Err(_) => (from, DepartureKind::Gone),
            Ok(()) => {
                let named = u32::from_le_bytes([m[1], m[2], m[3], m[4]]) as usize;
                match m[0] {
                    b'H' => continue,
                    b'B' => (from, DepartureKind::Left),
                    b'G' if from == 0 => (named, DepartureKind::Gone),
                    b'L' if from == 0 => (named, DepartureKind::Left),
                    _ => {
                        tracing::warn!("peer watch: rank {from} sent an unknown message {m:?}");
                        continue;
                    }
                }
            }
        };
        let news = shared.record(rank, kind);
        if news {
            match kind {
                DepartureKind::Gone => tracing::warn!("peer watch: rank {rank} is gone"),
                DepartureKind::Left => tracing::debug!("peer watch: rank {rank} left"),
            }
        }
        // Rank 0 passes the news on to the other peers.
        if news && shared.rank == 0 {
            let code = if kind == DepartureKind::Gone {
                b'G'
            } else {
                b'L'
            };
            if let Ok(mut links) = shared.links.lock() {
                for (r, l) in links.iter_mut() {
                    if *r != rank {
                        let _ = l.write_all(&message(code, rank));
                    }
                }
            }
        }
        if rank == from {
            // That connection is done.
            return;
        }
    }
}

/// Sends a heartbeat on every link every [`HEARTBEAT`] until the watch closes.
fn heartbeat(shared: &Shared) {
    let mut last = Instant::now();
    while !shared.closing.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
        if last.elapsed() < HEARTBEAT {
            continue;
        }
        last = Instant::now();
        if let Ok(mut links) = shared.links.lock() {
            for (_, l) in links.iter_mut() {
                let _ = l.write_all(&message(b'H', shared.rank));
            }
        }
    }
}

impl Drop for PeerWatch {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        if let Ok(mut links) = self.shared.links.lock() {
            for (_, l) in links.iter_mut() {
                let _ = l.write_all(&message(b'B', self.shared.rank));
                let _ = l.shutdown(Shutdown::Both);
            }
        }
    }
}

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
//! A rank that **aborted** the group (its own failure: its thread panicked, its plan did not
//! agree, it timed out) says so with its reason before its connections close, so that the
//! others fail naming the cause rather than a broken connection ([`PeerWatch::abort`]).
//!
//! Every link carries a heartbeat every [`HEARTBEAT`], so that a middlebox that reaps idle
//! connections does not close one under a long job (which would read as a rank gone).
//!
//! Wire format, after the rendezvous answer: messages of 5 bytes, a kind (`B`: goodbye from the
//! sender; `H`: heartbeat; `G`, `L`: from rank 0, the rank that follows is gone or left; `A`:
//! the rank that follows aborted the group, sent by that rank or passed on by rank 0) and a
//! rank `u32` (little endian); an `A` is followed by the reason's length `u32` and its UTF-8
//! bytes (at most [`MAX_REASON`]).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often each side of a link says it is there.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// The longest abort reason sent or accepted, in bytes (a longer one is cut).
pub const MAX_REASON: usize = 1 << 16;

/// The longest a write on a link (a heartbeat, news passed on, an abort) waits for a peer that
/// stopped reading: an abort is written from a panicking thread, which must not hang on it.
const WRITE_LIMIT: Duration = Duration::from_secs(2);

/// How a rank departed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DepartureKind {
    /// It closed its communicator (said goodbye).
    Left,
    /// Its connection closed without a goodbye: the process was killed or crashed.
    Gone,
    /// It aborted the group, saying why ([`Departure::reason`]).
    Aborted,
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
    /// Why it aborted ([`DepartureKind::Aborted`]; empty for the other kinds).
    pub reason: String,
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
            DepartureKind::Aborted => {
                write!(f, "rank {} aborted the group: {}", self.rank, self.reason)
            }
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
    /// Set once this process has told the others it aborted (it says so once).
    aborted: AtomicBool,
    /// Whether any rank departed (a cheap check for a polling loop).
    any: AtomicBool,
    /// Rank 0: the write ends to every peer (to pass departures on); a peer: to rank 0.
    links: Mutex<Vec<(usize, TcpStream)>>,
}

impl Shared {
    /// Records `rank`'s departure (the first one stands); true if it is news.
    fn record(&self, rank: usize, kind: DepartureKind, reason: String) -> bool {
        let Ok(mut d) = self.departed.lock() else {
            return false;
        };
        match d.get_mut(rank) {
            Some(slot @ None) if rank != self.rank => {
                *slot = Some(Departure {
                    rank,
                    kind,
                    at: Instant::now(),
                    reason,
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

/// The `A` message: `rank` aborted the group for `reason` (cut to [`MAX_REASON`] bytes at a
/// character boundary).
fn abort_message(rank: usize, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut m = message(b'A', rank).to_vec();
    m.extend_from_slice(&(end as u32).to_le_bytes());
    m.extend_from_slice(&reason.as_bytes()[..end]);
    m
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
            s.set_write_timeout(Some(WRITE_LIMIT))?;
            s.set_nonblocking(false)?;
            readers.push((*r, s.try_clone()?));
        }
        let shared = Arc::new(Shared {
            rank,
            departed: Mutex::new(vec![None; world]),
            closing: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
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

    /// Tells the other ranks that this one aborted the group for `reason` (its own failure),
    /// once; call it before the transport's own connections close, so that a rank that sees
    /// them close can learn why ([`PeerWatch::wait_for_departure`]). Best effort: a link
    /// that cannot take it is left alone.
    pub fn abort(&self, reason: &str) {
        if self.shared.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        let m = abort_message(self.shared.rank, reason);
        if let Ok(mut links) = self.shared.links.lock() {
            for (_, l) in links.iter_mut() {
                let _ = l.write_all(&m);
            }
        }
    }

    /// The first departure this process learnt of, waiting up to `wait` for one: for a
    /// transport whose connection with a rank just failed (or that failed without saying which
    /// rank), which the watch may learn of a moment later. The first is the cause; the
    /// departures after it are most likely what it caused (a rank that failed because of it).
    pub fn wait_for_departure(&self, wait: Duration) -> Option<Departure> {
        let until = Instant::now() + wait;
        loop {
            if let Some(d) = self.first_departure() {
                return Some(d);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The first departure, once `grace` has passed since this process learnt of it: what a
    /// collective still waiting then fails with (the grace lets a collective its peers finished
    /// just before ending complete here too).
    pub fn departed_for(&self, grace: Duration) -> Option<Departure> {
        self.first_departure().filter(|d| d.at.elapsed() >= grace)
    }
}

/// Reads one connection until it closes: rank 0 reads a peer's goodbye or abort; a peer reads
/// rank 0's news of others, its abort and its goodbye.
fn watch(shared: &Shared, from: usize, mut s: TcpStream) {
    let mut m = [0u8; 5];
    loop {
        let got = s.read_exact(&mut m);
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        let named = u32::from_le_bytes([m[1], m[2], m[3], m[4]]) as usize;
        let (rank, kind, reason) = match got {
            Err(_) => (from, DepartureKind::Gone, String::new()),
            Ok(()) => match m[0] {
                b'H' => continue,
                b'B' => (from, DepartureKind::Left, String::new()),
                b'G' if from == 0 => (named, DepartureKind::Gone, String::new()),
                b'L' if from == 0 => (named, DepartureKind::Left, String::new()),
                b'A' if from == 0 || named == from => match read_reason(&mut s) {
                    Some(reason) => (named, DepartureKind::Aborted, reason),
                    None => (from, DepartureKind::Gone, String::new()),
                },
                _ => {
                    tracing::warn!("peer watch: rank {from} sent an unknown message {m:?}");
                    continue;
                }
            },
        };
        let news = shared.record(rank, kind, reason.clone());
        if news {
            match kind {
                DepartureKind::Gone => tracing::warn!("peer watch: rank {rank} is gone"),
                DepartureKind::Aborted => {
                    tracing::warn!("peer watch: rank {rank} aborted the group: {reason}")
                }
                DepartureKind::Left => tracing::debug!("peer watch: rank {rank} left"),
            }
        }
        // Rank 0 passes the news on to the other peers.
        if news && shared.rank == 0 {
            let m = match kind {
                DepartureKind::Gone => message(b'G', rank).to_vec(),
                DepartureKind::Left => message(b'L', rank).to_vec(),
                DepartureKind::Aborted => abort_message(rank, &reason),
            };
            if let Ok(mut links) = shared.links.lock() {
                for (r, l) in links.iter_mut() {
                    if *r != rank {
                        let _ = l.write_all(&m);
                    }
                }
            }
        }
        if rank == from && kind != DepartureKind::Aborted {
            // That connection is done (an aborted rank's stays open until its process ends).
            return;
        }
    }
}

/// The reason after an `A` message, or `None` if the connection broke first (or it is longer
/// than any sender sends).
fn read_reason(s: &mut TcpStream) -> Option<String> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_REASON {
        return None;
    }
    let mut bytes = vec![0u8; len];
    s.read_exact(&mut bytes).ok()?;
    Some(String::from_utf8_lossy(&bytes).into_owned())
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

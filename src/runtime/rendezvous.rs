//! Multi-process rendezvous: rank 0 shares a few bytes (NCCL's 128-byte unique id) with every
//! other rank over TCP, at the address the usual environment names (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, as torchrun and most launchers set them).
//!
//! Rank 0 listens on `MASTER_ADDR:MASTER_PORT` and waits until every other rank has said hello
//! (its rank and the world size it was started with), then answers each with the payload. A
//! peer retries its connection until rank 0 is up. Everything is bounded by one deadline: a rank
//! that never shows up is an error on rank 0 naming it, and rank 0 tells the ranks that did
//! show up, so they fail with the same error rather than wait; a rank 0 that never shows up is
//! an error on each peer naming the address it tried. Hellos are checked: a wrong world size,
//! a rank out of range or a rank started twice fail the rendezvous with their own error. Rank 0
//! reads each connection's hello on a thread of its own, within a few seconds, so a stray
//! connection that sends nothing, trickles or sends garbage is logged and dropped without
//! holding up the real ranks.
//!
//! **Token.** With `CF_RENDEZVOUS_TOKEN` set (the same on every rank of a job), a hello carries
//! a 64-bit tag of it, and rank 0 refuses (logs, answers with the reason, and goes on waiting
//! for the real ranks) a hello whose tag is not its own: another job's rank that reached this
//! job's `MASTER_PORT` is turned away instead of joining or failing the group; a rank still
//! missing at the deadline is reported with the refusals. The tag guards against mixed-up
//! jobs, not against an attacker: it crosses the network in the clear.
//!
//! Wire format (little endian): hello = `b"CFRV"`, version `u8`, rank `u32`, world `u32`, token
//! tag `u64` (0: no token); answer = status `u8` (0: ok, 1: error), length `u32`, that many
//! bytes (payload, or message).

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

pub use super::peer_watch::PeerWatch;

const MAGIC: &[u8; 4] = b"CFRV";
const VERSION: u8 = 2;
/// Bytes of a hello.
const HELLO_LEN: usize = 21;
/// Largest payload accepted (a guard against a stray connection's garbage).
const MAX_PAYLOAD: u32 = 1 << 20;

/// Where and as whom this process joins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// This process's rank.
    pub rank: usize,
    /// Ranks in all.
    pub world: usize,
    /// Rank on this node (which GPU to use).
    pub local_rank: usize,
    /// Rank 0's host.
    pub addr: String,
    /// Rank 0's port.
    pub port: u16,
    /// Bound on the whole rendezvous.
    pub timeout: Duration,
    /// A secret every rank of the job shares (`CF_RENDEZVOUS_TOKEN`); a hello without it is
    /// refused.
    pub token: Option<String>,
}

/// Why a rendezvous failed.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// An environment variable is missing or malformed.
    #[error("rendezvous: environment variable {var} {why}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The configuration contradicts itself.
    #[error("rendezvous: {0}")]
    Config(String),
    /// Rank 0 waited for ranks that never said hello.
    #[error(
        "rendezvous: rank(s) {missing:?} of {world} never joined at {addr} within {waited:?} (joined: {joined:?}){}",
        refused_note(.refused)
    )]
    Missing {
        /// Ranks that did not join.
        missing: Vec<usize>,
        /// Ranks that did, rank 0 included.
        joined: Vec<usize>,
        /// World size.
        world: usize,
        /// Rank 0's address.
        addr: String,
        /// How long rank 0 waited.
        waited: Duration,
        /// The connections rank 0 refused meanwhile, and why.
        refused: Vec<String>,
    },
    /// A peer could not reach rank 0.
    #[error("rendezvous: rank {rank} could not reach rank 0 at {addr} within {waited:?}: {last}")]
    Unreachable {
        /// This rank.
        rank: usize,
        /// Rank 0's address.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last connection error.
        last: String,
    },
    /// A hello or an answer was not what the protocol says.
    #[error("rendezvous: {0}")]
    Protocol(String),
    /// Rank 0 refused the rendezvous and said why (the ranks that joined all see this).
    #[error("rendezvous: rank 0 reports: {0}")]
    Remote(String),
    /// An I/O error other than the ones above.
    #[error("rendezvous: {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
}

fn refused_note(refused: &[String]) -> String {
    if refused.is_empty() {
        String::new()
    } else {
        format!("; refused meanwhile: {}", refused.join("; "))
    }
}

/// The tag of a token a hello carries (0: none).
pub(crate) fn token_tag(token: Option<&str>) -> u64 {
    use std::hash::Hasher;
    let Some(t) = token else { return 0 };
    let mut h = crate::graph::Fnv64::default();
    h.write(b"collective-fusion rendezvous token\0");
    h.write(t.as_bytes());
    h.finish().max(1)
}

fn env_var(var: &'static str) -> Result<String, RendezvousError> {
    std::env::var(var).map_err(|_| RendezvousError::Env {
        var,
        why: "is not set".into(),
    })
}

fn env_num<T: std::str::FromStr>(var: &'static str) -> Result<T, RendezvousError> {
    let v = env_var(var)?;
    v.trim().parse().map_err(|_| RendezvousError::Env {
        var,
        why: format!("is {v:?}, not a number of the expected range"),
    })
}

impl RendezvousConfig {
    /// Rank `rank` of a `world`-rank group on this machine (rank 0 on `127.0.0.1:port`, the
    /// local rank the rank, no token), each start-up step bounded by `timeout`.
    pub fn loopback(rank: usize, world: usize, port: u16, timeout: Duration) -> Self {
        RendezvousConfig {
            rank,
            world,
            local_rank: rank,
            addr: "127.0.0.1".into(),
            port,
            timeout,
            token: None,
        }
    }

    /// Reads `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` and `LOCAL_RANK` (default: the
    /// rank); the timeout is `CF_RENDEZVOUS_TIMEOUT_MS` or `default_timeout`; the token
    /// `CF_RENDEZVOUS_TOKEN` (unset or empty: none).
    pub fn from_env(default_timeout: Duration) -> Result<Self, RendezvousError> {
        let rank: usize = env_num("RANK")?;
        let local_rank = match std::env::var("LOCAL_RANK") {
            Ok(_) => env_num("LOCAL_RANK")?,
            Err(_) => rank,
        };
        let timeout = match std::env::var("CF_RENDEZVOUS_TIMEOUT_MS") {
            Ok(_) => Duration::from_millis(env_num("CF_RENDEZVOUS_TIMEOUT_MS")?),
            Err(_) => default_timeout,
        };
        let cfg = RendezvousConfig {
            rank,
            world: env_num("WORLD_SIZE")?,
            local_rank,
            addr: env_var("MASTER_ADDR")?,
            port: env_num("MASTER_PORT")?,
            timeout,
            token: std::env::var("CF_RENDEZVOUS_TOKEN")
                .ok()
                .filter(|t| !t.is_empty()),
        };
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), RendezvousError> {
        if self.world == 0 || self.rank >= self.world {
            return Err(RendezvousError::Config(format!(
                "rank {} is not in a world of {} rank(s)",
                self.rank, self.world
            )));
        }
        Ok(())
    }

    fn target(&self) -> String {
        format!("{}:{}", self.addr, self.port)
    }

    fn resolve(&self) -> Result<Vec<SocketAddr>, RendezvousError> {
        let addrs: Vec<SocketAddr> = self
            .target()
            .to_socket_addrs()
            .map_err(|e| RendezvousError::Io {
                what: format!("resolving MASTER_ADDR {}", self.target()),
                source: e,
            })?
            .collect();
        if addrs.is_empty() {
            return Err(RendezvousError::Config(format!(
                "MASTER_ADDR {} resolves to no address",
                self.target()
            )));
        }
        Ok(addrs)
    }
}

/// Joins the rendezvous `cfg` describes. Rank 0 calls `payload` once and shares its bytes;
/// every rank returns them.
pub fn rendezvous(
    cfg: &RendezvousConfig,
    payload: impl FnOnce() -> Vec<u8>,
) -> Result<Vec<u8>, RendezvousError> {
    cfg.check()?;
    if cfg.rank == 0 {
        serve(cfg, payload()).map(|(p, _)| p)
    } else {
        join(cfg).map(|(p, _)| p)
    }
}

/// [`rendezvous`], keeping its connections open afterwards as a [`PeerWatch`]: which ranks
/// are still there, for a transport that cannot tell which rank failed (NCCL).
pub fn rendezvous_watched(
    cfg: &RendezvousConfig,
    payload: impl FnOnce() -> Vec<u8>,
) -> Result<(Vec<u8>, PeerWatch), RendezvousError> {
    cfg.check()?;
    let watching = io("keeping the rendezvous connections as a peer watch");
    if cfg.rank == 0 {
        let (p, peers) = serve(cfg, payload())?;
        let peers = peers
            .into_iter()
            .enumerate()
            .filter_map(|(r, s)| s.map(|s| (r, s)))
            .collect();
        Ok((p, PeerWatch::rank_zero(cfg.world, peers).map_err(watching)?))
    } else {
        let (p, s) = join(cfg)?;
        Ok((
            p,
            PeerWatch::peer(cfg.rank, cfg.world, s).map_err(watching)?,
        ))
    }
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RendezvousError {
    let what = what.into();
    move |source| RendezvousError::Io { what, source }
}

fn answer(stream: &mut TcpStream, ok: bool, bytes: &[u8]) -> std::io::Result<()> {
    let mut msg = Vec::with_capacity(5 + bytes.len());
    msg.push(u8::from(!ok));
    msg.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    msg.extend_from_slice(bytes);
    stream.write_all(&msg)?;
    stream.flush()
}

/// How long a connection may take to send its hello: real ranks send it as soon as they are
/// connected, so this only bounds a stray connection's stay.
const HELLO_WAIT: Duration = Duration::from_secs(5);

/// Rank 0's reader of hellos on a listening socket: each accepted connection's first `N`
/// bytes are read on a thread of its own (within [`HELLO_WAIT`] or the deadline), so a
/// connection that sends nothing, trickles bytes or sends garbage holds no real rank up; such
/// a connection is logged and dropped.
pub(crate) struct HelloReader<const N: usize> {
    tx: std::sync::mpsc::Sender<(TcpStream, SocketAddr, std::io::Result<[u8; N]>)>,
    rx: std::sync::mpsc::Receiver<(TcpStream, SocketAddr, std::io::Result<[u8; N]>)>,
    what: &'static str,
}

impl<const N: usize> HelloReader<N> {
    /// A reader for `what` (`rendezvous`, `data port`), for log lines.
    pub(crate) fn new(what: &'static str) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        HelloReader { tx, rx, what }
    }

    /// Accepts what is waiting on `listener` (non-blocking), and returns a connection whose
    /// `N`-byte hello arrived, if one did within a few milliseconds.
    pub(crate) fn poll(
        &self,
        listener: &TcpListener,
        deadline: Instant,
    ) -> std::io::Result<Option<(TcpStream, [u8; N])>> {
        loop {
            match listener.accept() {
                Ok((mut s, addr)) => {
                    let tx = self.tx.clone();
                    let wait = deadline
                        .saturating_duration_since(Instant::now())
                        .min(HELLO_WAIT)
                        .max(Duration::from_millis(1));
                    std::thread::spawn(move || {
                        let mut h = [0u8; N];
                        let r = s
                            .set_nonblocking(false)
                            .and_then(|_| s.set_read_timeout(Some(wait)))
                            .and_then(|_| s.read_exact(&mut h))
                            .map(|_| h);
                        let _ = tx.send((s, addr, r));
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        match self.rx.recv_timeout(Duration::from_millis(2)) {
            Ok((s, _, Ok(h))) => Ok(Some((s, h))),
            Ok((_, addr, Err(e))) => {
                tracing::warn!(
                    "{}: ignoring a connection from {addr} that sent no hello: {e}",
                    self.what
                );
                Ok(None)
            }
            Err(_) => Ok(None),
        }
    }
}

/// Rank 0: accept every peer's hello, then answer all. Returns the payload and the peers'
/// connections (by rank; none for rank 0).
#[allow(clippy::type_complexity)]
fn serve(
    cfg: &RendezvousConfig,
    payload: Vec<u8>,
) -> Result<(Vec<u8>, Vec<Option<TcpStream>>), RendezvousError> {
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let addrs = cfg.resolve()?;
    let listener = TcpListener::bind(&addrs[..]).map_err(io(format!(
        "rank 0 listening on {} (MASTER_ADDR:MASTER_PORT)",
        cfg.target()
    )))?;
    listener
        .set_nonblocking(true)
        .map_err(io("configuring the listener"))?;
    let mut peers: Vec<Option<TcpStream>> = (0..cfg.world).map(|_| None).collect();
    let mut joined = 1;
    let hellos = HelloReader::<HELLO_LEN>::new("rendezvous");
    let tag = token_tag(cfg.token.as_deref());
    let mut refused: Vec<String> = Vec::new();
    let fail_all = |peers: &mut Vec<Option<TcpStream>>, err: RendezvousError| {
        let msg = err.to_string();
        for s in peers.iter_mut().flatten() {
            let _ = answer(s, false, msg.as_bytes());
        }
        Err(err)
    };
    while joined < cfg.world {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (1..cfg.world).filter(|r| peers[*r].is_none()).collect();
            let joined = (0..cfg.world)
                .filter(|r| *r == 0 || peers[*r].is_some())
                .collect();
            let err = RendezvousError::Missing {
                missing,
                joined,
                world: cfg.world,
                addr: cfg.target(),
                waited: now - start,
                refused,
            };
            return fail_all(&mut peers, err);
        }
        let (mut stream, h) = match hellos.poll(&listener, deadline) {
            Ok(Some(x)) => x,
            Ok(None) => continue,
            Err(e) => return fail_all(&mut peers, io("accepting a peer")(e)),
        };
        if &h[..4] != MAGIC || h[4] != VERSION {
            tracing::warn!("rendezvous: ignoring a connection whose hello is not ours");
            let _ = answer(
                &mut stream,
                false,
                b"not a collective-fusion rendezvous hello",
            );
            continue;
        }
        let rank = u32::from_le_bytes([h[5], h[6], h[7], h[8]]) as usize;
        let world = u32::from_le_bytes([h[9], h[10], h[11], h[12]]) as usize;
        let theirs = u64::from_le_bytes([h[13], h[14], h[15], h[16], h[17], h[18], h[19], h[20]]);
        if theirs != tag {
            let why = match (theirs, tag) {
                (0, _) => "without the rendezvous token (CF_RENDEZVOUS_TOKEN) rank 0 has",
                (_, 0) => "with a rendezvous token (CF_RENDEZVOUS_TOKEN), which rank 0 has not",
                _ => "with a rendezvous token (CF_RENDEZVOUS_TOKEN) other than rank 0's",
            };
            let peer = stream
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            let msg = format!("a hello from {peer} as rank {rank} {why}");
            tracing::warn!("rendezvous: refusing {msg}");
            let _ = answer(&mut stream, false, format!("refused {msg}").as_bytes());
            refused.push(msg);
            continue;
        }
        let bad = if world != cfg.world {
            Some(format!(
                "rank {rank} was started with WORLD_SIZE={world}, rank 0 with WORLD_SIZE={}",
                cfg.world
            ))
        } else if rank == 0 || rank >= cfg.world {
            Some(format!(
                "a peer says it is rank {rank}, which is not a peer rank of a world of {}",
                cfg.world
            ))
        } else if peers[rank].is_some() {
            Some(format!(
                "rank {rank} joined twice (two processes with RANK={rank})"
            ))
        } else {
            None
        };
        if let Some(why) = bad {
            let _ = answer(&mut stream, false, why.as_bytes());
            return fail_all(&mut peers, RendezvousError::Protocol(why));
        }
        peers[rank] = Some(stream);
        joined += 1;
    }
    for (r, s) in peers.iter_mut().enumerate() {
        if let Some(s) = s {
            answer(s, true, &payload).map_err(io(format!("answering rank {r}")))?;
        }
    }
    Ok((payload, peers))
}

/// A peer: connect (retrying until rank 0 listens), say hello, read the answer. Returns the
/// payload and the connection to rank 0.
fn join(cfg: &RendezvousConfig) -> Result<(Vec<u8>, TcpStream), RendezvousError> {
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let addrs = cfg.resolve()?;
    let mut last = String::from("no attempt");
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(RendezvousError::Unreachable {
                rank: cfg.rank,
                addr: cfg.target(),
                waited: start.elapsed(),
                last,
            });
        }
        match TcpStream::connect_timeout(&addrs[0], left.min(Duration::from_secs(1))) {
            Ok(s) => break s,
            Err(e) => {
                last = e.to_string();
                std::thread::sleep(Duration::from_millis(20).min(left));
            }
        }
    };
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(cfg.world as u32).to_le_bytes());
    hello.extend_from_slice(&token_tag(cfg.token.as_deref()).to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(io(format!("rank {} saying hello to rank 0", cfg.rank)))?;
    // Rank 0 answers once every rank joined, or when its deadline passed; allow it a moment
    // past ours to say which.
    let left = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(1);
    stream
        .set_read_timeout(Some(left))
        .map_err(io("configuring the connection"))?;
    let mut head = [0u8; 5];
    stream.read_exact(&mut head).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => RendezvousError::Protocol(format!(
            "rank {} joined rank 0 at {} but got no answer within {:?}",
            cfg.rank,
            cfg.target(),
            start.elapsed()
        )),
        _ => io(format!("rank {} reading rank 0's answer", cfg.rank))(e),
    })?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    if len > MAX_PAYLOAD {
        return Err(RendezvousError::Protocol(format!(
            "rank 0 announced {len} bytes, more than {MAX_PAYLOAD}"
        )));
    }
    let mut body = vec![0u8; len as usize];
    stream
        .read_exact(&mut body)
        .map_err(io(format!("rank {} reading rank 0's answer", cfg.rank)))?;
    match head[0] {
        0 => Ok((body, stream)),
        _ => Err(RendezvousError::Remote(
            String::from_utf8_lossy(&body).into_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(29500)
    }

    fn cfg(rank: usize, world: usize, port: u16, ms: u64) -> RendezvousConfig {
        RendezvousConfig::loopback(rank, world, port, Duration::from_millis(ms))
    }

    #[test]
    fn threads_share_rank_zeros_bytes() {
        let port = free_port();
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|r| s.spawn(move || rendezvous(&cfg(r, 4, port, 10_000), || vec![7u8; 128])))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for o in out {
            assert_eq!(o.unwrap(), vec![7u8; 128]);
        }
    }

    /// Waits (bounded) until `watch` knows of `n` departures.
    fn departures(watch: &PeerWatch, n: usize) -> Vec<super::super::peer_watch::Departure> {
        let t0 = Instant::now();
        loop {
            let d = watch.departed();
            if d.len() >= n || t0.elapsed() > Duration::from_secs(10) {
                return d;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The rendezvous connections as a peer watch: a rank whose connection closes without a
    /// goodbye (as when its process is killed) is `Gone` on rank 0 and, through rank 0, on
    /// the other peers; a rank that drops its watch has `Left`; nobody lists itself.
    #[test]
    fn the_peer_watch_tells_a_killed_rank_from_one_that_left() {
        use super::super::peer_watch::DepartureKind::{Gone, Left};
        let port = free_port();
        let (w0, w1) = std::thread::scope(|s| {
            let z = s.spawn(|| rendezvous_watched(&cfg(0, 3, port, 10_000), || vec![1, 2, 3]));
            let one = s.spawn(|| rendezvous_watched(&cfg(1, 3, port, 10_000), Vec::new));
            // Rank 2 joins by hand and then closes its connection without a goodbye.
            let two = s.spawn(|| join(&cfg(2, 3, port, 10_000)));
            let (p2, conn2) = two.join().unwrap().unwrap();
            assert_eq!(p2, vec![1, 2, 3]);
            let w0 = z.join().unwrap().unwrap().1;
            let w1 = one.join().unwrap().unwrap();
            assert_eq!(w1.0, vec![1, 2, 3]);
            assert!(w0.departed().is_empty() && w1.1.departed().is_empty());
            drop(conn2);
            (w0, w1.1)
        });
        for w in [&w0, &w1] {
            let d = departures(w, 1);
            assert_eq!(d.len(), 1, "{d:?}");
            assert_eq!((d[0].rank, d[0].kind), (2, Gone));
            assert!(
                d[0].to_string().contains("rank 2's process is gone"),
                "{}",
                d[0]
            );
        }
        drop(w1);
        let d = departures(&w0, 2);
        assert_eq!(
            d.iter().map(|d| (d.rank, d.kind)).collect::<Vec<_>>(),
            [(1, Left), (2, Gone)]
        );
        assert_eq!(w0.first_departure().map(|d| d.rank), Some(2));
        assert!(w0.departed_for(Duration::ZERO).is_some());
        assert!(w0.departed_for(Duration::from_secs(3600)).is_none());
    }

    /// A rank that aborts tells every other why: rank 0 hears it from the peer, and the other
    /// peer from rank 0; its process ending afterwards changes nothing (the first departure
    /// stands), and an abort of rank 0 reaches the peers too. A second abort says nothing.
    #[test]
    fn an_aborting_rank_tells_every_other_why() {
        use super::super::peer_watch::DepartureKind::Aborted;
        let port = free_port();
        let mut w: Vec<PeerWatch> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| s.spawn(move || rendezvous_watched(&cfg(r, 3, port, 10_000), Vec::new)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap().unwrap().1)
                .collect()
        });
        w[1].abort("its thread panicked at src/x.rs:1:2: boom");
        w[1].abort("a second reason");
        for r in [0, 2] {
            let d = departures(&w[r], 1);
            assert_eq!(d.len(), 1, "rank {r}: {d:?}");
            assert_eq!((d[0].rank, d[0].kind), (1, Aborted), "rank {r}");
            assert_eq!(
                d[0].to_string(),
                "rank 1 aborted the group: its thread panicked at src/x.rs:1:2: boom"
            );
            assert_eq!(
                w[r].wait_for_departure(Duration::ZERO).map(|d| d.rank),
                Some(1)
            );
        }
        drop(w.remove(1));
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(w[0].departed()[0].kind, Aborted);
        w[0].abort("rank 0's own failure");
        let d = departures(&w[1], 2);
        assert_eq!(
            d.iter().map(|d| (d.rank, d.kind)).collect::<Vec<_>>(),
            [(0, Aborted), (1, Aborted)],
            "rank 2"
        );
        assert_eq!(d[0].reason, "rank 0's own failure");
    }

    /// Heartbeats are no news; the connection closing after them is.
    #[test]
    fn heartbeats_keep_a_rank_present() {
        use super::super::peer_watch::DepartureKind::Gone;
        let port = free_port();
        let (w0, mut conn1) = std::thread::scope(|s| {
            let z = s.spawn(|| rendezvous_watched(&cfg(0, 2, port, 10_000), Vec::new));
            let one = s.spawn(|| join(&cfg(1, 2, port, 10_000)));
            (z.join().unwrap().unwrap().1, one.join().unwrap().unwrap().1)
        });
        for _ in 0..3 {
            conn1.write_all(&[b'H', 1, 0, 0, 0]).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        assert!(w0.departed().is_empty(), "{:?}", w0.departed());
        drop(conn1);
        let d = departures(&w0, 1);
        assert_eq!(
            d.iter().map(|d| (d.rank, d.kind)).collect::<Vec<_>>(),
            [(1, Gone)]
        );
    }

    /// Rank 0 leaving (its watch dropped) is `Left` on a peer, not `Gone`.
    #[test]
    fn rank_zero_closing_its_watch_is_a_goodbye() {
        use super::super::peer_watch::DepartureKind::Left;
        let port = free_port();
        let (w0, w1) = std::thread::scope(|s| {
            let z = s.spawn(|| rendezvous_watched(&cfg(0, 2, port, 10_000), Vec::new));
            let one = s.spawn(|| rendezvous_watched(&cfg(1, 2, port, 10_000), Vec::new));
            (z.join().unwrap().unwrap().1, one.join().unwrap().unwrap().1)
        });
        drop(w0);
        let d = departures(&w1, 1);
        assert_eq!(
            d.iter().map(|d| (d.rank, d.kind)).collect::<Vec<_>>(),
            [(0, Left)]
        );
    }

    /// A connection to rank 0 that retries until it listens.
    fn stray(port: u16) -> TcpStream {
        loop {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", port)) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Connections that are not ranks reach rank 0 before the real peers: one silent, one
    /// with garbage for a hello, one trickling a byte at a time. Start-up still succeeds, well
    /// within the deadline, and none of them is taken for a rank.
    #[test]
    fn stray_connections_before_the_peers_do_not_hold_up_start_up() {
        let port = free_port();
        let t0 = Instant::now();
        let out: Vec<_> = std::thread::scope(|s| {
            let root = s.spawn(move || rendezvous(&cfg(0, 3, port, 20_000), || vec![9u8; 16]));
            let silent = stray(port);
            let mut garbage = stray(port);
            garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            let mut trickle = stray(port);
            s.spawn(move || {
                for b in b"CFRV" {
                    if trickle.write_all(&[*b]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(400));
                }
            });
            std::thread::sleep(Duration::from_millis(100));
            let peers: Vec<_> = (1..3)
                .map(|r| s.spawn(move || rendezvous(&cfg(r, 3, port, 20_000), Vec::new)))
                .collect();
            let mut out = vec![root.join().unwrap()];
            out.extend(peers.into_iter().map(|h| h.join().unwrap()));
            drop(silent);
            out
        });
        for (r, o) in out.into_iter().enumerate() {
            assert_eq!(o.expect("start-up succeeds"), vec![9u8; 16], "rank {r}");
        }
        // Not a speed claim: before, the silent connection held rank 0 until the deadline
        // (20 s) and the real peers were reported missing.
        assert!(
            t0.elapsed() < Duration::from_secs(12),
            "the stray connections held start-up for {:?}",
            t0.elapsed()
        );
    }

    #[test]
    fn a_wrong_world_size_fails_both_sides() {
        let port = free_port();
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(move || rendezvous(&cfg(0, 2, port, 5_000), || vec![1]));
            let b = s.spawn(move || rendezvous(&cfg(1, 3, port, 5_000), Vec::new));
            (a.join().unwrap(), b.join().unwrap())
        });
        let a = a.unwrap_err().to_string();
        let b = b.unwrap_err().to_string();
        assert!(
            a.contains("WORLD_SIZE=3") && a.contains("WORLD_SIZE=2"),
            "{a}"
        );
        assert!(b.contains("WORLD_SIZE=3"), "{b}");
    }

    /// With a token: a hello of another job (another token, or none) is refused and told why,
    /// and the ranks that carry the token still start; a rank with the wrong token that never
    /// joins is reported missing with the refusal.
    #[test]
    fn a_hello_without_the_token_is_refused_and_the_real_ranks_start() {
        let port = free_port();
        let with = |r, t: Option<&str>, ms| RendezvousConfig {
            token: t.map(str::to_string),
            ..cfg(r, 3, port, ms)
        };
        let (root, peers, intruders) = std::thread::scope(|s| {
            let root = s.spawn(move || rendezvous(&with(0, Some("job-a"), 20_000), || vec![5u8]));
            // The intruders first (each retries until rank 0 listens).
            let intruders: Vec<_> = [Some("job-b"), None]
                .into_iter()
                .map(|t| s.spawn(move || rendezvous(&with(1, t, 20_000), Vec::new)))
                .collect();
            let intruders: Vec<_> = intruders.into_iter().map(|h| h.join().unwrap()).collect();
            let peers: Vec<_> = (1..3)
                .map(|r| s.spawn(move || rendezvous(&with(r, Some("job-a"), 20_000), Vec::new)))
                .collect();
            let peers: Vec<_> = peers.into_iter().map(|h| h.join().unwrap()).collect();
            (root.join().unwrap(), peers, intruders)
        });
        assert_eq!(root.expect("rank 0 starts"), vec![5u8]);
        for p in peers {
            assert_eq!(p.expect("the peers start"), vec![5u8]);
        }
        let msgs: Vec<String> = intruders
            .into_iter()
            .map(|i| i.expect_err("refused").to_string())
            .collect();
        assert!(msgs[0].contains("other than rank 0's"), "{}", msgs[0]);
        assert!(
            msgs[1].contains("without the rendezvous token"),
            "{}",
            msgs[1]
        );

        // Rank 1 has the wrong token and nobody else comes: missing, with the refusal.
        let port = free_port();
        let with = |r, t: &str, ms| RendezvousConfig {
            token: Some(t.to_string()),
            ..cfg(r, 2, port, ms)
        };
        let (root, one) = std::thread::scope(|s| {
            let root = s.spawn(move || rendezvous(&with(0, "a", 1_500), || vec![1]));
            let one = s.spawn(move || rendezvous(&with(1, "b", 1_500), Vec::new));
            (root.join().unwrap(), one.join().unwrap())
        });
        let root = root.unwrap_err().to_string();
        assert!(
            root.contains("[1] of 2 never joined") && root.contains("refused meanwhile"),
            "{root}"
        );
        assert!(one.is_err());
    }

    #[test]
    fn a_rank_outside_the_world_is_refused_before_connecting() {
        let e = rendezvous(&cfg(3, 2, 1, 100), Vec::new).unwrap_err();
        assert!(
            e.to_string().contains("rank 3 is not in a world of 2"),
            "{e}"
        );
    }
}

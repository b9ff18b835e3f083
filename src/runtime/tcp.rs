//! The TCP communicator: one rank per process, host buffers over TCP, for data-parallel runs
//! across processes and machines without GPUs (and the CPU stand-in for NCCL in multi-process
//! tests). Start-up goes through the [`rendezvous`](super::rendezvous): rank 0 opens a data port
//! and shares its number, every other rank connects to it and says which rank it is.
//!
//! Topology: a star through rank 0. Each collective, every peer sends its buffer to rank 0,
//! which reduces all of them with the in-process group's arithmetic (every element summed in
//! rank order, each contribution divided by the group size first for a mean) and sends the
//! result back. The results are therefore bitwise those of the in-process communicator and
//! independent of timing. Rank 0 moves `2·(world − 1)` buffers per collective, so this suits a
//! few processes; it is not a ring.
//!
//! Every rank runs its collectives in the order they were enqueued, on its own communication
//! thread (its stream). Nothing waits unbounded: rank 0 waits for each peer's buffer until the
//! timeout (a peer that never sends is [`CommError::Timeout`] naming it), a peer waits for the
//! answer twice that, and a disagreement between ranks (collective, op, dtype, count) fails
//! every rank with [`CommError::Mismatch`] on rank 0 and the same message on the peers. A failed
//! or aborted rank shuts its connections, so the others fail at once instead of waiting. The
//! rendezvous connections stay open as a [`PeerWatch`]: a rank that aborts the group for its
//! own failure (its thread panicked) tells the others why over it before its connections shut,
//! and a rank whose connection with another fails reports what the watch knows of that rank
//! (aborted, with its reason; its process gone; left) rather than the socket's error alone.
//!
//! Wire format (little endian). Peer hello: `b"CFTH"`, rank `u32`, world `u32`, the
//! rendezvous token's tag `u64` (a connection whose hello is not a peer's of this group is
//! logged and ignored). Per
//! collective, peer → rank 0: `b"CFTC"`, collective `u32`, op `u8`, dtype `u8`, two zero bytes,
//! count `u64`, bucket `u32` (`u32::MAX`: none), then the buffer's bytes (op and dtype as
//! `ReduceOp::code` and `DType::code`); rank 0 → peer: status
//! `u8` (0: ok, then nanoseconds since the last rank joined `u64` and the result's bytes; 1:
//! failed, then a `u32` length and the message);
//! peer → rank 0: acknowledgement `u8` 0 once the result is staged; rank 0 → peer, once every
//! peer has acknowledged: commit `u8` 0 (or a failure as above). A peer hands its result to the
//! caller only on the commit, so a peer lost before acknowledging fails the collective on every
//! rank rather than on some (see `run_root`).
//!
//! Every read and write of a collective ends by its deadline however the bytes arrive (a peer
//! that trickles its buffer a byte at a time is a timeout naming it, not a wait of one socket
//! timeout per byte).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::buffer::HostBuffer;
use super::comm::{CollectiveDesc, CommError, CommSpan, Job, thread_cpu_us};
use super::comm_thread::{CommThread, GroupState, QueuedComm};
use super::peer_watch::PeerWatch;
use super::rendezvous::{RendezvousConfig, RendezvousError, rendezvous_watched};
use crate::graph::{DType, ReduceOp};

const HELLO: &[u8; 4] = b"CFTH";
const CALL: &[u8; 4] = b"CFTC";
const HEADER: usize = 24;

/// Largest failure message accepted from rank 0.
const MAX_MESSAGE: u32 = 1 << 16;

fn header(what: &CollectiveDesc) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(CALL);
    h[4..8].copy_from_slice(&what.collective.to_le_bytes());
    h[8] = what.op.code();
    h[9] = what.dtype.code();
    h[12..20].copy_from_slice(&what.count.to_le_bytes());
    h[20..24].copy_from_slice(&what.bucket.unwrap_or(u32::MAX).to_le_bytes());
    h
}

fn parse_header(h: &[u8; HEADER]) -> Option<CollectiveDesc> {
    if &h[..4] != CALL {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let bucket = u32_at(20);
    Some(CollectiveDesc {
        collective: u32_at(4),
        bucket: (bucket != u32::MAX).then_some(bucket),
        op: ReduceOp::from_code(h[8])?,
        dtype: DType::from_code(h[9])?,
        count: u64::from_le_bytes(h[12..20].try_into().ok()?),
        params: Vec::new(),
    })
}

fn same_call(a: &CollectiveDesc, b: &CollectiveDesc) -> bool {
    a.collective == b.collective && a.op == b.op && a.dtype == b.dtype && a.count == b.count
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Time left before `deadline`, or a `TimedOut` error once it has passed.
fn left(deadline: Instant) -> std::io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(std::io::Error::new(
            ErrorKind::TimedOut,
            "the deadline passed",
        ))
    } else {
        Ok(left)
    }
}

/// `read_exact` that ends by `deadline` however the bytes arrive: a socket timeout bounds one
/// `read`, so a peer that trickles a byte at a time would otherwise hold the call for as many
/// timeouts as the buffer has bytes.
fn read_by(s: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.set_read_timeout(Some(left(deadline)?))?;
        match s.read(buf) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` that ends by `deadline`, however slowly the other side reads.
fn write_by(s: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.set_write_timeout(Some(left(deadline)?))?;
        match s.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What a TCP rank's handle and its thread share: the first failure, and the connections.
pub struct TcpShared {
    rank: usize,
    /// The first failure; every later collective fails with it.
    aborted: Mutex<Option<String>>,
    /// Clones of the connections, to shut them on abort.
    streams: Vec<TcpStream>,
    /// The rendezvous connections: which rank departed or aborted, and why.
    watch: PeerWatch,
}

impl TcpShared {
    fn abort(&self, reason: String) {
        let mut a = self.aborted.lock().unwrap_or_else(|e| e.into_inner());
        if a.is_none() {
            *a = Some(reason);
        }
        drop(a);
        for s in &self.streams {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn aborted(&self) -> Option<String> {
        self.aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Why the connection with rank `peer` failed with `e`: this rank's own abort, else the
    /// first departure the peer watch learnt of (waiting a moment for one: an aborting rank
    /// tells the watch before its connections shut, but the two connections race), else the
    /// socket's error.
    fn why_lost(&self, peer: usize, e: &std::io::Error) -> String {
        self.aborted()
            .or_else(|| {
                self.watch
                    .wait_for_departure(Duration::from_millis(200))
                    .map(|d| d.to_string())
            })
            .unwrap_or_else(|| format!("the connection with rank {peer} failed: {e}"))
    }
}

enum Links {
    /// Rank 0: the stream of rank `r` at `r - 1`.
    Root(Vec<TcpStream>),
    /// Any other rank: its stream to rank 0.
    Peer(TcpStream),
}

/// One rank of a TCP group (one per process).
pub type TcpComm = QueuedComm<TcpShared>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RendezvousError {
    let what = what.into();
    move |source| RendezvousError::Io { what, source }
}

impl QueuedComm<TcpShared> {
    /// Joins the group `cfg` describes (the rendezvous, then the data connections), each step
    /// bounded by `cfg.timeout`; `timeout` then bounds every collective.
    pub fn connect(cfg: &RendezvousConfig, timeout: Duration) -> Result<Self, RendezvousError> {
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let (links, watch) = if cfg.rank == 0 {
            // The data port: the host rank 0 listens on for the rendezvous, any free port.
            let host = format!("{}:0", cfg.addr);
            let listener = TcpListener::bind(&host).map_err(io(format!(
                "rank 0 opening the data port on {} (MASTER_ADDR)",
                cfg.addr
            )))?;
            let port = listener
                .local_addr()
                .map_err(io("reading the data port"))?
                .port();
            let (_, watch) = rendezvous_watched(cfg, || port.to_le_bytes().to_vec())?;
            (
                Links::Root(accept_peers(cfg, &listener, start, deadline)?),
                watch,
            )
        } else {
            let (payload, watch) = rendezvous_watched(cfg, Vec::new)?;
            let port = match payload[..] {
                [a, b] => u16::from_le_bytes([a, b]),
                _ => {
                    return Err(RendezvousError::Protocol(format!(
                        "rank 0 shared {} bytes, not a data port (is it a TCP group?)",
                        payload.len()
                    )));
                }
            };
            (Links::Peer(connect_root(cfg, port, deadline)?), watch)
        };
        let streams = match &links {
            Links::Root(peers) => peers.iter().map(TcpStream::try_clone).collect(),
            Links::Peer(s) => s.try_clone().map(|s| vec![s]),
        }
        .map_err(io("cloning a connection"))?;
        let shared = Arc::new(TcpShared {
            rank: cfg.rank,
            aborted: Mutex::new(None),
            streams,
            watch,
        });
        let sh = Arc::clone(&shared);
        let (rank, world) = (cfg.rank, cfg.world);
        let thread = CommThread::spawn(rank, format!("cf-tcp-r{rank}"), move |rx| {
            let mut links = links;
            for job in rx {
                let Job {
                    contribution,
                    what,
                    reply,
                } = job;
                let out = contribution.into_host(rank, &what).and_then(|mut buffer| {
                    run(&sh, &mut links, world, timeout, &mut buffer, &what)
                        .map(|span| (buffer, span))
                });
                if let Err(e) = &out {
                    sh.abort(e.to_string());
                }
                let _ = reply.send(out);
            }
        })
        .map_err(io("spawning the communication thread"))?;
        Ok(QueuedComm::new(rank, world, shared, thread))
    }
}

impl GroupState for TcpShared {
    fn abort(&self, reason: String) {
        TcpShared::abort(self, reason);
    }

    fn rank_aborts(&self, _rank: usize, reason: &str) {
        self.watch.abort(reason);
    }

    fn closed(&self, _rank: usize) {
        // The collectives already queued ran to their end (or their timeout); now the
        // connections close, and a peer still waiting on this rank sees it at once.
        for s in &self.streams {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Rank 0: accepts one connection per peer, each saying which rank it is.
fn accept_peers(
    cfg: &RendezvousConfig,
    listener: &TcpListener,
    start: Instant,
    deadline: Instant,
) -> Result<Vec<TcpStream>, RendezvousError> {
    listener
        .set_nonblocking(true)
        .map_err(io("configuring the data port"))?;
    let mut peers: Vec<Option<TcpStream>> = (1..cfg.world).map(|_| None).collect();
    let hellos = super::rendezvous::HelloReader::<20>::new("data port");
    let tag = super::rendezvous::token_tag(cfg.token.as_deref());
    let mut refused: Vec<String> = Vec::new();
    while peers.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (1..cfg.world).filter(|r| peers[r - 1].is_none()).collect();
            let joined = (0..cfg.world).filter(|r| !missing.contains(r)).collect();
            return Err(RendezvousError::Missing {
                missing,
                joined,
                world: cfg.world,
                addr: format!("{} (data port)", cfg.addr),
                waited: now - start,
                refused,
            });
        }
        let (s, h) = match hellos.poll(listener, deadline) {
            Ok(Some(x)) => x,
            Ok(None) => continue,
            Err(e) => return Err(io("accepting a peer's data connection")(e)),
        };
        if &h[..4] != HELLO {
            tracing::warn!("data port: ignoring a connection whose hello is not ours");
            continue;
        }
        let rank = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let world = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let theirs = u64::from_le_bytes([h[12], h[13], h[14], h[15], h[16], h[17], h[18], h[19]]);
        let why = if theirs != tag {
            Some("its rendezvous token is not rank 0's".to_string())
        } else if world != cfg.world || rank == 0 || rank >= cfg.world {
            Some(format!(
                "it says it is rank {rank} of {world}, not a peer of this group of {}",
                cfg.world
            ))
        } else if peers[rank - 1].is_some() {
            Some(format!("rank {rank} is connected already"))
        } else {
            None
        };
        if let Some(why) = why {
            let peer = s
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            tracing::warn!("data port: ignoring a connection from {peer}: {why}");
            refused.push(format!("a data connection from {peer}: {why}"));
            continue;
        }
        s.set_nodelay(true)
            .map_err(io("configuring a connection"))?;
        peers[rank - 1] = Some(s);
    }
    Ok(peers.into_iter().flatten().collect())
}

/// A peer: connects to rank 0's data port and says which rank it is.
fn connect_root(
    cfg: &RendezvousConfig,
    port: u16,
    deadline: Instant,
) -> Result<TcpStream, RendezvousError> {
    let target = format!("{}:{port}", cfg.addr);
    let what = || {
        format!(
            "rank {} connecting to rank 0's data port {target}",
            cfg.rank
        )
    };
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&target)
        .map_err(io(what()))?
        .next()
        .ok_or_else(|| RendezvousError::Protocol(format!("{}: no address", what())))?;
    // Bounded: a dropped SYN would otherwise take the system's two minutes.
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let mut s = TcpStream::connect_timeout(&addr, left).map_err(io(what()))?;
    let mut hello = Vec::with_capacity(20);
    hello.extend_from_slice(HELLO);
    hello.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(cfg.world as u32).to_le_bytes());
    hello.extend_from_slice(&super::rendezvous::token_tag(cfg.token.as_deref()).to_le_bytes());
    s.set_write_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))
    .and_then(|_| s.write_all(&hello))
    .and_then(|_| s.set_nodelay(true))
    .map_err(io(format!(
        "rank {} saying hello on the data port",
        cfg.rank
    )))?;
    Ok(s)
}

fn failure(shared: &TcpShared, what: &CollectiveDesc, e: std::io::Error, peer: usize) -> CommError {
    CommError::Aborted {
        rank: shared.rank,
        what: what.clone(),
        reason: shared.why_lost(peer, &e),
    }
}

/// Runs one collective on this rank.
fn run(
    shared: &TcpShared,
    links: &mut Links,
    world: usize,
    timeout: Duration,
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<CommSpan, CommError> {
    if let Some(reason) = shared.aborted() {
        return Err(CommError::Aborted {
            rank: shared.rank,
            what: what.clone(),
            reason,
        });
    }
    match links {
        Links::Root(peers) => run_root(shared, peers, world, timeout, buf, what),
        Links::Peer(s) => run_peer(shared, s, timeout, buf, what),
    }
}

/// Status byte rank 0 sends before a result (phase one) and as the commit (phase two).
const OK: u8 = 0;
/// Status byte of a failure, followed by a `u32` length and the message.
const FAILED: u8 = 1;

/// Rank 0 tells every peer why the collective failed (best effort, a short wait each: they
/// also see the connections close when the group aborts).
fn tell_failure(peers: &mut [TcpStream], e: &CommError) {
    let msg = e.to_string();
    let mut answer = vec![FAILED];
    answer.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    answer.extend_from_slice(msg.as_bytes());
    for s in peers.iter_mut() {
        let _ = write_by(s, &answer, Instant::now() + Duration::from_millis(200));
    }
}

/// Rank 0's side: gather, reduce in rank order, then finish in two phases. Phase one sends the
/// result to every peer, which stages it and acknowledges; only when every peer has
/// acknowledged does phase two send the commit. A peer that fails before its acknowledgement
/// fails the collective on every rank (rank 0 sends the failure instead of the commit), so no
/// rank returns a result that another rank did not get. What is left is rank 0 dying between
/// two one-byte commit writes.
fn run_root(
    shared: &TcpShared,
    peers: &mut [TcpStream],
    world: usize,
    timeout: Duration,
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<CommSpan, CommError> {
    let t0 = Instant::now();
    let cpu = thread_cpu_us();
    // When the last header arrived: the last rank had joined by then (an upper bound: a header
    // that waited in the socket while an earlier peer's header was read is counted when read).
    let mut joined = t0;
    let lost = |e: std::io::Error, r: usize| {
        if timed_out(&e) {
            CommError::Timeout {
                rank: 0,
                what: what.clone(),
                waited: t0.elapsed(),
                missing: vec![r],
            }
        } else {
            failure(shared, what, e, r)
        }
    };
    let mut bufs = Vec::with_capacity(world);
    bufs.push(std::mem::take(buf));
    let gathered = (|| {
        let deadline = t0 + timeout;
        // Every header first, then every buffer: a header's read returns when that peer
        // joined (its buffer waits behind it in the socket), not after the buffers of the
        // peers before it were read; and a mismatch fails before any buffer is read.
        for (i, s) in peers.iter_mut().enumerate() {
            let r = i + 1;
            let mut h = [0u8; HEADER];
            read_by(s, &mut h, deadline).map_err(|e| lost(e, r))?;
            joined = Instant::now();
            let Some(theirs) = parse_header(&h) else {
                return Err(failure(
                    shared,
                    what,
                    std::io::Error::other("it sent something that is not a collective"),
                    r,
                ));
            };
            if !same_call(&theirs, what) {
                return Err(CommError::Mismatch {
                    rank: 0,
                    mine: what.clone(),
                    other_rank: r,
                    theirs,
                });
            }
        }
        for (i, s) in peers.iter_mut().enumerate() {
            let mut b = HostBuffer::zeros(what.dtype, what.count as usize).ok_or_else(|| {
                CommError::Unsupported {
                    rank: 0,
                    what: what.clone(),
                    why: format!("{} is not reduced", what.dtype),
                }
            })?;
            read_by(s, b.as_bytes_mut(), deadline).map_err(|e| lost(e, i + 1))?;
            bufs.push(b);
        }
        Ok(())
    })();
    if let Err(e) = gathered {
        tell_failure(peers, &e);
        return Err(e);
    }
    if !super::inprocess::reduce_in_rank_order(&mut bufs, what.op) {
        let e = CommError::Unsupported {
            rank: 0,
            what: what.clone(),
            why: "the ranks' buffers differ in dtype or length".into(),
        };
        tell_failure(peers, &e);
        return Err(e);
    }
    let result = bufs.swap_remove(0);
    let staged = (|| {
        let deadline = Instant::now() + timeout;
        for (i, s) in peers.iter_mut().enumerate() {
            write_by(s, &ok_since(joined), deadline)
                .and_then(|_| write_by(s, result.as_bytes(), deadline))
                .map_err(|e| lost(e, i + 1))?;
        }
        for (i, s) in peers.iter_mut().enumerate() {
            let mut ack = [FAILED];
            read_by(s, &mut ack, deadline).map_err(|e| lost(e, i + 1))?;
            if ack[0] != OK {
                return Err(failure(
                    shared,
                    what,
                    std::io::Error::other("it did not acknowledge the result"),
                    i + 1,
                ));
            }
        }
        Ok(())
    })();
    if let Err(e) = staged {
        tell_failure(peers, &e);
        return Err(e);
    }
    for (i, s) in peers.iter_mut().enumerate() {
        // Every peer holds the result: the collective is done. A peer that cannot take its
        // commit byte has gone since it acknowledged; it fails on its own, and the next
        // collective names it here.
        if let Err(e) = write_by(s, &[OK], Instant::now() + timeout) {
            tracing::warn!("rank 0: the commit of {what} to rank {} failed: {e}", i + 1);
        }
    }
    *buf = result;
    Ok(CommSpan::joined_until_now(joined, Some(joined), cpu))
}

/// The status rank 0 sends before a result: [`OK`], then the nanoseconds since the last rank
/// joined, so that a peer can time the collective from then in its own clock.
fn ok_since(joined: Instant) -> [u8; 9] {
    let mut m = [OK; 9];
    let ns = u64::try_from(joined.elapsed().as_nanos()).unwrap_or(u64::MAX);
    m[1..].copy_from_slice(&ns.to_le_bytes());
    m
}

/// Rank 0's failure message after a failure status byte.
fn failure_message(s: &mut TcpStream) -> String {
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut len = [0u8; 4];
    read_by(s, &mut len, deadline)
        .ok()
        .map(|_| u32::from_le_bytes(len).min(MAX_MESSAGE))
        .and_then(|n| {
            let mut m = vec![0u8; n as usize];
            read_by(s, &mut m, deadline).ok().map(|_| m)
        })
        .map_or_else(
            || "rank 0 failed the collective".to_string(),
            |m| format!("rank 0 reports: {}", String::from_utf8_lossy(&m)),
        )
}

/// A failure status and message rank 0 sent before the connection broke, if one arrives
/// within `wait`.
fn failure_status(s: &mut TcpStream, wait: Duration) -> Option<String> {
    let mut status = [OK];
    read_by(s, &mut status, Instant::now() + wait).ok()?;
    (status[0] != OK).then(|| failure_message(s))
}

/// A peer's side: send, receive the result (staged: the caller gets it only after the
/// commit), acknowledge, wait for the commit. On any error the caller gets no buffer.
fn run_peer(
    shared: &TcpShared,
    s: &mut TcpStream,
    timeout: Duration,
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<CommSpan, CommError> {
    let t0 = Instant::now();
    let cpu = thread_cpu_us();
    // Rank 0 may start this collective up to `timeout` after us and then wait as long for
    // the slowest peer.
    let deadline = t0 + super::comm::wait_bound(timeout);
    let lost = |e: std::io::Error| {
        if timed_out(&e) {
            CommError::Timeout {
                rank: shared.rank,
                what: what.clone(),
                waited: t0.elapsed(),
                missing: vec![0],
            }
        } else {
            failure(shared, what, e, 0)
        }
    };
    let aborted = |s: &mut TcpStream| CommError::Aborted {
        rank: shared.rank,
        what: what.clone(),
        reason: failure_message(s),
    };
    if let Err(e) =
        write_by(s, &header(what), deadline).and_then(|_| write_by(s, buf.as_bytes(), deadline))
    {
        // Rank 0 stops reading when the collective fails elsewhere (another peer died) and
        // tells every peer why before it closes: that reason names the rank at fault, a
        // broken pipe does not.
        if !timed_out(&e)
            && let Some(reason) = failure_status(s, Duration::from_millis(500))
        {
            return Err(CommError::Aborted {
                rank: shared.rank,
                what: what.clone(),
                reason,
            });
        }
        return Err(lost(e));
    }
    let mut status = [FAILED];
    read_by(s, &mut status, deadline).map_err(lost)?;
    let answered = Instant::now();
    if status[0] != OK {
        return Err(aborted(s));
    }
    let mut since = [0u8; 8];
    read_by(s, &mut since, deadline).map_err(|e| failure(shared, what, e, 0))?;
    // The last rank joined `since` before rank 0 answered (the answer's own trip, a few
    // microseconds on a local network, is counted as link time), and not before this call.
    let joined = answered
        .checked_sub(Duration::from_nanos(u64::from_le_bytes(since)))
        .map_or(t0, |j| j.max(t0));
    // Staged: `buf` is this thread's until the reply, and a failure below drops it.
    read_by(s, buf.as_bytes_mut(), deadline).map_err(|e| failure(shared, what, e, 0))?;
    write_by(s, &[OK], deadline).map_err(lost)?;
    let mut commit = [FAILED];
    read_by(s, &mut commit, deadline).map_err(lost)?;
    if commit[0] != OK {
        return Err(aborted(s));
    }
    Ok(CommSpan::joined_until_now(joined, Some(joined), cpu))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::Communicator;
    use std::thread;

    fn cfg(rank: usize, world: usize, port: u16) -> RendezvousConfig {
        RendezvousConfig::loopback(rank, world, port, Duration::from_secs(20))
    }

    fn desc(count: usize) -> CollectiveDesc {
        CollectiveDesc {
            collective: 0,
            bucket: Some(0),
            op: ReduceOp::Sum,
            dtype: DType::F32,
            count: count as u64,
            params: Vec::new(),
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A hand-written peer `rank` of `world`: joined, its data connection open, and its peer
    /// watch (as a real rank keeps it).
    fn raw_peer(rank: usize, world: usize, port: u16) -> (TcpStream, PeerWatch) {
        let c = cfg(rank, world, port);
        let (payload, watch) = rendezvous_watched(&c, Vec::new).unwrap();
        let data = u16::from_le_bytes([payload[0], payload[1]]);
        (
            connect_root(&c, data, Instant::now() + c.timeout).unwrap(),
            watch,
        )
    }

    /// Rank 2 (by hand) sends its buffer and takes the result, then goes before acknowledging
    /// it. No rank returns the result: rank 0 fails naming rank 2 and rank 1 fails with rank
    /// 0's reason. Before the two phases, rank 1 had its result and went on alone.
    #[test]
    fn a_peer_lost_before_acknowledging_fails_the_collective_everywhere() {
        let port = free_port();
        let n = 16;
        let timeout = Duration::from_secs(5);
        thread::scope(|sc| {
            sc.spawn(move || {
                let (mut s, _watch) = raw_peer(2, 3, port);
                s.write_all(&header(&desc(n))).unwrap();
                s.write_all(HostBuffer::zeros(DType::F32, n).unwrap().as_bytes())
                    .unwrap();
                let mut result = vec![0u8; 1 + 8 + 4 * n];
                s.read_exact(&mut result).unwrap();
                assert_eq!(result[0], OK);
            });
            let out: Vec<_> = (0..2)
                .map(|r| {
                    sc.spawn(move || {
                        let c = TcpComm::connect(&cfg(r, 3, port), timeout).unwrap();
                        let one = HostBuffer::from_f64(DType::F32, &vec![1.0; n]).unwrap();
                        c.all_reduce(one, desc(n))
                            .unwrap()
                            .wait(Duration::from_secs(30))
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect();
            for (r, o) in out.iter().enumerate() {
                let e = o.as_ref().map(|_| ()).unwrap_err().to_string();
                assert!(e.contains("rank 2"), "rank {r}: {e}");
            }
        });
    }

    /// Rank 1 speaks the protocol by hand: a proper hello and header, then its buffer a byte
    /// every 50 ms (it would take minutes). Rank 0 fails the collective within twice its
    /// timeout with a timeout naming rank 1; before, each byte restarted the socket timeout.
    #[test]
    fn a_peer_that_trickles_its_buffer_is_a_timeout_naming_it() {
        let port = free_port();
        let n = 1024;
        let timeout = Duration::from_secs(2);
        let stop = std::sync::atomic::AtomicBool::new(false);
        thread::scope(|sc| {
            let stop = &stop;
            sc.spawn(move || {
                let (mut s, _watch) = raw_peer(1, 2, port);
                s.write_all(&header(&desc(n))).unwrap();
                for _ in 0..n * 4 {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[7]).is_err()
                    {
                        break;
                    }
                    thread::sleep(Duration::from_millis(50));
                }
            });
            let root = TcpComm::connect(&cfg(0, 2, port), timeout).unwrap();
            let t0 = Instant::now();
            let e = root
                .all_reduce(HostBuffer::zeros(DType::F32, n).unwrap(), desc(n))
                .unwrap()
                .wait(Duration::from_secs(30))
                .unwrap_err();
            let waited = t0.elapsed();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            match e {
                CommError::Timeout { rank, missing, .. } => {
                    assert_eq!((rank, missing), (0, vec![1]));
                }
                e => panic!("expected a timeout naming rank 1, got {e}"),
            }
            assert!(
                waited < timeout * 2,
                "rank 0 waited {waited:?} for a trickling peer (timeout {timeout:?})"
            );
        });
    }
}

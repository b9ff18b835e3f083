//! The TCP communicator: one rank per process, host buffers over TCP, for data-parallel runs
//! across processes and machines without GPUs (and the CPU stand-in for NCCL in multi-process
//! tests). Start-up goes through the [`rendezvous`](super::rendezvous): rank 0 opens a data port
//! and shares its number, every other rank connects to it and says which rank it is.
//!
//! Topology: a star through rank 0, and in a group of three or more a mesh beside it. Each
//! collective, every peer sends its header to rank 0, which checks that all ranks call the same
//! collective. A small buffer then goes through rank 0 too: every peer sends it, rank 0 reduces
//! all of them with the in-process group's arithmetic (every element summed in rank order, each
//! contribution divided by the group size first for a mean) and sends the result back, moving
//! `2·(world − 1)` buffers. A buffer of [`TcpOptions::sharded_min_bytes`] or more (1 MiB by
//! default) goes through the mesh (module `mesh`): each rank reduces one shard of it with the same
//! arithmetic and sends it to every other, so each rank moves `2·(world − 1)/world` of a buffer
//! whatever the group size, and rank 0 only settles the outcome. Either way a rank folds the
//! values it receives into the result as they arrive, a chunk at a time (module `fold`), and the
//! results are bitwise those of the in-process communicator and independent of timing.
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
//! Wire format (little endian). Peer hello: `b"CFTH"` (`b"CFTS"` in a group that makes a
//! mesh), rank `u32`, world `u32`, the rendezvous token's tag `u64` (a connection whose hello
//! is not a peer's of this group is logged and ignored; one of the other kind is refused, the
//! refusal reported if the peer never joins). With a mesh, each peer then sends rank 0 the
//! address of its mesh port (length `u16`, then the text), rank 0 sends every peer all ranks'
//! addresses, and each rank connects to the mesh ports of the ranks below it with the same
//! hello but `b"CFTM"`. Per collective, peer → rank 0: `b"CFTC"`, collective `u32`, op `u8`, dtype `u8`, way `u8` (1:
//! the mesh), a zero byte, count `u64`, bucket `u32` (`u32::MAX`: none), then, through rank 0,
//! the buffer's bytes (op and dtype as `ReduceOp::code` and `DType::code`). Through the mesh:
//! rank 0 → peer: status `u8` (0: go, then nanoseconds since the last rank joined `u64`; 1:
//! failed, then a `u32` length and the message); the shards over the mesh; peer → rank 0: its
//! verdict (`u8` 0, or 1, a `u32` length and why); rank 0 → peer: commit `u8` 0 once every rank
//! succeeded, else a failure naming every rank's. Through rank 0: rank 0 → peer: status
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
use crate::config::ConfigError;
use crate::graph::{DType, ReduceOp};

mod fold;
mod mesh;
mod start;
mod writer;
use fold::Fold;
use mesh::{Mesh, run_peer_sharded, run_root_sharded};
use start::{accept_ranks, connect_root};

/// Bytes from which an all-reduce of a TCP group of three or more ranks goes through the mesh
/// (every rank reducing one shard) instead of the star through rank 0, by default.
pub const SHARDED_MIN_BYTES: usize = 1 << 20;

/// How a TCP rank moves its collectives; every rank of a group has the same (rank 0 checks:
/// a peer that makes a mesh when rank 0 does not, or the other way round, is refused at
/// start-up, and ranks that would send one collective different ways fail it, saying why).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpOptions {
    /// Bytes from which an all-reduce goes through the mesh in a group of three or more
    /// ([`SHARDED_MIN_BYTES`] by default). `None`: every collective goes through rank 0 and
    /// no mesh is made, so only rank 0's ports need to be reachable.
    pub sharded_min_bytes: Option<usize>,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            sharded_min_bytes: Some(SHARDED_MIN_BYTES),
        }
    }
}

impl TcpOptions {
    /// The options the launcher's environment gives: `CF_TCP_SHARDED_MIN_BYTES`, a number of
    /// bytes or `never` (the default when it is unset or empty);
    /// [`CollectiveOptions::from_env`](crate::backend::CollectiveOptions::from_env) reads it.
    pub fn from_env() -> Result<Self, ConfigError> {
        const VAR: &str = "CF_TCP_SHARDED_MIN_BYTES";
        let sharded_min_bytes = match std::env::var(VAR).ok().filter(|v| !v.is_empty()) {
            None => Some(SHARDED_MIN_BYTES),
            Some(v) if v == "never" => None,
            Some(v) => Some(v.trim().parse().map_err(|_| ConfigError::BadEnv {
                var: VAR,
                value: v.clone(),
                expected: "a number of bytes, or \"never\"",
            })?),
        };
        Ok(Self { sharded_min_bytes })
    }

    /// Whether a group of `world` ranks makes a mesh.
    fn mesh(self, world: usize) -> bool {
        // A group of two moves as much through the star as through a mesh.
        world >= 3 && self.sharded_min_bytes.is_some()
    }
}

/// A peer's hello on rank 0's data port, and the one of a peer that also makes a mesh.
const HELLO: &[u8; 4] = b"CFTH";
const HELLO_MESH: &[u8; 4] = b"CFTS";
const CALL: &[u8; 4] = b"CFTC";
const HEADER: usize = 24;

/// Largest failure message accepted from rank 0.
const MAX_MESSAGE: u32 = 1 << 16;

/// A collective's header; `sharded`: this rank reduces it through the mesh.
fn header(what: &CollectiveDesc, sharded: bool) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(CALL);
    h[4..8].copy_from_slice(&what.collective.to_le_bytes());
    h[8] = what.op.code();
    h[9] = what.dtype.code();
    h[10] = u8::from(sharded);
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
fn read_by(s: &TcpStream, mut buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.set_read_timeout(Some(left(deadline)?))?;
        match (&mut &*s).read(buf) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` that ends by `deadline`, however slowly the other side reads.
fn write_by(s: &TcpStream, mut buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.set_write_timeout(Some(left(deadline)?))?;
        match (&mut &*s).write(buf) {
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

/// The hello of a peer on rank 0's data port, for a group that makes a mesh or not, and the
/// other one with why rank 0 refuses it (every rank must make the mesh, or none).
fn star_hellos(mesh: bool) -> (&'static [u8; 4], (&'static [u8; 4], &'static str)) {
    let differ = "the ranks' TcpOptions::sharded_min_bytes (CF_TCP_SHARDED_MIN_BYTES) differ";
    if mesh {
        (HELLO_MESH, (HELLO, differ))
    } else {
        (HELLO, (HELLO_MESH, differ))
    }
}

impl QueuedComm<TcpShared> {
    /// Joins the group `cfg` describes (the rendezvous, then the data connections), each step
    /// bounded by `cfg.timeout`; `timeout` then bounds every collective.
    pub fn connect(cfg: &RendezvousConfig, timeout: Duration) -> Result<Self, RendezvousError> {
        Self::connect_with(cfg, timeout, TcpOptions::default())
    }

    /// A whole group of `world` ranks in this process, over loopback (each rank's start-up on
    /// a thread of its own, on a free port): for benches and tests that measure the transport
    /// itself. An error is the first rank's that failed to start.
    pub fn loopback_group(
        world: usize,
        timeout: Duration,
        options: TcpOptions,
    ) -> Result<Vec<Self>, RendezvousError> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(io("finding a free loopback port"))?
            .port();
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..world)
                .map(|rank| {
                    s.spawn(move || {
                        let cfg = RendezvousConfig::loopback(rank, world, port, timeout);
                        Self::connect_with(&cfg, timeout, options)
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    }

    /// [`connect`](Self::connect) with `options` (the same on every rank).
    pub fn connect_with(
        cfg: &RendezvousConfig,
        timeout: Duration,
        options: TcpOptions,
    ) -> Result<Self, RendezvousError> {
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
            let (hello, other) = star_hellos(options.mesh(cfg.world));
            (
                Links::Root(accept_ranks(
                    cfg,
                    &listener,
                    (hello, Some(other)),
                    1..cfg.world,
                    (start, deadline),
                    "data port",
                )?),
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
            let hello = star_hellos(options.mesh(cfg.world)).0;
            (
                Links::Peer(connect_root(cfg, port, hello, deadline)?),
                watch,
            )
        };
        let star = match &links {
            Links::Root(peers) => &peers[..],
            Links::Peer(s) => std::slice::from_ref(s),
        };
        let mesh = options
            .mesh(cfg.world)
            .then(|| Mesh::open(cfg, star, (start, deadline)))
            .transpose()?;
        let mut streams: Vec<TcpStream> = star
            .iter()
            .map(TcpStream::try_clone)
            .collect::<std::io::Result<_>>()
            .map_err(io("cloning a connection"))?;
        if let Some(m) = &mesh {
            streams.extend(m.clones().map_err(io("cloning a mesh connection"))?);
        }
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
                    let group = Group {
                        shared: &sh,
                        mesh: mesh.as_ref(),
                        sharded_min_bytes: options.sharded_min_bytes.unwrap_or(usize::MAX),
                        world,
                        timeout,
                    };
                    run(&group, &mut links, &mut buffer, &what).map(|span| (buffer, span))
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

fn failure(shared: &TcpShared, what: &CollectiveDesc, e: std::io::Error, peer: usize) -> CommError {
    CommError::Aborted {
        rank: shared.rank,
        what: what.clone(),
        reason: shared.why_lost(peer, &e),
    }
}

/// What every collective of a rank's thread needs.
struct Group<'a> {
    shared: &'a TcpShared,
    /// The mesh of a group of three or more.
    mesh: Option<&'a Mesh>,
    sharded_min_bytes: usize,
    world: usize,
    timeout: Duration,
}

impl Group<'_> {
    /// The mesh, when `what` goes through it: a buffer of
    /// [`TcpOptions::sharded_min_bytes`] or more in a group that has one. Ranks with the same
    /// options decide alike for the same call; rank 0 checks that the calls and their ways are
    /// the same before either way moves a buffer.
    fn sharded(&self, what: &CollectiveDesc) -> Option<&Mesh> {
        let bytes = what.count.saturating_mul(what.dtype.size());
        self.mesh.filter(|_| bytes >= self.sharded_min_bytes as u64)
    }
}

/// Runs one collective on this rank.
fn run(
    g: &Group,
    links: &mut Links,
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<CommSpan, CommError> {
    if let Some(reason) = g.shared.aborted() {
        return Err(CommError::Aborted {
            rank: g.shared.rank,
            what: what.clone(),
            reason,
        });
    }
    match (links, g.sharded(what)) {
        (Links::Root(peers), Some(mesh)) => run_root_sharded(g, mesh, peers, buf, what),
        (Links::Root(peers), None) => run_root(g.shared, peers, g.world, g.timeout, buf, what),
        (Links::Peer(s), Some(mesh)) => run_peer_sharded(g, mesh, s, buf, what),
        (Links::Peer(s), None) => run_peer(g.shared, s, g.timeout, buf, what),
    }
}

/// Status byte rank 0 sends before a result (phase one) and as the commit (phase two).
const OK: u8 = 0;
/// Status byte of a failure, followed by a `u32` length and the message.
const FAILED: u8 = 1;

/// Rank 0 tells every peer why the collective failed (best effort, a short wait each: they
/// also see the connections close when the group aborts).
fn tell_failure(peers: &[TcpStream], e: &CommError) {
    let answer = failed_with(&e.to_string());
    for s in peers {
        let _ = write_by(s, &answer, Instant::now() + Duration::from_millis(200));
    }
}

/// What rank 0 reports when its connection with peer `r` failed with `e` during a collective
/// it started at `t0`: a timeout naming the peer, or the loss and why.
fn lost_peer(
    shared: &TcpShared,
    what: &CollectiveDesc,
    t0: Instant,
    e: std::io::Error,
    r: usize,
) -> CommError {
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
}

/// Rank 0 reads every peer's header of the collective it started at `t0` (by the collective's
/// timeout) and checks that each peer calls the same collective; returns when the last header
/// arrived: the last rank had joined by then (an upper bound: a header that waited in the
/// socket while an earlier peer's header was read is counted when read).
fn gather_headers(
    shared: &TcpShared,
    peers: &[TcpStream],
    (what, sharded): (&CollectiveDesc, bool),
    (t0, deadline): (Instant, Instant),
) -> Result<Instant, CommError> {
    let mut joined = t0;
    for (i, s) in peers.iter().enumerate() {
        let r = i + 1;
        let mut h = [0u8; HEADER];
        read_by(s, &mut h, deadline).map_err(|e| lost_peer(shared, what, t0, e, r))?;
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
        if (h[10] == 1) != sharded {
            let way = |mesh: bool| if mesh { "the mesh" } else { "rank 0" };
            return Err(CommError::Failed {
                rank: 0,
                what: what.clone(),
                why: format!(
                    "rank {r} reduces it through {}, rank 0 through {}: the ranks' TcpOptions::sharded_min_bytes differ",
                    way(h[10] == 1),
                    way(sharded)
                ),
            });
        }
    }
    Ok(joined)
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
    let lost = |e: std::io::Error, r: usize| lost_peer(shared, what, t0, e, r);
    let mut joined = t0;
    // Rank 0's own values are the first term; each peer's are folded in as they arrive.
    let mut result = std::mem::take(buf);
    let gathered = (|| {
        let deadline = t0 + timeout;
        // Every header first, then every buffer: a header's read returns when that peer
        // joined (its buffer waits behind it in the socket), not after the buffers of the
        // peers before it were read; and a mismatch fails before any buffer is read.
        joined = gather_headers(shared, peers, (what, false), (t0, deadline))?;
        let unsupported = |why: String| CommError::Unsupported {
            rank: 0,
            what: what.clone(),
            why,
        };
        let mut fold = Fold::new(what.dtype, what.op, (0, world), result.len())
            .ok_or_else(|| unsupported(format!("{} is not reduced", what.dtype)))?;
        let peer = |r: usize| r.checked_sub(1).and_then(|i| peers.get(i));
        fold.reduce(result.as_bytes_mut(), peer, deadline)
            .map_err(|(r, e)| lost(e, r))
    })();
    if let Err(e) = gathered {
        tell_failure(peers, &e);
        return Err(e);
    }
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
    commit_all(peers, what, timeout);
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
fn failure_message(s: &TcpStream) -> String {
    read_message(s, Instant::now() + Duration::from_millis(500)).map_or_else(
        |_| "rank 0 failed the collective".to_string(),
        |m| format!("rank 0 reports: {m}"),
    )
}

/// A failure on the wire: [`FAILED`], then the message's length (`u32`) and bytes, at most
/// [`MAX_MESSAGE`] of them.
fn failed_with(msg: &str) -> Vec<u8> {
    let msg = &msg.as_bytes()[..msg.len().min(MAX_MESSAGE as usize)];
    let mut m = vec![FAILED];
    m.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    m.extend_from_slice(msg);
    m
}

/// The message after a [`FAILED`] status ([`failed_with`]).
fn read_message(s: &TcpStream, deadline: Instant) -> std::io::Result<String> {
    let mut len = [0u8; 4];
    read_by(s, &mut len, deadline)?;
    let mut m = vec![0u8; u32::from_le_bytes(len).min(MAX_MESSAGE) as usize];
    read_by(s, &mut m, deadline)?;
    Ok(String::from_utf8_lossy(&m).into_owned())
}

/// A failure status and message rank 0 sent before the connection broke, if one arrives
/// within `wait`.
fn failure_status(s: &TcpStream, wait: Duration) -> Option<String> {
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
    let call = PeerCall::new(shared, what);
    // Rank 0 may start this collective up to `timeout` after us and then wait as long for
    // the slowest peer.
    let deadline = call.t0 + super::comm::wait_bound(timeout);
    if let Err(e) = write_by(s, &header(what, false), deadline)
        .and_then(|_| write_by(s, buf.as_bytes(), deadline))
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
        return Err(call.lost(e));
    }
    let joined = call.answer(s, deadline)?;
    // Staged: `buf` is this thread's until the reply, and a failure below drops it.
    read_by(s, buf.as_bytes_mut(), deadline).map_err(|e| failure(shared, what, e, 0))?;
    write_by(s, &[OK], deadline).map_err(|e| call.lost(e))?;
    call.committed(s, deadline)?;
    Ok(CommSpan::joined_until_now(joined, Some(joined), call.cpu))
}

/// A peer's side of one collective, whichever way it goes: what it reports when rank 0's
/// answers fail or do not come.
struct PeerCall<'a> {
    shared: &'a TcpShared,
    what: &'a CollectiveDesc,
    t0: Instant,
    cpu: Option<f64>,
}

impl<'a> PeerCall<'a> {
    fn new(shared: &'a TcpShared, what: &'a CollectiveDesc) -> Self {
        Self {
            shared,
            what,
            t0: Instant::now(),
            cpu: thread_cpu_us(),
        }
    }

    /// The connection with rank 0 failed with `e`: a timeout naming rank 0, or the loss and
    /// why.
    fn lost(&self, e: std::io::Error) -> CommError {
        if timed_out(&e) {
            CommError::Timeout {
                rank: self.shared.rank,
                what: self.what.clone(),
                waited: self.t0.elapsed(),
                missing: vec![0],
            }
        } else {
            failure(self.shared, self.what, e, 0)
        }
    }

    /// Rank 0 sent a failure: its message.
    fn aborted(&self, s: &TcpStream) -> CommError {
        CommError::Aborted {
            rank: self.shared.rank,
            what: self.what.clone(),
            reason: failure_message(s),
        }
    }

    /// Rank 0's answer ([`ok_since`], or a failure); returns when the last rank joined, in
    /// this rank's clock: `since` before rank 0 answered (the answer's own trip, a few
    /// microseconds on a local network, is counted as link time), and not before this call.
    fn answer(&self, s: &TcpStream, deadline: Instant) -> Result<Instant, CommError> {
        let mut status = [FAILED];
        read_by(s, &mut status, deadline).map_err(|e| self.lost(e))?;
        let answered = Instant::now();
        if status[0] != OK {
            return Err(self.aborted(s));
        }
        let mut since = [0u8; 8];
        read_by(s, &mut since, deadline).map_err(|e| failure(self.shared, self.what, e, 0))?;
        Ok(answered
            .checked_sub(Duration::from_nanos(u64::from_le_bytes(since)))
            .map_or(self.t0, |j| j.max(self.t0)))
    }

    /// Rank 0's commit, or the group's failure.
    fn committed(&self, s: &TcpStream, deadline: Instant) -> Result<(), CommError> {
        let mut commit = [FAILED];
        read_by(s, &mut commit, deadline).map_err(|e| self.lost(e))?;
        if commit[0] != OK {
            return Err(self.aborted(s));
        }
        Ok(())
    }
}

/// Rank 0's commit to every peer, once every rank holds its result: the collective is done.
/// A peer that cannot take its commit byte has gone since; it fails on its own, and the next
/// collective names it here.
fn commit_all(peers: &[TcpStream], what: &CollectiveDesc, timeout: Duration) {
    for (i, s) in peers.iter().enumerate() {
        if let Err(e) = write_by(s, &[OK], Instant::now() + timeout) {
            tracing::warn!("rank 0: the commit of {what} to rank {} failed: {e}", i + 1);
        }
    }
}

#[cfg(test)]
mod tests;

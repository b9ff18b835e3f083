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
//! or aborted rank shuts its connections, so the others fail at once instead of waiting.
//!
//! Wire format (little endian). Peer hello: `b"CFTH"`, rank `u32`, world `u32`, the
//! rendezvous token's tag `u64` (a connection whose hello is not a peer's of this group is
//! logged and ignored). Per
//! collective, peer → rank 0: `b"CFTC"`, collective `u32`, op `u8`, dtype `u8`, two zero bytes,
//! count `u64`, bucket `u32` (`u32::MAX`: none), then the buffer's bytes (op and dtype as
//! `ReduceOp::code` and `DType::code`); rank 0 → peer: status
//! `u8` (0: ok, then the result's bytes; 1: failed, then a `u32` length and the message).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use super::buffer::HostBuffer;
use super::comm::{
    CollectiveDesc, CommError, CommSpan, Communicator, Contribution, Job, PendingReduce,
};
use super::grad::DeviceBucket;
use super::rendezvous::{RendezvousConfig, RendezvousError, rendezvous};
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

struct Shared {
    rank: usize,
    /// The first failure; every later collective fails with it.
    aborted: Mutex<Option<String>>,
    /// Clones of the connections, to shut them on abort.
    streams: Vec<TcpStream>,
}

impl Shared {
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
}

enum Links {
    /// Rank 0: the stream of rank `r` at `r - 1`.
    Root(Vec<TcpStream>),
    /// Any other rank: its stream to rank 0.
    Peer(TcpStream),
}

/// One rank of a TCP group (one per process).
pub struct TcpComm {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    tx: Option<mpsc::Sender<Job>>,
    worker: Option<thread::JoinHandle<()>>,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RendezvousError {
    let what = what.into();
    move |source| RendezvousError::Io { what, source }
}

impl TcpComm {
    /// Joins the group `cfg` describes (the rendezvous, then the data connections), each step
    /// bounded by `cfg.timeout`; `timeout` then bounds every collective.
    pub fn connect(cfg: &RendezvousConfig, timeout: Duration) -> Result<Self, RendezvousError> {
        let start = Instant::now();
        let deadline = start + cfg.timeout;
        let links = if cfg.rank == 0 {
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
            rendezvous(cfg, || port.to_le_bytes().to_vec())?;
            Links::Root(accept_peers(cfg, &listener, start, deadline)?)
        } else {
            let payload = rendezvous(cfg, Vec::new)?;
            let port = match payload[..] {
                [a, b] => u16::from_le_bytes([a, b]),
                _ => {
                    return Err(RendezvousError::Protocol(format!(
                        "rank 0 shared {} bytes, not a data port (is it a TCP group?)",
                        payload.len()
                    )));
                }
            };
            Links::Peer(connect_root(cfg, port, deadline)?)
        };
        let streams = match &links {
            Links::Root(peers) => peers.iter().map(TcpStream::try_clone).collect(),
            Links::Peer(s) => s.try_clone().map(|s| vec![s]),
        }
        .map_err(io("cloning a connection"))?;
        let shared = Arc::new(Shared {
            rank: cfg.rank,
            aborted: Mutex::new(None),
            streams,
        });
        let (tx, rx) = mpsc::channel::<Job>();
        let sh = Arc::clone(&shared);
        let (rank, world) = (cfg.rank, cfg.world);
        let worker = thread::Builder::new()
            .name(format!("cf-tcp-r{rank}"))
            .spawn(move || {
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
        Ok(TcpComm {
            rank,
            world,
            shared,
            tx: Some(tx),
            worker: Some(worker),
        })
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

fn failure(shared: &Shared, what: &CollectiveDesc, e: std::io::Error, peer: usize) -> CommError {
    CommError::Aborted {
        rank: shared.rank,
        what: what.clone(),
        reason: shared
            .aborted()
            .unwrap_or_else(|| format!("the connection with rank {peer} failed: {e}")),
    }
}

/// Runs one collective on this rank.
fn run(
    shared: &Shared,
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
    let t0 = Instant::now();
    match links {
        Links::Root(peers) => run_root(shared, peers, world, t0 + timeout, buf, what),
        Links::Peer(s) => run_peer(shared, s, timeout, buf, what).map(|started| CommSpan {
            start: started,
            end: Instant::now(),
        }),
    }
}

fn run_root(
    shared: &Shared,
    peers: &mut [TcpStream],
    world: usize,
    deadline: Instant,
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<CommSpan, CommError> {
    let t0 = Instant::now();
    let mut bufs = Vec::with_capacity(world);
    bufs.push(std::mem::take(buf));
    let gathered = (|| {
        for (i, s) in peers.iter_mut().enumerate() {
            let r = i + 1;
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let mut h = [0u8; HEADER];
            if let Err(e) = s
                .set_read_timeout(Some(left))
                .and_then(|_| s.read_exact(&mut h))
            {
                return Err(if timed_out(&e) {
                    CommError::Timeout {
                        rank: 0,
                        what: what.clone(),
                        waited: t0.elapsed(),
                        missing: vec![r],
                    }
                } else {
                    failure(shared, what, e, r)
                });
            }
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
            let mut b = HostBuffer::zeros(what.dtype, what.count as usize).ok_or_else(|| {
                CommError::Unsupported {
                    rank: 0,
                    what: what.clone(),
                    why: format!("{} is not reduced", what.dtype),
                }
            })?;
            s.read_exact(b.as_bytes_mut())
                .map_err(|e| failure(shared, what, e, r))?;
            bufs.push(b);
        }
        Ok(())
    })();
    if let Err(e) = gathered {
        // Tell the peers why (best effort; they also see the connection close).
        let msg = e.to_string();
        let mut answer = vec![1u8];
        answer.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        answer.extend_from_slice(msg.as_bytes());
        for s in peers.iter_mut() {
            let _ = s
                .set_write_timeout(Some(Duration::from_millis(200)))
                .and_then(|_| s.write_all(&answer));
        }
        return Err(e);
    }
    let started = Instant::now();
    if !super::inprocess::reduce_in_rank_order(&mut bufs, what.op) {
        return Err(CommError::Unsupported {
            rank: 0,
            what: what.clone(),
            why: "the ranks' buffers differ in dtype or length".into(),
        });
    }
    *buf = bufs.swap_remove(0);
    for (i, s) in peers.iter_mut().enumerate() {
        s.set_write_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1)),
        ))
        .and_then(|_| s.write_all(&[0]))
        .and_then(|_| s.write_all(buf.as_bytes()))
        .map_err(|e| failure(shared, what, e, i + 1))?;
    }
    Ok(CommSpan {
        start: started,
        end: Instant::now(),
    })
}

/// Rank 0's failure message after a failure status byte.
fn failure_message(s: &mut TcpStream) -> String {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)
        .ok()
        .map(|_| u32::from_le_bytes(len).min(MAX_MESSAGE))
        .and_then(|n| {
            let mut m = vec![0u8; n as usize];
            s.read_exact(&mut m).ok().map(|_| m)
        })
        .map_or_else(
            || "rank 0 failed the collective".to_string(),
            |m| format!("rank 0 reports: {}", String::from_utf8_lossy(&m)),
        )
}

/// A failure status and message rank 0 sent before the connection broke, if one arrives
/// within `wait`.
fn failure_status(s: &mut TcpStream, wait: Duration) -> Option<String> {
    let mut status = [0u8; 1];
    s.set_read_timeout(Some(wait))
        .and_then(|_| s.read_exact(&mut status))
        .ok()?;
    (status[0] != 0).then(|| failure_message(s))
}

fn run_peer(
    shared: &Shared,
    s: &mut TcpStream,
    timeout: Duration,
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<Instant, CommError> {
    let t0 = Instant::now();
    // Rank 0 may start this collective up to `timeout` after us and then wait as long for
    // the slowest peer.
    let bound = super::comm::wait_bound(timeout);
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
    if let Err(e) = s
        .set_write_timeout(Some(bound))
        .and_then(|_| s.write_all(&header(what)))
        .and_then(|_| s.write_all(buf.as_bytes()))
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
    let mut status = [0u8; 1];
    s.set_read_timeout(Some(bound))
        .and_then(|_| s.read_exact(&mut status))
        .map_err(lost)?;
    let started = Instant::now();
    if status[0] != 0 {
        return Err(CommError::Aborted {
            rank: shared.rank,
            what: what.clone(),
            reason: failure_message(s),
        });
    }
    s.read_exact(buf.as_bytes_mut())
        .map_err(|e| failure(shared, what, e, 0))?;
    Ok(started)
}

impl Communicator for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        super::comm::enqueue(
            self.rank,
            self.tx.as_ref(),
            Contribution::Host(buffer),
            what,
        )
    }

    fn all_reduce_read(
        &self,
        bucket: Box<dyn DeviceBucket>,
        what: CollectiveDesc,
    ) -> Result<PendingReduce, CommError> {
        super::comm::enqueue(
            self.rank,
            self.tx.as_ref(),
            Contribution::Device(bucket),
            what,
        )
    }

    fn abort(&self, reason: &str) {
        self.shared
            .abort(format!("rank {} aborted the group: {reason}", self.rank));
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        self.tx.take();
        // Collectives already enqueued run to their end (or their timeout); then the
        // connections close, and a peer still waiting on this rank sees it at once.
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
        for s in &self.shared.streams {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

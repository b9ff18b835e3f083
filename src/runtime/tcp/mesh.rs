//! The sharded all-reduce of a TCP group of three or more ranks: every rank reduces one shard.
//!
//! Through the star, rank 0 receives and sends the whole buffer of every peer, `2·(world − 1)`
//! buffers a collective. For a large buffer the group instead exchanges it over a mesh (a
//! connection between every two ranks, made at start-up): the buffer is cut into `world`
//! contiguous shards, rank `j` receives shard `j` of every other rank, reduces it with the
//! in-process group's arithmetic (every element summed in rank order, each contribution divided
//! by the group size first for a mean), and sends the reduced shard back to every rank. Each rank
//! then sends and receives `2·(world − 1)/world` of a buffer, whatever the group size, in two
//! hops; the bits are the star's and the in-process group's (the same elements summed in the same
//! order, only on another rank).
//!
//! Requires: every rank calls [`Mesh::all_reduce`] for the same collective (rank 0 checked the
//! headers over the star first) with a buffer of the same dtype and length. Guarantees: each
//! call ends by its deadline; on failure this rank's mesh connections are shut, so the other
//! ranks' calls end at once too, and the error names the rank whose connection failed. What a
//! failure means for the group (every rank fails the collective) is settled over the star.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::time::Instant;

use super::fold::{CHUNK_BYTES, Fold};
use super::start::{accept_ranks, connect_hello};
use super::writer::{Writer, interleave};
use super::{
    FAILED, Group, OK, PeerCall, commit_all, failed_with, gather_headers, header, io, lost_peer,
    ok_since, read_by, read_message, tell_failure, timed_out, write_by,
};
use crate::runtime::buffer::HostBuffer;
use crate::runtime::comm::{CollectiveDesc, CommError, CommSpan, thread_cpu_us};
use crate::runtime::rendezvous::{RendezvousConfig, RendezvousError};

/// The hello of a mesh connection (the data port's are `CFTH` and `CFTS`).
pub(super) const MESH_HELLO: &[u8; 4] = b"CFTM";

/// Largest address text accepted from another rank.
const MAX_ADDR: usize = 256;

/// The connections of one rank with every other rank of its group.
pub(super) struct Mesh {
    rank: usize,
    /// The connection with rank `r` at `r` (`None` at this rank's own index).
    links: Vec<Option<TcpStream>>,
    /// The thread that writes this rank's side of each exchange.
    writer: Writer,
}

/// Writes an address as its length (`u16`) and text.
pub(super) fn write_addr(
    s: &TcpStream,
    addr: &SocketAddr,
    deadline: Instant,
) -> std::io::Result<()> {
    let text = addr.to_string();
    let mut m = (text.len() as u16).to_le_bytes().to_vec();
    m.extend_from_slice(text.as_bytes());
    write_by(s, &m, deadline)
}

/// Reads an address [`write_addr`] wrote.
pub(super) fn read_addr(s: &TcpStream, deadline: Instant) -> std::io::Result<SocketAddr> {
    let mut len = [0u8; 2];
    read_by(s, &mut len, deadline)?;
    let len = usize::from(u16::from_le_bytes(len));
    if len > MAX_ADDR {
        return Err(std::io::Error::other(format!("an address of {len} bytes")));
    }
    let mut text = vec![0u8; len];
    read_by(s, &mut text, deadline)?;
    String::from_utf8_lossy(&text)
        .parse()
        .map_err(|e| std::io::Error::other(format!("a malformed address: {e}")))
}

impl Mesh {
    /// Makes the mesh of a group whose star is up: each rank listens on the interface its star
    /// connections use, tells rank 0 where (over the star), learns from rank 0 where every
    /// other rank listens, connects to the ranks below it and accepts the ranks above it (each
    /// saying which rank it is, with the group's token tag), all by `deadline`.
    pub(super) fn open(
        cfg: &RendezvousConfig,
        star: &[TcpStream],
        (start, deadline): (Instant, Instant),
    ) -> Result<Mesh, RendezvousError> {
        let ip: IpAddr = star[0]
            .local_addr()
            .map_err(io("reading the data connection's address"))?
            .ip();
        let listener = TcpListener::bind((ip, 0)).map_err(io(format!(
            "rank {} opening its mesh port on {ip}",
            cfg.rank
        )))?;
        let mine = listener.local_addr().map_err(io("reading the mesh port"))?;
        let table: Vec<SocketAddr> = if cfg.rank == 0 {
            let mut table = vec![mine];
            for (i, s) in star.iter().enumerate() {
                let what = format!("rank 0 reading rank {}'s mesh address", i + 1);
                table.push(read_addr(s, deadline).map_err(io(what))?);
            }
            for (i, s) in star.iter().enumerate() {
                for a in &table {
                    let what = format!("rank 0 sending the mesh addresses to rank {}", i + 1);
                    write_addr(s, a, deadline).map_err(io(what))?;
                }
            }
            table
        } else {
            let what = format!("rank {} exchanging mesh addresses with rank 0", cfg.rank);
            write_addr(&star[0], &mine, deadline).map_err(io(what.clone()))?;
            (0..cfg.world)
                .map(|_| read_addr(&star[0], deadline))
                .collect::<std::io::Result<_>>()
                .map_err(io(what))?
        };
        let mut links: Vec<Option<TcpStream>> = (0..cfg.world).map(|_| None).collect();
        for (r, addr) in table.iter().enumerate().take(cfg.rank) {
            let what = format!(
                "rank {} connecting to rank {r}'s mesh port {addr}",
                cfg.rank
            );
            links[r] = Some(connect_hello(cfg, *addr, MESH_HELLO, deadline, what).map_err(hint)?);
        }
        let above = accept_ranks(
            cfg,
            &listener,
            (MESH_HELLO, None),
            cfg.rank + 1..cfg.world,
            (start, deadline),
            "mesh port",
        )
        .map_err(hint)?;
        for (i, s) in above.into_iter().enumerate() {
            links[cfg.rank + 1 + i] = Some(s);
        }
        let clones = links
            .iter()
            .map(|s| s.as_ref().map(TcpStream::try_clone).transpose())
            .collect::<std::io::Result<_>>()
            .map_err(io("cloning a mesh connection"))?;
        let writer =
            Writer::spawn(cfg.rank, clones).map_err(io("spawning the mesh's writing thread"))?;
        Ok(Mesh {
            rank: cfg.rank,
            links,
            writer,
        })
    }

    /// Clones of the connections, for the group's abort to shut.
    pub(super) fn clones(&self) -> std::io::Result<Vec<TcpStream>> {
        self.links
            .iter()
            .flatten()
            .map(TcpStream::try_clone)
            .collect()
    }

    fn shut(&self) {
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Sends `send(r)` to every other rank `r` (on the writing thread) while `recv` reads what
    /// they send, both chunk by chunk in rank order (module `writer`), so no two ranks wait for
    /// each other's reads. On the first failure every connection of this rank is shut (the
    /// others' calls end too) and the error names the rank.
    fn exchange<'a>(
        &self,
        send: impl Fn(usize) -> &'a [u8],
        recv: impl FnOnce() -> Result<(), String>,
        deadline: Instant,
    ) -> Result<(), String> {
        let peers = (0..self.links.len()).filter(|&r| self.links[r].is_some());
        let parts = peers.map(|r| (r, send(r)));
        self.writer
            .send_while(parts, deadline, recv, &|| self.shut())
    }

    /// The sharded all-reduce of `buf` (see the module doc), by `deadline`; an error says what
    /// failed on this rank.
    pub(super) fn all_reduce(
        &self,
        buf: &mut HostBuffer,
        op: crate::graph::ReduceOp,
        deadline: Instant,
    ) -> Result<(), String> {
        let (world, rank) = (self.links.len(), self.rank);
        let (dtype, count) = (buf.dtype(), buf.len());
        let mut fold = Fold::new(dtype, op, (rank, world), shard(count, world, rank).len())
            .ok_or_else(|| format!("{dtype} is not reduced"))?;
        // The buffer as its shards; this rank's own is where its reduced shard goes.
        let mut parts: Vec<&mut [u8]> = Vec::with_capacity(world);
        let mut rest = buf.as_bytes_mut();
        for r in 0..world {
            let (part, tail) =
                rest.split_at_mut(shard(count, world, r).len() * dtype.size() as usize);
            parts.push(part);
            rest = tail;
        }
        let mine: &mut [u8] = std::mem::take(&mut parts[rank]);
        let received = |(r, e): (usize, std::io::Error)| format!("receiving from rank {r}: {e}");
        {
            let sends: Vec<&[u8]> = parts.iter().map(|p| &**p).collect();
            let link = |r: usize| self.links[r].as_ref();
            let recv = || fold.reduce(mine, link, deadline).map_err(received);
            self.exchange(|r| sends[r], recv, deadline)?;
        }
        // Every other rank's reduced shard, into its place in `buf`, while this one's goes out.
        let reduced: &[u8] = mine;
        let recv = || {
            let shards = parts.iter_mut().enumerate().filter_map(|(r, part)| {
                let s = self.links[r].as_ref()?;
                Some(((r, s), part.chunks_mut(CHUNK_BYTES)))
            });
            for ((r, s), chunk) in interleave(shards.collect()) {
                read_by(s, chunk, deadline).map_err(|e| received((r, e)))?;
            }
            Ok(())
        };
        self.exchange(|_| reduced, recv, deadline)
    }
}

/// A mesh connection that failed says how to go without the mesh.
fn hint(e: RendezvousError) -> RendezvousError {
    const HINT: &str = "ranks that cannot reach each other need CF_TCP_SHARDED_MIN_BYTES=never \
                        (TcpOptions::sharded_min_bytes: None) on every rank";
    match e {
        RendezvousError::Io { what, source } => RendezvousError::Io {
            what: format!("{what} ({HINT})"),
            source,
        },
        RendezvousError::Missing {
            missing,
            joined,
            world,
            addr,
            waited,
            refused,
        } => RendezvousError::Missing {
            missing,
            joined,
            world,
            addr: format!("{addr} ({HINT})"),
            waited,
            refused,
        },
        e => e,
    }
}

/// The elements of shard `j` of a buffer of `count` elements cut among `world` ranks: contiguous,
/// in rank order, their lengths differing by at most one.
pub(crate) fn shard(count: usize, world: usize, j: usize) -> Range<usize> {
    let at = |j: usize| (count as u128 * j as u128 / world as u128) as usize;
    at(j)..at(j + 1)
}

/// A verdict: [`OK`], or [`FAILED`] and why (a `u32` length and the message).
fn verdict(outcome: &Result<(), String>) -> Vec<u8> {
    match outcome {
        Ok(()) => vec![OK],
        Err(why) => failed_with(why),
    }
}

/// A peer's [`verdict`]: `None` when it is [`OK`], else why the peer failed.
fn read_verdict(s: &TcpStream, deadline: Instant) -> std::io::Result<Option<String>> {
    let mut status = [FAILED];
    read_by(s, &mut status, deadline)?;
    if status[0] == OK {
        return Ok(None);
    }
    read_message(s, deadline).map(Some)
}

/// Rank 0's side of a sharded all-reduce ([`mesh`]): every header checked as in
/// [`run_root`], then a go to every peer (with the time since the last rank joined, as
/// [`ok_since`]), the exchange, and every peer's verdict: the commit when every rank's exchange
/// succeeded, else every rank's failure, sent to all. As in the star, no rank returns a result
/// that another rank did not get.
pub(super) fn run_root_sharded(
    g: &Group,
    mesh: &Mesh,
    peers: &[TcpStream],
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<CommSpan, CommError> {
    let t0 = Instant::now();
    let cpu = thread_cpu_us();
    let shared = g.shared;
    let fail = |e: CommError| {
        tell_failure(peers, &e);
        Err(e)
    };
    let joined = match gather_headers(shared, peers, (what, true), (t0, t0 + g.timeout)) {
        Ok(j) => j,
        Err(e) => return fail(e),
    };
    let deadline = Instant::now() + g.timeout;
    for (i, s) in peers.iter().enumerate() {
        if let Err(e) = write_by(s, &ok_since(joined), deadline) {
            return fail(lost_peer(shared, what, t0, e, i + 1));
        }
    }
    let mut failed: Vec<String> = mesh
        .all_reduce(buf, what.op, deadline)
        .err()
        .map(|why| format!("rank 0: {why}"))
        .into_iter()
        .collect();
    // A rank whose connection with rank 0 is gone is the likely cause of the others' failed
    // exchanges (a failing rank shuts all its connections, so its neighbours' exchanges fail
    // with whatever link they were on): it is named alone, with what the peer watch knows.
    let mut lost: Vec<String> = Vec::new();
    let deadline = Instant::now() + g.timeout;
    for (i, s) in peers.iter().enumerate() {
        let r = i + 1;
        match read_verdict(s, deadline) {
            Ok(None) => {}
            Ok(Some(why)) => failed.push(format!("rank {r}: {why}")),
            Err(e) if timed_out(&e) => {
                lost.push(format!("rank {r} sent no verdict within {:?}", g.timeout));
            }
            Err(e) => lost.push(shared.why_lost(r, &e)),
        }
    }
    if !lost.is_empty() || !failed.is_empty() {
        let reason = if lost.is_empty() {
            format!("the sharded exchange failed: {}", failed.join("; "))
        } else {
            lost.join("; ")
        };
        return fail(CommError::Aborted {
            rank: 0,
            what: what.clone(),
            reason,
        });
    }
    commit_all(peers, what, g.timeout);
    Ok(CommSpan::joined_until_now(joined, Some(joined), cpu))
}

/// A peer's side of a sharded all-reduce ([`mesh`]): its header to rank 0, rank 0's go (or
/// the failure of the call, a mismatch or a rank that never joined), the exchange, its verdict
/// to rank 0, then rank 0's commit or the group's failure. On any error the caller gets no
/// buffer.
pub(super) fn run_peer_sharded(
    g: &Group,
    mesh: &Mesh,
    s: &TcpStream,
    buf: &mut HostBuffer,
    what: &CollectiveDesc,
) -> Result<CommSpan, CommError> {
    let call = PeerCall::new(g.shared, what);
    // As in `run_peer`: rank 0 may start up to a timeout after us, then wait as long.
    let deadline = call.t0 + crate::runtime::comm::wait_bound(g.timeout);
    write_by(s, &header(what, true), deadline).map_err(|e| call.lost(e))?;
    let joined = call.answer(s, deadline)?;
    let outcome = mesh.all_reduce(buf, what.op, Instant::now() + g.timeout);
    // Rank 0 reads the verdicts after its own exchange, then waits up to a timeout for them.
    let deadline = Instant::now() + crate::runtime::comm::wait_bound(g.timeout);
    write_by(s, &verdict(&outcome), deadline).map_err(|e| call.lost(e))?;
    call.committed(s, deadline)?;
    Ok(CommSpan::joined_until_now(joined, Some(joined), call.cpu))
}

//! Start-up of a TCP group: rank 0 accepts its peers on its data port, each peer connects to
//! it; the mesh's connections are made the same way ([`accept_ranks`], [`connect_hello`]).

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{io, write_by};
use crate::runtime::rendezvous::{RendezvousConfig, RendezvousError};

/// Accepts one connection on `listener` from each rank of `ranks`, each saying with a hello
/// that starts with `magic` which rank of this group it is (rank 0's data port: every peer;
/// a mesh port: the ranks above this one). A connection whose hello is not such a rank's is
/// logged and ignored (one that starts with `other`'s magic, refused for `other`'s reason);
/// ranks still missing at `deadline` are an error naming them, with the refusals.
pub(super) fn accept_ranks(
    cfg: &RendezvousConfig,
    listener: &TcpListener,
    (magic, other): (&[u8; 4], Option<(&[u8; 4], &str)>),
    ranks: std::ops::Range<usize>,
    (start, deadline): (Instant, Instant),
    port: &'static str,
) -> Result<Vec<TcpStream>, RendezvousError> {
    listener
        .set_nonblocking(true)
        .map_err(io(format!("configuring the {port}")))?;
    let mut peers: Vec<Option<TcpStream>> = ranks.clone().map(|_| None).collect();
    let hellos = crate::runtime::rendezvous::HelloReader::<20>::new(port);
    let tag = crate::runtime::rendezvous::token_tag(cfg.token.as_deref());
    let mut refused: Vec<String> = Vec::new();
    while peers.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = ranks
                .clone()
                .filter(|r| peers[r - ranks.start].is_none())
                .collect();
            let joined = (0..cfg.world).filter(|r| !missing.contains(r)).collect();
            let at = listener
                .local_addr()
                .map_or_else(|_| cfg.addr.clone(), |a| a.to_string());
            return Err(RendezvousError::Missing {
                missing,
                joined,
                world: cfg.world,
                addr: format!("{at} (rank {}'s {port})", cfg.rank),
                waited: now - start,
                refused,
            });
        }
        let (s, h) = match hellos.poll(listener, deadline) {
            Ok(Some(x)) => x,
            Ok(None) => continue,
            Err(e) => return Err(io(format!("accepting a connection on the {port}"))(e)),
        };
        let known_other = other.filter(|(m, _)| &h[..4] == *m);
        if &h[..4] != magic && known_other.is_none() {
            tracing::warn!("{port}: ignoring a connection whose hello is not ours");
            continue;
        }
        let rank = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let world = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let theirs = u64::from_le_bytes([h[12], h[13], h[14], h[15], h[16], h[17], h[18], h[19]]);
        let why = if let Some((_, why)) = known_other {
            Some(format!(
                "rank {rank}'s hello is not the one rank {} expects: {why}",
                cfg.rank
            ))
        } else if theirs != tag {
            Some(format!("its rendezvous token is not rank {}'s", cfg.rank))
        } else if world != cfg.world || !ranks.contains(&rank) {
            Some(format!(
                "it says it is rank {rank} of {world}, not one that connects here in this group of {}",
                cfg.world
            ))
        } else if peers[rank - ranks.start].is_some() {
            Some(format!("rank {rank} is connected already"))
        } else {
            None
        };
        if let Some(why) = why {
            let peer = s
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            tracing::warn!("{port}: ignoring a connection from {peer}: {why}");
            refused.push(format!("a connection to the {port} from {peer}: {why}"));
            continue;
        }
        s.set_nodelay(true)
            .map_err(io("configuring a connection"))?;
        peers[rank - ranks.start] = Some(s);
    }
    Ok(peers.into_iter().flatten().collect())
}

/// Connects to `addr` and says with a hello that starts with `magic` which rank of this group
/// this is, by `deadline`; `what` names the step in an error.
pub(super) fn connect_hello(
    cfg: &RendezvousConfig,
    addr: std::net::SocketAddr,
    magic: &[u8; 4],
    deadline: Instant,
    what: String,
) -> Result<TcpStream, RendezvousError> {
    // Bounded: a dropped SYN would otherwise take the system's two minutes.
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let s = TcpStream::connect_timeout(&addr, left).map_err(io(what.clone()))?;
    let mut hello = Vec::with_capacity(20);
    hello.extend_from_slice(magic);
    hello.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(cfg.world as u32).to_le_bytes());
    hello.extend_from_slice(
        &crate::runtime::rendezvous::token_tag(cfg.token.as_deref()).to_le_bytes(),
    );
    write_by(
        &s,
        &hello,
        deadline.max(Instant::now() + Duration::from_millis(1)),
    )
    .and_then(|_| s.set_nodelay(true))
    .map_err(io(format!("{what}: saying hello")))?;
    Ok(s)
}

/// A peer: connects to rank 0's data port and says which rank it is (with `hello`'s magic).
pub(super) fn connect_root(
    cfg: &RendezvousConfig,
    port: u16,
    hello: &[u8; 4],
    deadline: Instant,
) -> Result<TcpStream, RendezvousError> {
    let target = format!("{}:{port}", cfg.addr);
    let what = format!(
        "rank {} connecting to rank 0's data port {target}",
        cfg.rank
    );
    let addr = std::net::ToSocketAddrs::to_socket_addrs(&target)
        .map_err(io(what.clone()))?
        .next()
        .ok_or_else(|| RendezvousError::Protocol(format!("{what}: no address")))?;
    connect_hello(cfg, addr, hello, deadline, what)
}

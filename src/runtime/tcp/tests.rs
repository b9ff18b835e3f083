//! The TCP protocol with hand-written peers: a peer lost before acknowledging, one that
//! trickles its buffer, and a mesh port nobody listens on.

use super::*;
use crate::runtime::Communicator;
use std::thread;

fn cfg(rank: usize, world: usize, port: u16) -> RendezvousConfig {
    RendezvousConfig::loopback(rank, world, port, Duration::from_secs(20))
}

fn desc(count: usize) -> CollectiveDesc {
    CollectiveDesc::of_bucket(0, ReduceOp::Sum, DType::F32, count as u64)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A hand-written peer `rank` of `world`: joined, its data connection open, its peer
/// watch and, in a group of three or more, its mesh (as a real rank keeps them).
fn raw_peer(rank: usize, world: usize, port: u16) -> (TcpStream, PeerWatch, Option<Mesh>) {
    let c = cfg(rank, world, port);
    let start = Instant::now();
    let (payload, watch) = rendezvous_watched(&c, Vec::new).unwrap();
    let data = u16::from_le_bytes([payload[0], payload[1]]);
    let hello = star_hellos(world >= 3).0;
    let s = connect_root(&c, data, hello, start + c.timeout).unwrap();
    let mesh = (world >= 3)
        .then(|| Mesh::open(&c, std::slice::from_ref(&s), (start, start + c.timeout)).unwrap());
    (s, watch, mesh)
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
            let (mut s, _watch, _mesh) = raw_peer(2, 3, port);
            s.write_all(&header(&desc(n), false)).unwrap();
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

/// Rank 1 (by hand) gives rank 0 a mesh address nobody listens on: rank 2, which connects
/// to it, fails its start-up at once, saying how to go without the mesh.
#[test]
fn an_unreachable_mesh_port_fails_the_start_up_saying_how_to_do_without() {
    let port = free_port();
    let dead = free_port();
    thread::scope(|sc| {
        sc.spawn(move || {
            let mut c = cfg(1, 3, port);
            c.timeout = Duration::from_secs(2);
            let start = Instant::now();
            let (payload, _watch) = rendezvous_watched(&c, Vec::new).unwrap();
            let data = u16::from_le_bytes([payload[0], payload[1]]);
            let s = connect_root(&c, data, HELLO_MESH, start + c.timeout).unwrap();
            let nobody = std::net::SocketAddr::from(([127, 0, 0, 1], dead));
            mesh::write_addr(&s, &nobody, start + c.timeout).unwrap();
            for _ in 0..3 {
                mesh::read_addr(&s, start + c.timeout).unwrap();
            }
            thread::sleep(Duration::from_secs(3));
        });
        let others: Vec<_> = [0, 2]
            .into_iter()
            .map(|r| {
                sc.spawn(move || {
                    let mut c = cfg(r, 3, port);
                    c.timeout = Duration::from_secs(2);
                    TcpComm::connect(&c, Duration::from_secs(5))
                        .map(drop)
                        .unwrap_err()
                        .to_string()
                })
            })
            .collect();
        let errors: Vec<String> = others.into_iter().map(|h| h.join().unwrap()).collect();
        let e2 = &errors[1];
        assert!(
            e2.contains("rank 2 connecting to rank 1's mesh port")
                && e2.contains("CF_TCP_SHARDED_MIN_BYTES=never"),
            "{e2}"
        );
        assert!(errors[0].contains("never joined"), "{}", errors[0]);
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
            let (mut s, _watch, _mesh) = raw_peer(1, 2, port);
            s.write_all(&header(&desc(n), false)).unwrap();
            for _ in 0..n * 4 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[7]).is_err() {
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

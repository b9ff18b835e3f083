//! The TCP communicator over loopback, ranks as threads here (each with its own connections, as
//! separate processes would have): results bitwise those of the in-process group, through rank 0
//! and through the mesh, and the failures (a peer that never calls, ranks that disagree, a rank
//! that aborts mid-exchange) are typed errors, not hangs.

mod common;

use std::time::{Duration, Instant};

use collective_fusion::graph::{DType, ReduceOp};
use collective_fusion::runtime::comm::{CollectiveDesc, CommError, Communicator};
use collective_fusion::runtime::rendezvous::RendezvousConfig;
use collective_fusion::runtime::synthetic::SplitMix64;
use collective_fusion::runtime::tcp::{SHARDED_MIN_BYTES, TcpComm, TcpOptions};
use collective_fusion::runtime::transport::{Transport, communicators};
use collective_fusion::runtime::{HostBuffer, InProcessGroup};
use common::free_port;

fn cfg(rank: usize, world: usize, port: u16) -> RendezvousConfig {
    RendezvousConfig::loopback(rank, world, port, Duration::from_secs(20))
}

fn desc(collective: u32, op: ReduceOp, dtype: DType, count: usize) -> CollectiveDesc {
    CollectiveDesc::of_bucket(collective, op, dtype, count as u64)
}

fn data(rank: usize, dtype: DType, n: usize, seed: u64) -> HostBuffer {
    let mut r = SplitMix64(seed * 131 + rank as u64);
    let v: Vec<f64> = (0..n).map(|_| r.next_value()).collect();
    HostBuffer::from_f64(dtype, &v).unwrap()
}

/// Runs `f(comm)` on `world` TCP ranks, one thread each.
fn on_tcp<T: Send>(world: usize, timeout: Duration, f: impl Fn(&TcpComm) -> T + Sync) -> Vec<T> {
    on_tcp_with(world, timeout, |_| TcpOptions::default(), f)
}

/// [`on_tcp`], rank `r` with `options(r)`.
fn on_tcp_with<T: Send>(
    world: usize,
    timeout: Duration,
    options: impl Fn(usize) -> TcpOptions + Sync,
    f: impl Fn(&TcpComm) -> T + Sync,
) -> Vec<T> {
    let port = free_port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (f, options) = (&f, &options);
                s.spawn(move || {
                    let c = TcpComm::connect_with(&cfg(r, world, port), timeout, options(r))
                        .unwrap_or_else(|e| panic!("rank {r} of {world}: {e}"));
                    f(&c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Buffers below and from [`SHARDED_MIN_BYTES`]: in a group of three or more the large ones go
/// through the mesh, each rank reducing a shard (sizes not a multiple of the group size among
/// them), the small ones through rank 0.
const CASES: [(ReduceOp, DType, usize); 9] = [
    (ReduceOp::Sum, DType::F32, 100_003),
    (ReduceOp::Mean, DType::F32, 7),
    (ReduceOp::Sum, DType::F32, SHARDED_MIN_BYTES / 4 + 3),
    (ReduceOp::Mean, DType::BF16, 4099),
    (ReduceOp::Mean, DType::BF16, SHARDED_MIN_BYTES / 2 + 1),
    (ReduceOp::Sum, DType::F64, 1),
    (ReduceOp::Sum, DType::F64, SHARDED_MIN_BYTES / 8),
    (ReduceOp::Mean, DType::F16, 0),
    (ReduceOp::Mean, DType::F32, 3 * SHARDED_MIN_BYTES / 4),
];

/// Every case on `c`, all in flight at once, completed in order.
fn all_cases(c: &dyn Communicator) -> Vec<HostBuffer> {
    let pending: Vec<_> = CASES
        .iter()
        .enumerate()
        .map(|(i, (op, dt, n))| {
            c.all_reduce(
                data(c.rank(), *dt, *n, i as u64),
                desc(i as u32, *op, *dt, *n),
            )
            .unwrap()
        })
        .collect();
    pending
        .into_iter()
        .map(|p| p.wait(Duration::from_secs(60)).unwrap().0)
        .collect()
}

/// The error of a sum of `n` f32 (collective `collective`) that must fail on `c`.
fn failed_sum(c: &TcpComm, collective: u32, n: usize) -> String {
    c.all_reduce(
        data(c.rank(), DType::F32, n, 1),
        desc(collective, ReduceOp::Sum, DType::F32, n),
    )
    .unwrap()
    .wait(Duration::from_secs(20))
    .unwrap_err()
    .to_string()
}

#[test]
fn tcp_results_are_bitwise_those_of_the_in_process_group() {
    for world in [1usize, 2, 3, 4] {
        let tcp = on_tcp(world, Duration::from_secs(20), |c| all_cases(c));
        let group = InProcessGroup::ranks(world, Duration::from_secs(20));
        let local: Vec<Vec<HostBuffer>> = std::thread::scope(|s| {
            let hs: Vec<_> = group
                .iter()
                .map(|c| s.spawn(move || all_cases(c)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in 0..world {
            for (i, (a, b)) in tcp[r].iter().zip(&local[r]).enumerate() {
                assert!(a.bits_eq(b), "world {world} rank {r} case {i}");
            }
        }
    }
}

/// Through rank 0 (a small buffer) and through the mesh (a large one).
#[test]
fn a_peer_that_never_calls_is_a_timeout_naming_it() {
    for n in [8, SHARDED_MIN_BYTES / 4] {
        let t0 = Instant::now();
        let out = on_tcp(3, Duration::from_millis(500), |c| {
            if c.rank() == 2 {
                // Joined, but never calls; it keeps its connections open past the others'
                // timeout.
                std::thread::sleep(Duration::from_secs(3));
                return None;
            }
            let p = c
                .all_reduce(
                    data(c.rank(), DType::F32, n, 1),
                    desc(0, ReduceOp::Sum, DType::F32, n),
                )
                .unwrap();
            Some(p.wait(Duration::from_secs(10)).unwrap_err())
        });
        match &out[0] {
            Some(CommError::Timeout { missing, .. }) => assert_eq!(missing, &vec![2]),
            e => panic!("{n}: rank 0: {e:?}"),
        }
        let e1 = out[1].as_ref().unwrap().to_string();
        assert!(
            e1.contains("rank 1") && e1.contains("rank 0 reports"),
            "{n}: {e1}"
        );
        assert!(e1.contains("ranks [2] never arrived"), "{n}: {e1}");
        assert!(t0.elapsed() < Duration::from_secs(10));
    }
}

/// Rank 2 calls 100 ms after the others, 64 MiB each. Every rank's span says the last rank
/// joined after that call and well before the end (rank 0 sees the header arrive; the peers
/// hear from rank 0 how long before its answer that was), so the early ranks' link time leaves
/// their wait out and keeps the transfer in.
#[test]
fn a_tcp_collective_reports_when_the_last_rank_joined() {
    const N: usize = 16 << 20;
    let all_connected = std::sync::Barrier::new(3);
    let late_call = std::sync::OnceLock::new();
    let out = on_tcp(3, Duration::from_secs(10), |c| {
        let ones = HostBuffer::F32(vec![1.0; N]);
        all_connected.wait();
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(100));
            late_call.set(Instant::now()).unwrap();
        }
        let (buf, span) = c
            .all_reduce(ones, desc(0, ReduceOp::Sum, DType::F32, N))
            .unwrap()
            .wait(Duration::from_secs(10))
            .unwrap();
        assert_eq!(buf.to_f64(), vec![3.0; N]);
        span
    });
    let late_call = *late_call.get().unwrap();
    for (r, span) in out.into_iter().enumerate() {
        let joined = span.joined.expect("TCP tells when the last rank joined");
        assert!(joined >= late_call, "rank {r}");
        assert!(joined <= span.end, "rank {r}");
        // It is the join, not the answer: rank 0 reads every header before any buffer, and
        // moving 64 MiB three times and reducing it takes far longer than a header's trip
        // (measured: joined 3–5 ms after the late call, the end 400 ms after, debug build).
        let after = |t: Instant| t.duration_since(late_call);
        assert!(
            after(joined) * 4 < after(span.end),
            "rank {r}: joined {:?} after the late call, ended {:?} after",
            after(joined),
            after(span.end)
        );
    }
}

#[test]
fn ranks_that_call_different_collectives_fail_with_a_mismatch() {
    let out = on_tcp(2, Duration::from_secs(5), |c| {
        let n = if c.rank() == 0 { 8 } else { 9 };
        failed_sum(c, 3, n)
    });
    assert!(out[0].contains("collective mismatch"), "{}", out[0]);
    assert!(out[0].contains("f32×9"), "{}", out[0]);
    assert!(out[1].contains("collective mismatch"), "{}", out[1]);
}

/// Ranks whose buffers would go different ways (one through rank 0, the others through the
/// mesh) fail with rank 0's mismatch, whichever way rank 0's own goes.
#[test]
fn a_mismatch_between_the_star_and_the_mesh_fails_every_rank() {
    let large = SHARDED_MIN_BYTES / 4;
    for small_rank in [0, 2] {
        let out = on_tcp(3, Duration::from_secs(5), |c| {
            let n = if c.rank() == small_rank { 8 } else { large };
            failed_sum(c, 3, n)
        });
        for (r, e) in out.iter().enumerate() {
            assert!(
                e.contains("collective mismatch"),
                "small on {small_rank}, rank {r}: {e}"
            );
            assert!(e.contains("f32×8"), "small on {small_rank}, rank {r}: {e}");
        }
    }
}

/// Through rank 0 only, the large buffers too (`sharded_min_bytes: None`, no mesh made), the
/// results are the mesh's; ranks whose options send a buffer different ways fail it, saying so.
#[test]
fn ranks_agree_on_the_way_of_each_collective() {
    let star = TcpOptions {
        sharded_min_bytes: None,
    };
    let through_rank_0 = on_tcp_with(3, Duration::from_secs(20), |_| star, |c| all_cases(c));
    let meshed = on_tcp(3, Duration::from_secs(20), |c| all_cases(c));
    for r in 0..3 {
        for (i, (a, b)) in through_rank_0[r].iter().zip(&meshed[r]).enumerate() {
            assert!(a.bits_eq(b), "rank {r} case {i}");
        }
    }
    let n = SHARDED_MIN_BYTES / 4;
    let higher = TcpOptions {
        sharded_min_bytes: Some(2 * SHARDED_MIN_BYTES),
    };
    let out = on_tcp_with(
        3,
        Duration::from_secs(5),
        |r| {
            if r == 1 {
                higher
            } else {
                TcpOptions::default()
            }
        },
        |c| failed_sum(c, 0, n),
    );
    for (r, e) in out.iter().enumerate() {
        assert!(
            e.contains("rank 1 reduces it through rank 0, rank 0 through the mesh")
                && e.contains("sharded_min_bytes"),
            "rank {r}: {e}"
        );
    }
}

/// A peer that makes no mesh (`sharded_min_bytes: None`) in a group whose rank 0 does is
/// refused at start-up: rank 0's error names it and why. The ranks start as a server does,
/// from the transport and `CollectiveOptions::tcp`.
#[test]
fn a_peer_without_the_mesh_is_refused_at_start_up_naming_the_option() {
    let port = free_port();
    let out: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(move || {
                    let mut c = cfg(r, 3, port);
                    c.timeout = Duration::from_secs(2);
                    let options = TcpOptions {
                        sharded_min_bytes: (r != 1).then_some(SHARDED_MIN_BYTES),
                    };
                    let transport = Transport::Tcp(c);
                    let timeout = Duration::from_secs(5);
                    communicators(
                        (&transport, options),
                        &[r as u32],
                        &|_| None,
                        "cpu",
                        timeout,
                    )
                    .map(drop)
                    .map_err(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let e0 = out[0].as_ref().unwrap_err();
    assert!(
        e0.contains("[1]")
            && e0.contains("never joined")
            && e0.contains("rank 1's hello is not the one rank 0 expects")
            && e0.contains("CF_TCP_SHARDED_MIN_BYTES"),
        "{e0}"
    );
    assert!(
        out[2].is_err(),
        "rank 2 waits for the mesh addresses in vain"
    );
}

/// Rank 2 aborts the group while a 64 MiB all-reduce goes through the mesh: every rank fails
/// at once (not at the timeout), the others naming rank 2 and its reason.
#[test]
fn a_rank_that_aborts_during_a_sharded_all_reduce_fails_every_rank_naming_it() {
    const N: usize = 16 << 20;
    let t0 = Instant::now();
    let out = on_tcp(3, Duration::from_secs(20), |c| {
        let p = c
            .all_reduce(
                HostBuffer::F32(vec![1.0; N]),
                desc(0, ReduceOp::Sum, DType::F32, N),
            )
            .unwrap();
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(20));
            c.abort("its loader failed");
        }
        p.wait(Duration::from_secs(30)).unwrap_err().to_string()
    });
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    for (r, e) in out.iter().enumerate().take(2) {
        assert!(
            e.contains("rank 2 aborted the group: its loader failed"),
            "rank {r}: {e}"
        );
    }
}

#[test]
fn a_rank_that_never_joins_fails_the_start_up_with_its_number() {
    let port = free_port();
    let mut c = cfg(0, 2, port);
    c.timeout = Duration::from_millis(300);
    let e = TcpComm::connect(&c, Duration::from_secs(1))
        .err()
        .expect("rank 1 never joins")
        .to_string();
    assert!(e.contains("[1]") && e.contains("never joined"), "{e}");
}

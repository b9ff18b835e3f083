//! The multi-process rendezvous over loopback: separate processes of the `rendezvous` command,
//! started with the launcher's environment, share rank 0's id; a rank that never shows up, a
//! rank 0 that never shows up and a wrong world size are errors on every process that ran,
//! within the timeout, naming what was wrong.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{PROCESS_LIMIT, free_port, output_bounded, wait_bounded};

fn spawn(rank: usize, world: usize, port: u16, timeout_ms: u64) -> Child {
    Command::new(env!("CARGO_BIN_EXE_collective-fusion"))
        .arg("rendezvous")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("CF_RENDEZVOUS_TIMEOUT_MS", timeout_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the command starts")
}

/// (exit success, stdout, stderr) of each process.
fn finish(children: Vec<Child>) -> Vec<(bool, String, String)> {
    children
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let o = wait_bounded(c, PROCESS_LIMIT, &format!("process {r}"));
            (
                o.status.success(),
                String::from_utf8_lossy(&o.stdout).into_owned(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            )
        })
        .collect()
}

#[test]
fn four_processes_share_rank_zeros_id() {
    let port = free_port();
    // Peers first: they retry until rank 0 listens.
    let mut children: Vec<Child> = (1..4).map(|r| spawn(r, 4, port, 20_000)).collect();
    std::thread::sleep(Duration::from_millis(200));
    children.insert(0, spawn(0, 4, port, 20_000));
    let out = finish(children);
    let ids: Vec<&str> = out
        .iter()
        .enumerate()
        .map(|(r, (ok, stdout, stderr))| {
            assert!(ok, "rank {r} failed: {stderr}");
            assert!(
                stdout.starts_with(&format!("rank {r} of 4: joined")),
                "{stdout}"
            );
            stdout.split("; id ").nth(1).unwrap_or("").trim()
        })
        .collect();
    assert!(ids[0].contains("128 bytes"), "{}", ids[0]);
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
}

#[test]
fn a_rank_that_never_joins_fails_the_others_naming_it() {
    let port = free_port();
    let t0 = Instant::now();
    let children = vec![spawn(0, 3, port, 1_500), spawn(1, 3, port, 1_500)];
    let out = finish(children);
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(10), "took {took:?}");
    for (r, (ok, _, stderr)) in out.iter().enumerate() {
        assert!(!ok, "rank {r} should fail");
        assert!(
            stderr.contains("rank(s) [2] of 3 never joined"),
            "rank {r}: {stderr}"
        );
    }
    // Rank 1 hears it from rank 0.
    assert!(out[1].2.contains("rank 0 reports"), "{}", out[1].2);
}

#[test]
fn a_missing_rank_zero_is_an_error_naming_its_address() {
    let port = free_port();
    let t0 = Instant::now();
    let out = finish(vec![spawn(1, 2, port, 800)]);
    assert!(t0.elapsed() < Duration::from_secs(10));
    let (ok, _, stderr) = &out[0];
    assert!(!ok);
    assert!(
        stderr.contains(&format!(
            "rank 1 could not reach rank 0 at 127.0.0.1:{port}"
        )),
        "{stderr}"
    );
}

#[test]
fn a_process_started_with_another_world_size_fails_both() {
    let port = free_port();
    let children = vec![spawn(0, 2, port, 5_000), spawn(1, 3, port, 5_000)];
    for (r, (ok, _, stderr)) in finish(children).iter().enumerate() {
        assert!(!ok, "rank {r} should fail");
        assert!(
            stderr.contains("rank 1 was started with WORLD_SIZE=3, rank 0 with WORLD_SIZE=2"),
            "rank {r}: {stderr}"
        );
    }
}

#[test]
fn a_missing_environment_variable_is_named() {
    let o = output_bounded(
        Command::new(env!("CARGO_BIN_EXE_collective-fusion"))
            .arg("rendezvous")
            .env_remove("RANK")
            .env("WORLD_SIZE", "2"),
    );
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("environment variable RANK is not set"),
        "{stderr}"
    );
}

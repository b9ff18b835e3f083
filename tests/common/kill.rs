//! The fault-table check shared by the TCP tests (`tests/multiprocess.rs`) and the NCCL ones
//! (`tests/gpu.rs`): a rank of a long multi-process `run` killed with SIGKILL mid-run fails
//! every other rank within twice the timeout, each exiting with an error that names it.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{PROCESS_LIMIT, free_port, wait_bounded};

/// Starts `world` ranks of `bin run ... --steps 100000` (the launcher's environment set as
/// torchrun would, `LOCAL_RANK` = rank, `transport` appended: `--transport tcp`, or
/// `--backend cuda --transport nccl`) whose collectives wait at most `timeout` seconds, kills
/// rank `victim` with SIGKILL once a surviving rank finished its second step, and returns every
/// survivor's rank, output and time from the kill to its exit.
pub fn kill_mid_run(
    bin: &str,
    transport: &[&str],
    world: usize,
    victim: usize,
    timeout: u64,
) -> Vec<(usize, Output, Duration)> {
    use std::io::BufRead;
    let port = free_port().to_string();
    let args: Vec<String> = ["run", "--model", "mlp", "--steps", "100000", "--batch", "2"]
        .into_iter()
        .chain(["--hidden-layers", "1"])
        .chain(transport.iter().copied())
        .map(String::from)
        .chain(["--timeout".to_string(), timeout.to_string()])
        .collect();
    let mut children: Vec<_> = (0..world)
        .map(|r| {
            rank_process(bin, &args, r, world, &port)
                .env("CF_LOG", "info")
                .spawn()
                .unwrap()
        })
        .collect();
    // Watch a survivor's log for its second step.
    let watched = usize::from(victim == 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = children[watched].stderr.take().unwrap();
    let mut log = Some(std::thread::spawn(move || {
        let mut text = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("step done") && line.contains("step=2") {
                let _ = tx.send(());
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    }));
    let started = rx.recv_timeout(PROCESS_LIMIT);
    children[victim].kill().unwrap();
    let killed_at = Instant::now();
    let _ = children[victim].wait();
    let mut out = Vec::new();
    for (r, c) in children.into_iter().enumerate() {
        if r == victim {
            continue;
        }
        let mut o = wait_bounded(c, PROCESS_LIMIT, &format!("rank {r}"));
        let took = killed_at.elapsed();
        if let (true, Some(l)) = (r == watched, log.take()) {
            o.stderr = l.join().unwrap_or_default().into_bytes();
            if o.stderr.is_empty() {
                o.stderr = b"(no stderr)".to_vec();
            }
        }
        out.push((r, o, took));
    }
    assert!(started.is_ok(), "no step finished: {:?}", out);
    out
}

/// The command of rank `r` of `world`: `bin args`, with the launcher's environment as torchrun
/// sets it (`LOCAL_RANK` = `r`, rank 0 at `127.0.0.1:port`) and its output piped.
pub fn rank_process(bin: &str, args: &[String], r: usize, world: usize, port: &str) -> Command {
    let mut c = Command::new(bin);
    c.args(args)
        .env("RANK", r.to_string())
        .env("LOCAL_RANK", r.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// [`kill_mid_run`] with a timeout of 3 s, then the check: every survivor exits with status 1
/// within twice the timeout (and a few seconds of process start-up and tear-down), its error
/// naming rank `victim`.
pub fn survivors_fail_naming(bin: &str, transport: &[&str], world: usize, victim: usize) {
    let timeout = 3;
    for (r, o, took) in kill_mid_run(bin, transport, world, victim, timeout) {
        let err = String::from_utf8_lossy(&o.stderr);
        let last = err
            .lines()
            .filter(|l| !l.contains(" INFO "))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(
            o.status.code(),
            Some(1),
            "rank {r} after rank {victim} was killed:\n{last}"
        );
        assert!(last.contains("error: "), "rank {r}:\n{last}");
        assert!(
            last.contains(&format!("rank {victim}")),
            "rank {r} names rank {victim}:\n{last}"
        );
        assert!(
            took <= Duration::from_secs(2 * timeout + 5),
            "rank {r} took {took:?} to fail after rank {victim} was killed:\n{last}"
        );
    }
}

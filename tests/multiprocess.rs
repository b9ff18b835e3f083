//! Data-parallel training across processes: `collective-fusion run --transport tcp` started
//! once per rank with the launcher's environment (as torchrun would), against the same run with
//! every rank a thread of one process.

mod common;

use std::process::{Command, Output, Stdio};

use common::{PROCESS_LIMIT, free_port, output_bounded, wait_bounded};

const BIN: &str = env!("CARGO_BIN_EXE_collective-fusion");

const ARGS: [&str; 7] = ["run", "--model", "mlp", "--steps", "3", "--batch", "4"];

fn digest(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.strip_prefix("weights digest "))
        .and_then(|l| l.split(": ").nth(1))
        .unwrap_or_else(|| panic!("no digest in:\n{text}"))
        .to_string()
}

#[test]
fn three_processes_over_tcp_end_with_the_weights_of_three_threads() {
    let world = 3;
    let port = free_port().to_string();
    let children: Vec<_> = (0..world)
        .map(|r| {
            Command::new(BIN)
                .args(ARGS)
                .args(["--transport", "tcp"])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .enumerate()
        .map(|(r, c)| wait_bounded(c, PROCESS_LIMIT, &format!("rank {r}")))
        .collect();
    let threads = output_bounded(
        Command::new(BIN)
            .args(ARGS)
            .args(["--world", &world.to_string()]),
    );
    let expected = digest(&threads);
    for (r, o) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            text.contains(&format!("this process: rank [{r}]")),
            "{text}"
        );
        assert_eq!(digest(o), expected, "rank {r}:\n{text}");
    }
}

#[test]
fn a_rank_that_never_starts_fails_rank_zero_with_its_number() {
    let out = output_bounded(
        Command::new(BIN)
            .args(ARGS)
            .args(["--transport", "tcp"])
            .env("RANK", "0")
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", free_port().to_string())
            .env("CF_RENDEZVOUS_TIMEOUT_MS", "500"),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("rank(s) [1] of 2 never joined"), "{err}");
}

#[test]
fn a_missing_launcher_variable_is_named() {
    let out = output_bounded(
        Command::new(BIN)
            .args(ARGS)
            .args(["--transport", "tcp"])
            .env_remove("RANK")
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "1"),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("RANK is not set"), "{err}");
}

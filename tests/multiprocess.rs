//! Data-parallel training across processes: `collective-fusion run --transport tcp` started
//! once per rank with the launcher's environment (as torchrun would), against the same run with
//! every rank a thread of one process.

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::kill::{rank_process, survivors_fail_naming};
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

/// Runs `world` processes of `run --transport tcp`, rank `r` with `extra(r)` appended to
/// [`ARGS`], each bounded by [`PROCESS_LIMIT`].
fn over_tcp(world: usize, extra: impl Fn(usize) -> Vec<String>) -> Vec<Output> {
    over_tcp_with(&ARGS, world, extra)
}

/// [`over_tcp`] with `base` in place of [`ARGS`].
fn over_tcp_with(base: &[&str], world: usize, extra: impl Fn(usize) -> Vec<String>) -> Vec<Output> {
    let port = free_port().to_string();
    let children: Vec<_> = (0..world)
        .map(|r| {
            let args: Vec<String> = base
                .iter()
                .copied()
                .chain(["--transport", "tcp"])
                .map(String::from)
                .chain(extra(r))
                .collect();
            rank_process(BIN, &args, r, world, &port).spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .enumerate()
        .map(|(r, c)| wait_bounded(c, PROCESS_LIMIT, &format!("rank {r}")))
        .collect()
}

#[test]
fn three_processes_over_tcp_end_with_the_weights_of_three_threads() {
    let world = 3;
    let outs = over_tcp(world, |_| Vec::new());
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

/// Each process builds its own model from its own seed, as processes under a launcher do:
/// marking the model gives every rank rank 0's weights, so the three end alike, and alike with
/// a run whose processes were all seeded as rank 0 was.
#[test]
fn processes_that_initialize_their_own_models_train_from_rank_zero_weights() {
    let seeded = over_tcp(3, |r| vec!["--seed".into(), (11 + 7 * r).to_string()]);
    let alike = over_tcp(3, |_| vec!["--seed".into(), "11".into()]);
    let expected = digest(&alike[0]);
    for (r, o) in seeded.iter().chain(&alike).enumerate() {
        assert_eq!(digest(o), expected, "process {r}");
    }
    // Verified instead of broadcast, the differently seeded processes refuse to start.
    let verified = over_tcp(3, |r| {
        [
            "--seed",
            &(11 + 7 * r).to_string(),
            "--initial-weights",
            "verify",
        ]
        .map(String::from)
        .to_vec()
    });
    for (r, o) in verified.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "rank {r}: {err}");
        assert!(
            err.contains(&format!("error: rank {r}: the initial weights differ across ranks: 0.weight f32[784,1024] on rank 1")),
            "rank {r}: {err}"
        );
    }
}

/// Processes that each build their own residual convnet (its own seed), whose BatchNorms each
/// update from their own batches, end alike, running statistics included: before each step
/// every rank takes rank 0's statistics (`--buffers broadcast`, the default) or the ranks' mean.
/// They end as the same run with its ranks threads of one process does (each rank a copy of the
/// model with statistics of its own).
#[test]
fn processes_training_a_resnet_end_with_alike_running_statistics() {
    const RESNET: [&str; 9] = [
        "run", "--model", "resnet", "--blocks", "1", "--steps", "2", "--batch", "1",
    ];
    for buffers in ["broadcast", "mean"] {
        let outs = over_tcp_with(&RESNET, 2, |r| {
            ["--seed", &(5 + r).to_string(), "--buffers", buffers]
                .map(String::from)
                .to_vec()
        });
        let threads = output_bounded(Command::new(BIN).args(RESNET).args([
            "--world",
            "2",
            "--seed",
            "5",
            "--buffers",
            buffers,
        ]));
        let expected = digest(&threads);
        for (r, o) in outs.iter().enumerate() {
            assert_eq!(digest(o), expected, "--buffers {buffers}, rank {r}");
        }
    }
}

/// Runs `base` with `flags` as two processes over TCP, rank r seeded `seed + r` (marking gives
/// both rank 0's weights), and as two threads of one process seeded `seed`; asserts that each
/// process ends with the threads' weights, and that the threads' run without `flags` ends
/// elsewhere (`what` says why it must). Returns the processes' outputs.
fn assert_processes_end_as_threads(
    base: &[&str],
    seed: usize,
    flags: &[&str],
    what: &str,
) -> Vec<Output> {
    let outs = over_tcp_with(base, 2, |r| {
        let mut extra = vec!["--seed".to_string(), (seed + r).to_string()];
        extra.extend(flags.iter().map(|f| f.to_string()));
        extra
    });
    let threads = |extra: &[&str]| {
        let seed = seed.to_string();
        let args = ["--world", "2", "--seed", seed.as_str()];
        digest(&output_bounded(
            Command::new(BIN).args(base).args(args).args(extra),
        ))
    };
    let expected = threads(flags);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(digest(o), expected, "rank {r}");
    }
    assert_ne!(threads(&[]), expected, "{what}");
    outs
}

/// A small resnet run: BatchNorm buffers, made alike each step.
const RESNET: [&str; 9] = [
    "run", "--model", "resnet", "--blocks", "1", "--steps", "2", "--batch", "2",
];

/// The resnet with `SyncBatchNorm` (`--sync-bn`): two processes over TCP, each seeding its own
/// model, normalize with the statistics of both ranks' batches and end as its two threads do,
/// and not as the same run with Burn's `BatchNorm` (each rank's own statistics) ends.
#[test]
fn processes_training_a_resnet_with_synchronized_norms_end_as_its_threads() {
    assert_processes_end_as_threads(
        &RESNET,
        5,
        &["--sync-bn"],
        "--sync-bn trained as BatchNorm does",
    );
}

/// Processes with uneven inputs (`--uneven 1`: rank 0 trains 2 steps, rank 1 all 3, over TCP,
/// each seeding its own model) take part in each other's gradient syncs to the end and end with
/// rank 1's weights, as the run's two threads do; and not as the even run ends. The same with
/// the last step's mean divided by the one rank that trained it (`--uneven-mean trained`).
#[test]
fn processes_with_uneven_inputs_end_as_their_threads() {
    let mut digests = Vec::new();
    for flags in [
        &["--uneven", "1"][..],
        &["--uneven", "1", "--uneven-mean", "trained"],
    ] {
        let outs = assert_processes_end_as_threads(&ARGS, 9, flags, "--uneven as the even run");
        assert_uneven_lines(&outs);
        digests.push(digest(&outs[0]));
    }
    assert_ne!(digests[0], digests[1], "the two means end alike");
}

/// The resnet with uneven inputs (`--uneven 1`: rank 0 trains 1 step, rank 1 both): the
/// finished process takes part in the other's buffer sync as well as its gradient sync, and the
/// two processes end as the run's two threads do.
#[test]
fn processes_with_uneven_inputs_training_a_resnet_end_as_its_threads() {
    let outs = assert_processes_end_as_threads(&RESNET, 5, &["--uneven", "1"], "--uneven");
    for (r, o) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        let line = format!("uneven inputs (rank {r}): trained {} steps", 1 + r);
        assert!(text.contains(&line), "rank {r}:\n{text}");
    }
}

fn assert_uneven_lines(outs: &[Output]) {
    for (r, o) in outs.iter().enumerate() {
        let text = String::from_utf8_lossy(&o.stdout);
        let line = format!(
            "uneven inputs (rank {r}): trained {} steps, took part in {} more with zero gradients; ends with rank 1's weights",
            2 + r,
            1 - r
        );
        assert!(text.contains(&line), "rank {r}:\n{text}");
    }
}

/// A process whose model has an extra layer fails every process at `mark_distributed`,
/// naming the parameter where the models part.
#[test]
fn a_process_with_an_extra_layer_fails_all_three_naming_it() {
    let outs = over_tcp(3, |r| {
        if r == 1 {
            vec!["--hidden-layers".into(), "4".into()]
        } else {
            Vec::new()
        }
    });
    for (r, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "rank {r}: {err}");
        assert!(
            err.contains(&format!("error: rank {r}: the ranks' models differ at parameter 6: rank {r} has 3.weight f32[1024,")),
            "rank {r}: {err}"
        );
        assert!(
            err.contains("(8 parameters on rank") || err.contains("(10 parameters on rank"),
            "rank {r}: {err}"
        );
    }
}

/// `run --transport tcp` as rank 0 of `world` on a free loopback port, with `env` added: its
/// output and its stderr.
fn rank_zero_over_tcp(world: usize, env: &[(&str, &str)]) -> (Output, String) {
    let out = output_bounded(
        Command::new(BIN)
            .args(ARGS)
            .args(["--transport", "tcp"])
            .env("RANK", "0")
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", free_port().to_string())
            .envs(env.iter().copied()),
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

#[test]
fn a_rank_that_never_starts_fails_rank_zero_with_its_number() {
    let (out, err) = rank_zero_over_tcp(2, &[("CF_RENDEZVOUS_TIMEOUT_MS", "500")]);
    // An error, not a panic: exit code 1 and `error:`.
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("error: "), "{err}");
    assert!(err.contains("rank(s) [1] of 2 never joined"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
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

#[test]
fn a_malformed_tcp_setting_is_named() {
    let (out, err) = rank_zero_over_tcp(1, &[("CF_TCP_SHARDED_MIN_BYTES", "1MB")]);
    assert!(!out.status.success());
    assert!(
        err.contains("CF_TCP_SHARDED_MIN_BYTES=\"1MB\": a number of bytes, or \"never\""),
        "{err}"
    );
}

#[test]
fn a_rank_killed_mid_run_fails_the_others_naming_it() {
    survivors_fail_naming(BIN, &["--transport", "tcp"], 3, 1);
}

#[test]
fn rank_zero_killed_mid_run_fails_the_others_naming_it() {
    survivors_fail_naming(BIN, &["--transport", "tcp"], 3, 0);
}

/// The peer watch across real processes: three ranks join with `rendezvous --hold-ms` and
/// stay; rank 1 is killed with SIGKILL; ranks 0 and 2 (which hears it from rank 0) exit 1
/// within seconds, naming rank 1, instead of holding on.
#[test]
fn a_killed_process_is_named_by_the_peer_watch_of_every_other() {
    use std::io::BufRead;
    let port = free_port().to_string();
    let args: Vec<String> = ["rendezvous", "--hold-ms", "60000"]
        .map(String::from)
        .to_vec();
    let mut children: Vec<_> = (0..3)
        .map(|r| rank_process(BIN, &args, r, 3, &port).spawn().unwrap())
        .collect();
    // Rank 0 prints its line once every rank joined.
    let stdout = children[0].stdout.take().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("rank 0 of 3: joined"), "{line}");
    std::thread::sleep(Duration::from_millis(200));
    children[1].kill().unwrap();
    let killed = Instant::now();
    let _ = children[1].wait();
    for (r, c) in children.into_iter().enumerate() {
        if r == 1 {
            continue;
        }
        let o = wait_bounded(c, PROCESS_LIMIT, &format!("rank {r}"));
        let took = killed.elapsed();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "rank {r}: {err}");
        assert!(
            err.contains(&format!("error: rank {r}: rank 1's process is gone")),
            "rank {r}: {err}"
        );
        assert!(took < Duration::from_secs(10), "rank {r} took {took:?}");
    }
}

/// Ranks that all stay for the hold and then end say goodbye: every one exits 0.
#[test]
fn ranks_that_finish_together_are_no_departure() {
    let port = free_port().to_string();
    let args: Vec<String> = ["rendezvous", "--hold-ms", "500"]
        .map(String::from)
        .to_vec();
    let children: Vec<_> = (0..3)
        .map(|r| rank_process(BIN, &args, r, 3, &port).spawn().unwrap())
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait_bounded(c, PROCESS_LIMIT, &format!("rank {r}"));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "rank {r}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains("every rank was there"), "rank {r}: {out}");
    }
}

/// Set in the rank processes a panicking-group test starts: run as a rank of its group, and
/// panic if this rank is the one the variable names.
const PANIC_GROUP: &str = "CF_TEST_PANIC_GROUP";

/// The message the panicking rank's training loop panics with.
const PANICS: &str = "this rank's training loop hit a bug";

/// A rank of a TCP group written as a user would (`Autodiff<Collective<NdArray>>`, Burn's
/// `Linear`, SGD; the launcher's environment), whose rank `victim` panics in its third step,
/// after the forward pass, while the others wait for its gradients (their timeout is 60 s).
fn rank_of_a_group_where_one_panics(victim: usize) {
    use burn_autodiff::Autodiff;
    use burn_backend::Backend;
    use burn_backend::distributed::{DistributedConfig, ReduceOperation};
    use burn_ndarray::{NdArray, NdArrayDevice};
    use burn_nn::loss::{MseLoss, Reduction};
    use burn_nn::{Linear, LinearConfig};
    use burn_optim::{GradientsParams, Optimizer, SgdConfig};
    use collective_fusion::backend::{
        Collective, CollectiveDevice, CollectiveOptions, mark_distributed,
    };
    use collective_fusion::runtime::rendezvous::RendezvousConfig;
    use collective_fusion::runtime::transport::Transport;
    use collective_fusion::train::synthetic_batch;
    type I = NdArray<f32>;
    type B = Autodiff<Collective<I>>;
    let timeout = Duration::from_secs(60);
    let cfg = RendezvousConfig::from_env(timeout).expect("the launcher's environment");
    let rank = cfg.rank;
    let device = CollectiveDevice::new(NdArrayDevice::Cpu, rank as u32);
    CollectiveOptions {
        transport: Transport::Tcp(cfg),
        timeout,
        ..CollectiveOptions::default()
    }
    .install::<I>();
    Collective::<I>::try_start_communication_server(
        std::slice::from_ref(&device),
        DistributedConfig {
            all_reduce_op: ReduceOperation::Mean,
        },
    )
    .expect("joining the group");
    B::seed(&device, 1);
    let mut net: Linear<B> =
        mark_distributed(LinearConfig::new(8, 4).init(&device)).expect("marking the model");
    let mut sgd = SgdConfig::new().init::<B, Linear<B>>();
    for step in 0..4 {
        let (x, y) = synthetic_batch::<B>(step, (rank * 2, rank * 2 + 2), 8, 4, &device);
        let loss = MseLoss::new().forward(net.forward(x), y, Reduction::Mean);
        assert!(!(rank == victim && step == 2), "{PANICS}");
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        net = sgd.step(0.1, net, grads);
        eprintln!("rank {rank}: step {step} done");
    }
}

/// Runs test `name` of this binary as the three ranks of a TCP group whose rank `victim`
/// panics mid-step (a bug in the user's code on one rank), and checks that the others, in
/// their own processes, fail within seconds rather than at their 60 s timeout, naming the
/// rank, where it panicked and the panic's message. (The aborting rank tells them over the
/// peer watch, the rendezvous connections, before its data connections shut.)
fn the_others_name_a_panicking_rank(name: &str, victim: usize) {
    if let Some(v) = std::env::var_os(PANIC_GROUP) {
        rank_of_a_group_where_one_panics(v.to_str().and_then(|v| v.parse().ok()).unwrap());
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let exe = exe.to_str().expect("a UTF-8 path");
    let port = free_port().to_string();
    let args: Vec<String> = ["--exact", name, "--nocapture", "--test-threads=1"]
        .map(String::from)
        .to_vec();
    let t0 = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|r| {
            rank_process(exe, &args, r, 3, &port)
                .env(PANIC_GROUP, victim.to_string())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .enumerate()
        .map(|(r, c)| wait_bounded(c, PROCESS_LIMIT, &format!("rank {r}")))
        .collect();
    let took = t0.elapsed();
    let err = |r: usize| String::from_utf8_lossy(&outs[r].stderr).into_owned();
    assert!(
        err(victim).contains(PANICS),
        "rank {victim}:\n{}",
        err(victim)
    );
    for r in (0..3).filter(|r| *r != victim) {
        assert!(!outs[r].status.success(), "rank {r} failed:\n{}", err(r));
        let named = format!(
            "rank {victim} aborted the group: its thread panicked at tests/multiprocess.rs:"
        );
        assert!(
            err(r).contains(&named) && err(r).contains(PANICS),
            "rank {r} names rank {victim}'s panic:\n{}",
            err(r)
        );
    }
    assert!(
        took < Duration::from_secs(30),
        "the group took {took:?} to fail (the timeout is 60 s)"
    );
}

/// A peer's panic: rank 0 hears it over the watch, rank 2 from rank 0.
#[test]
fn a_rank_process_whose_thread_panics_fails_the_others_at_once() {
    the_others_name_a_panicking_rank(
        "a_rank_process_whose_thread_panics_fails_the_others_at_once",
        1,
    );
}

/// The panic of rank 0, the TCP star's centre: every peer hears it from rank 0 itself.
#[test]
fn rank_zero_whose_thread_panics_fails_the_others_at_once() {
    the_others_name_a_panicking_rank("rank_zero_whose_thread_panics_fails_the_others_at_once", 0);
}

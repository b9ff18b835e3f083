//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod cube;
pub mod join;
pub mod kernels;
pub mod kill;
pub mod persistent;
pub mod ranks;
pub mod sync_norm;
pub mod threads;

use collective_fusion::config::{BucketConfig, BucketPolicy, CompileConfig};
use collective_fusion::graph::Graph;
use collective_fusion::graph::parse::parse;
use collective_fusion::graph::print::print;
use collective_fusion::graph::verify::{VerifyOptions, verify};
use collective_fusion::passes::{ManagerOptions, Pass, PassManager};

/// One gradient of a synthetic backward chain: name, type, reduce op, group.
pub struct G<'a>(pub &'a str, pub &'a str, pub &'a str, pub &'a str);

/// A backward chain in text form: one compute per gradient, then gradient and grad_sync, then a
/// sync reading every grad_sync. Groups g0 and g1 have 4 ranks.
pub fn chain(grads: &[G<'_>]) -> String {
    chain_in(4, grads)
}

/// [`chain`] with groups of `world` ranks.
pub fn chain_in(world: u32, grads: &[G<'_>]) -> String {
    let mut s = format!("graph \"t\" {{\n  group g0 size={world}\n  group g1 size={world}\n");
    s.push_str("  %0 = input \"loss.grad\" : f32[8]\n");
    let mut n = 1;
    let mut prev = 0;
    let mut syncs = Vec::new();
    for (i, G(name, ty, reduce, group)) in grads.iter().enumerate() {
        s.push_str(&format!(
            "  %{n} = compute \"{name}.bwd\" kind=matmul flops=1000000000 (%{prev}) : f32[8]\n"
        ));
        prev = n;
        s.push_str(&format!(
            "  %{} = gradient \"{name}\" (%{n}) : {ty}\n",
            n + 1
        ));
        s.push_str(&format!(
            "  %{} = grad_sync \"{name}\" reduce={reduce} group={group} ready={i} (%{}) : {ty}\n",
            n + 2,
            n + 1
        ));
        syncs.push(format!("%{}", n + 2));
        n += 3;
    }
    s.push_str(&format!("  %{n} = sync ({})\n}}\n", syncs.join(", ")));
    s
}

/// A free TCP port on the loopback interface.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The rendezvous of a group of one (rank 0, device 0) on a free loopback port.
pub fn world_of_one() -> collective_fusion::runtime::rendezvous::RendezvousConfig {
    collective_fusion::runtime::rendezvous::RendezvousConfig::loopback(
        0,
        1,
        free_port(),
        std::time::Duration::from_secs(30),
    )
}

/// Bucketing options.
pub fn bucket(policy: BucketPolicy, first: u64, cap: u64) -> BucketConfig {
    BucketConfig {
        policy,
        cap_bytes: cap,
        first_bucket_bytes: first,
    }
}

/// Parses `text`, runs `passes` with verification on, and returns the printed result.
pub fn run_passes(text: &str, passes: Vec<Box<dyn Pass>>, cap: Option<u64>) -> String {
    let mut g = parse(text).unwrap_or_else(|e| panic!("test input does not parse: {e}\n{text}"));
    let pm = PassManager::new(
        passes,
        ManagerOptions {
            verify: true,
            verify_options: VerifyOptions {
                bucket_cap_bytes: cap,
            },
            ..Default::default()
        },
    );
    pm.run(&mut g).unwrap_or_else(|e| panic!("{e}"));
    roundtrip(&g)
}

/// Prints `g`, checks that the text parses back to the same text, and returns it.
pub fn roundtrip(g: &Graph) -> String {
    let text = print(g);
    let again =
        parse(&text).unwrap_or_else(|e| panic!("printed graph does not parse: {e}\n{text}"));
    assert_eq!(
        print(&again),
        text,
        "print → parse → print changed the text"
    );
    text
}

/// A test configuration: verification on.
pub fn config(bucket: BucketConfig, overlap: bool) -> CompileConfig {
    CompileConfig {
        bucket,
        overlap,
        verify: true,
        ..CompileConfig::default()
    }
}

/// Checks the verifier accepts `g` with the given cap.
pub fn assert_valid(g: &Graph, cap: Option<u64>) {
    if let Err(e) = verify(
        g,
        &VerifyOptions {
            bucket_cap_bytes: cap,
        },
    ) {
        panic!("{e}\n{}", print(g));
    }
}

/// How long a process a test starts may run before the test kills it and fails: far above what
/// any of them takes, so that a hang fails the test instead of holding CI.
pub const PROCESS_LIMIT: std::time::Duration = std::time::Duration::from_secs(180);

/// Waits for `child` (stdout and stderr piped) at most `limit`; past it, kills the process and
/// panics naming `what`. Its output is read on threads meanwhile, so a full pipe cannot stall it.
pub fn wait_bounded(
    mut child: std::process::Child,
    limit: std::time::Duration,
    what: &str,
) -> std::process::Output {
    use std::io::Read;
    fn drain<R: Read + Send + 'static>(r: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    }
    let out = drain(child.stdout.take());
    let err = drain(child.stderr.take());
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("the process can be waited for") {
            break s;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let err = String::from_utf8_lossy(&err.join().unwrap_or_default()).into_owned();
            panic!("{what}: still running after {limit:?}, killed; its stderr:\n{err}");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// Runs test `child_test` of this test binary once per side of `sides`, each in a child process
/// with `var` naming the side and `configure` given the command and a scratch log file of its
/// own; returns what `read` makes of each side's log. Fails with a child's output if it fails.
pub fn child_sides<T>(
    child_test: &str,
    var: &str,
    sides: &[&str],
    configure: impl Fn(&mut std::process::Command, &std::path::Path),
    read: impl Fn(&std::path::Path) -> T,
) -> Vec<T> {
    let exe = std::env::current_exe().expect("this test binary");
    let dir = std::env::temp_dir().join(format!("cf-{child_test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let found = sides
        .iter()
        .map(|which| {
            let log = dir.join(format!("{which}.log"));
            let mut cmd = std::process::Command::new(&exe);
            cmd.args(["--exact", child_test, "--nocapture", "--test-threads=1"])
                .env(var, which);
            configure(&mut cmd, &log);
            let out = output_bounded(&mut cmd);
            assert!(
                out.status.success(),
                "{which}: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            read(&log)
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    found
}

/// Runs `cmd` to the end like `Command::output`, within [`PROCESS_LIMIT`].
pub fn output_bounded(cmd: &mut std::process::Command) -> std::process::Output {
    let what = format!("{cmd:?}");
    let child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the command starts");
    wait_bounded(child, PROCESS_LIMIT, &what)
}

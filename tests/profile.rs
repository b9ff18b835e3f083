//! The `profile` comparison table and trace files: structure snapshots (the simulation is
//! deterministic arithmetic, so the table's numbers are stable; trace snapshots keep names,
//! tracks and order, not times).

mod common;

use collective_fusion::config::{BucketPolicy, CompileConfig};
use collective_fusion::cost::{CostModel, SystemProfile};
use collective_fusion::graph::ReduceOp;
use collective_fusion::model::ModelProfile;
use collective_fusion::profile::{ProfileOptions, compare, compiled_graph, simulated_trace};
use collective_fusion::trace::{SpanKind, chrome_json, svg};

fn options(link: &str) -> ProfileOptions {
    let cost = CostModel::new(SystemProfile::load(link).unwrap());
    ProfileOptions {
        world: cost.system.world,
        batch: 8,
        reduce: ReduceOp::Mean,
        config: CompileConfig {
            cost,
            ..CompileConfig::default()
        },
    }
}

/// The standard output of a command that must have succeeded (its standard error otherwise).
fn success_stdout(out: std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

#[test]
fn profile_tables_of_two_models() {
    for (model, link) in [("gpt2", "h200-nvlink"), ("resnet50", "ib-400g")] {
        let profile = ModelProfile::load(model).unwrap();
        let mut seen = Vec::new();
        let cmp = compare(&profile, &options(link), BucketPolicy::Cost, |p| {
            seen.push(p.to_string())
        })
        .unwrap();
        assert_eq!(
            seen,
            ["per-param", "ddp", "cost"],
            "progress names every policy"
        );
        for r in &cmp.rows {
            assert!(
                r.times.total >= cmp.bound.step * (1.0 - 1e-9),
                "{model} {}: beats the bound",
                r.policy.name()
            );
        }
        insta::assert_snapshot!(format!("profile_{model}_{link}"), cmp.to_string());
    }
}

#[test]
fn trace_structure_names_tracks_and_order() {
    let profile = ModelProfile::load("resnet50").unwrap();
    let opts = options("h200-nvlink");
    let g = compiled_graph(&profile, &opts, BucketPolicy::Ddp).unwrap();
    let (times, spans) = simulated_trace(&g, &opts.config.cost).unwrap();
    // Early buckets' all-reduces overlap later backward compute.
    let first_ar = spans.iter().find(|s| s.cat == SpanKind::AllReduce).unwrap();
    assert!(
        spans.iter().any(|s| s.cat == SpanKind::Compute
            && s.start_us < first_ar.start_us + first_ar.dur_us
            && s.start_us + s.dur_us > first_ar.start_us),
        "the first all-reduce overlaps compute"
    );
    assert!(
        (spans
            .iter()
            .map(|s| s.start_us + s.dur_us)
            .fold(0.0, f64::max)
            - times.total * 1e6)
            .abs()
            < 1e-3
    );
    let json: serde_json::Value = serde_json::from_str(&chrome_json("resnet50", &spans)).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let mut lines = Vec::new();
    for e in events {
        let ph = e["ph"].as_str().unwrap();
        if ph == "M" {
            lines.push(format!(
                "M pid={} tid={} {}={}",
                e["pid"],
                e["tid"],
                e["name"].as_str().unwrap(),
                e["args"]
            ));
        } else {
            assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() > 0.0);
            lines.push(format!(
                "X pid={} tid={} [{}] {}",
                e["pid"],
                e["tid"],
                e["cat"].as_str().unwrap(),
                e["name"].as_str().unwrap()
            ));
        }
    }
    // Compute spans are many and uninteresting one by one: keep the first five and the count.
    let compute: Vec<&String> = lines.iter().filter(|l| l.contains("[compute]")).collect();
    let n_compute = compute.len();
    let keep: Vec<String> = lines
        .iter()
        .filter(|l| {
            !l.contains("[compute]") || compute.iter().take(5).any(|c| std::ptr::eq(*c, *l))
        })
        .cloned()
        .collect();
    insta::assert_snapshot!(format!(
        "{}\n... {n_compute} compute spans in all",
        keep.join("\n")
    ));
    let svg = svg("resnet50", &spans);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<title>").count(), spans.len());
}

#[test]
fn profile_command_prints_the_table_and_writes_both_traces() {
    let dir = std::env::temp_dir().join(format!("cf-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, svg_path) = (dir.join("step.json"), dir.join("step.svg"));
    let out = common::output_bounded(
        std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion"))
            .args([
                "profile", "--model", "resnet50", "--policy", "ddp", "--trace",
            ])
            .arg(&trace)
            .arg("--svg")
            .arg(&svg_path),
    );
    let text = success_stdout(out);
    assert!(text.contains("ddp*") && text.contains("bound"), "{text}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert!(json["traceEvents"].as_array().unwrap().len() > 100);
    assert!(
        std::fs::read_to_string(&svg_path)
            .unwrap()
            .contains("all-reduce b0")
    );
    // An unknown model is a clear error naming it.
    let bad = common::output_bounded(
        std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion")).args([
            "profile",
            "--model",
            "no_such_model",
        ]),
    );
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no_such_model"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_command_trains_on_cpu_ranks_and_traces_overlap() {
    let dir = std::env::temp_dir().join(format!("cf-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("run.json");
    let step_graph = dir.join("step.txt");
    let out = common::output_bounded(
        std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion"))
            .args([
                "run",
                "--world",
                "2",
                "--steps",
                "3",
                "--batch",
                "4",
                "--bucket-cap",
                "2MiB",
                "--trace",
            ])
            .arg(&trace)
            .arg("--step-graph")
            .arg(&step_graph),
    );
    let text = success_stdout(out);
    assert!(
        text.contains("2 steps launched buckets during backward, 1 reduced at the sync point"),
        "{text}"
    );
    assert!(text.contains("ranks agree: yes"), "{text}");
    // The recorded step: the MLP's forward and backward ops and the syncs among them.
    assert!(text.contains("recorded step (rank 0): "), "{text}");
    let graph = std::fs::read_to_string(&step_graph).unwrap();
    assert!(graph.contains("compute \"linear\" kind=matmul"), "{graph}");
    assert!(graph.contains("grad_sync"), "{graph}");
    collective_fusion::graph::parse::parse(&graph).expect("the step graph parses back");
    // The recorded step profiles like a model: every policy at 8 ranks, and the chosen policy's
    // compiled graph with its buckets launched among the recorded ops.
    let prof = common::output_bounded(
        std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion"))
            .args([
                "profile",
                "--world",
                "8",
                "--policy",
                "ddp",
                "--print-graph",
                "--model",
            ])
            .arg(&step_graph),
    );
    let ptext = success_stdout(prof);
    assert!(ptext.contains("world 8 · recorded step"), "{ptext}");
    assert!(ptext.contains("\nddp* "), "{ptext}");
    assert!(ptext.contains("all_reduce_start"), "{ptext}");
    assert!(ptext.contains("group g0 size=8"), "{ptext}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let spans = |pid: u64, name: &str| -> Vec<(f64, f64)> {
        events
            .iter()
            .filter(|e| {
                e["ph"] == "X" && e["pid"] == pid && e["name"].as_str().unwrap().starts_with(name)
            })
            .map(|e| {
                (
                    e["ts"].as_f64().unwrap(),
                    e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    for rank in 0..2 {
        // In a step after the first, an all-reduce starts while that rank's backward still runs.
        let backward = spans(rank, "backward");
        let all_reduce = spans(rank, "all_reduce");
        let overlapped = backward[1..]
            .iter()
            .any(|(b0, b1)| all_reduce.iter().any(|(a0, _)| a0 > b0 && a0 < b1));
        assert!(
            overlapped,
            "rank {rank}: no all-reduce started during a backward pass"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `run --compare-policies`: the same steps of the many-small-tensors model under every
/// policy (two rounds in turn), each row's measured times beside the simulator's prediction for
/// those steps, and the same final weights whatever the bucketing (the in-process sum is
/// elementwise in rank order).
#[test]
fn run_compare_policies_measures_and_predicts_every_policy() {
    let out = common::output_bounded(
        std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion")).args([
            "run",
            "--model",
            "blocks",
            "--blocks",
            "2",
            "--world",
            "2",
            "--steps",
            "4",
            "--batch",
            "2",
            "--compare-policies",
            "--rounds",
            "2",
        ]),
    );
    let text = success_stdout(out);
    assert!(
        text.starts_with("compare policies: blocks on ndarray · 2 ranks"),
        "{text}"
    );
    assert!(text.contains("steps 3–4 of 2 rounds in turn"), "{text}");
    let row = |name: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} row: {text}"));
        line.split_whitespace().map(str::to_string).collect()
    };
    // Two blocks of 16 tensors, the embedding, the final norm and the head: 38 gradients, one
    // all-reduce each under per-param, measured and predicted alike.
    assert_eq!(row("per-param")[1..3], ["38", "(38)"], "{text}");
    let ddp: f64 = row("ddp")[1].parse().unwrap();
    assert!(ddp < 38.0, "{text}");
    for name in ["per-param", "ddp", "cost"] {
        let r = row(name);
        // measured and predicted step, backward, exposed, wait and host work.
        for i in [3, 4, 6, 7, 9, 10, 12, 13, 14, 15] {
            let v: f64 = r[i].parse().unwrap_or_else(|_| panic!("{name}: {text}"));
            assert!(v.is_finite() && v >= 0.0, "{text}");
        }
        // The waits and the host work are each a part of the exposed time, measured and
        // predicted.
        for (exposed, parts) in [(9, [12, 14]), (10, [13, 15])] {
            let exposed: f64 = r[exposed].parse().unwrap();
            for i in parts {
                assert!(r[i].parse::<f64>().unwrap() <= exposed + 0.01, "{text}");
            }
        }
        // The hand-back of 38 gradients is host work the simulator now sees.
        assert!(r[15].parse::<f64>().unwrap() > 0.0, "{name}: {text}");
    }
    // Each pair of policies compared step by step, by step time and by exposed
    // communication: steps 3 and 4 of two rounds.
    let paired: Vec<&str> = text.lines().filter(|l| l.starts_with("  ")).collect();
    assert_eq!(paired.len(), 6, "{text}");
    for (line, pair) in paired.into_iter().zip(
        ["cost − ddp", "ddp − per-param", "cost − per-param"]
            .into_iter()
            .cycle(),
    ) {
        assert!(line.trim_start().starts_with(pair), "{line}");
        let a = pair.split(' ').next().unwrap();
        let faster = line
            .split(&format!("{a} lower in "))
            .nth(1)
            .and_then(|t| t.split(" of 4 ").next())
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(faster <= 4, "{line}");
        // 4 pairs are too few for a 95% interval of the median.
        assert!(line.contains("95% CI   (too few pairs)"), "{line}");
        // With 4 pairs no split is lopsided enough for p < 0.001.
        let p: f64 = line.rsplit("p = ").next().unwrap().parse().unwrap();
        assert!((0.125..=1.0).contains(&p), "{line}");
    }
    // Planned after step 1, and again after step 2 when its collectives ran under the
    // backward (what they paid there is news to the first plan).
    assert!(
        text.contains("cost: 1 plan(s) from measured steps, 0 re-plan(s)")
            || text.contains("cost: 2 plan(s) from measured steps, 1 re-plan(s)"),
        "{text}"
    );
    assert!(
        text.contains(
            "ranks agree under every policy: yes; the same weights under every policy: yes"
        ),
        "{text}"
    );
}

/// `run --backend wgpu`: the same training on Burn's wgpu backend (Mesa's software Vulkan driver
/// in CI), buckets packed on the device; with `--bucket-view` the reduced gradients are views of
/// their buckets, and the weights are bit for bit those of the copies.
#[test]
fn run_command_trains_on_wgpu_ranks_with_device_buckets_and_views() {
    if common::cube::wgpu_client().is_none() {
        return;
    }
    let run = |extra: &[&str]| -> String {
        let out = common::output_bounded(
            std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion"))
                .args([
                    "run",
                    "--backend",
                    "wgpu",
                    "--world",
                    "2",
                    "--steps",
                    "2",
                    "--batch",
                    "4",
                ])
                .args(extra),
        );
        success_stdout(out)
    };
    let copies = run(&[]);
    assert!(copies.starts_with("run mlp on wgpu · 2 ranks"), "{copies}");
    assert!(copies.contains("ranks agree: yes"), "{copies}");
    assert!(
        copies.contains("buckets packed on the gradients' device"),
        "{copies}"
    );
    assert!(
        copies.contains(", 0 gradients handed back as views"),
        "{copies}"
    );
    let views = run(&["--bucket-view"]);
    assert!(
        !views.contains(", 0 gradients handed back as views"),
        "{views}"
    );
    let digest = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("weights digest"))
            .map(str::to_string)
    };
    assert_eq!(digest(&copies), digest(&views), "{copies}\n{views}");
    assert!(digest(&copies).is_some());
}

/// Inputs that parse but are wrong (`tests/malformed/`): `profile` says `error: ...` and exits
/// with code 1, in every build; none reaches a pass or an unchecked size unverified.
#[test]
fn malformed_inputs_are_errors_never_panics() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/malformed");
    let mut cases = 0;
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x != "md"))
        .collect();
    files.sort();
    for path in files {
        let file = path.to_str().expect("a UTF-8 path").to_string();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // A link profile goes to every command that takes one; anything else is a model (graph
        // text or a profile) for every command that loads a model.
        let commands: Vec<Vec<&str>> = if name.starts_with("link_") {
            vec![
                vec!["profile", "--model", "gpt2", "--link", &file],
                vec!["plan", "--model", "gpt2", "--link", &file],
            ]
        } else {
            vec![
                vec!["profile", "--model", &file],
                vec!["plan", "--model", &file],
            ]
        };
        for args in commands {
            cases += 1;
            let out = common::output_bounded(
                std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion"))
                    .args(&args)
                    // As in a release build: no verification after passes.
                    .env("CF_VERIFY", "0"),
            );
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
            assert!(err.starts_with("error:"), "{args:?}: {err}");
        }
    }
    assert!(cases >= 20, "only {cases} malformed inputs");
}

/// Bad values on the command line and in the launcher's environment: an `error:` line naming
/// the value and a non-zero exit (1, or clap's 2 for a value it parses), never a panic (101).
#[test]
fn bad_arguments_and_environment_are_errors_never_panics() {
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let cases: &[Case] = &[
        (&["run", "--world", "0"], &[]),
        (&["run", "--steps", "0"], &[]),
        (&["run", "--batch", "0"], &[]),
        (&["run", "--timeout", "0"], &[]),
        (&["run", "--bucket-cap", "0"], &[]),
        (&["run", "--bucket-cap", "1ZiB"], &[]),
        (&["run", "--world", "100000"], &[]),
        (&["run", "--model", "blocks", "--blocks", "0"], &[]),
        (&["run", "--model", "mlp", "--blocks", "2"], &[]),
        (&["run", "--model", "mlp", "--width", "0"], &[]),
        (&["run", "--model", "convnet", "--width", "64"], &[]),
        (&["run", "--compare-policies", "--steps", "2"], &[]),
        (&["run", "--compare-policies", "--policy", "ddp"], &[]),
        (&["run", "--compare-policies", "--rounds", "0"], &[]),
        (&["run", "--rounds", "2"], &[]),
        (
            &["run", "--world", "3", "--steps", "4", "--uneven", "2"],
            &[],
        ),
        (
            &[
                "run",
                "--model",
                "resnet",
                "--sync-bn",
                "--world",
                "2",
                "--uneven",
                "1",
            ],
            &[],
        ),
        (&["run", "--world", "2", "--uneven-mean", "trained"], &[]),
        (&["plan", "--model", "gpt2", "--world", "0"], &[]),
        (&["plan", "--model", "no-such-model"], &[]),
        (&["profile", "--model", "gpt2", "--world", "0"], &[]),
        (
            &["profile", "--model", "gpt2", "--link", "no-such-link"],
            &[],
        ),
        (
            &["rendezvous"],
            &[
                ("RANK", "x"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "1"),
            ],
        ),
        (
            &["rendezvous"],
            &[
                ("RANK", "3"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "1"),
            ],
        ),
        (&["run", "--transport", "tcp"], &[("RANK", "0")]),
    ];
    for (args, env) in cases {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_collective-fusion"));
        cmd.args(*args)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("MASTER_ADDR")
            .env_remove("MASTER_PORT");
        for (k, v) in *env {
            cmd.env(k, v);
        }
        let out = common::output_bounded(&mut cmd);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(1 | 2)),
            "{args:?} {env:?}: exit {:?}: {err}",
            out.status.code()
        );
        assert!(err.starts_with("error:"), "{args:?} {env:?}: {err}");
    }
}

/// Two gradients of 4 KiB (`a`, `b`) ready at 0 and 1000 us, then 2000 us of compute to the
/// sync point, on 2 ranks over [`fitted_link`] with the fixed costs `alpha_split_us`: the
/// measured segment compiled one collective per gradient, and the config it was compiled with.
fn two_gradients_per_param(
    alpha_split_us: [Option<f64>; 2],
) -> (collective_fusion::graph::Graph, CompileConfig) {
    use collective_fusion::graph::{DType, TensorType};
    use collective_fusion::measure::MeasuredProfile;
    let profile = MeasuredProfile {
        ready_us: vec![0.0, 1000.0],
        link: Some(fitted_link()),
        alpha_split_us,
        interference_us: None,
        cores_free_us: None,
    };
    let ty = TensorType::new(DType::F32, &[1024]);
    let entries = vec![("a".to_string(), ty.clone()), ("b".to_string(), ty)];
    let mut g = profile.segment_until(2, ReduceOp::Mean, &entries, 2000.0);
    let mut cfg = CompileConfig::default();
    cfg.bucket.policy = BucketPolicy::PerParam;
    cfg.cost = CostModel::new(profile.system_profile(2, &cfg.cost.system));
    collective_fusion::passes::compile(&mut g, &cfg).unwrap();
    (g, cfg)
}

/// The facts of a measured step the simulator takes beyond the graph: a collective waits for
/// the last rank to have its gradient, and the hand-back after the last collective is time at
/// the sync point.
#[test]
fn a_late_peer_and_the_hand_back_are_time_at_the_sync_point() {
    use collective_fusion::cost::{StepFacts, simulate_measured};
    // Alone, both all-reduces (about 54 us each) are hidden.
    let (g, cfg) = two_gradients_per_param([None; 2]);
    let alone = simulate_measured(&g, &cfg.cost, &StepFacts::default()).unwrap();
    assert!((alone.compute_end - 3000e-6).abs() < 1e-9, "{alone:?}");
    assert!(alone.at_sync() < 1e-9, "{alone:?}");
    // The other rank has `b` only at 4000 us: its all-reduce ends about 54 us after that.
    let mut facts = StepFacts::default();
    facts.peer_ready.insert("b".into(), 4000e-6);
    let late = simulate_measured(&g, &cfg.cost, &facts).unwrap();
    let ar = 50e-6 + 4096.0 / 1e9;
    assert!((late.at_sync() - (1000e-6 + ar)).abs() < 1e-7, "{late:?}");
    assert!((late.waits - late.at_sync()).abs() < 1e-9, "{late:?}");
    // The hand-back comes after the last collective, all of it at the sync point.
    facts.handback = 300e-6;
    let handed = simulate_measured(&g, &cfg.cost, &facts).unwrap();
    assert!(
        (handed.at_sync() - late.at_sync() - 300e-6).abs() < 1e-9,
        "{handed:?}"
    );
    assert_eq!(handed.host, 300e-6);
    assert!((handed.waits - late.waits).abs() < 1e-12);
}

/// A link of 50 us and 1 GB/s, as fitted from two sizes.
fn fitted_link() -> collective_fusion::measure::LinkFit {
    collective_fusion::measure::LinkFit {
        alpha_us: 50.0,
        busbw_gbs: 1.0,
        sizes: 2,
        samples: 2,
    }
}

/// Eight gradients of 4 KiB, `g0` to `g7`.
fn eight_gradients_of_4_kib() -> Vec<(String, collective_fusion::graph::TensorType)> {
    use collective_fusion::graph::{DType, TensorType};
    let ty = TensorType::new(DType::F32, &[1024]);
    (0..8).map(|i| (format!("g{i}"), ty.clone())).collect()
}

/// A measured profile of `entries` ready one every 1000 us over [`fitted_link`], a collective
/// costing 50 us during the backward and after it, no interference, no cores' horizon.
fn one_every_ms(
    entries: &[(String, collective_fusion::graph::TensorType)],
) -> collective_fusion::measure::MeasuredProfile {
    collective_fusion::measure::MeasuredProfile {
        ready_us: (0..entries.len()).map(|i| i as f64 * 1000.0).collect(),
        link: Some(fitted_link()),
        alpha_split_us: [Some(50.0), Some(50.0)],
        interference_us: None,
        cores_free_us: None,
    }
}

/// `profile`'s segment of `entries` on 2 ranks, compiled under `policy` with the profile's
/// measured system, as the measured plans are, and simulated.
fn planned_and_simulated(
    profile: &collective_fusion::measure::MeasuredProfile,
    entries: &[(String, collective_fusion::graph::TensorType)],
    policy: BucketPolicy,
) -> collective_fusion::cost::StepTimes {
    let mut g = profile.segment(2, ReduceOp::Mean, entries);
    let mut cfg = CompileConfig::default();
    cfg.bucket.policy = policy;
    cfg.cost = CostModel::new(profile.system_profile(2, &cfg.cost.system));
    collective_fusion::passes::compile(&mut g, &cfg).unwrap();
    collective_fusion::cost::simulate(&g, &cfg.cost).unwrap()
}

/// A collective that starts while the step's compute runs pays the system's busy alpha, one
/// that starts after it the plain alpha: the simulator and the `cost` policy read the same
/// system, so the plan moves communication out of a backward pass that makes it dear.
#[test]
fn a_collective_under_the_backward_pays_the_busy_alpha() {
    use collective_fusion::graph::{DType, TensorType};
    use collective_fusion::measure::MeasuredProfile;
    // Two gradients of 4 KiB, ready at 0 and 1000 us, the backward over at 1000 us.
    let ty = TensorType::new(DType::F32, &[1024]);
    let entries = vec![("a".to_string(), ty.clone()), ("b".to_string(), ty)];
    let run = |busy: Option<f64>, policy: BucketPolicy| {
        let profile = MeasuredProfile {
            ready_us: vec![0.0, 1000.0],
            link: Some(fitted_link()),
            alpha_split_us: [busy, Some(50.0)],
            interference_us: None,
            cores_free_us: None,
        };
        planned_and_simulated(&profile, &entries, policy)
    };
    let ar = 50.0 + 4096.0 / 1e3;
    // `a` at 0 pays 3000 us under the backward; `b` starts at its end, after the backward.
    let dear = run(Some(3000.0), BucketPolicy::PerParam);
    assert_eq!(dear.collectives, 2);
    let want = 3000.0 + 4096.0 / 1e3 + ar;
    assert!((dear.total * 1e6 - want).abs() < 1e-3, "{dear:?}");
    // At one alpha throughout `a` is hidden under the backward and the cost policy keeps it
    // alone; at 3000 us it waits for the backward's end and goes with `b`.
    let cheap = run(None, BucketPolicy::Cost);
    assert_eq!(cheap.collectives, 2, "{cheap:?}");
    let planned = run(Some(3000.0), BucketPolicy::Cost);
    assert_eq!(planned.collectives, 1, "{planned:?}");
    assert!(
        planned.total < dear.total / 2.0,
        "{planned:?} against {dear:?}"
    );
}

/// Where the process's cores came free before this rank's backward was over (ranks that
/// share cores out of step), a collective after that pays the idle alpha in the plan as in the
/// measurement the split came from: the `cost` policy overlaps the end of the backward instead
/// of waiting for it, and the simulator, reading the same system, predicts the step shorter.
#[test]
fn the_plan_pays_the_idle_alpha_once_the_cores_came_free() {
    use collective_fusion::measure::MeasuredProfile;
    // Eight gradients of 4 KiB, one every 1000 us, the backward over at 7000 us; a
    // collective costs 8000 us while every core computes (longer than the backward, so none
    // can hide under it), 50 after.
    let entries = eight_gradients_of_4_kib();
    let run = |cores_free: Option<f64>, policy: BucketPolicy| {
        let profile = MeasuredProfile {
            alpha_split_us: [Some(8000.0), Some(50.0)],
            cores_free_us: cores_free,
            ..one_every_ms(&entries)
        };
        let sys = profile.system_profile(2, &CostModel::default().system);
        assert_eq!(sys.busy_shift_us, cores_free.map(|f| f - 7000.0));
        planned_and_simulated(&profile, &entries, policy)
    };
    // Busy until the backward's end: one collective after it.
    let busy = run(None, BucketPolicy::Cost);
    assert_eq!(busy.collectives, 1, "{busy:?}");
    // The cores free at 2000 us: what is ready after that goes out at once, at 50 us each.
    let freed = run(Some(2000.0), BucketPolicy::Cost);
    assert!(freed.collectives > 1, "{freed:?}");
    assert!(freed.total < busy.total, "{freed:?} against {busy:?}");
    // One per gradient, the cores free from the start: each at 50 us as it comes, the last
    // ending 50 us and its bytes after the backward. Busy until the backward's end: g0 pays
    // 8000 and the seven queued behind it start after the end, at 50 each.
    let wire = 4096.0 / 1e3;
    let idle = run(Some(0.0), BucketPolicy::PerParam);
    assert!(
        (idle.total * 1e6 - (7000.0 + 50.0 + wire)).abs() < 1e-3,
        "{idle:?}"
    );
    let busy = run(None, BucketPolicy::PerParam);
    let want = 8000.0 + wire + 7.0 * (50.0 + wire);
    assert!((busy.total * 1e6 - want).abs() < 1e-3, "{busy:?}");
}

/// A collective under the backward that takes compute time from it (`interference_us`, the
/// CPU ranks' shared cores) delays the rest of the backward in the simulator, and the `cost`
/// policy, pricing the same, stops splitting gradients into collectives that run beside it.
#[test]
fn a_collective_that_slows_the_backward_is_charged_to_it_and_avoided() {
    use collective_fusion::measure::MeasuredProfile;
    // Eight gradients of 4 KiB, one every 1000 us, the backward over at 7000 us.
    let entries = eight_gradients_of_4_kib();
    let run = |interference: Option<f64>, policy: BucketPolicy| {
        let profile = MeasuredProfile {
            interference_us: interference,
            ..one_every_ms(&entries)
        };
        planned_and_simulated(&profile, &entries, policy)
    };
    // One per gradient: the seven launched under the backward each delay it by 400 us.
    let free = run(None, BucketPolicy::PerParam);
    let taxed = run(Some(400.0), BucketPolicy::PerParam);
    assert_eq!(taxed.collectives, 8);
    assert!(
        (taxed.interference * 1e6 - 7.0 * 400.0).abs() < 1e-3,
        "{taxed:?}"
    );
    assert!(
        (taxed.total - free.total - taxed.interference).abs() < 1e-9,
        "{taxed:?} against {free:?}"
    );
    // Free beside the backward, the cost policy overlaps; charged, it waits for the end.
    let overlapped = run(None, BucketPolicy::Cost);
    assert!(overlapped.collectives > 1, "{overlapped:?}");
    let planned = run(Some(400.0), BucketPolicy::Cost);
    assert_eq!(planned.collectives, 1, "{planned:?}");
    assert_eq!(planned.interference, 0.0, "{planned:?}");
    assert!(planned.total < taxed.total, "{planned:?} against {taxed:?}");
}

/// `predict_measured` lines the ranks' steps up by their start: a peer that had the last
/// gradient later than this rank makes this rank wait for it at the sync point, and the
/// measured hand-back follows.
#[test]
fn a_measured_step_is_predicted_with_its_peers_lined_up_by_their_start() {
    use collective_fusion::measure::{LinkFit, MeasuredGradient, MeasuredStep};
    use collective_fusion::profile::predict_measured;
    let grad = |param: &str, ready_us: f64| MeasuredGradient {
        param: param.into(),
        bytes: 4096,
        ready_us,
    };
    let mine = MeasuredStep {
        world: 2,
        start_us: 1000.0,
        gradients: vec![grad("a", 100.0), grad("b", 200.0)],
        sync_us: 300.0,
        handback_us: 50.0,
        end_us: 1000.0,
        ..MeasuredStep::default()
    };
    // The peer started 500 us later and had `b` 200 us later in its own step: 700 us after
    // this rank, 800 us after this rank's first gradient.
    let peer = MeasuredStep {
        start_us: 1500.0,
        gradients: vec![grad("a", 100.0), grad("b", 400.0)],
        ..mine.clone()
    };
    let link = LinkFit {
        alpha_us: 50.0,
        busbw_gbs: 1.0,
        sizes: 2,
        samples: 2,
    };
    let cfg = CompileConfig::default();
    let predict = |peers: &[MeasuredStep]| {
        predict_measured(
            &mine,
            peers,
            Some(link),
            ReduceOp::Mean,
            &cfg,
            BucketPolicy::PerParam,
        )
        .unwrap()
    };
    let ar: f64 = 50.0 + 4096.0 / 1e3;
    let alone = predict(&[]);
    assert!((alone.compute_end * 1e6 - 200.0).abs() < 1e-6, "{alone:?}");
    // Alone: `b`'s all-reduce (launched at 100 us) ends before the sync point at 200 us; the
    // hand-back is all there is at the sync point.
    let own_end = (100.0 + ar).max(200.0);
    assert!(
        (alone.at_sync() * 1e6 - (own_end - 200.0 + 50.0)).abs() < 1e-3,
        "{alone:?}"
    );
    let late = predict(std::slice::from_ref(&peer));
    assert!(
        (late.at_sync() * 1e6 - (800.0 + ar - 200.0 + 50.0)).abs() < 1e-3,
        "{late:?}"
    );
    assert_eq!(late.host, 50e-6);
}

/// Where the measured step says the cores freed before this rank's compute ended (the other
/// ranks were done), a collective that starts after that pays the idle alpha, though this
/// rank still computes (`StepFacts::busy_until`).
#[test]
fn a_collective_after_the_cores_freed_pays_the_idle_alpha() {
    use collective_fusion::cost::{StepFacts, simulate_measured};
    // A collective costs 3000 us while the cores are taken, 50 us after.
    let (g, cfg) = two_gradients_per_param([Some(3000.0), Some(50.0)]);
    let ar = 50e-6 + 4096.0 / 1e9;
    // Busy until this rank's compute ends at 3000 us: `a` ends at 3000 + 4 us, `b` after it.
    let own = simulate_measured(&g, &cfg.cost, &StepFacts::default()).unwrap();
    assert!(
        (own.at_sync() - (4096.0 / 1e9 + ar)).abs() < 1e-9,
        "{own:?}"
    );
    // The cores free from the start: both are hidden under the compute.
    let facts = StepFacts {
        busy_until: Some(0.0),
        ..StepFacts::default()
    };
    let freed = simulate_measured(&g, &cfg.cost, &facts).unwrap();
    assert!(freed.at_sync() < 1e-9, "{freed:?}");
    assert!((freed.comm - 2.0 * ar).abs() < 1e-9, "{freed:?}");
}

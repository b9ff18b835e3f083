//! The `collective-fusion` command: inspect what the compiler does to a real model's step.

use std::fmt::Write as _;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use collective_fusion::codegen::layout::bucket_layouts;
use collective_fusion::config::{BucketPolicy, CompileConfig, PrintAfter};
use collective_fusion::cost::{CostModel, SystemProfile, simulate};
use collective_fusion::graph::builder::{BuildOptions, build_step_graph};
use collective_fusion::graph::print::{fmt_bytes, print};
use collective_fusion::graph::{DType, ReduceOp};
use collective_fusion::model::ModelProfile;
use collective_fusion::passes::compile;

#[derive(Parser)]
#[command(
    name = "collective-fusion",
    version,
    about = "A graph compiler for the gradient communication of data-parallel training"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Policy {
    /// One all-reduce per parameter (Burn today).
    PerParam,
    /// PyTorch DDP's greedy buckets.
    Ddp,
    /// Cost-model buckets.
    Cost,
}

#[derive(Clone, Copy, ValueEnum)]
enum RunModelArg {
    /// 784 → 1024 → 1024 → 1024 → 10 multilayer perceptron.
    Mlp,
    /// Two 3×3 convolutions and a linear layer on 28×28 inputs.
    Convnet,
    /// Transformer-style blocks of width 64 (many small tensors: 16 per block).
    Blocks,
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    /// Every rank a thread of this process (`--world` ranks).
    Inprocess,
    /// This process is one rank, over TCP: the launcher's RANK, WORLD_SIZE, MASTER_ADDR and
    /// MASTER_PORT say which and where (as torchrun sets them).
    Tcp,
    /// This process is one rank, over NCCL on GPU LOCAL_RANK (feature `cuda`); the same
    /// environment as `tcp`.
    #[cfg(feature = "cuda")]
    Nccl,
    /// Every rank a thread of this process on its own GPU, over NCCL (`--world` GPUs, with
    /// `--backend cuda`; feature `cuda`).
    #[cfg(feature = "cuda")]
    NcclLocal,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendArg {
    /// Burn's NdArray on the CPU: gradients in host memory.
    Ndarray,
    /// Burn's wgpu backend on the default adapter: gradients stay in device buffers.
    Wgpu,
    /// Burn's CUDA backend (a build with `--features cuda`).
    Cuda,
    /// Burn's runtime-selected backend (`burn::Dispatch`) on `--dispatch-device`.
    Dispatch,
}

#[derive(Clone, Copy, ValueEnum)]
enum DispatchDeviceArg {
    /// Dispatch's NdArray device (the CPU).
    Ndarray,
    /// Dispatch's wgpu device (the default adapter).
    Wgpu,
    /// Dispatch's CUDA device (a build with `--features cuda`).
    Cuda,
}

#[derive(Clone, Copy, ValueEnum)]
enum ProfilePolicy {
    /// One all-reduce per parameter.
    None,
    /// PyTorch DDP's buckets.
    Ddp,
    /// Cost-model buckets.
    Cost,
}

impl From<Policy> for BucketPolicy {
    fn from(p: Policy) -> Self {
        match p {
            Policy::PerParam => BucketPolicy::PerParam,
            Policy::Ddp => BucketPolicy::Ddp,
            Policy::Cost => BucketPolicy::Cost,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum PrintWhen {
    All,
    Change,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model data-parallel on CPU ranks (threads of this process) through
    /// `Autodiff<Collective<NdArray>>`, with per-step timing and an optional trace.
    Run(RunArgs),
    /// Simulate one training step of a model under every bucketing policy, side by side against
    /// a lower bound; optionally write the chosen policy's step as a trace.
    Profile(ProfileArgs),
    /// Compile one training step of a model and print the optimized graph and its bucket plan.
    Plan {
        /// A bundled profile (resnet50, vit_b_16, bert_base_uncased, gpt2, llama_1b,
        /// llama_1b_tied) or the path of a profile file of the same schema.
        #[arg(long)]
        model: String,
        /// Bucketing policy (default: CF_BUCKET_POLICY, else ddp).
        #[arg(long, value_enum)]
        policy: Option<Policy>,
        /// Bucket cap: bytes, or with a unit (25MiB, 512KiB). Default 25MiB.
        #[arg(long, value_parser = parse_size)]
        bucket_cap: Option<u64>,
        /// Cap of the first bucket: bytes, or with a unit. Default 1MiB.
        #[arg(long, value_parser = parse_size)]
        first_bucket: Option<u64>,
        /// Ranks in the data-parallel group (default: the link profile's).
        #[arg(long)]
        world: Option<u32>,
        /// Samples per rank (scales compute).
        #[arg(long, default_value_t = 8)]
        batch: u64,
        /// System profile for the cost model: a bundled name or a file.
        #[arg(long)]
        link: Option<String>,
        /// Cast buckets to this dtype for the all-reduce (bf16, f16, f32).
        #[arg(long)]
        reduce_dtype: Option<String>,
        /// Reduce with sum instead of mean.
        #[arg(long)]
        sum: bool,
        /// Keep collectives blocking (no start/done split, no overlap scheduling).
        #[arg(long)]
        no_overlap: bool,
        /// Hand reduced gradients back as views of their bucket (DDP's
        /// gradient_as_bucket_view; default: CF_BUCKET_VIEW, else off).
        #[arg(long)]
        bucket_view: bool,
        /// Skip a pass by name (repeatable).
        #[arg(long = "disable-pass")]
        disable_pass: Vec<String>,
        /// Print the graph after every pass, or after every pass that changed it (to stderr).
        #[arg(long, value_enum)]
        print_after: Option<PrintWhen>,
        /// Print the bucket plan as JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Print the lowered plan (per-stream steps, NCCL calls) instead of the graph.
        #[arg(long)]
        lowered: bool,
    },
    /// Join a multi-process rendezvous from the launcher's environment (RANK, WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT; CF_RENDEZVOUS_TIMEOUT_MS) and print the 128-byte id rank 0
    /// shared, as a real job shares NCCL's: checks that every rank reaches rank 0 before a long
    /// job starts.
    Rendezvous {
        /// Give up after this many milliseconds (default: CF_RENDEZVOUS_TIMEOUT_MS, else 60000).
        #[arg(long)]
        timeout_ms: Option<u64>,
    },
}

/// The `CF_*` compiler options with the command line's bucketing options over them.
fn configured(
    policy: Option<Policy>,
    cap: Option<u64>,
    first: Option<u64>,
    views: bool,
) -> Result<CompileConfig, collective_fusion::config::ConfigError> {
    let mut config = CompileConfig::from_env()?;
    if let Some(p) = policy {
        config.bucket.policy = p.into();
    }
    config.bucket.cap_bytes = cap.unwrap_or(config.bucket.cap_bytes);
    config.bucket.first_bucket_bytes = first.unwrap_or(config.bucket.first_bucket_bytes);
    config.gradient_as_bucket_view |= views;
    Ok(config)
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = [
        ("GiB", 1u64 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n.trim(), *m)))
    .unwrap_or((s, 1));
    let v: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (bytes, or a number with KiB/MiB/GiB)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err(format!("'{s}' must be a positive size"));
    }
    Ok((v * mult as f64).round() as u64)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CF_LOG"))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Run(a) => run_cmd(a),
        Command::Profile(a) => profile_cmd(a),
        Command::Rendezvous { timeout_ms } => {
            use collective_fusion::runtime::rendezvous::{RendezvousConfig, rendezvous};
            let mut cfg = RendezvousConfig::from_env(std::time::Duration::from_secs(60))?;
            if let Some(ms) = timeout_ms {
                cfg.timeout = std::time::Duration::from_millis(ms);
            }
            let t0 = std::time::Instant::now();
            let id = rendezvous(&cfg, || {
                // NCCL's own id where NCCL is there; else a random one of the same size.
                #[cfg(feature = "cuda")]
                if let Ok(id) = collective_fusion::runtime::nccl::unique_id() {
                    return id;
                }
                let seed = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0)
                    ^ u64::from(std::process::id()) << 32;
                let mut rng = collective_fusion::runtime::synthetic::SplitMix64(seed);
                (0..16).flat_map(|_| rng.next_u64().to_le_bytes()).collect()
            })?;
            let hex: String = id.iter().take(8).map(|b| format!("{b:02x}")).collect();
            let digest = id.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
            });
            println!(
                "rank {} of {}: joined {}:{} in {} ms; id {hex}… ({} bytes, fnv {digest:016x})",
                cfg.rank,
                cfg.world,
                cfg.addr,
                cfg.port,
                t0.elapsed().as_millis(),
                id.len()
            );
            Ok(())
        }
        Command::Plan {
            model,
            policy,
            bucket_cap,
            first_bucket,
            world,
            batch,
            link,
            reduce_dtype,
            sum,
            no_overlap,
            bucket_view,
            disable_pass,
            print_after,
            json,
            lowered,
        } => {
            let mut out = String::new();
            let profile = ModelProfile::load(&model)?;
            let mut config = configured(policy, bucket_cap, first_bucket, bucket_view)?;
            if let Some(l) = link {
                config.cost = CostModel::new(SystemProfile::load(&l)?);
            }
            if let Some(d) = reduce_dtype {
                config.reduce_dtype = Some(
                    DType::from_name(&d)
                        .filter(|d| d.is_float())
                        .ok_or_else(|| {
                            format!("--reduce-dtype '{d}': expected bf16, f16, f32 or f64")
                        })?,
                );
            }
            if no_overlap {
                config.overlap = false;
            }
            config.disabled_passes.extend(disable_pass);
            if let Some(p) = print_after {
                config.print_after = match p {
                    PrintWhen::All => PrintAfter::All,
                    PrintWhen::Change => PrintAfter::Change,
                };
            }
            let world = world.unwrap_or(config.cost.system.world);
            if world == 0 {
                return Err("--world must be at least 1".into());
            }
            let opts = BuildOptions {
                world,
                batch,
                reduce: if sum { ReduceOp::Sum } else { ReduceOp::Mean },
            };
            let mut graph = build_step_graph(&profile, &opts);
            let baseline = simulate(&graph, &config.cost)?;
            let report = compile(&mut graph, &config)?;
            for (pass, text) in &report.dumps {
                eprintln!("; after pass '{pass}'\n{text}");
            }
            let layouts = bucket_layouts(&graph)?;
            let index_of = |name: &str| profile.params.iter().position(|p| p.name == name);
            if json {
                let buckets: Vec<serde_json::Value> = layouts
                    .iter()
                    .map(|l| {
                        let params: Vec<Option<usize>> = l
                            .members
                            .iter()
                            .map(|m| m.param.as_deref().and_then(index_of))
                            .collect();
                        serde_json::json!({
                            "bucket": l.bucket,
                            "params": params,
                            "bytes": l.member_bytes,
                            "wire_bytes": l.bytes,
                            "wire_dtype": l.wire_dtype,
                            "reduce": l.reduce,
                            "scale_div": l.scale_div,
                        })
                    })
                    .collect();
                let json_out = serde_json::json!({
                    "model": profile.model,
                    "policy": config.bucket.policy.name(),
                    "bucket_cap": config.bucket.cap_bytes,
                    "first_bucket": config.bucket.first_bucket_bytes,
                    "world": world,
                    "buckets": buckets,
                });
                writeln!(out, "{}", serde_json::to_string_pretty(&json_out)?)?;
                return emit(&out);
            }
            if lowered {
                write!(out, "{}", collective_fusion::codegen::lower(&graph)?)?;
            } else {
                write!(out, "{}", print(&graph))?;
            }
            writeln!(out)?;
            writeln!(
                out,
                "model {} · {} tensors, {} · policy {} · cap {} · first {} · world {} · link {}",
                profile.model,
                profile.params.len(),
                fmt_bytes(profile.total_bytes()),
                config.bucket.policy.name(),
                fmt_bytes(config.bucket.cap_bytes),
                fmt_bytes(config.bucket.first_bucket_bytes),
                world,
                config.cost.system.name
            )?;
            writeln!(
                out,
                "{:>6}  {:>7}  {:>11}  {:>9}  {:<40}  {:<40}",
                "bucket", "tensors", "bytes", "allreduce", "first param", "last param"
            )?;
            for l in &layouts {
                let name = |m: Option<&collective_fusion::codegen::layout::MemberLayout>| {
                    m.and_then(|m| m.param.clone())
                        .unwrap_or_else(|| "-".into())
                };
                writeln!(
                    out,
                    "{:>6}  {:>7}  {:>11}  {:>7.1}us  {:<40}  {:<40}",
                    l.bucket.map_or("-".to_string(), |b| b.to_string()),
                    l.members.len(),
                    fmt_bytes(l.bytes),
                    config.cost.all_reduce_secs(l.bytes, world) * 1e6,
                    name(l.members.first()),
                    name(l.members.last()),
                )?;
            }
            let after = simulate(&graph, &config.cost)?;
            writeln!(out)?;
            writeln!(
                out,
                "predicted step: {:.3} ms (compute {:.3} ms, comm {:.3} ms, exposed comm {:.3} ms, waits {:.3} ms, overlap {:.0}%)",
                after.total * 1e3,
                after.compute * 1e3,
                after.comm * 1e3,
                after.exposed() * 1e3,
                after.waits * 1e3,
                after.overlap_pct()
            )?;
            writeln!(
                out,
                "per-parameter sync:  {:.3} ms (exposed comm {:.3} ms, {} collectives)",
                baseline.total * 1e3,
                baseline.exposed() * 1e3,
                baseline.collectives
            )?;
            let total: f64 = report
                .timings
                .iter()
                .map(|t| t.duration.as_secs_f64())
                .sum();
            writeln!(
                out,
                "compile: {} passes in {:.3} ms ({})",
                report.timings.len(),
                total * 1e3,
                report
                    .timings
                    .iter()
                    .map(|t| format!("{} {:.0}us", t.name, t.duration.as_secs_f64() * 1e6))
                    .collect::<Vec<_>>()
                    .join(", ")
            )?;
            emit(&out)
        }
    }
}

#[derive(clap::Args)]
struct RunArgs {
    /// Ranks.
    #[arg(long, default_value_t = 4)]
    world: u32,
    /// Model.
    #[arg(long, value_enum, default_value = "mlp")]
    model: RunModelArg,
    /// Training steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Bucketing policy (default: CF_BUCKET_POLICY, else ddp).
    #[arg(long, value_enum)]
    policy: Option<Policy>,
    /// Bucket cap: bytes, or with a unit (25MiB). Default 25MiB.
    #[arg(long, value_parser = parse_size)]
    bucket_cap: Option<u64>,
    /// Cap of the first bucket. Default 1MiB.
    #[arg(long, value_parser = parse_size)]
    first_bucket: Option<u64>,
    /// Write every rank's spans as Chrome/Perfetto trace JSON.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Write the same as an SVG timeline.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// Write rank 0's last recorded step (every op, the gradients and their syncs) in the
    /// graph text form; `profile --model FILE --print-graph` compiles and simulates it.
    #[arg(long)]
    step_graph: Option<std::path::PathBuf>,
    /// How the ranks talk: threads of this process, or one rank per process.
    #[arg(long, value_enum, default_value = "inprocess")]
    transport: TransportArg,
    /// The Burn backend inside `Collective`.
    #[arg(long, value_enum, default_value = "ndarray")]
    backend: BackendArg,
    /// The device of `--backend dispatch`.
    #[arg(long, value_enum, default_value = "ndarray")]
    dispatch_device: DispatchDeviceArg,
    /// Hand reduced gradients back as views of their bucket (device backends; DDP's
    /// gradient_as_bucket_view; default: CF_BUCKET_VIEW, else off).
    #[arg(long)]
    bucket_view: bool,
    /// Bound on every wait for another rank, in seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Seed of this process's model initialization. Processes seeded differently build
    /// different weights; marking the model gives every rank rank 0's.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Hidden layers of the MLP, 1024 wide each (default 3).
    #[arg(long)]
    hidden_layers: Option<usize>,
    /// Transformer-style blocks of `--model blocks` (default 12).
    #[arg(long)]
    blocks: Option<usize>,
    /// Train the same steps under each bucketing policy (per-param, ddp, cost; same seed) and
    /// print each one's measured step time and exposed communication beside what the
    /// simulator predicts for those very steps from the measured times and link.
    #[arg(long, conflicts_with_all = ["policy", "trace", "svg", "step_graph"])]
    compare_policies: bool,
    /// What marking the model does about the ranks' weights: take rank 0's, or check that
    /// they already are rank 0's.
    #[arg(long, value_enum, default_value = "broadcast")]
    initial_weights: InitialWeightsArg,
}

#[derive(Clone, Copy, ValueEnum)]
enum InitialWeightsArg {
    /// Every rank takes rank 0's weights (PyTorch DDP's behaviour).
    Broadcast,
    /// Every rank keeps its own, which must be rank 0's bit for bit.
    Verify,
}

fn run_cmd(a: RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    use collective_fusion::backend::{CollectiveOptions, InitialWeights, Transport};
    use collective_fusion::train::{DispatchOn, RunBackend, RunModel, RunOptions, run};
    use std::io::IsTerminal as _;
    if a.world == 0 || a.world > 256 {
        return Err("--world must be between 1 and 256".into());
    }
    if a.steps == 0 || a.batch == 0 {
        return Err("--steps and --batch must be at least 1".into());
    }
    let config = configured(a.policy, a.bucket_cap, a.first_bucket, a.bucket_view)?;
    let backend = match a.backend {
        BackendArg::Ndarray => RunBackend::NdArray,
        BackendArg::Wgpu => RunBackend::Wgpu,
        BackendArg::Cuda => RunBackend::Cuda,
        BackendArg::Dispatch => RunBackend::Dispatch(match a.dispatch_device {
            DispatchDeviceArg::Ndarray => DispatchOn::NdArray,
            DispatchDeviceArg::Wgpu => DispatchOn::Wgpu,
            DispatchDeviceArg::Cuda => DispatchOn::Cuda,
        }),
    };
    let model = match (a.model, a.hidden_layers, a.blocks) {
        (RunModelArg::Mlp, layers, None) => RunModel::Mlp {
            hidden_layers: layers.unwrap_or(3),
        },
        (RunModelArg::Convnet, None, None) => RunModel::ConvNet,
        (RunModelArg::Blocks, None, blocks) => RunModel::Blocks {
            blocks: blocks.unwrap_or(12),
        },
        (_, Some(_), _) => {
            return Err("--hidden-layers is an option of --model mlp".into());
        }
        (_, _, Some(_)) => {
            return Err("--blocks is an option of --model blocks".into());
        }
    };
    if a.blocks == Some(0) {
        return Err("--blocks must be at least 1".into());
    }
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        return Err("--timeout must be a positive number of seconds".into());
    }
    let timeout = std::time::Duration::from_secs_f64(a.timeout);
    let from_env = || collective_fusion::runtime::rendezvous::RendezvousConfig::from_env(timeout);
    let transport = match a.transport {
        TransportArg::Inprocess => Transport::InProcess,
        TransportArg::Tcp => Transport::Tcp(from_env()?),
        #[cfg(feature = "cuda")]
        TransportArg::Nccl => Transport::Nccl(from_env()?),
        #[cfg(feature = "cuda")]
        TransportArg::NcclLocal => {
            if !matches!(
                backend,
                RunBackend::Cuda | RunBackend::Dispatch(DispatchOn::Cuda)
            ) {
                return Err("--transport nccl-local needs --backend cuda (a GPU per rank)".into());
            }
            Transport::NcclLocal
        }
    };
    let opts = RunOptions {
        world: a.world,
        model,
        steps: a.steps,
        batch: a.batch,
        backend,
        seed: a.seed,
        collective: CollectiveOptions {
            config: config.clone(),
            timeout,
            trace: a.trace.is_some() || a.svg.is_some(),
            transport,
            initial_weights: match a.initial_weights {
                InitialWeightsArg::Broadcast => InitialWeights::Broadcast,
                InitialWeightsArg::Verify => InitialWeights::Verify,
            },
            probe_link: true,
            ..CollectiveOptions::default()
        },
    };
    let tty = std::io::stderr().is_terminal();
    let steps = a.steps;
    let progress = move |done: usize| {
        if tty {
            let width = 30;
            let filled = done * width / steps;
            eprint!(
                "\r[{}{}] step {done}/{steps}",
                "#".repeat(filled),
                " ".repeat(width - filled)
            );
            if done == steps {
                eprint!("\r{:60}\r", "");
            }
        }
    };
    if a.compare_policies {
        return compare_policies_cmd(&opts, tty);
    }
    let report = run(&opts, &progress)?;
    let mut out = String::new();
    writeln!(
        out,
        "run {} on {} · {} ranks{} · {} params ({}) · batch {}/rank · policy {} · cap {} · first {}",
        model.name(),
        backend.name(),
        report.world,
        if report.local_ranks.len() == report.world as usize {
            String::new()
        } else {
            format!(" (this process: rank {:?})", report.local_ranks)
        },
        report.params,
        fmt_bytes(report.bytes),
        a.batch,
        config.bucket.policy.name(),
        fmt_bytes(config.bucket.cap_bytes),
        fmt_bytes(config.bucket.first_bucket_bytes)
    )?;
    writeln!(
        out,
        "{:>5} {:>11} {:>13} {:>10}",
        "step", "time", "backward+sync", "loss"
    )?;
    for (i, s) in report.steps.iter().enumerate() {
        writeln!(
            out,
            "{:>5} {:>8.1} ms {:>10.1} ms {:>10.5}",
            i + 1,
            s.secs * 1e3,
            s.backward_secs * 1e3,
            s.loss
        )?;
    }
    if report.steps.len() > 1 {
        let rest = &report.steps[1..];
        let mean = rest.iter().map(|s| s.secs).sum::<f64>() / rest.len() as f64;
        writeln!(
            out,
            "steps 2–{}: mean {:.1} ms",
            report.steps.len(),
            mean * 1e3
        )?;
    }
    let s0 = &report.stats[0];
    writeln!(
        out,
        "gradient sync: {} steps launched buckets during backward, {} reduced at the sync point, {} left alone (one rank), {} plan(s) compiled; ranks agree: {}",
        s0.eager_steps,
        s0.flushed_steps,
        s0.local_steps,
        s0.compiled,
        if report.ranks_agree { "yes" } else { "NO" }
    )?;
    if s0.device_buckets + s0.device_collectives + s0.view_grads > 0 {
        writeln!(
            out,
            "device (rank {}): {} buckets packed by the kernels on the gradients' buffers, {} collectives reduced in place in device memory, {} gradients handed back as views of their bucket",
            report.local_ranks[0], s0.device_buckets, s0.device_collectives, s0.view_grads
        )?;
    }
    let r0 = report.local_ranks[0];
    if s0.measured_plans > 0 {
        writeln!(
            out,
            "measured plans (rank {r0}): {} compiled from measured steps, {} of them re-plans after a drift",
            s0.measured_plans, s0.replans
        )?;
    }
    if let Some(m) = &report.measured {
        writeln!(out, "measured (rank {r0}, last step): {m}")?;
    }
    if report.world > 1 {
        match &report.link {
            Some(l) => writeln!(out, "link (rank {r0}, fitted): {l}")?,
            None => writeln!(
                out,
                "link (rank {r0}): not fitted (collectives of fewer than two sizes)"
            )?,
        }
    }
    writeln!(
        out,
        "weights digest (rank {}): {:016x}",
        report.local_ranks[0], report.weights_digest
    )?;
    let l = &report.lazy[0];
    writeln!(
        out,
        "lazy ops (rank 0): {} recorded, {} ran, {} never ran (dropped before needed); queue run {} times for a value ({}), {} for a shape or dtype, {} by sync, {} at the bound",
        l.recorded,
        l.executed,
        l.skipped,
        l.forced_by_value,
        l.forced_by
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", "),
        l.forced_by_metadata,
        l.forced_by_sync,
        l.forced_by_bound
    )?;
    if let Some(st) = &report.step {
        writeln!(
            out,
            "recorded step (rank 0): {} ops ({} matmul/conv), {:.1} MFLOP; {} buckets; the first launches with {} of {} ops after it still to run",
            st.ops,
            st.heavy_ops,
            st.flops as f64 / 1e6,
            st.buckets,
            st.ops_after_first_launch,
            st.ops
        )?;
        if let Some(p) = &a.step_graph {
            std::fs::write(p, &st.text).map_err(|e| format!("writing {}: {e}", p.display()))?;
            writeln!(out, "step graph: {}", p.display())?;
        }
    }
    let title = format!(
        "run {} · {} ranks · {}",
        model.name(),
        report.world,
        config.bucket.policy.name()
    );
    if let Some(p) = &a.trace {
        std::fs::write(
            p,
            collective_fusion::trace::chrome_json(&title, &report.trace),
        )
        .map_err(|e| format!("writing {}: {e}", p.display()))?;
        writeln!(out, "trace: {} ({} spans)", p.display(), report.trace.len())?;
    }
    if let Some(p) = &a.svg {
        // The last step: from rank 0's last forward to the end.
        let from = report
            .trace
            .iter()
            .filter(|s| s.rank == 0 && s.name == "forward")
            .map(|s| s.start_us)
            .fold(0.0, f64::max);
        let to = report
            .trace
            .iter()
            .map(|s| s.start_us + s.dur_us)
            .fold(0.0, f64::max);
        let title = format!(
            "{title} · step {} of {}",
            report.steps.len(),
            report.steps.len()
        );
        std::fs::write(
            p,
            collective_fusion::trace::svg_between(&title, &report.trace, from, to),
        )
        .map_err(|e| format!("writing {}: {e}", p.display()))?;
        writeln!(out, "svg: {} (the last step)", p.display())?;
    }
    if !report.ranks_agree {
        emit(&out)?;
        return Err("the ranks ended with different weights".into());
    }
    emit(&out)
}

#[derive(clap::Args)]
struct ProfileArgs {
    /// A bundled profile (resnet50, vit_b_16, bert_base_uncased, gpt2, llama_1b,
    /// llama_1b_tied), the path of a profile file of the same schema, or a recorded step in
    /// the graph text form (`run --step-graph`).
    #[arg(long)]
    model: String,
    /// Ranks (default: the link profile's).
    #[arg(long)]
    world: Option<u32>,
    /// System profile: a bundled name (h200-nvlink, ib-400g) or a file.
    #[arg(long)]
    link: Option<String>,
    /// Bucket cap: bytes, or with a unit (25MiB). Default 25MiB.
    #[arg(long, value_parser = parse_size)]
    bucket_cap: Option<u64>,
    /// Cap of the first bucket. Default 1MiB.
    #[arg(long, value_parser = parse_size)]
    first_bucket: Option<u64>,
    /// Policy whose trace is written and which the table marks with `*` (none = per-param).
    #[arg(long, default_value = "cost")]
    policy: ProfilePolicy,
    /// Samples per rank (scales compute).
    #[arg(long, default_value_t = 8)]
    batch: u64,
    /// Write the chosen policy's simulated step as Chrome/Perfetto trace JSON.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Write the same step as an SVG timeline.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// Print the chosen policy's compiled step graph after the table.
    #[arg(long)]
    print_graph: bool,
}

fn profile_cmd(a: ProfileArgs) -> Result<(), Box<dyn std::error::Error>> {
    use collective_fusion::profile::{
        ProfileOptions, StepSource, compare_step, compiled_step, simulated_trace,
    };
    use std::io::IsTerminal as _;
    // A file in the graph text form is a recorded step (`run --step-graph`); anything else
    // names a model profile.
    let recorded = match std::fs::read_to_string(&a.model) {
        Ok(text) if collective_fusion::profile::is_graph_text(&text) => {
            Some(collective_fusion::profile::recorded_step(&a.model, &text)?)
        }
        _ => None,
    };
    let profile = match &recorded {
        Some(_) => None,
        None => Some(ModelProfile::load(&a.model)?),
    };
    let source = match (&recorded, &profile) {
        (Some(graph), _) => StepSource::Recorded {
            name: &a.model,
            graph,
        },
        (None, Some(p)) => StepSource::Profile(p),
        (None, None) => unreachable!("one of the two was loaded"),
    };
    let mut config = configured(None, a.bucket_cap, a.first_bucket, false)?;
    if let Some(l) = a.link {
        config.cost = CostModel::new(SystemProfile::load(&l)?);
    }
    let world = a.world.unwrap_or(config.cost.system.world);
    if world == 0 {
        return Err("--world must be at least 1".into());
    }
    let opts = ProfileOptions {
        world,
        batch: a.batch,
        reduce: ReduceOp::Mean,
        config,
    };
    let selected = match a.policy {
        ProfilePolicy::None => BucketPolicy::PerParam,
        ProfilePolicy::Ddp => BucketPolicy::Ddp,
        ProfilePolicy::Cost => BucketPolicy::Cost,
    };
    // Progress on a terminal once a run takes more than a moment.
    let started = std::time::Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut shown = false;
    let cmp = compare_step(source, &opts, selected, |policy| {
        if tty && started.elapsed() > std::time::Duration::from_millis(300) {
            eprint!("\rsimulating {} · policy {policy:<9}", source.name());
            shown = true;
        }
    })?;
    if shown {
        eprint!("\r{:60}\r", "");
    }
    let mut out = cmp.to_string();
    if a.print_graph {
        let g = compiled_step(source, &opts, selected)?;
        let _ = write!(out, "\n{}", collective_fusion::graph::print::print(&g));
    }
    if a.trace.is_some() || a.svg.is_some() {
        let g = compiled_step(source, &opts, selected)?;
        let (_, spans) = simulated_trace(&g, &opts.config.cost)?;
        let title = format!(
            "{} · {} · world {} · {} (simulated)",
            source.name(),
            selected.name(),
            world,
            opts.config.cost.system.name
        );
        if let Some(p) = &a.trace {
            std::fs::write(p, collective_fusion::trace::chrome_json(&title, &spans))
                .map_err(|e| format!("writing {}: {e}", p.display()))?;
            let _ = writeln!(out, "trace: {} ({} spans)", p.display(), spans.len());
        }
        if let Some(p) = &a.svg {
            std::fs::write(p, collective_fusion::trace::svg(&title, &spans))
                .map_err(|e| format!("writing {}: {e}", p.display()))?;
            let _ = writeln!(out, "svg: {}", p.display());
        }
    }
    emit(&out)
}

/// Writes the output; a closed pipe (`| head`) is not an error.
/// `run --compare-policies`: the table of [`collective_fusion::train::compare_policies`].
fn compare_policies_cmd(
    opts: &collective_fusion::train::RunOptions,
    tty: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    use collective_fusion::train::{PolicyRun, compare_policies};
    const WARMUP: usize = 2;
    let steps = opts.steps;
    let progress = move |policy: &str, done: usize| {
        if tty {
            eprint!("\r{policy}: step {done}/{steps}   ");
            if done == steps {
                eprint!("\r{:40}\r", "");
            }
        }
    };
    let rows = compare_policies(opts, WARMUP, &progress)?;
    let mut out = String::new();
    writeln!(
        out,
        "compare policies: {} on {} · {} ranks · batch {}/rank · steps {}–{} (median, rank 0) · predicted: the simulator on each step's measured backward and the run's link",
        opts.model.name(),
        opts.backend.name(),
        opts.world,
        opts.batch,
        WARMUP + 1,
        steps
    )?;
    writeln!(
        out,
        "{:<10} {:>11} {:>26} {:>26} {:>26}   link",
        "policy",
        "collectives",
        "step ms (pred, err)",
        "backward ms (pred, err)",
        "exposed ms (pred, err)"
    )?;
    let cell = |p: (f64, f64)| {
        format!(
            "{:>8.2} {:>8.2} {:>+7.1}%",
            p.0,
            p.1,
            PolicyRun::error(p) * 100.0
        )
    };
    for r in &rows {
        writeln!(
            out,
            "{:<10} {:>5.0} {:>5} {:>26} {:>26} {:>26}   {}",
            r.policy.name(),
            r.collectives.0,
            format!("({:.0})", r.collectives.1),
            cell(r.step_ms),
            cell(r.backward_ms),
            cell(r.exposed_ms),
            r.link.map_or("not fitted".to_string(), |l| format!(
                "{:.0} us + {:.2} GB/s",
                l.alpha_us, l.busbw_gbs
            ))
        )?;
    }
    if let Some(c) = rows
        .iter()
        .find(|r| r.policy == collective_fusion::config::BucketPolicy::Cost)
    {
        writeln!(
            out,
            "cost: {} plan(s) from measured steps, {} re-plan(s)",
            c.measured_plans.0, c.measured_plans.1
        )?;
    }
    let same = rows
        .iter()
        .all(|r| r.weights_digest == rows[0].weights_digest);
    let agree = rows.iter().all(|r| r.ranks_agree);
    writeln!(
        out,
        "final weights: ranks agree under every policy: {}; the same weights under every policy: {}",
        if agree { "yes" } else { "NO" },
        if same {
            "yes"
        } else {
            "no (sums in a different order)"
        }
    )?;
    emit(&out)?;
    if !agree {
        return Err("the ranks ended with different weights".into());
    }
    Ok(())
}

fn emit(out: &str) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

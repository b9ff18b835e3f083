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

mod cli {
    pub(crate) mod run;
}
use cli::run::{RunArgs, run_cmd};

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
    /// A small residual convnet with BatchNorm (residual blocks of 8 channels).
    Resnet,
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
        #[command(flatten)]
        bucketing: BucketArgs,
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
        /// Then stay joined this many milliseconds, watching the other ranks as an NCCL job does
        /// (the rendezvous connections as a peer watch): a rank whose process ends without a
        /// goodbye (killed, crashed) is an error naming it; ranks that finish are not.
        #[arg(long)]
        hold_ms: Option<u64>,
    },
}

/// The bucketing options of `run` and `plan`.
#[derive(clap::Args, Clone, Copy, Default)]
struct BucketArgs {
    /// Bucketing policy (default: CF_BUCKET_POLICY, else ddp).
    #[arg(long, value_enum)]
    policy: Option<Policy>,
    /// Bucket cap: bytes, or with a unit (25MiB, 512KiB). Default 25MiB.
    #[arg(long, value_parser = parse_size)]
    bucket_cap: Option<u64>,
    /// Cap of the first bucket: bytes, or with a unit. Default 1MiB.
    #[arg(long, value_parser = parse_size)]
    first_bucket: Option<u64>,
}

/// The `CF_*` compiler options with the command line's bucketing options over them.
fn configured(
    b: BucketArgs,
    views: bool,
) -> Result<CompileConfig, collective_fusion::config::ConfigError> {
    let mut config = CompileConfig::from_env()?;
    if let Some(p) = b.policy {
        config.bucket.policy = p.into();
    }
    config.bucket.cap_bytes = b.bucket_cap.unwrap_or(config.bucket.cap_bytes);
    config.bucket.first_bucket_bytes = b.first_bucket.unwrap_or(config.bucket.first_bucket_bytes);
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
        Command::Rendezvous {
            timeout_ms,
            hold_ms,
        } => {
            use collective_fusion::runtime::peer_watch::DepartureKind;
            use collective_fusion::runtime::rendezvous::{RendezvousConfig, rendezvous_watched};
            let mut cfg = RendezvousConfig::from_env(std::time::Duration::from_secs(60))?;
            if let Some(ms) = timeout_ms {
                cfg.timeout = std::time::Duration::from_millis(ms);
            }
            let t0 = std::time::Instant::now();
            let (id, watch) = rendezvous_watched(&cfg, || {
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
            let digest = collective_fusion::graph::fnv64_bytes(&id);
            println!(
                "rank {} of {}: joined {}:{} in {} ms; id {hex}… ({} bytes, fnv {digest:016x})",
                cfg.rank,
                cfg.world,
                cfg.addr,
                cfg.port,
                t0.elapsed().as_millis(),
                id.len()
            );
            if let Some(ms) = hold_ms {
                let until = std::time::Instant::now() + std::time::Duration::from_millis(ms);
                while std::time::Instant::now() < until {
                    if let Some(d) = watch
                        .departed()
                        .into_iter()
                        .find(|d| d.kind == DepartureKind::Gone)
                    {
                        return Err(format!("rank {}: {d}", cfg.rank).into());
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                println!("rank {}: every rank was there for {ms} ms", cfg.rank);
            }
            Ok(())
        }
        Command::Plan {
            model,
            bucketing,
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
            let mut config = configured(bucketing, bucket_view)?;
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
    let mut config = configured(
        BucketArgs {
            bucket_cap: a.bucket_cap,
            first_bucket: a.first_bucket,
            ..BucketArgs::default()
        },
        false,
    )?;
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
fn emit(out: &str) -> Result<(), Box<dyn std::error::Error>> {
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

//! The `run` command: train on real Burn backends and print what the run measured
//! (`--compare-policies`: the same steps under every bucketing policy beside the simulator's
//! prediction).

use std::fmt::Write as _;

use clap::ValueEnum;
use collective_fusion::graph::print::fmt_bytes;

use crate::{
    BackendArg, BucketArgs, DispatchDeviceArg, RunModelArg, TransportArg, configured, emit,
};

#[derive(clap::Args)]
pub(crate) struct RunArgs {
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
    #[command(flatten)]
    bucketing: BucketArgs,
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
    /// Hidden layers of the MLP (default 3).
    #[arg(long)]
    hidden_layers: Option<usize>,
    /// Width of every hidden layer of the MLP (default 1024).
    #[arg(long)]
    width: Option<usize>,
    /// Transformer-style blocks of `--model blocks` (default 12), residual blocks of `--model
    /// resnet` (default 2).
    #[arg(long)]
    blocks: Option<usize>,
    /// Train the same steps under each bucketing policy (per-param, ddp, cost; same seed) and
    /// print each one's measured step time and exposed communication beside what the
    /// simulator predicts for those very steps from the measured times and link.
    #[arg(long, conflicts_with_all = ["policy", "trace", "svg", "step_graph"])]
    compare_policies: bool,
    /// With `--compare-policies`: train every policy this many times, in turn (per-param,
    /// ddp, cost; then ddp, cost, per-param; ...: each round's order turned by one), and take
    /// the medians over all of them, so a machine whose speed drifts slows every policy alike.
    #[arg(long, default_value_t = 1, requires = "compare_policies", value_parser = clap::value_parser!(u64).range(1..=100))]
    rounds: u64,
    /// What marking the model does about the ranks' weights: take rank 0's, or check that
    /// they already are rank 0's.
    #[arg(long, value_enum, default_value = "broadcast")]
    initial_weights: InitialWeightsArg,
    /// How the ranks' buffers (BatchNorm's running statistics, `--model resnet`) are made
    /// alike before each step: rank 0's (PyTorch DDP's `broadcast_buffers=True`) or the ranks'
    /// mean. A model without buffers communicates nothing.
    #[arg(long, value_enum, default_value = "broadcast")]
    buffers: BuffersArg,
    /// With `--model resnet`: its norms as `SyncBatchNorm`, whose training statistics are
    /// those of every rank's batch (one all-reduce per norm in forward, one in backward),
    /// instead of Burn's `BatchNorm`, whose statistics are each rank's.
    #[arg(long)]
    sync_bn: bool,
    /// Uneven inputs: rank r of w stops after `--steps` − (w − 1 − r) × N steps (the last rank
    /// trains them all) inside a join scope, where a rank out of inputs takes part in the
    /// others' gradient syncs with zeros; every rank then takes the last rank's weights.
    #[arg(long, value_name = "N", default_value_t = 0)]
    uneven: usize,
    /// With `--uneven`: what the mean of a step that only some ranks trained divides by
    /// (default: world).
    #[arg(long, value_enum)]
    uneven_mean: Option<UnevenMeanArg>,
    /// Read every gradient into host memory as it arrives and pack there, even on a device
    /// backend (`CollectiveOptions::device_buckets` off), to compare with the device pack.
    #[arg(long)]
    host_pack: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum BuffersArg {
    /// Every rank takes rank 0's buffers.
    Broadcast,
    /// Every rank takes the mean of the ranks' buffers.
    Mean,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum UnevenMeanArg {
    /// The whole world, as in a full step (PyTorch's `divide_by_initial_world_size=True`).
    World,
    /// The ranks that trained in that step (`divide_by_initial_world_size=False`).
    Trained,
}

#[derive(Clone, Copy, ValueEnum)]
enum InitialWeightsArg {
    /// Every rank takes rank 0's weights (PyTorch DDP's behaviour).
    Broadcast,
    /// Every rank keeps its own, which must be rank 0's bit for bit.
    Verify,
}

pub(crate) fn run_cmd(a: RunArgs) -> Result<(), Box<dyn std::error::Error>> {
    use collective_fusion::backend::{
        BufferSync, CollectiveOptions, InitialWeights, JoinOptions, Transport,
    };
    use collective_fusion::train::{DispatchOn, RunBackend, RunModel, RunOptions, run};
    use std::io::IsTerminal as _;
    if a.world == 0 || a.world > 256 {
        return Err("--world must be between 1 and 256".into());
    }
    if a.steps == 0 || a.batch == 0 {
        return Err("--steps and --batch must be at least 1".into());
    }
    if a.uneven_mean.is_some() && a.uneven == 0 {
        return Err("--uneven-mean needs --uneven N (N above 0)".into());
    }
    let config = configured(a.bucketing, a.bucket_view)?;
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
            width: a.width.unwrap_or(1024),
        },
        (RunModelArg::Convnet, None, None) => RunModel::ConvNet,
        (RunModelArg::Resnet, None, blocks) => RunModel::ResNet {
            blocks: blocks.unwrap_or(2),
        },
        (RunModelArg::Blocks, None, blocks) => RunModel::Blocks {
            blocks: blocks.unwrap_or(12),
        },
        (_, Some(_), _) => {
            return Err("--hidden-layers is an option of --model mlp".into());
        }
        (_, _, Some(_)) => {
            return Err("--blocks is an option of --model blocks and --model resnet".into());
        }
    };
    if a.blocks == Some(0) {
        return Err("--blocks must be at least 1".into());
    }
    if a.width.is_some() && !matches!(a.model, RunModelArg::Mlp) {
        return Err("--width is an option of --model mlp".into());
    }
    if a.sync_bn && !matches!(a.model, RunModelArg::Resnet) {
        return Err("--sync-bn is an option of --model resnet".into());
    }
    if a.width == Some(0) {
        return Err("--width must be at least 1".into());
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
            tcp: collective_fusion::runtime::tcp::TcpOptions::from_env()?,
            initial_weights: match a.initial_weights {
                InitialWeightsArg::Broadcast => InitialWeights::Broadcast,
                InitialWeightsArg::Verify => InitialWeights::Verify,
            },
            probe_link: true,
            device_buckets: !a.host_pack,
            ..CollectiveOptions::default()
        },
        buffers: match a.buffers {
            BuffersArg::Broadcast => BufferSync::Broadcast,
            BuffersArg::Mean => BufferSync::Mean,
        },
        sync_norm: a.sync_bn,
        uneven: a.uneven,
        join: JoinOptions {
            divide_by_initial_world_size: a.uneven_mean != Some(UnevenMeanArg::Trained),
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
        return compare_policies_cmd(&opts, a.rounds as usize, tty);
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
            "device (rank {}): {} buckets packed on the gradients' device, {} collectives reduced in place in device memory, {} gradients handed back as views of their bucket",
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
            Some(l) => {
                writeln!(out, "link (rank {r0}, fitted): {l}")?;
                if let Some(m) = &report.measured {
                    let peers: Vec<_> = report
                        .peer_measured_steps
                        .iter()
                        .filter_map(|s| s.last().cloned())
                        .collect();
                    let side =
                        |a: Option<f64>| a.map_or("none ran".into(), |a| format!("{a:.0} us"));
                    let [busy, idle] = m.alpha_split_us(&peers, l);
                    writeln!(
                        out,
                        "fixed cost of a collective (rank {r0}, last step, what measured plans use): {} while the backward passes took every core, {} after; compute time one took from the backward beside it: {}",
                        side(busy),
                        side(idle),
                        side(m.interference_us())
                    )?;
                }
            }
            None => writeln!(
                out,
                "link (rank {r0}): not fitted (collectives of fewer than two sizes)"
            )?,
        }
    }
    for j in &report.joins {
        writeln!(
            out,
            "uneven inputs (rank {}): trained {} steps, took part in {} more with zero gradients; ends with rank {}'s weights",
            j.rank,
            report.steps_of(j.rank),
            j.shadowed_steps,
            j.authority
        )?;
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
            "recorded step (rank 0): {} ops ({} matmul/conv), {:.1} MFLOP; {} bucket{}; the first launches with {} of {} ops after it still to run",
            st.ops,
            st.heavy_ops,
            st.flops as f64 / 1e6,
            st.buckets,
            if st.buckets == 1 { "" } else { "s" },
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
        // The last step: from the start of rank 0's last one (its buffer sync) to the end.
        let from = report
            .trace
            .iter()
            .filter(|s| s.rank == 0 && s.name == "buffers")
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

/// `run --compare-policies`: the table of [`collective_fusion::train::compare_policies`].
fn compare_policies_cmd(
    opts: &collective_fusion::train::RunOptions,
    rounds: usize,
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
    let compared = compare_policies(opts, WARMUP, rounds, &progress)?;
    let rows = &compared.rows;
    let mut out = String::new();
    writeln!(
        out,
        "compare policies: {} on {} · {} ranks · batch {}/rank · steps {}–{}{} (median, rank 0) · predicted: the simulator on each step's measured backward and the run's link",
        opts.model.name(),
        opts.backend.name(),
        opts.world,
        opts.batch,
        WARMUP + 1,
        steps,
        if rounds > 1 {
            format!(" of {rounds} rounds in turn")
        } else {
            String::new()
        }
    )?;
    writeln!(
        out,
        "{:<10} {:>11} {:>26} {:>26} {:>26} {:>17} {:>17}   link",
        "policy",
        "collectives",
        "step ms (pred, err)",
        "backward ms (pred, err)",
        "exposed ms (pred, err)",
        "wait ms (pred)",
        "host ms (pred)"
    )?;
    let cell = |p: (f64, f64)| {
        format!(
            "{:>8.2} {:>8.2} {:>+7.1}%",
            p.0,
            p.1,
            PolicyRun::error(p) * 100.0
        )
    };
    for r in rows {
        writeln!(
            out,
            "{:<10} {:>5.0} {:>5} {:>26} {:>26} {:>26} {:>8.2} {:>8.2} {:>8.2} {:>8.2}   {}",
            r.policy.name(),
            r.collectives.0,
            format!("({:.0})", r.collectives.1),
            cell(r.step_ms),
            cell(r.backward_ms),
            cell(r.exposed_ms),
            r.wait_ms.0,
            r.wait_ms.1,
            r.host_ms.0,
            r.host_ms.1,
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
    for (what, gaps) in [
        ("step time", &compared.step_gaps),
        ("exposed communication", &compared.exposed_gaps),
    ] {
        writeln!(
            out,
            "{what}, paired (a's minus b's, the same step of the same round):"
        )?;
        for g in gaps {
            writeln!(
                out,
                "  {:<18} median {:>+8.2} ms, {} · quartiles {:>+8.2} to {:>+8.2} · {} lower in {} of {} · sign test p {}",
                format!("{} − {}", g.a.name(), g.b.name()),
                g.median_ms,
                match g.median_ci_ms {
                    Some((lo, hi)) => format!("95% CI {lo:>+8.2} to {hi:>+8.2}"),
                    None => "95% CI   (too few pairs)".to_string(),
                },
                g.quartiles_ms.0,
                g.quartiles_ms.1,
                g.a.name(),
                g.a_lower,
                g.pairs,
                if g.sign_test_p < 0.001 {
                    "< 0.001".to_string()
                } else {
                    format!("= {:.3}", g.sign_test_p)
                }
            )?;
        }
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

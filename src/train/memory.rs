//! What a training step holds in memory under `Collective<B>`, against `B` alone: the same step
//! as the overhead tables time ([`StepRow`]: forward, backward, SGD, a one-value read), each
//! configuration ([`MemoryRow`]) in a process of its own, since a CubeCL device's memory pools
//! only grow within a process and the host heap keeps what earlier rows left.
//!
//! Two readings per row, after warm-up steps: the **peak** a step reached (on a CubeCL device
//! the bytes its memory pools reserved, which is what the device gives the process and what an
//! out-of-memory error is about, read after every step: the pools reserve a step's high-water
//! mark and keep it; on the host the exact peak of the heap, counted by [`CountingAllocator`])
//! and what is **held between steps** (in use after a step's final read: parameters, optimizer
//! state, and whatever the sync keeps from one step to the next). The memory bench
//! (`benches/memory.rs`) and the GPU check (`tests/gpu.rs`) print their tables with it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn_autodiff::Autodiff;
use burn_backend::distributed::{DistributedBackend, DistributedConfig, ReduceOperation};
use burn_backend::{AutodiffBackend, Backend};

use super::nets::RunModel;
use super::overhead::{Marking, StepRow};
use crate::backend::{Collective, CollectiveDevice, CollectiveOptions, SingleRank};

/// The environment variable a memory child reads its row from ([`MemoryRow::name`]).
pub const MEMORY_CHILD: &str = "CF_MEMORY_ROW";

/// The configurations a memory table compares, in the order it prints them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryRow {
    /// `Autodiff<B>`: Burn alone.
    Alone,
    /// `Autodiff<Collective<B>>`, the model not marked: the lazy layer only.
    Lazy,
    /// Marked once under a one-rank server, the default `SingleRank::Skip`: gradients submitted
    /// and left as they are (what a user with one device gets).
    Sync,
    /// Marked once under a one-rank server with the plan run anyway (`SingleRank::Run`):
    /// gradients packed into buckets, reduced and handed back, as with more ranks.
    PlanRun,
    /// [`MemoryRow::PlanRun`] with the reduced gradients handed back as views of their bucket
    /// (DDP's `gradient_as_bucket_view`).
    PlanRunViews,
}

impl MemoryRow {
    /// Every row, in table order.
    pub const ALL: [MemoryRow; 5] = [
        MemoryRow::Alone,
        MemoryRow::Lazy,
        MemoryRow::Sync,
        MemoryRow::PlanRun,
        MemoryRow::PlanRunViews,
    ];

    /// The row's name, as [`MEMORY_CHILD`] carries it.
    pub fn name(self) -> &'static str {
        match self {
            MemoryRow::Alone => "alone",
            MemoryRow::Lazy => "lazy",
            MemoryRow::Sync => "sync",
            MemoryRow::PlanRun => "plan-run",
            MemoryRow::PlanRunViews => "plan-run-views",
        }
    }

    /// The row named `name` ([`MemoryRow::name`]).
    pub fn from_name(name: &str) -> Option<MemoryRow> {
        MemoryRow::ALL.into_iter().find(|r| r.name() == name)
    }

    /// What the table calls the row.
    pub fn label(self) -> &'static str {
        match self {
            MemoryRow::Alone => "Autodiff<B>",
            MemoryRow::Lazy => "Autodiff<Collective<B>>",
            MemoryRow::Sync => "  + sync, one rank",
            MemoryRow::PlanRun => "  + plan run, one rank",
            MemoryRow::PlanRunViews => "  + plan run, bucket views",
        }
    }
}

/// One reading of a backend's memory, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemorySample {
    /// What the backend holds: for a CubeCL device the bytes its memory pools reserved; for
    /// the host heap the most it had in use since the probe's last reset.
    pub held: u64,
    /// Bytes in use now.
    pub in_use: u64,
}

/// Where a row's memory is read.
pub trait MemoryProbe {
    /// Starts the measured steps (after the warm-up).
    fn reset(&mut self) {}
    /// Reads the memory now.
    fn sample(&mut self) -> MemorySample;
}

/// A CubeCL device's memory pools, as its client reports them (Burn's wgpu or CUDA backend,
/// fused or not, on that device).
pub struct CubeProbe<R: cubecl::Runtime>(pub cubecl::client::ComputeClient<R>);

impl<R: cubecl::Runtime> MemoryProbe for CubeProbe<R> {
    /// Waits for the device, then has the pools give back every page nothing uses: what the
    /// warm-up reserved for itself (autotuning's trial buffers, the kernels it compiled) does
    /// not count in the measured steps' peak, which then is what those steps reserve again.
    fn reset(&mut self) {
        if let Err(e) = cubecl::future::block_on(self.0.sync()) {
            panic!("waiting for the device before reading its memory failed: {e:?}");
        }
        self.0.memory_cleanup();
        if let Err(e) = cubecl::future::block_on(self.0.sync()) {
            panic!("waiting for the device's memory cleanup failed: {e:?}");
        }
    }

    fn sample(&mut self) -> MemorySample {
        // In a memory child, whose parent prints the panic's message in the row.
        let u = self
            .0
            .memory_usage()
            .unwrap_or_else(|e| panic!("reading CubeCL's memory usage failed: {e:?}"));
        MemorySample {
            held: u.bytes_reserved,
            in_use: u.bytes_in_use,
        }
    }
}

static HEAP_NOW: AtomicU64 = AtomicU64::new(0);
static HEAP_PEAK: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting the bytes in use and their peak, for [`HeapProbe`]. A binary
/// that measures host memory installs it: `#[global_allocator] static A: CountingAllocator =
/// CountingAllocator;` (two relaxed atomic updates per allocation).
pub struct CountingAllocator;

fn grew(bytes: usize) {
    let now = HEAP_NOW.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    HEAP_PEAK.fetch_max(now, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    HEAP_NOW.fetch_sub(bytes as u64, Ordering::Relaxed);
}

// SAFETY: every call is passed to `System` as it came; the counters do not touch the memory.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

/// The host heap as [`CountingAllocator`] counts it (all zero where it is not the global
/// allocator).
pub struct HeapProbe;

impl MemoryProbe for HeapProbe {
    fn reset(&mut self) {
        HEAP_PEAK.store(HEAP_NOW.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn sample(&mut self) -> MemorySample {
        MemorySample {
            held: HEAP_PEAK.load(Ordering::Relaxed),
            in_use: HEAP_NOW.load(Ordering::Relaxed),
        }
    }
}

/// What one row's steps held, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepMemory {
    /// The most the backend held during the measured steps ([`MemorySample::held`]).
    pub peak: u64,
    /// In use after the last step's final read.
    pub between_steps: u64,
}

/// The line a memory child prints, which [`StepMemory::from_output`] finds.
const LINE: &str = "step memory:";

impl std::fmt::Display for StepMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{LINE} peak {} bytes, between steps {} bytes",
            self.peak, self.between_steps
        )
    }
}

impl StepMemory {
    /// Runs `warmup` steps of `row`, resets `probe`, runs `steps` more and reads `probe` after
    /// each of them.
    pub fn measure(
        row: &mut StepRow,
        probe: &mut dyn MemoryProbe,
        warmup: usize,
        steps: usize,
    ) -> StepMemory {
        for _ in 0..warmup {
            row.run_step();
        }
        probe.reset();
        let mut out = StepMemory::default();
        for _ in 0..steps {
            row.run_step();
            let s = probe.sample();
            out.peak = out.peak.max(s.held);
            out.between_steps = s.in_use;
        }
        out
    }

    /// The reading a memory child printed (its [`Display`](std::fmt::Display) line) in
    /// `stdout`.
    pub fn from_output(stdout: &str) -> Option<StepMemory> {
        let line = stdout.lines().rev().find_map(|l| l.strip_prefix(LINE))?;
        let mut numbers = line
            .split(|c: char| !c.is_ascii_digit())
            .filter(|w| !w.is_empty())
            .map(|w| w.parse::<u64>());
        let peak = numbers.next()?.ok()?;
        let between_steps = numbers.next()?.ok()?;
        Some(StepMemory {
            peak,
            between_steps,
        })
    }
}

/// Measures the [`MemoryRow::Alone`] row of model `model` on batch `batch` over autodiff
/// backend `Bk` (`Autodiff<B>`) on `device`.
pub fn measure_alone<Bk: AutodiffBackend>(
    device: &Bk::Device,
    model: RunModel,
    batch: usize,
    (warmup, steps): (usize, usize),
    probe: &mut dyn MemoryProbe,
) -> StepMemory {
    let label = MemoryRow::Alone.label();
    let mut step = StepRow::for_model::<Bk>(label, device, model, batch, Marking::Unmarked);
    StepMemory::measure(&mut step, probe, warmup, steps)
}

/// Measures `row` of model `model` on batch `batch` over inner backend `I` on `device`: the
/// [`MemoryRow::Alone`] row on `Autodiff<I>` ([`measure_alone`]), the others as
/// [`measure_collective`] does.
pub fn measure_row<I: Backend>(
    row: MemoryRow,
    options: CollectiveOptions,
    device: I::Device,
    model: RunModel,
    batch: usize,
    steps: (usize, usize),
    probe: &mut dyn MemoryProbe,
) -> StepMemory
where
    Autodiff<I>: AutodiffBackend<Device = I::Device>,
{
    match row {
        MemoryRow::Alone => measure_alone::<Autodiff<I>>(&device, model, batch, steps, probe),
        _ => measure_collective::<I>(row, options, device, model, batch, steps, probe),
    }
}

/// Measures `row` (not [`MemoryRow::Alone`], which has no `Collective`) of model `model` on
/// batch `batch` over `Autodiff<Collective<I>>` on inner device `device`: installs `options`
/// with the row's own (`single_rank`, `gradient_as_bucket_view`), starts a one-rank server for
/// the marked rows (over `options.transport`), and closes it after.
///
/// # Panics
/// For [`MemoryRow::Alone`], or when a step fails (as [`StepRow::new`] says).
pub fn measure_collective<I: Backend>(
    row: MemoryRow,
    options: CollectiveOptions,
    device: I::Device,
    model: RunModel,
    batch: usize,
    (warmup, steps): (usize, usize),
    probe: &mut dyn MemoryProbe,
) -> StepMemory {
    let (single_rank, views, marking) = match row {
        MemoryRow::Alone => panic!("the Autodiff<B> row has no Collective options"),
        MemoryRow::Lazy => (SingleRank::Skip, false, Marking::Unmarked),
        MemoryRow::Sync => (SingleRank::Skip, false, Marking::Once),
        MemoryRow::PlanRun => (SingleRank::Run, false, Marking::Once),
        MemoryRow::PlanRunViews => (SingleRank::Run, true, Marking::Once),
    };
    let mut options = CollectiveOptions {
        single_rank,
        ..options
    };
    options.config.gradient_as_bucket_view = views;
    options.install::<I>();
    let cd = CollectiveDevice::new(device, 0);
    let server = marking != Marking::Unmarked;
    if server {
        Collective::<I>::start_communication_server(
            std::slice::from_ref(&cd),
            DistributedConfig {
                all_reduce_op: ReduceOperation::Mean,
            },
        );
    }
    type C<I> = Autodiff<Collective<I>>;
    let mut step = StepRow::for_model::<C<I>>(row.label(), &cd, model, batch, marking);
    let out = StepMemory::measure(&mut step, probe, warmup, steps);
    drop(step);
    if server {
        Collective::<I>::close_communication_server(&cd);
    }
    out
}

/// Each row's memory, measured in children: one table.
pub struct MemoryTable {
    /// What was measured (model, batch, backend).
    pub title: String,
    /// The rows, each with the reading of every run (or why it has none).
    pub rows: Vec<(MemoryRow, Vec<Result<StepMemory, String>>)>,
    /// Untimed steps before the measured ones, and measured steps, per row.
    pub steps: (usize, usize),
}

impl MemoryTable {
    /// Runs every row of `rows` in the child process `child` makes for it (a command that runs
    /// this binary's memory child with [`MEMORY_CHILD`] set to the row's name, which this adds),
    /// `runs` times, and collects what each printed; a child that runs past 15 minutes is
    /// killed, and its row says so. (A device's pools reserve pages in an order that moves
    /// from one process to the next, so a device row's peak is worth a few runs; the host
    /// heap's count is the same each time.)
    pub fn in_children(
        title: &str,
        rows: &[MemoryRow],
        steps: (usize, usize),
        runs: usize,
        mut child: impl FnMut(MemoryRow) -> Command,
    ) -> MemoryTable {
        let one = |row: MemoryRow, child: &mut dyn FnMut(MemoryRow) -> Command| {
            let mut cmd = child(row);
            cmd.env(MEMORY_CHILD, row.name());
            let out = output_within(cmd, CHILD_LIMIT)?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            StepMemory::from_output(&stdout).ok_or_else(|| {
                let stderr = String::from_utf8_lossy(&out.stderr);
                let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
                format!(
                    "the child printed no reading ({}): {}",
                    out.status,
                    last.unwrap_or("")
                )
            })
        };
        let rows = rows
            .iter()
            .map(|&row| {
                (
                    row,
                    (0..runs.max(1)).map(|_| one(row, &mut child)).collect(),
                )
            })
            .collect();
        MemoryTable {
            title: title.to_string(),
            rows,
            steps,
        }
    }
}

/// How long a memory child may run before it is killed (a wide model's steps on a software
/// GPU take minutes).
const CHILD_LIMIT: Duration = Duration::from_secs(900);

/// What `cmd` printed and how it ended, or why it has no result: it did not start, or ran past
/// `limit` and was killed.
fn output_within(mut cmd: Command, limit: Duration) -> Result<Output, String> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("the child did not start: {e}"))?;
    // Read on threads of their own, so that a child that fills a pipe does not stall.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = pipe {
                // A pipe that fails to read gives what was read so far.
                let _ = p.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                // Killed and reaped; an error here means it ended meanwhile.
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the child ran past {limit:?} and was killed"));
            }
            Err(e) => return Err(format!("waiting for the child failed: {e}")),
        }
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// The highest peak and between-steps reading of `runs` with the lowest peak, or the first
/// run's error.
fn highest(runs: &[Result<StepMemory, String>]) -> Result<(StepMemory, u64), String> {
    let mut out: Option<(StepMemory, u64)> = None;
    for r in runs {
        let m = r.as_ref().map_err(Clone::clone)?;
        let (hi, lo) = out.get_or_insert((*m, m.peak));
        hi.peak = hi.peak.max(m.peak);
        hi.between_steps = hi.between_steps.max(m.between_steps);
        *lo = (*lo).min(m.peak);
    }
    out.ok_or_else(|| "no run".to_string())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

impl std::fmt::Display for MemoryTable {
    /// The title, then a line per row: the peak in MiB (the highest of the row's runs) with its
    /// ratio to the first row's and the difference, then the same for what the step holds
    /// between steps; and where the runs' peaks differ, their range.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (warmup, steps) = self.steps;
        writeln!(
            f,
            "{} (each row in its own process; {steps} steps after {warmup} warm-up)",
            self.title
        )?;
        let first = self.rows.first().and_then(|r| highest(&r.1).ok());
        let first = first.map(|(m, _)| m);
        for (row, runs) in &self.rows {
            write!(f, "  {:<30}", row.label())?;
            let (m, lowest) = match highest(runs) {
                Ok(m) => m,
                Err(e) => {
                    writeln!(f, " no reading: {e}")?;
                    continue;
                }
            };
            let m = &m;
            for (what, v, base) in [
                ("peak", m.peak, first.map(|b| b.peak)),
                (
                    "between steps",
                    m.between_steps,
                    first.map(|b| b.between_steps),
                ),
            ] {
                write!(f, "  {what} {:>9.2} MiB", mib(v))?;
                if let Some(b) = base.filter(|&b| b > 0) {
                    let diff = mib(v) - mib(b);
                    write!(f, " {:>5.2}x ({diff:+.2})", v as f64 / b as f64)?;
                }
            }
            if lowest != m.peak {
                let n = runs.len();
                write!(
                    f,
                    "; peaks of {n} runs {:.2}–{:.2}",
                    mib(lowest),
                    mib(m.peak)
                )?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe that reads what it is told, counting its calls.
    struct Scripted {
        samples: Vec<MemorySample>,
        resets: usize,
        read: usize,
    }

    impl MemoryProbe for Scripted {
        fn reset(&mut self) {
            self.resets += 1;
        }
        fn sample(&mut self) -> MemorySample {
            self.read += 1;
            self.samples[self.read - 1]
        }
    }

    #[test]
    fn a_rows_peak_is_the_most_held_and_its_steps_end_with_the_last_reading() {
        use burn_ndarray::{NdArray, NdArrayDevice};
        type B = Autodiff<Collective<NdArray>>;
        let d = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
        let model = RunModel::Mlp {
            hidden_layers: 1,
            width: 8,
        };
        let mut row = StepRow::for_model::<B>("r", &d, model, 4, Marking::Unmarked);
        let s = |held, in_use| MemorySample { held, in_use };
        let mut probe = Scripted {
            samples: vec![s(10, 4), s(30, 7), s(20, 5)],
            resets: 0,
            read: 0,
        };
        let m = StepMemory::measure(&mut row, &mut probe, 2, 3);
        assert_eq!((probe.resets, probe.read), (1, 3));
        assert_eq!(
            m,
            StepMemory {
                peak: 30,
                between_steps: 5
            }
        );
    }

    #[test]
    fn a_child_past_its_limit_is_killed_and_one_within_it_is_read() {
        let mut sleeper = Command::new("sleep");
        sleeper.arg("30");
        let started = Instant::now();
        let e = output_within(sleeper, Duration::from_millis(200)).unwrap_err();
        assert!(e.contains("ran past"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
        let mut echo = Command::new("echo");
        echo.arg("step memory: peak 7 bytes, between steps 3 bytes");
        let out = output_within(echo, Duration::from_secs(60)).unwrap();
        let m = StepMemory::from_output(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(
            m,
            Some(StepMemory {
                peak: 7,
                between_steps: 3
            })
        );
    }

    #[test]
    fn a_childs_reading_is_found_in_its_output() {
        let m = StepMemory {
            peak: 123_456_789,
            between_steps: 42,
        };
        let out = format!("compiling\n{m}\nbye\n");
        assert_eq!(StepMemory::from_output(&out), Some(m));
        assert_eq!(StepMemory::from_output("nothing here"), None);
        for row in MemoryRow::ALL {
            assert_eq!(MemoryRow::from_name(row.name()), Some(row));
        }
        assert_eq!(MemoryRow::from_name("other"), None);
    }

    #[test]
    fn a_memory_table_prints_each_row_against_the_first() {
        let mib = 1u64 << 20;
        let table = MemoryTable {
            title: "t".into(),
            rows: vec![
                (
                    MemoryRow::Alone,
                    vec![Ok(StepMemory {
                        peak: 100 * mib,
                        between_steps: 10 * mib,
                    })],
                ),
                (
                    MemoryRow::PlanRun,
                    vec![
                        Ok(StepMemory {
                            peak: 120 * mib,
                            between_steps: 10 * mib,
                        }),
                        Ok(StepMemory {
                            peak: 150 * mib,
                            between_steps: 10 * mib,
                        }),
                    ],
                ),
                (
                    MemoryRow::Sync,
                    vec![
                        Ok(StepMemory::default()),
                        Err("the child printed no reading".into()),
                    ],
                ),
            ],
            steps: (2, 3),
        };
        let text = table.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].ends_with("(each row in its own process; 3 steps after 2 warm-up)"));
        assert!(
            lines[1].contains("peak    100.00 MiB  1.00x (+0.00)"),
            "{text}"
        );
        assert!(
            lines[2].ends_with(
                "peak    150.00 MiB  1.50x (+50.00)  between steps     10.00 MiB  1.00x (+0.00); peaks of 2 runs 120.00–150.00"
            ),
            "{text}"
        );
        assert!(
            lines[3].contains("no reading: the child printed no reading"),
            "{text}"
        );
    }
}

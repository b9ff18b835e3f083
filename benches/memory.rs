//! What a training step holds in memory under `Collective<B>` against `B` alone
//! (`train::memory`): for the models the step bench times (`train::overhead::overhead_models`),
//! one row per configuration, each in a child process of this binary (`train::memory::MemoryRow`:
//! Burn alone, the lazy layer, marked under a one-rank server, the plan run anyway with
//! gradients copied back or handed back as bucket views).
//!
//! `B` is NdArray, whose tensors live on the host heap (counted by `CountingAllocator`, installed
//! here; no `Autodiff<NdArray>` row, see `benches/step.rs`), Burn's default wgpu backend
//! (`burn_wgpu::Wgpu`, fusion on; CubeCL's memory pools, Mesa's software Vulkan on a machine
//! without a GPU), skipped without an adapter, and with `--features cuda` on a machine with a GPU
//! Burn's CUDA backend with GPU-sized models. A device row runs 3 times (its pools reserve pages
//! in an order that moves from one process to the next), a host row once. Run with
//! `cargo bench --bench memory` (`-- STEPS` for another number of measured steps than 3;
//! `-- STEPS WORD` for the models whose name contains WORD; `-- STEPS WORD RUNS` for another
//! number of runs of a device row). First, a table of what one 32 MiB all-reduce of a TCP group
//! allocates beyond the ranks' buffers (`-- STEPS tcp` for that table alone).

mod common;

use std::process::Command;

use collective_fusion::backend::CollectiveOptions;
#[cfg(feature = "cuda")]
use collective_fusion::backend::Transport;
use collective_fusion::train::memory::{
    CountingAllocator, CubeProbe, HeapProbe, MEMORY_CHILD, MemoryRow, MemoryTable, StepMemory,
    measure_collective, measure_row,
};
use collective_fusion::train::overhead::overhead_models;

#[global_allocator]
static HEAP: CountingAllocator = CountingAllocator;

/// Untimed steps before the measured ones (kernel compilation, autotuning, the first plan).
const WARMUP: usize = 3;
/// The backend a child measures on.
const BACKEND: &str = "CF_MEMORY_BACKEND";
/// The index of the model a child measures, in `overhead_models`.
const MODEL: &str = "CF_MEMORY_MODEL";
/// How many steps a child measures.
const STEPS: &str = "CF_MEMORY_STEPS";

/// One child's row: prints its reading for the parent.
fn child(row: &str) {
    let row = MemoryRow::from_name(row).unwrap_or_else(|| panic!("no memory row named {row:?}"));
    let backend = std::env::var(BACKEND).expect("the backend");
    let gpu = backend == "cuda";
    let index: usize = std::env::var(MODEL)
        .ok()
        .and_then(|m| m.parse().ok())
        .expect("the model");
    let steps: usize = std::env::var(STEPS)
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("the steps");
    let (_, model, batch) = overhead_models(gpu)[index];
    let steps = (WARMUP, steps);
    let m: StepMemory = match backend.as_str() {
        "ndarray" => {
            let d = burn_ndarray::NdArrayDevice::Cpu;
            measure_collective::<burn_ndarray::NdArray>(
                row,
                CollectiveOptions::default(),
                d,
                model,
                batch,
                steps,
                &mut HeapProbe,
            )
        }
        "wgpu" => {
            use cubecl::Runtime;
            let d = burn_wgpu::WgpuDevice::DefaultDevice;
            let mut probe = CubeProbe(cubecl::wgpu::WgpuRuntime::client(&d));
            measure_row::<burn_wgpu::Wgpu>(
                row,
                CollectiveOptions::default(),
                d,
                model,
                batch,
                steps,
                &mut probe,
            )
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            use cubecl::Runtime;
            let d = burn_cuda::CudaDevice::default();
            let mut probe = CubeProbe(cubecl::cuda::CudaRuntime::client(&d));
            // One rank over NCCL, as the GPU check's overhead table has it: buckets reduced in
            // place on the device.
            let options = CollectiveOptions {
                transport: Transport::NcclLocal,
                ..CollectiveOptions::default()
            };
            measure_row::<burn_cuda::Cuda>(row, options, d, model, batch, steps, &mut probe)
        }
        other => panic!("no backend {other:?} in this build"),
    };
    println!("{m}");
}

/// Every selected model's table on `backend` (`label` in the titles), each row run `runs`
/// times.
fn tables(
    backend: &str,
    label: &str,
    rows: &[MemoryRow],
    (steps, runs): (usize, usize),
    only: Option<&str>,
) {
    let exe = std::env::current_exe().expect("this bench binary");
    for (index, (name, _, batch)) in overhead_models(backend == "cuda").into_iter().enumerate() {
        if only.is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let title = format!("{label} · {name}, batch {batch}");
        let table = MemoryTable::in_children(&title, rows, (WARMUP, steps), runs, |_| {
            let mut c = Command::new(&exe);
            c.env(BACKEND, backend)
                .env(MODEL, index.to_string())
                .env(STEPS, steps.to_string());
            c
        });
        print!("{table}");
    }
}

/// The host heap one all-reduce of a TCP group takes beyond the ranks' buffers, all ranks of the
/// group together (threads of this process over loopback): what the transport allocates for a
/// call, through rank 0 and through the mesh.
fn tcp_table() {
    use collective_fusion::graph::{DType, ReduceOp};
    use collective_fusion::runtime::HostBuffer;
    use collective_fusion::runtime::comm::{CollectiveDesc, Communicator};
    use collective_fusion::runtime::tcp::{TcpComm, TcpOptions};
    use collective_fusion::train::memory::MemoryProbe;
    use std::time::Duration;

    const BYTES: usize = 32 << 20;
    let n = BYTES / 4;
    let what = CollectiveDesc::of_bucket(0, ReduceOp::Sum, DType::F32, n as u64);
    let star = TcpOptions {
        sharded_min_bytes: None,
    };
    println!(
        "\nTCP all-reduce of {} MiB over loopback: heap beyond the ranks' buffers",
        BYTES >> 20
    );
    println!("| ranks | way | during the call, all ranks together |");
    println!("|---|---|---|");
    for (world, way, options) in [
        (2, "rank 0", TcpOptions::default()),
        (4, "rank 0", star),
        (4, "mesh", TcpOptions::default()),
    ] {
        let timeout = Duration::from_secs(60);
        let comms = TcpComm::loopback_group(world, timeout, options).expect("a TCP group");
        let mut bufs: Vec<HostBuffer> = (0..world).map(|_| HostBuffer::F32(vec![1.0; n])).collect();
        let call = |bufs: Vec<HostBuffer>| -> Vec<HostBuffer> {
            let pending: Vec<_> = comms
                .iter()
                .zip(bufs)
                .map(|(c, b)| c.all_reduce(b, what.clone()).expect("a launch"))
                .collect();
            pending
                .into_iter()
                .map(|p| p.wait(timeout).expect("an all-reduce").0)
                .collect()
        };
        // The first call starts whatever the threads keep; the second is measured.
        bufs = call(bufs);
        let mut heap = HeapProbe;
        heap.reset();
        let before = heap.sample().in_use;
        bufs = call(bufs);
        let beyond = heap.sample().held - before;
        drop(bufs);
        let mib = beyond as f64 / (1 << 20) as f64;
        println!("| {world} | {way} | {mib:.2} MiB |");
    }
}

fn main() {
    if let Ok(row) = std::env::var(MEMORY_CHILD) {
        child(&row);
        return;
    }
    // Cargo passes `--bench`; the words after it are ours.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let steps: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(3);
    let only = args.get(1).map(String::as_str);
    let runs: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    if only.is_none_or(|o| o == "tcp") {
        tcp_table();
    }
    println!(
        "what one training step holds in memory on one rank; ratios to each table's first row"
    );
    let collective = &MemoryRow::ALL[1..];
    // The host heap's count is the same in every run; a device's pools are not.
    tables(
        "ndarray",
        "NdArray (host heap)",
        collective,
        (steps, 1),
        only,
    );
    let wd = burn_wgpu::WgpuDevice::DefaultDevice;
    if common::wgpu_adapter(&wd, "wgpu") {
        let label = "burn_wgpu::Wgpu (fusion on; CubeCL's pools)";
        tables("wgpu", label, &MemoryRow::ALL, (steps, runs), only);
    }
    #[cfg(feature = "cuda")]
    if collective_fusion::runtime::nccl::device_count() > 0 {
        let label = "burn_cuda::Cuda (fusion on; CubeCL's pools)";
        tables("cuda", label, &MemoryRow::ALL, (steps, runs), only);
    }
}

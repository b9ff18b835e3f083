#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU, libcuda and libnccl: builds with `cuda`,
# runs the GPU tests with skipping turned into failure (kernels against the host path, NCCL
# through the rendezvous, buckets of CUDA gradients reduced in place by NCCL, `Collective<Cuda>`
# training in process and over NCCL; and two printed benches: pack bandwidth against the
# device copy, and whether an NCCL call overlaps the compute queued after it, by CUDA event
# timestamps), a two-process rendezvous smoke test that shares a real NCCL id, a one-rank
# NCCL training run through the launcher environment, and `Collective<Cuda>` training runs
# through the CLI over NCCL (one process, and in-process ranks) with views of the buckets. Prints what it ran; exits non-zero on the
# first failure.
# Usage: scripts/gpu-check.sh   (from the repository root; about 5 minutes on 16 cores, cold)
set -euo pipefail
cd "$(dirname "$0")/.."
export CF_REQUIRE_GPU=1
echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
ls /usr/lib/x86_64-linux-gnu/libnccl* /usr/local/cuda/lib64/libnccl* 2>/dev/null || echo "(libnccl not in the usual places; relying on the loader path)"
echo "== build (release, --features cuda)"
time cargo build --release --features cuda --tests --bins 2>&1 | tail -3
echo "== GPU tests"
timeout 300 cargo test --release --features cuda --test gpu -- --nocapture --test-threads=1
echo "== two-process rendezvous with a real NCCL id"
bin=target/release/collective-fusion
port=$((29500 + RANDOM % 1000))
pids=()
for r in 1 0; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    CF_RENDEZVOUS_TIMEOUT_MS=20000 "$bin" rendezvous &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "== one rank over NCCL through the launcher environment (run --transport nccl)"
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((port + 1)) \
  timeout 120 "$bin" run --transport nccl --world 1 --steps 3 --batch 8 | tail -4
echo "== Collective<Cuda> over NCCL through the CLI: buckets reduced in place, gradients as views"
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((port + 2)) \
  timeout 120 "$bin" run --backend cuda --transport nccl --bucket-view --world 1 --steps 3 --batch 8 | grep -E "^run|agree|device"
timeout 120 "$bin" run --backend cuda --transport nccl-local --world 1 --steps 3 --batch 8 | grep -E "^run|agree|device"
echo "== gpu-check: all passed"

#!/usr/bin/env bash
# The run half of the GPU checks, on a machine with an NVIDIA GPU (no cargo needed): unpacks
# what scripts/gpu-pack.sh packed beside it, finds libcuda, libnccl and libnvrtc, and runs
# with skips turned into failures (CF_REQUIRE_GPU=1): the GPU tests (kernels against the host
# path, NCCL through the rendezvous, CUDA gradients reduced in place, fused and unfused
# `Collective<Cuda>` training; the pack-bandwidth, overlap and lazy-layer overhead benches print
# their tables), a two-process rendezvous sharing a real NCCL id, and `Collective<Cuda>`
# training through the CLI over NCCL, then what a training step holds in device memory (each
# configuration in a child process). Logs go to $OUT (default: out/ beside this script); the last lines are one
# summary.
# Usage: bash .gpu/run.sh   (under 5 minutes on one H200 before the memory bench, which is
# bounded by CF_GPU_MEMORY_TIMEOUT, 180 s by default)
set -uo pipefail
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
summary=()
record() { summary+=("$1: $2"); echo "== $1: $2"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
tar -xJf bins.tar.xz
# cudarc opens libnccl.so and libnvrtc.so by those names; on such machines they live under the
# CUDA install and the system library folder, sometimes only as libnccl.so.2.
libs=$(mktemp -d)
find_lib() {
  find /usr/lib /usr/lib64 /usr/local /opt -maxdepth 9 -name "$1*" 2>/dev/null \
    | grep -v stubs | sort | head -1
}
for l in libnccl.so libnvrtc.so; do
  found=$(find_lib "$l")
  if [ -n "$found" ]; then
    ln -sf "$found" "$libs/$l"
    export LD_LIBRARY_PATH="$(dirname "$found"):${LD_LIBRARY_PATH:-}"
    echo "$l: $found"
  else
    echo "$l: not found"
  fi
done
export LD_LIBRARY_PATH="$libs:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export CF_REQUIRE_GPU=1
# Tests that need more GPUs than this machine has skip (and say so); the CLI they start is ours.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 1 ] 2>/dev/null || gpus=1
export CF_REQUIRE_GPUS=$gpus
export CF_CLI=$PWD/bin/collective-fusion

# Each line of the log starts with the seconds since the tests began, so a slow test shows.
stamp() {
  local t0=${EPOCHREALTIME/./} t line
  while IFS= read -r line; do
    t=$(((${EPOCHREALTIME/./} - t0) / 100000))
    printf '%5d.%d %s\n' $((t / 10)) $((t % 10)) "$line"
  done
}
# CF_GPU_TESTS_FILTER runs only the tests whose names hold it (libtest's filter). The memory
# bench runs last, on its own (below): a child process per row, so a slow one costs only its
# own table.
memory_bench=bench_what_a_training_step_holds_in_device_memory
timeout "${CF_GPU_TESTS_TIMEOUT:-300}" bin/gpu-tests ${CF_GPU_TESTS_FILTER:-} --nocapture \
  --test-threads=1 --skip "$memory_bench" 2>&1 \
  | stamp > "$OUT/gpu-tests.log"
rc=${PIPESTATUS[0]}
grep -E "^ *[0-9]+\.[0-9] test |test result|SKIPPED|panicked|in a child process" "$OUT/gpu-tests.log" \
  | tail -60
# libtest's own count (a test's output can split its "... ok" from its name); skips pass.
result=$(grep -o "test result: .*" "$OUT/gpu-tests.log" | tail -1)
record "GPU tests" "exit $rc, ${result:-no result line}, $(grep -c "SKIPPED" "$OUT/gpu-tests.log") skipped"
grep -A30 "pack bandwidth\|overlap\|overhead\|pinned staging" "$OUT/gpu-tests.log" > "$OUT/benches.txt" || true

bin=bin/collective-fusion
port=$((29500 + RANDOM % 1000))
pids=()
for r in 1 0; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    CF_RENDEZVOUS_TIMEOUT_MS=20000 timeout 60 "$bin" rendezvous > "$OUT/rendezvous-$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
record "two-process rendezvous" "exit $rc"

RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((port + 1)) \
  timeout 120 "$bin" run --backend cuda --transport nccl --bucket-view --world 1 --steps 3 --batch 8 \
  > "$OUT/run-nccl.log" 2>&1
record "run --backend cuda --transport nccl --bucket-view" "exit $?"
timeout 120 "$bin" run --backend cuda --transport nccl-local --world 1 --steps 3 --batch 8 \
  > "$OUT/run-nccl-local.log" 2>&1
record "run --backend cuda --transport nccl-local" "exit $?"

# What a training step holds in device memory: Burn alone, the lazy layer, marked, the plan run
# with copies and with bucket views, each row in a child process.
timeout "${CF_GPU_MEMORY_TIMEOUT:-180}" bin/gpu-tests "training::$memory_bench" --exact --nocapture 2>&1 \
  | stamp > "$OUT/memory.log"
rc=${PIPESTATUS[0]}
grep -E "memory ·|peak" "$OUT/memory.log" | tee "$OUT/memory.txt"
record "memory bench" "exit $rc"

echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
! grep -qE "exit [1-9]|[1-9][0-9]* failed" "$OUT/summary.txt"

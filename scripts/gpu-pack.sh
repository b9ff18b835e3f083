#!/usr/bin/env bash
# The build half of the GPU checks, for a machine without a GPU: builds the release binaries
# with `--features cuda` (the GPU test binary and the CLI), strips them and packs them with
# scripts/gpu-run.sh into .gpu/ (ignored by git), for a GPU machine that has no cargo.
# Then, on the GPU machine, from a copy of the repository with .gpu/ in it: `bash .gpu/run.sh`.
# cudarc is built without a CUDA toolkit here, so it takes the newest CUDA bindings it knows
# (`fallback-latest`, CUDA 13.4 with cudarc 0.19.10); newer bindings ran against a 13.0 driver.
# Usage: scripts/gpu-pack.sh   (from the repository root; minutes when the cuda dependencies
# are built already, much longer cold on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
target=${CARGO_TARGET_DIR:-target}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu
mkdir -p .gpu/bin
echo "== release build, --features cuda"
cargo build --release --locked --features cuda --bins
gpu_test=$(cargo test --release --locked --features cuda --test gpu --no-run --message-format=json \
  | grep -o '"executable":"[^"]*/deps/gpu-[^"]*"' | cut -d'"' -f4 | tail -1)
[ -n "$gpu_test" ] && [ -x "$gpu_test" ] || { echo "error: no GPU test binary was built" >&2; exit 1; }
cp "$gpu_test" .gpu/bin/gpu-tests
cp "$target/release/collective-fusion" .gpu/bin/
strip .gpu/bin/*
tar -C .gpu -cJf .gpu/bins.tar.xz bin
rm -rf .gpu/bin
cp scripts/gpu-run.sh .gpu/run.sh
size=$(du -m .gpu/bins.tar.xz | cut -f1)
echo "== packed: .gpu/bins.tar.xz (${size} MiB) and .gpu/run.sh"
if [ "$size" -ge 64 ]; then
  echo "error: the pack is ${size} MiB, over the 64 MiB a device run carries" >&2
  exit 1
fi

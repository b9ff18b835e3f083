#!/usr/bin/env bash
# Runs the cargo-fuzz targets (nightly toolchain and `cargo install cargo-fuzz` needed) for
# SECONDS each (default 300), seeding the graph text target with the graph snapshots.
# Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-300}
mkdir -p fuzz/corpus/graph_text fuzz/corpus/pipeline
for f in tests/snapshots/*.snap; do
  body=$(awk 'c>=2{print} /^---$/{c++}' "$f")
  case "$body" in 'graph "'*) printf '%s\n' "$body" > "fuzz/corpus/graph_text/$(basename "$f" .snap)" ;; esac
done
for t in graph_text pipeline; do
  echo "== $t, ${secs}s"
  cargo +nightly fuzz run -s none -O "$t" -- -max_total_time="$secs" -rss_limit_mb=4096 2>&1 \
    | grep -E "INITED|DONE|^Done|panicked|SUMMARY|Test unit written" | tail -8
done

#!/usr/bin/env bash
# Runs the cargo-fuzz targets (nightly toolchain and `cargo install cargo-fuzz` needed) for
# SECONDS each (default 300), seeding the graph text target with the graph snapshots and the
# profiles target with the bundled model profiles (each followed by a NUL and a link profile).
# Usage: scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-300}
mkdir -p fuzz/corpus/graph_text fuzz/corpus/pipeline fuzz/corpus/profiles
for f in tests/snapshots/*.snap; do
  body=$(awk 'c>=2{print} /^---$/{c++}' "$f")
  case "$body" in 'graph "'*) printf '%s\n' "$body" > "fuzz/corpus/graph_text/$(basename "$f" .snap)" ;; esac
done
link=$(python3 -c 'import json; p = json.load(open("profiles/links.json")); print(json.dumps({"profiles": p["profiles"][:1]}))')
for f in models/*.json; do
  { cat "$f"; printf '\0%s' "$link"; } > "fuzz/corpus/profiles/$(basename "$f" .json)"
done
for t in graph_text pipeline profiles; do
  echo "== $t, ${secs}s"
  cargo +nightly fuzz run -s none -O "$t" -- -max_total_time="$secs" -rss_limit_mb=4096 2>&1 \
    | grep -E "INITED|DONE|^Done|panicked|SUMMARY|Test unit written" | tail -8
done

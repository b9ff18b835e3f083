#!/usr/bin/env bash
# The lazy layer's host cost per op in instructions, which a shared, noisy machine does not
# blur the way it blurs time: runs the `op_chain64` groups of `benches/backend.rs` (64
# dependent adds on a 1-element tensor, then a read) under valgrind's callgrind, for NdArray
# alone and for Collective<NdArray>, and prints instructions per op: the whole chain's, and
# under Collective the split into recording (the `float_add` of Collective) and the rest
# (running the queue, moving values out of nodes).
# Usage: scripts/op-instructions.sh [BENCH_BINARY]   (from the repository root; needs valgrind
# and python3; without a binary it builds `cargo bench --bench backend --no-run` first)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-binary.sh
bin=$(bench_binary backend "${1:-}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The bench's wgpu group asks for an adapter at start-up; give it a runtime folder.
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-$work}
for group in ndarray collective_ndarray; do
  valgrind --tool=callgrind --callgrind-out-file="$work/$group.out" \
    "$bin" --bench "op_chain64/$group\$" --profile-time 2 > "$work/$group.log" 2>&1 \
    || { cat "$work/$group.log" >&2; exit 1; }
  callgrind_annotate --inclusive=yes --tree=caller "$work/$group.out" > "$work/$group.tree"
done
python3 - "$work" <<'PY'
import re, sys

work = sys.argv[1]
def inclusive(tree, pattern):
    """Inclusive instructions of the first function matching `pattern`, and its calls."""
    lines = open(f"{work}/{tree}.tree").read().split("\n")
    for i, line in enumerate(lines):
        if " *  " in line and pattern in line:
            total = int(line.split()[0].replace(",", ""))
            calls, j = 0, i - 1
            while j >= 0 and " <" in lines[j]:
                m = re.search(r"\(([\d,]+)x\)", lines[j])
                calls += int(m.group(1).replace(",", "")) if m else 0
                j -= 1
            return total, calls
    sys.exit(f"error: no function matching {pattern!r} in the {tree} profile")

def per_op(tree):
    # Every iteration of the bench loop runs NdArray's add once per op, with or without the
    # lazy layer (a dropped node would not run, but the chain reads its last value).
    total, _ = inclusive(tree, "criterion::bencher::Bencher<M>::iter [")
    _, ops = inclusive(tree, "NdArray<E,I,Q>>::float_add [")
    return total / ops

alone = per_op("ndarray")
lazy = per_op("collective_ndarray")
rec, rec_calls = inclusive("collective_ndarray", "Collective<I>>::float_add [")
inner, inner_calls = inclusive("collective_ndarray", "NdArray<E,I,Q>>::float_add [")
print("instructions per op, op_chain64 (64 dependent adds and a read, 1-element tensors)")
print(f"  NdArray alone          {alone:8.0f}")
print(f"  Collective<NdArray>    {lazy:8.0f}   ({lazy / alone:.2f}x, {lazy - alone:+.0f})")
print(f"    recording            {rec / rec_calls:8.0f}   (Collective's float_add)")
print(f"    NdArray's float_add  {inner / inner_calls:8.0f}")
print(f"    the rest             {lazy - rec / rec_calls - inner / inner_calls:8.0f}"
      "   (Burn's tensor API, running the queue, moving values out)")
PY

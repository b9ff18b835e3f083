#!/usr/bin/env bash
# A host-bound training step's instructions, part by part, which a shared, noisy machine does
# not blur the way it blurs time: runs `benches/host_step.rs` (the step bench's tiny deep MLP,
# 16 layers of 16 on batch 8, on NdArray at world 1) under valgrind's callgrind for its four
# rows, each in a process of its own:
#   lazy    Autodiff<Collective<NdArray>>, the model not marked;
#   skip    the model marked once under a one-rank server (the sync skipped);
#   remark  the same, the model marked again before every step;
#   run     the model marked once, the plan run anyway (gradients read, bucketed, reduced and
#           handed back);
# and prints instructions per step: the whole step, marking (and Burn's share of it:
# `Param::consume` and `set_distributed`), backward (and within it the sync hooks:
# `submit_gradient_sync` for all gradients, `submit_sync_collective`), and the optimizer (and
# Burn's `set_distributed` within it: its optimizers mark each parameter they update again).
# Usage: scripts/step-instructions.sh [STEPS [MODEL_WORD [BENCH_BINARY]]]   (from the repository
# root; needs valgrind and python3; without a binary it builds `cargo bench --bench host_step
# --no-run` first). STEPS defaults to 20, MODEL_WORD to `tiny`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/bench-binary.sh
steps=${1:-20}
word=${2:-tiny}
bin=$(bench_binary host_step "${3:-}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Each row runs twice, with STEPS and with 2 x STEPS timed steps: the difference is STEPS
# steady steps, without start-up, warm-up or the first step's marking (which draws the lazily
# initialized parameters).
for row in lazy skip remark run; do
  for n in "$steps" $((2 * steps)); do
    valgrind --tool=callgrind --callgrind-out-file="$work/$row.$n.out" \
      "$bin" "$row" "$n" "$word" > "$work/$row.$n.log" 2>&1 \
      || { cat "$work/$row.$n.log" >&2; exit 1; }
    callgrind_annotate --threshold=100 --inclusive=yes --tree=caller "$work/$row.$n.out" \
      > "$work/$row.$n.tree"
  done
done
grep -m1 '^NdArray · ' "$work/lazy.$steps.log" | sed 's/ (median.*//; s/, Skip$//'
python3 - "$work" "$steps" <<'PY'
import functools, re, sys

work, steps = sys.argv[1], int(sys.argv[2])
ROWS = ["lazy", "skip", "remark", "run"]

@functools.cache
def functions(path):
    """Every function in a profile: its inclusive instructions, its call count, and its
    callers' lines (each with the instructions spent in it from that caller)."""
    lines = open(path).read().split("\n")
    found = {}
    for i, line in enumerate(lines):
        if " *  " not in line:
            continue
        total = int(line.split()[0].replace(",", ""))
        calls, callers, j = 0, [], i - 1
        while j >= 0 and " <" in lines[j]:
            m = re.search(r"\(([\d,]+)x\)", lines[j])
            calls += int(m.group(1).replace(",", "")) if m else 0
            callers.append(lines[j])
            j -= 1
        name = line.split(" *  ", 1)[1]
        found[name] = (total, calls, callers)
    return found

def inclusive(found, pattern, caller=None):
    """The first function whose name contains `pattern`: (instructions, calls), counting only
    its calls from callers whose name contains `caller` when one is given; (0, 0) if none."""
    for name, (total, calls, callers) in found.items():
        if pattern not in name:
            continue
        if caller is None:
            return (total, calls)
        total, calls = 0, 0
        for line in callers:
            if caller in line:
                total += int(line.split()[0].replace(",", ""))
                m = re.search(r"\(([\d,]+)x\)", line)
                calls += int(m.group(1).replace(",", "")) if m else 0
        return (total, calls)
    return (0, 0)

SHARDER = "mark_distributed_as::Sharder"
OPTIMIZER = "SimpleOptimizerMapper<B,O>"
# Burn's marking of one parameter: `Tensor::set_distributed`, or, where the compiler inlined
# it into its caller, the `AutodiffTensor::grad_distributed` it calls; a caller filter keeps
# whichever of the two that caller calls directly.
SET_DISTRIBUTED = [">>::set_distributed [", "AutodiffTensor<B>::grad_distributed ["]
PARTS = [
    # (label, patterns (summed), indent, only from callers whose name contains)
    ("whole step", ["StepRow::new::{{closure}}"], 0, None),
    ("marking", ["params::mark_distributed_as ["], 1, None),
    ("Burn's Param::consume", ["Param<T>::consume ["], 2, SHARDER),
    ("Burn's set_distributed", SET_DISTRIBUTED, 2, SHARDER),
    ("backward", ["burn_tensor::tensor::api::base::Tensor<B,_>>::backward ["], 1, None),
    ("Burn's gradient registration", ["DistributedRegistration>::on_register ["], 2, None),
    ("submit_gradient_sync, all", [">::submit_gradient_sync ["], 3, None),
    ("submit_sync_collective", [">::submit_sync_collective ["], 2, None),
    ("optimizer", ["OptimizerAdaptor<O,M,B>::step_common ["], 1, None),
    ("Burn's set_distributed", SET_DISTRIBUTED, 2, OPTIMIZER),
]
GRADIENTS = 6  # the row whose calls count the gradients submitted

def per_step(row, patterns, caller, which=0):
    """Instructions (`which` 0) or calls (1) per steady step: the longer run less the shorter."""
    short, long = (functions(f"{work}/{row}.{n}.tree") for n in (steps, 2 * steps))
    got = [sum(inclusive(f, p, caller)[which] for p in patterns) for f in (short, long)]
    return round((got[1] - got[0]) / steps)

table = {}
for row in ROWS:
    if per_step(row, PARTS[0][1], None, which=1) != 1:
        sys.exit(f"error: the {row} profiles do not differ by {steps} training steps")
    table[row] = [per_step(row, ps, c) for _, ps, _, c in PARTS]
    table[row].append(per_step(row, PARTS[GRADIENTS][1], None, which=1))

print(f"instructions per step (the difference between {2 * steps} and {steps} steps, over {steps})")
print(f"  {'':34s}" + "".join(f"{r:>12s}" for r in ROWS) + "   skip-lazy remark-skip")
for k, (label, _, indent, _) in enumerate(PARTS):
    cells = "".join(f"{table[r][k]:12,.0f}" for r in ROWS)
    diffs = [table[a][k] - table[b][k] for a, b in (("skip", "lazy"), ("remark", "skip"))]
    print(f"  {'  ' * indent + label:34s}{cells}" + "".join(f"{d:+12,.0f}" for d in diffs))
print(f"  {'gradients submitted':34s}" + "".join(f"{table[r][-1]:12.0f}" for r in ROWS))
PY

#!/usr/bin/env bash
# Runs the unit tests of Burn 0.21.0's core, modules, optimizers and training crate
# (`crates/burn-core`: parameters and their lazy initialization, module derive and mapping,
# records and recorders, initializers, configs, data loaders; `crates/burn-nn`:
# layers, losses, attention, recurrent cells, quantized modules; `crates/burn-optim`: SGD, Adam,
# AdamW, Muon, ..., gradient clipping, learning-rate schedulers, optimizer records;
# `crates/burn-train`: metrics, vision metrics, early stopping, checkpointing, summaries) with
# their test backend made `Collective<B>`, and their autodiff test backend
# `Autodiff<Collective<B>>`: Burn's module code as its users run it, checked by tests nobody here
# wrote. Not part of CI (it needs Burn's source and about 10 minutes of build on 2 cores; twice
# that with --baseline).
#
# Usage: scripts/burn-module-tests.sh BURN_CLONE [WORK_DIR] [--wgpu] [--baseline]
#   BURN_CLONE  a git clone of tracel-ai/burn that has the tag v0.21.0 (only read)
#   WORK_DIR    where the crates are built (default: a new temporary folder)
#   --wgpu      B is Burn's default wgpu backend (`burn_wgpu::Wgpu`, fusion on), as Burn's
#               `test-wgpu` feature makes it; without it B is Flex, Burn's default test backend
#   --baseline  also run the same tests as Burn runs them (B alone, in WORK_DIR/alone, a build
#               without this crate); the exit status is then 0 when the tests fail exactly as
#               they fail on B alone
#
# What is adapted: each crate's `TestBackend` (and with it `TestAutodiffBackend`); the test
# modules that name Flex themselves (CTC, RNN-T losses, Muon) get `Collective<Flex>` and a rank-0
# device; the tests Burn runs on Flex only (burn-core's `Param` and initializer tests and its
# derive-module and record-resilience integration tests; burn-train's crate-wide backend and the
# FID/LPIPS/DISTS modules' own) run on `Collective<B>`, with --wgpu too, and burn-core's data
# loader and tensor serde tests take that backend's default device; burn-core is built with
# `dataset` (so its data loader tests run; with --wgpu its unit tests are left out, see below),
# burn-optim and burn-train with `distributed` and `ddp`, as this crate builds them, burn-train
# with `vision` and without its terminal UI, system metrics and reinforcement learning; the
# manifests name versions instead of Burn's workspace (burn-core's tests build Burn's burn-core
# from source beside the published one the other crates use). A test added to burn-nn checks
# that the test backend is `Collective` and that its ops are recorded.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/suite-report.sh
. "$ROOT/scripts/suite-report.sh"
usage() { print_usage "$0"; }
[ $# -ge 1 ] || usage
BURN=$1
shift
WORK=""
BASELINE=0
INNER=burn_flex::Flex
WGPU=0
for a in "$@"; do
    case $a in
        --baseline) BASELINE=1 ;;
        --wgpu) INNER=burn_wgpu::Wgpu; WGPU=1 ;;
        -*) usage ;;
        *) WORK=$a ;;
    esac
done
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
cd "$WORK"

# Writes the workspace in the current folder; $1 is this crate's dependency line (empty for the
# baseline), $2 burn-optim's default features, $3 burn-train's beside `vision`.
workspace() {
    rm -rf burn-core burn-nn burn-optim burn-train
    git -C "$BURN" archive v0.21.0 crates/burn-core crates/burn-nn crates/burn-optim crates/burn-train \
        | tar -x --strip-components=1
    cp "$ROOT/Cargo.lock" .
    cat > Cargo.toml <<'EOF'
[workspace]
members = ["burn-core", "burn-nn", "burn-optim", "burn-train"]
resolver = "3"

[profile.dev]
debug = false
[profile.dev.package."*"]
opt-level = 1
EOF
    # The features Burn's test cfgs name; `test-wgpu` picks wgpu as Burn's own manifests do.
    local features='doc = []
tracing = []
test-tch = []
test-wgpu = ["dep:burn-wgpu"]
test-cuda = []
test-rocm = []
test-vulkan = []
test-metal = []
test-memory-checks = []'
    local dev="[dev-dependencies]
burn-flex = \"=0.21.0\"
burn-autodiff = \"=0.21.0\"
rstest = \"0.26.1\"
$1"
    package() { printf '[package]\nname = "%s"\nversion = "0.21.0"\nedition = "2024"\npublish = false\n' "$1"; }
    local wgpu='burn-wgpu = { version = "=0.21.0", optional = true, default-features = false, features = ["std", "fusion"] }'
    # burn-core's own tests (the other crates use Burn's published burn-core), with `dataset`
    # on so that its data loaders' tests run too.
    cat > burn-core/Cargo.toml <<EOF
$(package burn-core)

[features]
default = ["std", "dataset", "burn-std/default", "burn-dataset?/default", "burn-tensor/default"]
dataset = ["burn-dataset"]
network = ["burn-std/network"]
std = ["bincode/std", "burn-std/std", "burn-tensor/std", "flate2", "half/std", "log", "rand/std",
    "rmp-serde", "serde/std", "serde_json/std", "num-traits/std"]
vision = []
audio = []
distributed = []
record-item-custom-serde = ["thiserror"]
$features

[dependencies]
burn-std = { version = "=0.21.0", default-features = false }
burn-dataset = { version = "=0.21.0", optional = true }
burn-derive = "=0.21.0"
burn-tensor = { version = "=0.21.0", default-features = false }
data-encoding = { version = "2.11.0", default-features = false, features = ["alloc"] }
uuid = { version = "1.23.0", default-features = false }
derive-new = { version = "0.7.0", default-features = false }
log = { version = "0.4.29", default-features = false, optional = true }
rand = { version = "0.10.1", default-features = false, features = ["std_rng"] }
hashbrown = { version = "0.16", features = ["serde"] }
flate2 = { version = "1.1.9", optional = true }
serde = { version = "1.0.228", default-features = false, features = ["derive", "alloc"] }
ahash = { version = "0.8.12", default-features = false }
bincode = { version = "2.0.1", default-features = false, features = ["alloc", "serde"] }
half = { version = "2.7.1", default-features = false, features = ["alloc", "num-traits", "serde"] }
num-traits = { version = "0.2.19", default-features = false, features = ["libm"] }
rmp-serde = { version = "1.3.1", default-features = false, optional = true }
serde_json = { version = "1.0.148", default-features = false, features = ["alloc"] }
spin = { version = "0.10.0", features = ["mutex", "spin_mutex", "portable-atomic"] }
thiserror = { version = "2", default-features = false, optional = true }
regex = { version = "1.12.3", default-features = false, features = ["perf", "unicode"] }
$wgpu

$dev
burn-dataset = { version = "=0.21.0", features = ["default", "fake"] }
serial_test = "3.2.0"
EOF
    # With --wgpu, burn-core's unit tests are left out (its integration tests run): its data
    # loader tests copy a device out of a reference, which wgpu's device (not `Copy`) does not
    # allow, so they do not compile with Burn's `test-wgpu` alone either.
    [ "$WGPU" = 0 ] || printf '\n[lib]\ntest = false\n' >> burn-core/Cargo.toml
    cat > burn-nn/Cargo.toml <<EOF
$(package burn-nn)

[features]
default = ["std"]
std = ["burn-core/std", "num-traits/std"]
$features

[dependencies]
burn-core = "=0.21.0"
num-traits = { version = "0.2.19", default-features = false, features = ["libm"] }
$wgpu

$dev
EOF
    cat > burn-optim/Cargo.toml <<EOF
$(package burn-optim)

[features]
default = [$2]
std = ["burn-core/std", "num-traits/std", "serde/std", "log"]
distributed = ["std", "burn-core/distributed"]
collective = []
$features

[dependencies]
burn-core = "=0.21.0"
num-traits = { version = "0.2.19", default-features = false, features = ["libm"] }
derive-new = { version = "0.7.0", default-features = false }
log = { version = "0.4.29", default-features = false, optional = true }
serde = { version = "1.0.228", default-features = false, features = ["derive", "alloc"] }
hashbrown = { version = "0.16", features = ["serde"] }
$wgpu

$dev
burn-nn = "=0.21.0"
EOF
    cat > burn-train/Cargo.toml <<EOF
$(package burn-train)

[features]
default = ["vision", $3]
ddp = ["burn-optim/distributed", "burn-core/distributed"]
vision = ["burn-nn", "burn-store/pytorch", "burn-std/network", "dirs"]
sys-metrics = []
tui = []
rl = []
$features

[dependencies]
burn-core = { version = "=0.21.0", features = ["dataset", "std"] }
burn-optim = { version = "=0.21.0", features = ["std"] }
burn-nn = { version = "=0.21.0", optional = true, features = ["std"] }
burn-store = { version = "=0.21.0", optional = true, features = ["std"] }
burn-std = { version = "=0.21.0", optional = true, features = ["std"] }
burn-flex = "=0.21.0"
dirs = { version = "6.0.0", optional = true }
log = "0.4.29"
tracing-subscriber = "0.3.23"
tracing-appender = "0.2.3"
tracing-core = "0.1.36"
derive-new = { version = "0.7.0", default-features = false }
serde = { version = "1.0.228", features = ["std", "derive"] }
async-channel = "2.5"
rstest = "0.26.1"
thiserror = "2"
rand = { version = "0.10.1", default-features = false, features = ["std_rng"] }
$wgpu

$dev
EOF
}

# Runs the crates' tests into $1 (from the current folder).
run_tests() {
    local args=(--workspace --no-fail-fast)
    [ "$WGPU" = 0 ] || args+=(--features test-wgpu)
    cargo test "${args[@]}" > "$1" 2>&1 || true
}

# The tests that name Flex themselves (Flex in Burn, B here): burn-core's `Param` checks,
# initializer tests and two integration tests, and burn-train's crate-wide backend and vision
# metrics' own; burn-core's data loader and tensor serde tests take the default device of the
# backend they run on instead of Flex's device.
flex_tests_backend() {
    sed -i -E -e "s/check::<burn_flex::Flex>\(\)/check::<$1>()/" \
        -e "s/^( *)type B = burn_flex::Flex;/\1type B = $1;/" burn-core/src/module/param/base.rs
    sed -i -E "s/^( *)pub type TB = burn_flex::Flex;/\1pub type TB = $1;/" \
        burn-core/src/module/initializer.rs
    sed -i -E "s/^pub type TestBackend = burn_flex::Flex;/pub type TestBackend = $1;/" \
        burn-core/tests/test_derive_module.rs
    sed -i -E -e '/^ *use burn_flex::FlexDevice;/d' -e 's/&FlexDevice\)/\&Default::default())/' \
        -e "s/^( *)type TestBackend = burn_flex::Flex;/\1type TestBackend = $1;/" \
        burn-core/tests/test_record_resilience.rs
    sed -i -E 's/\(burn_flex::FlexDevice, burn_flex::FlexDevice\)/(Default::default(), Default::default())/' \
        burn-core/src/data/dataloader/builder.rs burn-core/src/data/dataloader/split.rs
    sed -i -E "s/^pub\(crate\) type TestBackend = burn_flex::Flex;/pub(crate) type TestBackend = $1;/" \
        burn-train/src/lib.rs
    grep -q "^pub(crate) type TestBackend = $1;" burn-train/src/lib.rs
    grep -rl '^ *use burn_flex::Flex;' burn-train/src/metric/vision | xargs -r sed -i -E \
        -e '/^ *use burn_flex::Flex;/d' -e "s/^( *)type TestBackend = Flex;/\1type TestBackend = $1;/"
}

workspace 'collective-fusion = { path = "'"$ROOT"'", default-features = false }' \
    '"std", "distributed"' '"ddp"'
COLLECTIVE="collective_fusion::backend::Collective<$INNER>"
flex_tests_backend "$COLLECTIVE"
# Burn's test backend, whichever feature picked it.
TEST_BACKENDS=(burn-core/src/lib.rs burn-nn/src/lib.rs burn-optim/src/lib.rs burn-nn/tests/quantize.rs)
sed -i -E "s/^pub type (TestBackend|B) = $INNER;/pub type \\1 = $COLLECTIVE;/" "${TEST_BACKENDS[@]}"
[ "$(grep -c "= $COLLECTIVE;" "${TEST_BACKENDS[@]}" | grep -c ':1$')" = 4 ]
# burn-core's data loaders moved to two wgpu devices (with --wgpu): devices of Collective.
sed -i -E 's/(burn_wgpu::WgpuDevice::DiscreteGpu\([01]\))/collective_fusion::backend::CollectiveDevice { inner: \1, rank: 0 }/' \
    burn-core/src/data/dataloader/builder.rs burn-core/src/data/dataloader/split.rs
# Test modules that name Flex and its device themselves.
grep -rl 'use burn_flex::{Flex, FlexDevice};' burn-nn/src burn-optim/src | xargs -r sed -i -E \
    's/^( *)use burn_flex::\{Flex, FlexDevice\};/\1type Flex = collective_fusion::backend::Collective<burn_flex::Flex>;\n\1type FlexDevice = collective_fusion::backend::CollectiveDevice<burn_flex::FlexDevice>;\n\1#[allow(non_upper_case_globals)]\n\1const FlexDevice: FlexDevice = collective_fusion::backend::CollectiveDevice { inner: burn_flex::FlexDevice, rank: 0 };/'
sed -i -E 's/^( *)type TestBackend = burn_flex::Flex;/\1type TestBackend = collective_fusion::backend::Collective<burn_flex::Flex>;/' \
    burn-optim/src/optim/muon.rs
# (Left: the crate-wide test backends that another feature picks, what was put in above, and
# burn-train's own code, which converts metric inputs to Flex.)
if { grep -rn 'burn_flex::\(Flex\|FlexDevice\)\b' burn-core burn-nn burn-optim burn-train
    grep -rn 'type TestBackend = Flex;' burn-train; true; } \
    | grep -v '^burn-train/src/learner/[a-z_/]*\.rs:[0-9]*:use burn_flex::Flex;$' \
    | grep -v ':pub type \(TestBackend\|B\) = burn_flex::Flex;$' \
    | grep -v 'Collective<burn_flex::Flex>\|inner: burn_flex::FlexDevice\|CollectiveDevice<burn_flex::FlexDevice>'; then
    echo "a test still names Flex directly (above): adapt the script" >&2
    exit 1
fi
cat >> burn-nn/src/lib.rs <<'EOF'

#[cfg(test)]
mod collective_check {
    /// The suite runs on `Collective`, which records what it is given.
    #[test]
    fn test_backends_are_collective_and_record() {
        assert!(core::any::type_name::<super::TestAutodiffBackend>().contains("Collective<"));
        let device: burn_core::tensor::Device<super::TestBackend> = Default::default();
        let before = collective_fusion::backend::lazy_stats(device.rank);
        let t = burn_core::tensor::Tensor::<super::TestBackend, 1>::from_floats([1.0, 2.0], &device);
        assert_eq!((t.clone() + t).into_data().to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
        let stats = collective_fusion::backend::lazy_stats(device.rank).since(&before);
        assert!(stats.recorded >= 1, "{stats:?}");
    }
}
EOF
run_tests modules.log

if [ "$BASELINE" = 1 ]; then
    mkdir -p alone
    (cd alone && workspace '' '"std"' '' && flex_tests_backend "$INNER" && run_tests ../baseline_modules.log)
fi

echo "Burn 0.21.0 core, module, optimizer and training tests, in $WORK:"
STATUS=0
report_suite modules "$BASELINE" "Collective<$INNER>" "$INNER"
exit $STATUS

#!/usr/bin/env bash
# Runs Burn 0.21.0's own backend test suite (`crates/burn-backend-tests`: its tensor and autodiff
# suites) against `Collective<B>` and `Autodiff<Collective<B>>`, B NdArray, Flex, wgpu or Dispatch:
# a check of `Collective` that nobody here wrote. Not part of CI (it needs Burn's source and
# about 5 minutes of build on 2 cores); run it when the forwarding or the op rules change.
#
# Usage: scripts/burn-suite.sh BURN_CLONE [WORK_DIR] [--flex|--wgpu|--unfused|--dispatch|--cuda]
#        [--f16] [--baseline] [--autodiff-baseline] [--include-ignored]
#   BURN_CLONE     a git clone of tracel-ai/burn that has the tag v0.21.0 (only read)
#   WORK_DIR       where the harness is built (default: a new temporary folder)
#   --flex         the inner backend is Burn's Flex CPU backend (`burn_flex::Flex`), with the
#                  suite's `flex` tests on
#   --wgpu         the inner backend is Burn's default wgpu backend (`burn_wgpu::Wgpu`, fusion
#                  on; Mesa's lavapipe on a machine without a GPU) instead of NdArray; the
#                  suite's fusion memory test (`memory_cleaning`) runs too
#   --unfused      the inner backend is wgpu's `CubeBackend` without the fusion layer
#   --dispatch     the inner backend is `burn::Dispatch` on its default device (wgpu here)
#   --cuda         the inner backend is Burn's default CUDA backend (`burn_cuda::Cuda`, fusion
#                  on), this crate built with its `cuda` feature: a machine with a GPU and cargo
#   --f16          also run the suite's f16 float tests (`tensor_f16`: every float test with f16
#                  as the default float type; with --flex or --cuda, the backends Burn runs it on),
#                  the same tests with bf16 (`tensor_bf16`, made here from `tensor_f16`), and the
#                  f16 autodiff suite (`autodiff_f16`, which Burn runs on GPUs only)
#   --baseline     also run the tensor suite on the inner backend alone; then the exit status
#                  is 0 when Collective fails exactly the tests the inner backend fails alone
#   --autodiff-baseline  also run the autodiff suites on `Autodiff<B>` alone, built in
#                  WORK_DIR/alone without this crate (under Burn's `distributed` feature, which
#                  this crate turns on, `Autodiff<B>` of a backend without distributed ops is no
#                  autodiff backend); compared as --baseline compares the tensor suites. A
#                  second build of Burn: about 8 more minutes on 2 cores
#   --include-ignored  run the tests Burn marks #[ignore] too
#
# What is adapted, and why: Burn's suite targets `burn::Dispatch`, whose device switches autodiff
# on at run time; here the tensor suite's `TestBackend` is `Collective<B>` and the autodiff
# suite's is `Autodiff<Collective<B>>` (its checkpointing module runs on the same type).
# The quantization tests ask `Dispatch::default_quant_scheme`, an inherent method of `Dispatch`;
# they get the scheme `Dispatch` gives on B's device (`Dispatch`'s own, for `--dispatch`).
# Suites for other backends (CubeCL, fusion kernels, autodiff in f16) are left out.
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
AD_BASELINE=0
INNER=burn_ndarray::NdArray
QUANT=""
IGNORED=()
CF_FEATURES=""
CUDA_DEP=""
FLEX_DEP=""
# Whether to run the suite's fusion memory test (`memory_cleaning`: every fusion handle a test
# makes is released once its tensors drop) too: for an inner backend with Burn's fusion layer.
MEMORY=0
# The suite's own feature naming the backend (some tests are only for it).
SUITE_FEATURE=ndarray
F16=0
for a in "$@"; do
    case $a in
        --baseline) BASELINE=1 ;;
        --autodiff-baseline) AD_BASELINE=1 ;;
        --flex)
            INNER=burn_flex::Flex
            FLEX_DEP='burn-flex = { version = "=0.21.0" }'
            SUITE_FEATURE=flex
            ;;
        --f16) F16=1 ;;
        --wgpu)
            INNER=burn_wgpu::Wgpu
            MEMORY=1
            ;;
        --unfused) INNER="burn_wgpu::CubeBackend<burn_wgpu::WgpuRuntime, f32, i32, u32>" ;;
        --dispatch)
            INNER=burn_dispatch::Dispatch
            QUANT="burn_dispatch::Dispatch::default_quant_scheme(&Default::default())"
            ;;
        --cuda)
            INNER=burn_cuda::Cuda
            CF_FEATURES=', features = ["cuda"]'
            CUDA_DEP='burn-cuda = { version = "=0.21.0", default-features = false, features = ["std", "fusion"] }'
            SUITE_FEATURE=cuda
            ;;
        --include-ignored) IGNORED=(--include-ignored) ;;
        -*) usage ;;
        *) WORK=$a ;;
    esac
done
if [ "$F16" = 1 ] && [ "$SUITE_FEATURE" = ndarray ]; then
    echo "--f16 needs --flex or --cuda (Burn runs its f16 suite on those)" >&2
    exit 2
fi
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
cd "$WORK"
rm -rf src tests benches
git -C "$BURN" archive v0.21.0 crates/burn-backend-tests | tar -x --strip-components=2
rm -rf benches tests/cubecl tests/cubecl.rs tests/fusion .cargo
if [ "$F16" = 1 ]; then
    # The same float tests with bf16 as the default float type (Burn's own suite has no bf16
    # variant yet; against the inner backend alone, its failures are the backend's).
    sed -e 's/^pub type FloatElem = burn_tensor::f16;/pub type FloatElem = burn_tensor::bf16;/' \
        -e 's/^mod f16;/mod bf16;/' tests/tensor_f16.rs > tests/tensor_bf16.rs
    grep -q "FloatElem = burn_tensor::bf16" tests/tensor_bf16.rs
    # Burn gates its f16 autodiff suite to GPU backends; Flex runs it here too.
    sed -i 's/^    feature = "metal"$/    feature = "metal",\n    feature = "flex"/' tests/autodiff_f16.rs
    grep -q 'feature = "flex"' tests/autodiff_f16.rs
else
    rm tests/tensor_f16.rs tests/autodiff_f16.rs
fi
[ "$MEMORY" = 1 ] || rm tests/memory_cleaning.rs
FUSION_DEP=""
[ "$MEMORY" = 0 ] || FUSION_DEP='burn-fusion = { version = "=0.21.0", default-features = false, features = ["std", "test-util"] }'
cp "$ROOT/Cargo.lock" .

cat > Cargo.toml <<EOF
[package]
name = "burn-backend-tests"
version = "0.0.0"
edition = "2024"
publish = false

[features]
default = ["std", "$SUITE_FEATURE", "quantization"]
std = []
quantization = []
# Features the suite's cfgs name: the backend's is on (above), the rest off.
ndarray = []
flex = []
cuda = []
cube = []
fusion = []
distributed = []
metal = []
vulkan = []
rocm = []

[dependencies]
burn-tensor = { version = "=0.21.0", features = ["std"] }
burn-backend = "=0.21.0"
burn-tensor-testgen = "=0.21.0"
burn-dispatch = { version = "=0.21.0", default-features = false, features = ["std", "ndarray"] }
burn-autodiff = { version = "=0.21.0", features = ["export_tests"] }
burn-ndarray = { version = "=0.21.0", features = ["export_tests"] }
burn-wgpu = { version = "=0.21.0", default-features = false, features = ["std", "fusion"] }
num-traits = "0.2.19"
serial_test = "3.2.0"
rand = { version = "0.10.1", default-features = false, features = ["std_rng"] }
collective-fusion = { path = "$ROOT", default-features = false$CF_FEATURES }
$CUDA_DEP
$FLEX_DEP
$FUSION_DEP

[dev-dependencies]
ctor = "0.10.1"

[profile.dev]
debug = false
[profile.dev.package."*"]
opt-level = 1
EOF

# The backend each suite runs on.
backend_file() {
    cat <<EOF
use ctor::ctor;

use super::{FloatElem, IntElem};

pub type TestBackend = $1;

#[ctor]
fn init_device_settings() {
    let device: burn_backend::tensor::Device<TestBackend> = Default::default();
    burn_tensor::set_default_dtypes::<TestBackend>(
        &device,
        <FloatElem as burn_tensor::Element>::dtype(),
        <IntElem as burn_tensor::Element>::dtype(),
    )
    .unwrap();
}

#[allow(unused)]
pub mod prelude {
    pub use burn_tensor::Tensor;

    use super::*;
    pub type TestTensor<const D: usize> = Tensor<TestBackend, D>;
    pub type TestTensorInt<const D: usize> = Tensor<TestBackend, D, burn_tensor::Int>;
    pub type TestTensorBool<const D: usize> = Tensor<TestBackend, D, burn_tensor::Bool>;
}

#[allow(unused)]
pub use prelude::*;

/// The scheme \`Dispatch::default_quant_scheme\` gives on the inner backend's device.
#[allow(unused)]
pub fn default_quant_scheme<D>(_device: &D) -> burn_tensor::quantization::QuantScheme {
    use burn_backend::QTensorPrimitive;
    ${QUANT:-<burn_backend::tensor::QuantizedTensor<$INNER> as QTensorPrimitive>::default_scheme()}
}
EOF
}
COLLECTIVE="collective_fusion::backend::Collective<$INNER>"
backend_file "$COLLECTIVE" > tests/common/backend.rs
backend_file "burn_autodiff::Autodiff<$COLLECTIVE>" > tests/common/backend_ad.rs
sed -i 's#"common/backend.rs"#"common/backend_ad.rs"#' tests/autodiff*.rs
cat > tests/common/autodiff.rs <<'EOF'
pub use super::*;

/// The autodiff suite's device: the backend itself differentiates.
pub struct AutodiffDevice;

impl AutodiffDevice {
    #[allow(clippy::new_ret_no_self)]
    pub fn new() -> burn_backend::tensor::Device<TestBackend> {
        Default::default()
    }
}

#[path = "../autodiff/mod.rs"]
mod base;

mod checkpointing {
    pub use super::FloatElem;

    pub struct AutodiffDevice;

    impl AutodiffDevice {
        #[allow(clippy::new_ret_no_self)]
        pub fn new() -> burn_backend::tensor::Device<super::TestBackend> {
            Default::default()
        }
    }

    include!("../autodiff/mod.rs");
}
EOF
grep -rl "TestBackend::default_quant_scheme" tests | xargs -r sed -i -E \
    's/TestBackend::default_quant_scheme\(([^)]*)\)/crate::default_quant_scheme(\1)/g'

SUITES=(tensor)
[ "$F16" = 1 ] && SUITES+=(tensor_f16 tensor_bf16)
for t in "${SUITES[@]}"; do
    cargo test --test "$t" --no-fail-fast -- "${IGNORED[@]}" > "$t.log" 2>&1 || true
done
AD_SUITES=(autodiff)
[ "$F16" = 1 ] && AD_SUITES+=(autodiff_f16)
for t in "${AD_SUITES[@]}"; do
    cargo test --test "$t" --no-fail-fast -- "${IGNORED[@]}" > "$t.log" 2>&1 || true
done
if [ "$AD_BASELINE" = 1 ]; then
    # The same harness without this crate, so without Burn's `distributed` feature.
    mkdir -p alone
    rm -rf alone/src alone/tests
    cp -r src tests Cargo.lock alone/
    sed '/^collective-fusion = /d' Cargo.toml > alone/Cargo.toml
    backend_file "burn_autodiff::Autodiff<$INNER>" > alone/tests/common/backend_ad.rs
    for t in "${AD_SUITES[@]}"; do
        (cd alone && cargo test --test "$t" --no-fail-fast -- "${IGNORED[@]}") \
            > "baseline_$t.log" 2>&1 || true
    done
fi
if [ "$MEMORY" = 1 ]; then
    # The test file and its suite need the `cube` and `fusion` cfgs, which this build alone turns on.
    cargo test --test memory_cleaning --features cube,fusion --no-fail-fast -- "${IGNORED[@]}" \
        > memory.log 2>&1 || true
fi
if [ "$BASELINE" = 1 ]; then
    backend_file "$INNER" > tests/common/backend.rs
    for t in "${SUITES[@]}"; do
        cargo test --test "$t" --no-fail-fast -- "${IGNORED[@]}" > "baseline_$t.log" 2>&1 || true
    done
    backend_file "$COLLECTIVE" > tests/common/backend.rs
fi
echo "Burn 0.21.0 backend suite, in $WORK:"
STATUS=0
for t in "${SUITES[@]}"; do
    report_suite "$t" "$BASELINE" "Collective<$INNER>" "$INNER"
done
for t in "${AD_SUITES[@]}"; do
    report_suite "$t" "$AD_BASELINE" "Autodiff<Collective<$INNER>>" "Autodiff<$INNER>"
done
if [ "$MEMORY" = 1 ]; then
    summary memory.log "fusion memory test, Collective<$INNER>"
    failures memory.log
    [ -z "$(failures memory.log)" ] && grep -q "^test result: ok" memory.log || STATUS=1
fi
exit $STATUS

//! What the benches share.

use burn_core::tensor::Tensor;

/// Whether Burn's wgpu backend finds an adapter (Mesa's software Vulkan counts); says so when
/// it does not, for `group`.
pub fn wgpu_adapter(device: &burn_wgpu::WgpuDevice, group: &str) -> bool {
    let probe = std::panic::catch_unwind(|| {
        let t: Tensor<burn_wgpu::Wgpu, 1> = Tensor::from_data([1.0f32], device);
        t.into_data()
    });
    if probe.is_err() {
        eprintln!("{group}: skipped, no wgpu adapter");
    }
    probe.is_ok()
}

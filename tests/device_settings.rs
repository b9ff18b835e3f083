//! A rank's default dtypes (`set_default_dtypes` on its `CollectiveDevice`) are what the inner
//! backend's ops use where they pick a dtype themselves, as they would be with the inner
//! backend alone. Burn keeps device settings per process and lets each be set once: this file
//! is its own test binary, and its one test the only one to touch them.

use burn_backend::QTensorPrimitive;
use burn_backend::tensor::QuantizedTensor;
use burn_backend::{DType, get_device_settings};
use burn_core::tensor::quantization::QuantValue;
use burn_core::tensor::{Tensor, set_default_dtypes};
use burn_ndarray::{NdArray, NdArrayDevice};
use collective_fusion::backend::{Collective, CollectiveDevice};

type I = NdArray<f32>;
type B = Collective<I>;

#[test]
fn a_ranks_default_dtypes_reach_the_inner_backend() {
    let device = CollectiveDevice::new(NdArrayDevice::Cpu, 0);
    set_default_dtypes::<B>(&device, DType::F64, DType::I32).unwrap();
    let x = Tensor::<B, 2>::from_data([[1.0, 6.35], [2.0, 3.0]], &device);
    assert_eq!(x.dtype(), DType::F64);
    // Burn's default body for a quantized op dequantizes to the device's default float dtype,
    // which NdArray reads from its own device's settings (NdArray quantizes f32 only).
    let scheme =
        <QuantizedTensor<I> as QTensorPrimitive>::default_scheme().with_value(QuantValue::Q8S);
    let y = x.cast(DType::F32).quantize_dynamic(&scheme).add_scalar(1.0);
    assert_eq!(y.to_data().dtype, DType::F64);
    let inner = get_device_settings::<I>(&NdArrayDevice::Cpu);
    assert_eq!(inner, get_device_settings::<B>(&device));
}

//! Seeded synthetic gradients for a plan's slots: what numerics tests, benches and the profiling
//! command feed a plan when no model produces real ones. Values span several binades (so that
//! rounding order matters) and are reproducible from `(seed, rank, slot)`.

use super::buffer::HostBuffer;
use crate::codegen::plan::Plan;

/// SplitMix64: a small, well-mixed, seedable generator.
#[derive(Clone, Copy, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `[-2^8, 2^8]` with a random sign, a uniform mantissa and an exponent in
    /// `[-8, 7]`.
    #[inline]
    pub fn next_value(&mut self) -> f64 {
        let r = self.next_u64();
        let mant = r >> 12; // 52 bits
        let exp = 1023 + ((r >> 4) & 15) - 8;
        let sign = (r & 1) << 63;
        f64::from_bits(sign | (exp << 52) | mant)
    }
}

/// Gradients for every slot of `plan` on `rank`, in each slot's dtype.
pub fn seeded_gradients(plan: &Plan, rank: usize, seed: u64) -> Vec<HostBuffer> {
    plan.slots
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut rng = SplitMix64(seed ^ ((rank as u64) << 40) ^ ((i as u64) << 8));
            let n = s.ty.numel() as usize;
            let mut b = HostBuffer::zeros(s.ty.dtype, n).unwrap_or_default();
            crate::with_host_buffer!(&mut b, v => {
                for x in v.iter_mut() {
                    *x = crate::runtime::Element::from_f64(rng.next_value());
                }
            });
            b
        })
        .collect()
}

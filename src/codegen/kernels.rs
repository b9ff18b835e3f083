//! CubeCL definitions of the bucket kernels. Definitions only: launching them on a device is the
//! runtime's job (`runtime::cube`).
//!
//! One launch per bucket: the members arrive as a [`Sequence`] of arrays, so the kernel is
//! specialized on the member count (CubeCL caches one compiled kernel per count and dtype pair)
//! while sizes and offsets stay runtime values. Every unit walks every member with a grid-stride
//! loop, so the launch size is independent of the layout.
//!
//! `offsets` has one entry per member plus the buffer length: member `j` occupies
//! `[offsets[j], offsets[j] + len_j)` and the gap up to `offsets[j + 1]` is padding.

#![allow(missing_docs)] // the launch items `#[cube(launch)]` generates carry no docs

use cubecl::prelude::*;

/// Gathers the members into the flat buffer `out` at their offsets, multiplying by `scale` in the
/// member dtype and then casting to the wire dtype; writes zero into the padding.
#[cube(launch)]
pub fn bucket_pack<F: Float + CubeElement, W: Float>(
    members: &Sequence<Array<F>>,
    offsets: &Array<u32>,
    out: &mut Array<W>,
    scale: F,
) {
    let stride = CUBE_COUNT * (CUBE_DIM as usize);
    #[unroll]
    for j in 0..members.len() {
        let m = &members[j];
        let base = offsets[j] as usize;
        let end = offsets[j + 1] as usize;
        let len = m.len();
        let mut i = ABSOLUTE_POS;
        while i < len {
            out[base + i] = W::cast_from(m[i] * scale);
            i += stride;
        }
        let mut k = base + len + ABSOLUTE_POS;
        while k < end {
            out[k] = W::from_int(0);
            k += stride;
        }
    }
}

/// Scatters the reduced flat buffer back into the members, casting each element back to the
/// member dtype.
#[cube(launch)]
pub fn bucket_unpack<W: Float, F: Float>(
    buffer: &Array<W>,
    offsets: &Array<u32>,
    members: &mut Sequence<Array<F>>,
) {
    let stride = CUBE_COUNT * (CUBE_DIM as usize);
    #[unroll]
    for j in 0..members.len() {
        let m = members.index_mut(j);
        let base = offsets[j] as usize;
        let len = m.len();
        let mut i = ABSOLUTE_POS;
        while i < len {
            m[i] = F::cast_from(buffer[base + i]);
            i += stride;
        }
    }
}

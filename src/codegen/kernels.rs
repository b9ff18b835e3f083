//! CubeCL definitions of the bucket kernels. Definitions only: launching them on a device is the
//! runtime's job (`runtime::cube`).
//!
//! The members arrive as a [`Sequence`] of arrays, so a kernel is specialized on the member count
//! (CubeCL caches one compiled kernel per count, dtype pair and vector width) while sizes and
//! offsets stay runtime values.
//!
//! **Work split.** Every cube works in one member, `rounds` chunks of `CUBE_DIM × per_unit`
//! vectors. The launcher gives each member as many consecutive cubes as it needs, and writes a
//! table with, per member, `[first cube, offset, extent]` (offset and extent in vectors, extent
//! being what the member's cubes cover), followed by the total cube count. A cube finds its
//! member once, by bisecting the members' first cubes; after that no element pays for a member
//! lookup. A member's `n` cubes move it together, round by round: in round `r` cube `k` moves
//! chunk `r·n + k`, so each round of a member is one contiguous span (a cube owning one long
//! range instead would put the grid's concurrent accesses a range apart, all on the same few
//! memory channels). In each chunk a unit moves `per_unit` vectors, `CUBE_DIM` apart, so a
//! cube's loads and stores are coalesced; it loads all of them into registers before it stores
//! any, so `per_unit` loads are in flight per unit. `rounds` is 1 unless the bucket needs more
//! cubes than the launcher allows, which keeps the grid about one wave of the device on large
//! buckets. Cubes past the total (the launcher may round the grid up) find no member and do
//! nothing.
//!
//! **Vectors.** All arrays of a launch share the vector width `N` (up to 16 bytes per access);
//! the launcher puts members whose length and offset are not multiples of it in a launch of
//! width 1. Scaling and casting are per lane, so the bits are those of the scalar host path.

#![allow(missing_docs)] // the launch items `#[cube(launch_unchecked)]` generates carry no docs

use cubecl::prelude::*;

/// Entries per member in a launch's table: first cube, offset, extent.
pub const TABLE_STRIDE: usize = 3;

/// The member whose range holds this cube: the last member whose first cube is at or before it,
/// found by bisection over the table's first cubes (a handful of loads per cube, whatever the
/// member count). An empty member shares its successor's first cube, so it is never the last
/// such member. A cube past the launch's total gets `count`, which no member has.
#[cube]
fn member_of(table: &Array<u32>, #[comptime] count: usize) -> usize {
    let cube = CUBE_POS;
    let mut found = count.runtime();
    if cube < table[TABLE_STRIDE * count] as usize {
        // Invariant: member `lo`'s first cube is at or before this cube (member 0's is cube 0),
        // member `hi`'s (or the total's) after it.
        let mut lo = 0usize;
        let mut hi = count.runtime();
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if table[TABLE_STRIDE * mid] as usize <= cube {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        found = lo;
    }
    found
}

/// Where this unit starts in member `j` (on a cube [`member_of`] gives `j`), and how far it
/// steps each round, in vectors: the cube's place among the member's cubes picks its chunk of
/// the round, and a round spans all of them. The member's cubes run up to the next member's
/// first cube, or the launch's total (the entry after the last member).
#[cube]
fn unit_start(table: &Array<u32>, j: usize, #[comptime] per_unit: u32) -> (usize, usize) {
    let chunk = (CUBE_DIM * per_unit) as usize;
    let first = table[TABLE_STRIDE * j] as usize;
    let cubes = table[TABLE_STRIDE * (j + 1)] as usize - first;
    (
        (CUBE_POS - first) * chunk + UNIT_POS as usize,
        cubes * chunk,
    )
}

/// Gathers the members into the flat buffer `out` at their offsets, multiplying by `scale` in the
/// member dtype and then casting to the wire dtype; writes zero into the padding (a member's
/// extent is its length plus the padding up to the next member).
///
/// Unchecked launch: every index is guarded by the member's length or extent, which the launcher
/// checked against the buffers.
#[cube(launch_unchecked)]
pub fn bucket_pack<F: Float + CubeElement, W: Float, N: Size>(
    members: &Sequence<Array<Vector<F, N>>>,
    table: &Array<u32>,
    out: &mut Array<Vector<W, N>>,
    scale: F,
    rounds: u32,
    #[comptime] per_unit: u32,
) {
    let owner = member_of(table, members.len());
    #[unroll]
    for j in 0..members.len() {
        if owner == j {
            let m = &members[j];
            let base = table[TABLE_STRIDE * j + 1] as usize;
            let extent = table[TABLE_STRIDE * j + 2] as usize;
            let len = m.len();
            let (start, stride) = unit_start(table, j, per_unit);
            let factor = Vector::<F, N>::new(scale);
            let mut moved = Array::<Vector<W, N>>::new(per_unit as usize);
            for r in 0..rounds {
                let at = start + r as usize * stride;
                // Every load of the chunk before any store: the compiler cannot move a load
                // past a store to another buffer it may alias, so a load, store, load order
                // would leave one load in flight per unit.
                #[unroll]
                for u in 0..per_unit {
                    let i = at + (u * CUBE_DIM) as usize;
                    let mut v = Vector::<W, N>::new(W::from_int(0));
                    if i < len {
                        v = Vector::cast_from(m[i] * factor);
                    }
                    moved[u as usize] = v;
                }
                #[unroll]
                for u in 0..per_unit {
                    let i = at + (u * CUBE_DIM) as usize;
                    if i < extent {
                        out[base + i] = moved[u as usize];
                    }
                }
            }
        }
    }
}

/// Scatters the reduced flat buffer back into the members, casting each element back to the
/// member dtype. The same work split as [`bucket_pack()`]; a member's extent is its length.
#[cube(launch_unchecked)]
pub fn bucket_unpack<W: Float, F: Float, N: Size>(
    buffer: &Array<Vector<W, N>>,
    table: &Array<u32>,
    members: &mut Sequence<Array<Vector<F, N>>>,
    rounds: u32,
    #[comptime] per_unit: u32,
) {
    let owner = member_of(table, members.len());
    #[unroll]
    for j in 0..members.len() {
        if owner == j {
            let m = members.index_mut(j);
            let base = table[TABLE_STRIDE * j + 1] as usize;
            let len = m.len();
            let (start, stride) = unit_start(table, j, per_unit);
            let mut moved = Array::<Vector<F, N>>::new(per_unit as usize);
            for r in 0..rounds {
                let at = start + r as usize * stride;
                // Loads first, then stores, as in the pack.
                #[unroll]
                for u in 0..per_unit {
                    let i = at + (u * CUBE_DIM) as usize;
                    if i < len {
                        moved[u as usize] = Vector::cast_from(buffer[base + i]);
                    }
                }
                #[unroll]
                for u in 0..per_unit {
                    let i = at + (u * CUBE_DIM) as usize;
                    if i < len {
                        m[i] = moved[u as usize];
                    }
                }
            }
        }
    }
}

//! How a bucket's members are split into launches of the bucket kernels
//! ([`kernels`](super::kernels)), and the table each launch reads. Pure: the layout and a few
//! facts about the member buffers in, launch descriptions out.
//!
//! Requires: a layout whose members are in offset order and whose `numel` fits the kernels'
//! 32-bit table. Guarantees: every member is in exactly one launch; a launch of width `w` holds
//! only members whose length, offset, extent and buffer start are multiples of `w` elements;
//! no launch holds more than the given member count; a member's cubes cover exactly its extent
//! in chunks of [`CUBE_DIM`] × [`PER_UNIT`] vectors.

use super::kernels::TABLE_STRIDE;
use super::layout::BucketLayout;

/// Units per cube of the bucket kernels.
pub const CUBE_DIM: u32 = 256;
/// Vectors each unit moves per chunk (unrolled in the kernels, so that many accesses are in
/// flight per unit).
pub const PER_UNIT: u32 = 4;
/// The most members one launch takes, whatever the device binds. The kernels hold one copy of
/// their body per member (a sequence is indexed at compile time), and that copy is paid for
/// twice: on an H200 a kernel of 63 members took 6.3 s to compile against 0.66 s for 15 and
/// 1.5 s for 31 (the first pack of each count compiles its own), and 64 members packed 256 MiB
/// at 0.35 of a device copy in every run against 0.66–0.78 for 4 members; on lavapipe,
/// which runs every member's copy masked, a 4 MiB bucket of 64 members took 16.4 ms against
/// 10.5 ms for 16. More members take consecutive launches into the same buffer.
pub const MAX_MEMBERS_PER_LAUNCH: usize = 16;

/// Cubes a launch aims at: past this, each cube takes several chunks in turn. 1024 cubes of 256
/// units fill a large GPU (an H200's 132 multiprocessors at 2048 units each) about once, and
/// keep the per-cube cost of software rasterizers (lavapipe) bounded.
pub const TARGET_CUBES: u64 = 1024;

/// What a member's cubes cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extent {
    /// The member and its padding up to the next member (or the buffer's end): the pack writes
    /// the padding.
    WithPadding,
    /// The member alone: the unpack leaves the padding.
    Member,
}

/// One launch's share of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Vector width in elements (1: scalar).
    pub width: usize,
    /// Member indices into the layout, ascending.
    pub members: Vec<usize>,
}

/// Member `j`'s extent in elements.
pub fn extent_of(layout: &BucketLayout, j: usize, extent: Extent) -> u64 {
    let m = &layout.members[j];
    match extent {
        Extent::Member => m.numel,
        Extent::WithPadding => {
            let end = layout.members.get(j + 1).map_or(layout.numel, |n| n.offset);
            end - m.offset
        }
    }
}

/// Splits the members into launches: those that can move `width` elements at a time first, then
/// the rest at width 1, each class in groups of at most `per_launch` members. `start_bytes[j]`
/// is where member `j`'s buffer starts within its allocation, `elem_bytes` its element size.
pub fn launches(
    layout: &BucketLayout,
    start_bytes: &[u64],
    elem_bytes: u64,
    width: usize,
    per_launch: usize,
) -> Vec<Launch> {
    let w = width as u64;
    let fits = |j: usize| {
        let m = &layout.members[j];
        width > 1
            && m.numel.is_multiple_of(w)
            && m.offset.is_multiple_of(w)
            && extent_of(layout, j, Extent::WithPadding).is_multiple_of(w)
            && start_bytes[j].is_multiple_of(w * elem_bytes)
    };
    let (wide, narrow): (Vec<usize>, Vec<usize>) =
        (0..layout.members.len()).partition(|&j| fits(j));
    let mut out = Vec::new();
    for (width, list) in [(width, wide), (1, narrow)] {
        out.extend(list.chunks(per_launch.max(1)).map(|c| Launch {
            width,
            members: c.to_vec(),
        }));
    }
    out
}

/// One launch's table and grid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// [`TABLE_STRIDE`] entries per member (first cube, offset and extent in vectors), then the
    /// total cube count.
    pub entries: Vec<u32>,
    /// Cubes the launch needs.
    pub cubes: u32,
    /// Chunks each cube moves in turn.
    pub rounds: u32,
}

/// The kernels' table for one launch: each member gets consecutive cubes, which move it
/// `rounds` chunks each, a round at a time (see [`kernels`](super::kernels)); `rounds` is
/// the fewest that keep the launch near [`TARGET_CUBES`].
pub fn table(layout: &BucketLayout, launch: &Launch, extent: Extent) -> Table {
    let w = launch.width as u64;
    let chunk = u64::from(CUBE_DIM * PER_UNIT);
    let extents: Vec<u64> = launch
        .members
        .iter()
        .map(|&j| extent_of(layout, j, extent) / w)
        .collect();
    let chunks: u64 = extents.iter().map(|e| e.div_ceil(chunk)).sum();
    let rounds = chunks.div_ceil(TARGET_CUBES).max(1);
    let mut entries = Vec::with_capacity(launch.members.len() * TABLE_STRIDE + 1);
    let mut cubes = 0u64;
    for (&j, &ext) in launch.members.iter().zip(&extents) {
        entries.extend([
            cubes as u32,
            (layout.members[j].offset / w) as u32,
            ext as u32,
        ]);
        cubes += ext.div_ceil(chunk * rounds);
    }
    entries.push(cubes as u32);
    Table {
        entries,
        cubes: cubes as u32,
        rounds: rounds as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::layout::MemberLayout;

    /// Members of these sizes, each at the next multiple of 4 elements.
    fn layout(sizes: &[u64]) -> BucketLayout {
        let mut offset = 0;
        let mut members = Vec::new();
        for n in sizes {
            offset = u64::next_multiple_of(offset, 4);
            members.push(MemberLayout {
                param: None,
                offset,
                numel: *n,
                dtype: "f32".into(),
            });
            offset += n;
        }
        let numel = offset.next_multiple_of(4);
        BucketLayout {
            bucket: Some(0),
            reduce: "sum".into(),
            scale_div: None,
            group: 0,
            wire_dtype: "f32".into(),
            members,
            numel,
            padding: numel - sizes.iter().sum::<u64>(),
            bytes: numel * 4,
            member_bytes: sizes.iter().sum::<u64>() * 4,
        }
    }

    #[test]
    fn odd_lengths_and_unaligned_buffers_go_to_the_scalar_launch() {
        let l = layout(&[8, 5, 4096, 12]);
        // Member 3's buffer starts 4 bytes into its allocation: not on a 16-byte boundary.
        let got = launches(&l, &[0, 0, 256, 4], 4, 4, 64);
        assert_eq!(
            got,
            vec![
                Launch {
                    width: 4,
                    members: vec![0, 2],
                },
                Launch {
                    width: 1,
                    members: vec![1, 3],
                },
            ]
        );
    }

    #[test]
    fn width_one_puts_everything_in_scalar_launches_of_at_most_per_launch_members() {
        let l = layout(&[4; 5]);
        let got = launches(&l, &[0; 5], 4, 1, 2);
        let widths: Vec<usize> = got.iter().map(|g| g.width).collect();
        let members: Vec<Vec<usize>> = got.into_iter().map(|g| g.members).collect();
        assert_eq!(widths, [1, 1, 1]);
        assert_eq!(members, [vec![0, 1], vec![2, 3], vec![4]]);
    }

    #[test]
    fn a_table_gives_each_member_its_chunks_and_the_pack_covers_the_padding() {
        // 5001 elements pad to 5004; the chunk is 1024 vectors (4096 elements at width 4).
        let l = layout(&[4100, 5001, 16]);
        let one = Launch {
            width: 4,
            members: vec![0, 2],
        };
        let t = table(&l, &one, Extent::WithPadding);
        // Member 0: 4100 elements = 1025 vectors, two cubes; member 2 starts at element 9104.
        assert_eq!(t.entries, vec![0, 0, 1025, 2, 9104 / 4, 4, 3]);
        assert_eq!((t.cubes, t.rounds), (3, 1));
        let scalar = Launch {
            width: 1,
            members: vec![1],
        };
        let with_pad = table(&l, &scalar, Extent::WithPadding).entries;
        let bare = table(&l, &scalar, Extent::Member).entries;
        assert_eq!(with_pad[2], 5004);
        assert_eq!(bare[2], 5001);
    }

    #[test]
    fn empty_members_get_no_cube() {
        let l = layout(&[0, 8]);
        let all = Launch {
            width: 4,
            members: vec![0, 1],
        };
        let t = table(&l, &all, Extent::Member);
        assert_eq!(t.entries, vec![0, 0, 0, 0, 0, 2, 1]);
        assert_eq!(t.cubes, 1);
    }

    #[test]
    fn a_large_bucket_takes_several_rounds_per_cube_and_stays_near_the_target_grid() {
        // Three members of 3 Mi elements: 768 chunks of 1024 vectors each, 2304 in all.
        let l = layout(&[3 << 20; 3]);
        let all = Launch {
            width: 4,
            members: vec![0, 1, 2],
        };
        let t = table(&l, &all, Extent::WithPadding);
        assert_eq!(t.rounds, 3);
        // 768 chunks in rounds of 3: 256 cubes a member.
        assert_eq!(t.entries[3], 256);
        assert_eq!(t.cubes, 768);
        assert!(u64::from(t.cubes) <= TARGET_CUBES);
    }
}

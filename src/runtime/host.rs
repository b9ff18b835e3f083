//! Host implementation of the bucket kernels, for tensors in host memory (NdArray's, and the
//! reference the CubeCL kernels are checked against). Same arithmetic as the CubeCL kernels:
//! scale in the member dtype, then cast to the wire dtype with round to nearest even.

use super::buffer::{Element, HostBuffer, HostSlice};
use crate::codegen::layout::BucketLayout;
use crate::with_host_buffer;

/// Why a bucket kernel could not run.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// A member does not match the layout.
    #[error("bucket {bucket}: member {index} ({param}) is {got}, the layout expects {expected}")]
    Member {
        /// Bucket label.
        bucket: String,
        /// Member index.
        index: usize,
        /// Parameter, when known.
        param: String,
        /// What the layout says.
        expected: String,
        /// What was given.
        got: String,
    },
    /// A device kernel, read or write failed.
    #[error("{what}: {why}")]
    Device {
        /// What was being done (names the bucket or the gradient).
        what: String,
        /// The device's error.
        why: String,
    },
    /// A dtype the host path does not handle.
    #[error("bucket {bucket}: dtype {dtype} is not supported by the host bucket kernels")]
    Dtype {
        /// Bucket label.
        bucket: String,
        /// The dtype.
        dtype: String,
    },
}

pub(crate) fn label(layout: &BucketLayout) -> String {
    layout
        .bucket
        .map_or_else(|| "(unbucketed)".to_string(), |b| format!("b{b}"))
}

fn check(layout: &BucketLayout, members: &[&HostBuffer]) -> Result<(), KernelError> {
    check_members(layout, members.iter().map(|m| (m.len(), m.dtype())))
}

/// Checks that `members` (each one's element count and dtype, in layout order) are the
/// layout's; an error names the first that is not. Every bucket kernel, host or device, checks
/// its members with it.
pub(crate) fn check_members(
    layout: &BucketLayout,
    members: impl ExactSizeIterator<Item = (usize, crate::graph::DType)>,
) -> Result<(), KernelError> {
    if members.len() != layout.members.len() {
        return Err(KernelError::Member {
            bucket: label(layout),
            index: members.len().min(layout.members.len()),
            param: "-".into(),
            expected: format!("{} members", layout.members.len()),
            got: format!("{} members", members.len()),
        });
    }
    for (i, (len, dtype)) in members.enumerate() {
        check_member(layout, i, len, dtype)?;
    }
    Ok(())
}

/// Member `i` of the layout; an error where it has fewer.
fn member_at(
    layout: &BucketLayout,
    i: usize,
) -> Result<&crate::codegen::layout::MemberLayout, KernelError> {
    layout.members.get(i).ok_or_else(|| KernelError::Member {
        bucket: label(layout),
        index: i,
        param: "-".into(),
        expected: format!("{} members", layout.members.len()),
        got: format!("member {i}"),
    })
}

/// Checks that member `i` of the layout exists and has `len` elements of `dtype`; the error
/// names it.
fn check_member(
    layout: &BucketLayout,
    i: usize,
    len: usize,
    dtype: crate::graph::DType,
) -> Result<(), KernelError> {
    let l = member_at(layout, i)?;
    if len as u64 != l.numel || dtype.name() != l.dtype {
        return Err(KernelError::Member {
            bucket: label(layout),
            index: i,
            param: l.param.clone().unwrap_or_else(|| "-".into()),
            expected: format!("{}[{}]", l.dtype, l.numel),
            got: format!("{dtype}[{len}]"),
        });
    }
    Ok(())
}

/// Zeros in the padding after member `j`'s `len` elements, up to the next member (or the end).
fn zero_padding_after<W: Element>(layout: &BucketLayout, j: usize, len: usize, out: &mut [W]) {
    let start = layout.members[j].offset as usize + len;
    let end = layout.members.get(j + 1).map_or(layout.numel, |n| n.offset) as usize;
    out[start..end].fill(W::ZERO);
}

/// Checks that a reduced flat buffer of `len` elements of `dtype` is the layout's.
pub(crate) fn check_flat(
    layout: &BucketLayout,
    len: usize,
    dtype: crate::graph::DType,
) -> Result<(), KernelError> {
    if len as u64 != layout.numel || dtype.name() != layout.wire_dtype {
        return Err(KernelError::Member {
            bucket: label(layout),
            index: 0,
            param: "(the flat buffer)".into(),
            expected: format!("{}[{}]", layout.wire_dtype, layout.numel),
            got: format!("{dtype}[{len}]"),
        });
    }
    Ok(())
}

fn pack_typed<F: Element, W: Element>(
    layout: &BucketLayout,
    members: &[&[F]],
    scale_div: Option<u32>,
    out: &mut [W],
) {
    for (j, m) in members.iter().enumerate() {
        pack_member_typed(layout, j, m, scale_div, out);
    }
}

/// Member `j` into its place in `out` (scaled, cast), and zeros in the padding after it, up to
/// the next member (or the end).
fn pack_member_typed<F: Element, W: Element>(
    layout: &BucketLayout,
    j: usize,
    m: &[F],
    scale_div: Option<u32>,
    out: &mut [W],
) {
    zero_padding_after(layout, j, m.len(), out);
    let dst = &mut out[layout.members[j].offset as usize..][..m.len()];
    match scale_div {
        Some(d) => {
            for (o, x) in dst.iter_mut().zip(m.iter()) {
                *o = W::from_f64(x.scale_div(d).to_f64());
            }
        }
        None => {
            for (o, x) in dst.iter_mut().zip(m.iter()) {
                *o = W::from_f64(x.to_f64());
            }
        }
    }
}

fn unpack_typed<W: Element, F: Element>(
    layout: &BucketLayout,
    buffer: &[W],
    member: &mut [F],
    i: usize,
) {
    let l = &layout.members[i];
    let src = &buffer[l.offset as usize..][..member.len()];
    for (o, x) in member.iter_mut().zip(src) {
        *o = F::from_f64(x.to_f64());
    }
}

fn wire_buffer(layout: &BucketLayout) -> Result<HostBuffer, KernelError> {
    crate::graph::DType::from_name(&layout.wire_dtype)
        .and_then(|d| HostBuffer::zeros(d, layout.numel as usize))
        .ok_or_else(|| KernelError::Dtype {
            bucket: label(layout),
            dtype: layout.wire_dtype.clone(),
        })
}

fn pack_as<F: Element>(
    layout: &BucketLayout,
    members: &[&HostBuffer],
    scale_div: Option<u32>,
    out: &mut HostBuffer,
) {
    let typed: Vec<&[F]> = members.iter().filter_map(|m| F::slice(m)).collect();
    with_host_buffer!(out, o => pack_typed(layout, &typed, scale_div, o));
}

/// Packs `members` (in layout order) into a new flat buffer of the layout's wire dtype, dividing
/// by `scale_div` when set. Padding is zero.
pub fn pack(
    layout: &BucketLayout,
    members: &[&HostBuffer],
    scale_div: Option<u32>,
) -> Result<HostBuffer, KernelError> {
    let mut out = wire_buffer(layout)?;
    pack_into(layout, members, scale_div, &mut out)?;
    Ok(out)
}

/// [`pack`] into `out`, reusing its memory when it already has the layout's dtype and length (a
/// fresh buffer costs a page fault per 4 KiB on first touch, more than the pack itself).
pub fn pack_into(
    layout: &BucketLayout,
    members: &[&HostBuffer],
    scale_div: Option<u32>,
    out: &mut HostBuffer,
) -> Result<(), KernelError> {
    check(layout, members)?;
    if out.dtype().name() != layout.wire_dtype || out.len() as u64 != layout.numel {
        *out = wire_buffer(layout)?;
    }
    let out = &mut *out;
    // Members share one dtype: the verifier guarantees it and `check` confirmed each one.
    match members.first().map(|m| m.dtype()) {
        None => {}
        Some(crate::graph::DType::F32) => pack_as::<f32>(layout, members, scale_div, out),
        Some(crate::graph::DType::F64) => pack_as::<f64>(layout, members, scale_div, out),
        Some(crate::graph::DType::F16) => pack_as::<half::f16>(layout, members, scale_div, out),
        Some(crate::graph::DType::BF16) => pack_as::<half::bf16>(layout, members, scale_div, out),
        Some(d) => {
            return Err(KernelError::Dtype {
                bucket: label(layout),
                dtype: d.name().to_string(),
            });
        }
    }
    Ok(())
}

/// Scatters a reduced flat buffer back into `members` (in layout order), casting each element
/// back to the member's dtype.
pub fn unpack(
    layout: &BucketLayout,
    buffer: &HostBuffer,
    members: &mut [&mut HostBuffer],
) -> Result<(), KernelError> {
    {
        let shared: Vec<&HostBuffer> = members.iter().map(|m| &**m).collect();
        check(layout, &shared)?;
    }
    check_flat(layout, buffer.len(), buffer.dtype())?;
    for (i, m) in members.iter_mut().enumerate() {
        let range = layout.members[i].range();
        // The cast back to the same type is a copy.
        match (buffer, &mut **m) {
            (HostBuffer::F32(b), HostBuffer::F32(o)) => o.copy_from_slice(&b[range]),
            (HostBuffer::F64(b), HostBuffer::F64(o)) => o.copy_from_slice(&b[range]),
            (HostBuffer::F16(b), HostBuffer::F16(o)) => o.copy_from_slice(&b[range]),
            (HostBuffer::BF16(b), HostBuffer::BF16(o)) => o.copy_from_slice(&b[range]),
            (b, o) => {
                with_host_buffer!(b, b => with_host_buffer!(o, o => unpack_typed(layout, b, o, i)))
            }
        }
    }
    Ok(())
}

/// [`unpack`] into new member buffers of the layout's dtypes and lengths: for members whose own
/// memory was let go once the bucket held their values.
pub fn unpack_new(
    layout: &BucketLayout,
    buffer: &HostBuffer,
) -> Result<Vec<HostBuffer>, KernelError> {
    (0..layout.members.len())
        .map(|j| unpack_member(layout, j, buffer))
        .collect()
}

/// Member `j` of the reduced flat buffer, in a new buffer of its own dtype.
pub fn unpack_member(
    layout: &BucketLayout,
    j: usize,
    buffer: &HostBuffer,
) -> Result<HostBuffer, KernelError> {
    check_flat(layout, buffer.len(), buffer.dtype())?;
    let l = member_at(layout, j)?;
    let range = l.range();
    if l.dtype == layout.wire_dtype {
        // The cast back to the same type is a copy.
        return Ok(match buffer {
            HostBuffer::F32(v) => HostBuffer::F32(v[range].to_vec()),
            HostBuffer::F64(v) => HostBuffer::F64(v[range].to_vec()),
            HostBuffer::F16(v) => HostBuffer::F16(v[range].to_vec()),
            HostBuffer::BF16(v) => HostBuffer::BF16(v[range].to_vec()),
        });
    }
    let mut out = crate::graph::DType::from_name(&l.dtype)
        .and_then(|d| HostBuffer::zeros(d, l.numel as usize))
        .ok_or_else(|| KernelError::Dtype {
            bucket: label(layout),
            dtype: l.dtype.clone(),
        })?;
    with_host_buffer!(buffer, b => with_host_buffer!(&mut out, o => unpack_typed(layout, b, o, j)));
    Ok(out)
}

// A bucket filled as its gradients arrive (the backend's host path): each member is copied into
// the flat buffer as it is the moment it exists ([`copy_member`], its own copy let go), the
// bucket's other members are packed when the last one is in ([`pack_rest`]), and the copied ones
// are scaled in place at the launch ([`scale_copied`]). Until then a copied member can be read
// back exactly ([`unpack_member`]: for a member of the wire's dtype, a copy); the numbers are [`pack`]'s, bit for bit.

/// Whether member `j` can be copied in before the pack: its dtype is the wire's, so the copy
/// is exact and the pack's arithmetic (scale in the member's dtype, then the cast, an identity
/// here) can run in place later.
pub fn copies_in(layout: &BucketLayout, j: usize) -> bool {
    layout
        .members
        .get(j)
        .is_some_and(|l| l.dtype == layout.wire_dtype)
}

/// Makes `out` the layout's flat buffer, reusing its memory when it already is one.
pub fn ensure_flat(layout: &BucketLayout, out: &mut HostBuffer) -> Result<(), KernelError> {
    if out.dtype().name() != layout.wire_dtype || out.len() as u64 != layout.numel {
        *out = wire_buffer(layout)?;
    }
    Ok(())
}

/// Copies member `j` into its place in the layout's flat buffer `out` unscaled (the padding
/// after it zeroed), from wherever its values lie (a gradient's own memory, a host copy of it).
/// The member must be one [`copies_in`] allows.
pub fn copy_member(
    layout: &BucketLayout,
    j: usize,
    member: HostSlice<'_>,
    out: &mut HostBuffer,
) -> Result<(), KernelError> {
    check_member(layout, j, member.len(), member.dtype())?;
    ensure_flat(layout, out)?;
    match (member, out) {
        (HostSlice::F32(m), HostBuffer::F32(o)) => copy_same(layout, j, m, o),
        (HostSlice::F64(m), HostBuffer::F64(o)) => copy_same(layout, j, m, o),
        (HostSlice::F16(m), HostBuffer::F16(o)) => copy_same(layout, j, m, o),
        (HostSlice::BF16(m), HostBuffer::BF16(o)) => copy_same(layout, j, m, o),
        (m, _) => {
            return Err(KernelError::Dtype {
                bucket: label(layout),
                dtype: format!("{} into a {} bucket", m.dtype(), layout.wire_dtype),
            });
        }
    }
    Ok(())
}

/// Member `j` into its place in `out`, of its own dtype (a `memcpy`: what the pack's cast to the
/// same type is, bit for bit), and zeros in the padding after it.
fn copy_same<T: Element>(layout: &BucketLayout, j: usize, m: &[T], out: &mut [T]) {
    zero_padding_after(layout, j, m.len(), out);
    out[layout.members[j].offset as usize..][..m.len()].copy_from_slice(m);
}

/// Packs the members given (`Some`, in layout order) into `out` as [`pack_into`] does; the
/// others (`None`) are in `out` already, copied in by [`copy_member`].
pub fn pack_rest(
    layout: &BucketLayout,
    members: &[Option<&HostBuffer>],
    scale_div: Option<u32>,
    out: &mut HostBuffer,
) -> Result<(), KernelError> {
    if members.len() != layout.members.len() {
        return check_members(
            layout,
            members.iter().map(|_| (0, crate::graph::DType::F32)),
        );
    }
    ensure_flat(layout, out)?;
    for (j, m) in members.iter().enumerate() {
        let Some(m) = m else { continue };
        check_one(layout, j, m)?;
        with_host_buffer!(*m, v => with_host_buffer!(&mut *out, o => pack_member_typed(layout, j, v, scale_div, o)));
    }
    Ok(())
}

/// Scales the members `copied` (indices, each copied in by [`copy_member`]) in place in the
/// packed flat buffer `out`, as the pack would have: the bucket is then [`pack`]'s.
pub fn scale_copied(
    layout: &BucketLayout,
    copied: &[usize],
    scale_div: Option<u32>,
    out: &mut HostBuffer,
) -> Result<(), KernelError> {
    check_flat(layout, out.len(), out.dtype())?;
    let Some(d) = scale_div else { return Ok(()) };
    for &j in copied {
        with_host_buffer!(&mut *out, o => {
            for x in &mut o[layout.members[j].range()] {
                *x = x.scale_div(d);
            }
        });
    }
    Ok(())
}

/// Checks member `j` against the layout.
fn check_one(layout: &BucketLayout, j: usize, member: &HostBuffer) -> Result<(), KernelError> {
    check_member(layout, j, member.len(), member.dtype())
}

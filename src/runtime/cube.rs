//! Launching the CubeCL bucket kernels ([`codegen::kernels`](crate::codegen::kernels)) on a
//! CubeCL runtime: wgpu here (Mesa's software Vulkan driver in CI), CUDA on GPUs. Buffers are
//! CubeCL handles, the same kind Burn's CubeCL backends keep their tensors in.
//!
//! A bucket is one launch when every member can be moved in 16-byte vectors (length, offset and
//! buffer start multiples of the vector width, which bucket alignment gives all but odd-sized
//! tensors) and there are at most [`MAX_MEMBERS_PER_LAUNCH`] members, within the device's
//! binding limit (every member is one storage binding). Members that cannot be vectorized go to
//! a second launch of width 1; buckets with more members than one launch takes are packed in
//! consecutive launches into the same buffer.

use cubecl::prelude::*;
use cubecl::server::{CubeCountSelection, Handle};

use super::buffer::HostBuffer;
use super::grad::{CudaMemory, DeviceBucket, DeviceGrad, Packed, Unpacked};
use super::host::KernelError;
use crate::codegen::kernels::{bucket_pack, bucket_unpack};
use crate::codegen::launches::{
    CUBE_DIM, Extent, MAX_MEMBERS_PER_LAUNCH, PER_UNIT, launches, table,
};
use crate::codegen::layout::{BucketLayout, MemberLayout};
use crate::graph::DType;

/// Widest access the kernels make, in bytes.
const MAX_VECTOR_BYTES: usize = 16;

/// Why a kernel could not be launched.
#[derive(Debug, thiserror::Error)]
pub enum CubeError {
    /// The runtime cannot run this dtype pair.
    #[error("bucket {bucket}: {what} is not supported on this device")]
    Unsupported {
        /// Bucket label.
        bucket: String,
        /// The dtype pair or feature.
        what: String,
    },
    /// A member handle does not match the layout.
    #[error("bucket {bucket}: {why}")]
    Layout {
        /// Bucket label.
        bucket: String,
        /// What is wrong.
        why: String,
    },
}

fn label(layout: &BucketLayout) -> String {
    layout
        .bucket
        .map_or_else(|| "(unbucketed)".to_string(), |b| format!("b{b}"))
}

/// A member tensor on the device: its handle and element count.
#[derive(Clone)]
pub struct DeviceMember {
    /// The buffer.
    pub handle: Handle,
    /// Elements.
    pub len: usize,
}

/// Members per launch on this client.
fn members_per_launch<R: Runtime>(client: &ComputeClient<R>) -> usize {
    // Every launch also binds the offsets and the flat buffer, plus CubeCL's metadata buffer.
    let bindings = client.properties().hardware.max_bindings as usize;
    bindings.saturating_sub(4).clamp(1, MAX_MEMBERS_PER_LAUNCH)
}

fn check(layout: &BucketLayout, members: &[DeviceMember]) -> Result<(), CubeError> {
    if members.len() != layout.members.len() {
        return Err(CubeError::Layout {
            bucket: label(layout),
            why: format!(
                "{} members given, the layout has {}",
                members.len(),
                layout.members.len()
            ),
        });
    }
    if layout.numel > u64::from(u32::MAX) {
        return Err(CubeError::Layout {
            bucket: label(layout),
            why: format!(
                "{} elements exceed the kernels' 32-bit offsets",
                layout.numel
            ),
        });
    }
    for (i, (m, l)) in members.iter().zip(&layout.members).enumerate() {
        if m.len as u64 != l.numel {
            return Err(CubeError::Layout {
                bucket: label(layout),
                why: format!(
                    "member {i} has {} elements, the layout says {}",
                    m.len, l.numel
                ),
            });
        }
    }
    Ok(())
}

/// The widest vector (in elements) the device loads for both dtypes, within [`MAX_VECTOR_BYTES`].
fn vector_width<R: Runtime>(client: &ComputeClient<R>, member: usize, wire: usize) -> usize {
    let elem = member.max(wire);
    client
        .io_optimized_vector_sizes(elem)
        .find(|v| v * elem <= MAX_VECTOR_BYTES)
        .unwrap_or(1)
}

/// One launch's grid: cube count and shape, vector width, and chunks per cube.
struct Grid {
    count: CubeCount,
    dim: CubeDim,
    width: usize,
    rounds: u32,
}

/// Calls `launch` once per [`Launch`] with cubes to run: its grid, member arrays, table and the
/// flat buffer `flat` (`layout.numel` elements). Vectors are as wide as the device loads for
/// both element sizes (`member_bytes`, `wire_bytes`) in one 16-byte access, or scalar where the
/// flat buffer does not start on a vector boundary (a view handed in).
fn per_launch<R: Runtime, T: CubePrimitive>(
    client: &ComputeClient<R>,
    layout: &BucketLayout,
    members: &[DeviceMember],
    flat: &Handle,
    (member_bytes, wire_bytes): (usize, usize),
    extent: Extent,
    mut launch: impl FnMut(Grid, SequenceArg<R, Array<T>>, ArrayArg<R>, ArrayArg<R>),
) {
    let mut width = vector_width(client, member_bytes, wire_bytes);
    let flat_start = flat.offset_start.unwrap_or(0);
    if !flat_start.is_multiple_of((width * wire_bytes) as u64) {
        width = 1;
    }
    let starts: Vec<u64> = members
        .iter()
        .map(|m| m.handle.offset_start.unwrap_or(0))
        .collect();
    let per = members_per_launch(client);
    for l in launches(layout, &starts, member_bytes as u64, width, per) {
        let t = table(layout, &l, extent);
        if t.cubes == 0 {
            continue;
        }
        let tab_handle = table_handle(client, &t.entries);
        let seq: SequenceArg<R, Array<T>> = l
            .members
            .iter()
            // SAFETY: each handle holds `len` member elements (checked against the layout), a
            // multiple of the launch's width. Lengths are in elements; the kernel sees
            // `len / width` vectors.
            .map(|&j| unsafe {
                ArrayArg::from_raw_parts(members[j].handle.clone(), members[j].len)
            })
            .collect();
        // SAFETY: the table was just created with `entries.len()` elements; the flat buffer
        // holds `layout.numel` elements (the caller's contract), a multiple of the width
        // wherever a member of this launch sits.
        let (tab_arg, flat_arg) = unsafe {
            (
                ArrayArg::from_raw_parts(tab_handle, t.entries.len()),
                ArrayArg::from_raw_parts(flat.clone(), layout.numel as usize),
            )
        };
        let grid = Grid {
            count: CubeCountSelection::new(client, t.cubes).cube_count(),
            dim: CubeDim::new_1d(CUBE_DIM),
            width: l.width,
            rounds: t.rounds,
        };
        launch(grid, seq, tab_arg, flat_arg);
    }
}

/// Tables cached at most, over all devices, before the cache starts again.
const TABLES_CACHED: usize = 4096;

/// The device copy of a launch's table. A training step packs the same buckets every step, so
/// a table is uploaded once per device and content, not once per launch (each upload is one
/// more request to CubeCL's device thread on the launch's path). The cache is keyed by the
/// runtime, the device (the address of the server's info, which every client of one device
/// shares) and the entries; it starts again past [`TABLES_CACHED`] tables, each a small
/// allocation (at most 196 bytes) in CubeCL's memory pool. A cached handle is only ever read by
/// the kernels, and the cache's own reference keeps CubeCL from reusing its memory.
fn table_handle<R: Runtime>(client: &ComputeClient<R>, entries: &[u32]) -> Handle {
    type Tables =
        hashbrown::HashMap<(std::any::TypeId, usize), hashbrown::HashMap<Vec<u32>, Handle>>;
    static TABLES: std::sync::Mutex<Option<Tables>> = std::sync::Mutex::new(None);
    let device = std::ptr::from_ref(client.info()).cast::<()>() as usize;
    // A panic while the lock was held left at worst a missing entry.
    let mut tables = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    let tables = tables.get_or_insert_with(Default::default);
    let key = (std::any::TypeId::of::<R>(), device);
    // Looked up by the slice: a hit allocates nothing.
    if let Some(h) = tables.get(&key).and_then(|t| t.get(entries)) {
        return h.clone();
    }
    if tables.values().map(hashbrown::HashMap::len).sum::<usize>() >= TABLES_CACHED {
        tables.clear();
    }
    let h = client.create_from_slice(u32::as_bytes(entries));
    tables
        .entry(key)
        .or_default()
        .insert(entries.to_vec(), h.clone());
    h
}

/// Packs into `out`, which holds `layout.numel` elements of `W`.
fn pack_typed<R: Runtime, F: Float + CubeElement, W: Float + CubeElement>(
    client: &ComputeClient<R>,
    layout: &BucketLayout,
    members: &[DeviceMember],
    scale: f32,
    out: &Handle,
) {
    let sizes = (size_of::<F>(), size_of::<W>());
    let padded = Extent::WithPadding;
    per_launch(
        client,
        layout,
        members,
        out,
        sizes,
        padded,
        |g, seq, tab, out| {
            // SAFETY: every index the kernel makes is below a member's length or extent, which the
            // table and the arrays carry.
            unsafe {
                bucket_pack::launch_unchecked::<F, W, R>(
                    client,
                    g.count,
                    g.dim,
                    g.width,
                    seq,
                    tab,
                    out,
                    F::new(scale),
                    g.rounds,
                    PER_UNIT,
                );
            }
        },
    );
}

/// Unpacks from `buffer`, which holds `layout.numel` elements of `W`.
fn unpack_typed<R: Runtime, W: Float + CubeElement, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    layout: &BucketLayout,
    buffer: &Handle,
    members: &[DeviceMember],
) {
    let sizes = (size_of::<F>(), size_of::<W>());
    per_launch(
        client,
        layout,
        members,
        buffer,
        sizes,
        Extent::Member,
        |g, seq, tab, buf| {
            // SAFETY: as in `pack_typed`.
            unsafe {
                bucket_unpack::launch_unchecked::<W, F, R>(
                    client, g.count, g.dim, g.width, buf, tab, seq, g.rounds, PER_UNIT,
                );
            }
        },
    );
}

fn dtype_of(layout: &BucketLayout, name: &str) -> Result<DType, CubeError> {
    DType::from_name(name).ok_or_else(|| CubeError::Unsupported {
        bucket: label(layout),
        what: format!("dtype {name}"),
    })
}

fn supports<R: Runtime>(client: &ComputeClient<R>, d: DType) -> bool {
    let ty = match d {
        DType::F32 => f32::as_type_native_unchecked(),
        DType::F16 => half::f16::as_type_native_unchecked(),
        DType::BF16 => half::bf16::as_type_native_unchecked(),
        DType::F64 => f64::as_type_native_unchecked(),
        DType::I32 | DType::I64 | DType::Bool => return false,
    };
    client.properties().supports_type(ty)
}

macro_rules! by_dtype_pair {
    ($member:expr, $wire:expr, $layout:expr, |$f:ident, $w:ident| $call:expr) => {{
        macro_rules! inner {
            ($ft:ty) => {
                match $wire {
                    DType::F32 => {
                        type $f = $ft;
                        type $w = f32;
                        $call
                    }
                    DType::F16 => {
                        type $f = $ft;
                        type $w = half::f16;
                        $call
                    }
                    DType::BF16 => {
                        type $f = $ft;
                        type $w = half::bf16;
                        $call
                    }
                    DType::F64 => {
                        type $f = $ft;
                        type $w = f64;
                        $call
                    }
                    d => {
                        return Err(CubeError::Unsupported {
                            bucket: label($layout),
                            what: format!("wire dtype {d}"),
                        })
                    }
                }
            };
        }
        match $member {
            DType::F32 => inner!(f32),
            DType::F16 => inner!(half::f16),
            DType::BF16 => inner!(half::bf16),
            DType::F64 => inner!(f64),
            d => {
                return Err(CubeError::Unsupported {
                    bucket: label($layout),
                    what: format!("member dtype {d}"),
                });
            }
        }
    }};
}

fn dtypes<R: Runtime>(
    client: &ComputeClient<R>,
    layout: &BucketLayout,
) -> Result<(DType, DType), CubeError> {
    let wire = dtype_of(layout, &layout.wire_dtype)?;
    let member = match layout.members.first() {
        Some(m) => dtype_of(layout, &m.dtype)?,
        None => wire,
    };
    for d in [member, wire] {
        if !supports(client, d) {
            return Err(CubeError::Unsupported {
                bucket: label(layout),
                what: format!("dtype {d}"),
            });
        }
    }
    Ok((member, wire))
}

/// Packs `members` into a new device buffer of the layout's wire dtype (scaled by
/// `1/scale_div` when set), returning its handle. One launch per bucket when the members fit
/// the device's binding limit.
pub fn pack<R: Runtime>(
    client: &ComputeClient<R>,
    layout: &BucketLayout,
    members: &[DeviceMember],
    scale_div: Option<u32>,
) -> Result<Handle, CubeError> {
    check(layout, members)?;
    let (member, wire) = dtypes(client, layout)?;
    let out = client.empty(layout.numel.max(1) as usize * wire.size() as usize);
    // The same factor the host path uses: 1/div rounded in f32 (exact for powers of two).
    let scale = scale_div.map_or(1.0, |d| 1.0 / d as f32);
    by_dtype_pair!(member, wire, layout, |F, W| pack_typed::<R, F, W>(
        client, layout, members, scale, &out
    ));
    Ok(out)
}

/// Scatters a reduced flat buffer back into the members' buffers, casting back.
pub fn unpack<R: Runtime>(
    client: &ComputeClient<R>,
    layout: &BucketLayout,
    buffer: &Handle,
    members: &[DeviceMember],
) -> Result<(), CubeError> {
    check(layout, members)?;
    let (member, wire) = dtypes(client, layout)?;
    by_dtype_pair!(member, wire, layout, |F, W| unpack_typed::<R, W, F>(
        client, layout, buffer, members
    ));
    Ok(())
}

/// A gradient in a CubeCL device buffer (a contiguous tensor's handle), for the executor: a
/// bucket whose members are all `CubeGrad`s of one runtime is packed and unpacked by the kernels
/// above, and only the flat bucket crosses to the host.
pub struct CubeGrad<R: Runtime> {
    /// The runtime's client (the tensor's).
    pub client: ComputeClient<R>,
    /// The buffer, `len` elements of `dtype` from its start.
    pub handle: Handle,
    /// Elements.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
}

/// A failed device operation: `what` was being done, `why` it failed.
pub(crate) fn device_error(what: String, why: impl std::fmt::Display) -> KernelError {
    KernelError::Device {
        what,
        why: why.to_string(),
    }
}

/// Reads `len` elements of `dtype` from `handle` into host memory.
fn read_back<R: Runtime>(
    client: &ComputeClient<R>,
    handle: &Handle,
    dtype: DType,
    len: usize,
    what: impl Fn() -> String,
) -> Result<HostBuffer, KernelError> {
    let bytes = client
        .read_one(handle.clone())
        .map_err(|e| device_error(what(), format!("{e:?}")))?;
    let want = len * dtype.size() as usize;
    if bytes.len() < want {
        return Err(device_error(
            what(),
            format!("the device returned {} bytes, {want} expected", bytes.len()),
        ));
    }
    HostBuffer::from_le_bytes(dtype, &bytes[..want])
        .ok_or_else(|| device_error(what(), format!("{dtype} has no host buffer")))
}

impl<R: Runtime> CubeGrad<R> {
    fn member(&self) -> DeviceMember {
        DeviceMember {
            handle: self.handle.clone(),
            len: self.len,
        }
    }
}

impl<R: Runtime> DeviceGrad for CubeGrad<R> {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }

    fn read(&self) -> Result<HostBuffer, KernelError> {
        read_back(&self.client, &self.handle, self.dtype, self.len, || {
            format!(
                "reading a {}[{}] gradient from the device",
                self.dtype, self.len
            )
        })
    }

    fn pack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        scale_div: Option<u32>,
    ) -> Result<Option<Box<dyn DeviceBucket>>, KernelError> {
        let Some(ours) = members
            .iter()
            .map(|m| {
                m.as_any()
                    .downcast_ref::<CubeGrad<R>>()
                    .map(CubeGrad::member)
            })
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        for (i, (m, l)) in members.iter().zip(&layout.members).enumerate() {
            if m.dtype().name() != l.dtype {
                return Err(device_error(
                    format!("packing {}", label(layout)),
                    format!(
                        "member {i} is {}[{}], the layout expects {}[{}]",
                        m.dtype(),
                        m.len(),
                        l.dtype,
                        l.numel
                    ),
                ));
            }
        }
        let what = || format!("packing {}", label(layout));
        let out = match pack(&self.client, layout, &ours, scale_div) {
            Ok(out) => out,
            // A dtype this device does not run: the host packs it.
            Err(CubeError::Unsupported { .. }) => return Ok(None),
            Err(e) => return Err(device_error(what(), e)),
        };
        // `pack` parsed it already.
        let wire = dtype_of(layout, &layout.wire_dtype).map_err(|e| device_error(what(), e))?;
        Ok(Some(Box::new(CubeBucket {
            client: self.client.clone(),
            handle: out,
            len: layout.numel as usize,
            dtype: wire,
            label: label(layout),
        })))
    }

    fn copy_to_bucket(&self) -> Result<Option<Box<dyn DeviceBucket>>, KernelError> {
        if self.len == 0 {
            return Ok(None);
        }
        // A bucket of one member at offset 0, no scale, no cast: the pack kernel is the copy.
        let mut layout =
            BucketLayout::of_sizes(&[self.len as u64], self.dtype, self.dtype, None, 0);
        layout.bucket = None;
        layout.members[0].param = None;
        match pack(&self.client, &layout, &[self.member()], None) {
            Ok(handle) => Ok(Some(Box::new(CubeBucket {
                client: self.client.clone(),
                handle,
                len: self.len,
                dtype: self.dtype,
                label: format!("{}[{}] gradient", self.dtype, self.len),
            }))),
            Err(CubeError::Unsupported { .. }) => Ok(None),
            Err(e) => Err(device_error(
                format!("copying a {}[{}] gradient", self.dtype, self.len),
                e,
            )),
        }
    }

    fn unpack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        reduced: &Packed,
        views: bool,
    ) -> Result<Unpacked, KernelError> {
        let what = || format!("unpacking {}", label(layout));
        super::host::check_flat(layout, reduced.len(), reduced.dtype())?;
        super::host::check_members(layout, members.iter().map(|m| (m.len(), m.dtype())))?;
        let flat = match reduced {
            Packed::Host(b) => self.client.create_from_slice(b.as_bytes()),
            Packed::Device(d) => match d.as_any().downcast_ref::<CubeBucket<R>>() {
                Some(b) => b.handle.clone(),
                None => self.client.create_from_slice(d.read()?.as_bytes()),
            },
        };
        let wire = reduced.dtype();
        // The device's offset alignment for a buffer binding (CubeCL's `memory.alignment`, the
        // same test Burn's own slicing makes before it takes a view).
        let align = self.client.properties().memory.alignment.max(1);
        let view_of = |m: &&dyn DeviceGrad, l: &MemberLayout| -> Option<Handle> {
            let start = l.offset * wire.size();
            let bytes = m.len() as u64 * wire.size();
            let fits = start + bytes <= flat.size_in_used();
            (views && m.dtype() == wire && !m.is_empty() && fits && start.is_multiple_of(align))
                .then(|| {
                    flat.clone()
                        .offset_start(start)
                        .offset_end(flat.size_in_used() - start - bytes)
                })
        };
        let mut out: Vec<Option<CubeGrad<R>>> = members
            .iter()
            .zip(&layout.members)
            .map(|(m, l)| {
                view_of(m, l).map(|handle| CubeGrad {
                    client: self.client.clone(),
                    handle,
                    len: m.len(),
                    dtype: m.dtype(),
                })
            })
            .collect();
        let viewed = out.iter().filter(|g| g.is_some()).count() as u32;
        // The rest are copied out by the unpack kernel, over a layout of just those members.
        let copied: Vec<usize> = (0..members.len()).filter(|&i| out[i].is_none()).collect();
        if !copied.is_empty() {
            let fresh: Vec<CubeGrad<R>> = copied
                .iter()
                .map(|&i| CubeGrad {
                    client: self.client.clone(),
                    handle: self
                        .client
                        .empty((members[i].len() * members[i].dtype().size() as usize).max(1)),
                    len: members[i].len(),
                    dtype: members[i].dtype(),
                })
                .collect();
            let targets: Vec<DeviceMember> = fresh.iter().map(CubeGrad::member).collect();
            let sub;
            let sub_layout = if copied.len() == layout.members.len() {
                layout
            } else {
                sub = BucketLayout {
                    members: copied.iter().map(|&i| layout.members[i].clone()).collect(),
                    ..layout.clone()
                };
                &sub
            };
            unpack(&self.client, sub_layout, &flat, &targets)
                .map_err(|e| device_error(what(), e))?;
            for (i, g) in copied.into_iter().zip(fresh) {
                out[i] = Some(g);
            }
        }
        Ok(Unpacked {
            grads: out
                .into_iter()
                .flatten()
                .map(|g| Box::new(g) as Box<dyn DeviceGrad>)
                .collect(),
            views: viewed,
        })
    }
}

/// A bucket packed by the kernels above: a CubeCL handle of `len` wire elements.
pub struct CubeBucket<R: Runtime> {
    /// The runtime's client (the members').
    pub client: ComputeClient<R>,
    /// The flat buffer.
    pub handle: Handle,
    /// Elements.
    pub len: usize,
    /// Wire element type.
    pub dtype: DType,
    /// The bucket's label (`b3`), for errors.
    pub label: String,
}

impl<R: Runtime> DeviceBucket for CubeBucket<R> {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn read(&self) -> Result<HostBuffer, KernelError> {
        read_back(&self.client, &self.handle, self.dtype, self.len, || {
            format!("reading packed bucket {} from the device", self.label)
        })
    }

    fn into_grad(self: Box<Self>) -> Box<dyn DeviceGrad> {
        Box::new(CubeGrad {
            client: self.client,
            handle: self.handle,
            len: self.len,
            dtype: self.dtype,
        })
    }

    fn cuda_memory(&self) -> Result<Option<CudaMemory>, KernelError> {
        #[cfg(feature = "cuda")]
        if let Some(client) = (&self.client as &dyn std::any::Any)
            .downcast_ref::<ComputeClient<cubecl::cuda::CudaRuntime>>()
        {
            let what = format!("handing packed bucket {} to NCCL", self.label);
            // CubeCL keeps its CUDA streams to itself, so the NCCL stream cannot wait on an
            // event of the pack kernel's stream. Instead the bucket is looked up on a stream of
            // its own (`fence_stream`): CubeCL then records an event on this thread's stream,
            // right after the pack kernel, and queues a wait for it on that stream. Nothing
            // blocks here; the communicator's thread blocks on the fence stream later, which
            // passes once the pack kernel (and what came before it) has run.
            let mut fence = client.clone();
            // SAFETY: the fence stream only ever looks buckets up and synchronizes: it
            // allocates nothing and launches nothing, so no memory of its pool is in use.
            unsafe { fence.set_stream(fence_stream()) };
            let resource = fence
                .get_resource(self.handle.clone())
                .map_err(|e| device_error(what.clone(), format!("{e:?}")))?;
            let (ptr, bytes) = (resource.resource().ptr, resource.resource().size);
            let ready: super::grad::ReadyWait = Box::new(move || {
                cubecl::future::block_on(fence.sync())
                    .map_err(|e| format!("{what}: waiting for the pack kernel: {e:?}"))
            });
            return Ok(Some(CudaMemory::new(
                ptr,
                bytes,
                Box::new((self.handle.clone(), resource)),
                ready,
            )));
        }
        Ok(None)
    }
}

/// The CubeCL stream on which buckets handed to NCCL are waited for: one id for the process,
/// taken from CubeCL's own counter by a thread that makes no other CubeCL call, so that no
/// thread computes on it (CubeCL gives every thread the next id of that counter).
#[cfg(feature = "cuda")]
fn fence_stream() -> cubecl::stream_id::StreamId {
    static FENCE: std::sync::OnceLock<cubecl::stream_id::StreamId> = std::sync::OnceLock::new();
    *FENCE.get_or_init(|| {
        std::thread::Builder::new()
            .name("cf-fence-stream-id".into())
            .spawn(cubecl::stream_id::StreamId::current)
            .ok()
            .and_then(|t| t.join().ok())
            // Without a thread to spare, an id far beyond any thread's (it may share a CUDA
            // stream with one, which makes the wait longer, never wrong).
            .unwrap_or(cubecl::stream_id::StreamId { value: u64::MAX })
    })
}

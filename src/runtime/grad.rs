//! Where a rank's gradient lives while a plan runs: in host memory ([`HostBuffer`]), or in a
//! device buffer of the inner backend ([`DeviceGrad`]), so that a bucket of device gradients is
//! packed and unpacked by the CubeCL kernels on the tensors' own buffers and crosses to the host
//! (for a host communicator) once per bucket instead of once per gradient.
//!
//! The executor packs a bucket on the device when every member is a device gradient and the
//! device runs the bucket's dtypes; otherwise it reads the device members into host memory and
//! packs there. Either way the numbers are the same: the kernels and the host path share their
//! arithmetic (checked bitwise in the kernel tests).
//!
//! A bucket packed on the device stays there ([`DeviceBucket`]) until its collective: a
//! communicator that reduces that device's memory (NCCL on the bucket's GPU) reduces it in
//! place, and the unpack reads it on the device; any other communicator reads it into host
//! memory on its own thread, and the unpack writes the reduced bucket back first.

use std::any::Any;

use super::buffer::HostBuffer;
use super::host::KernelError;
use crate::codegen::layout::BucketLayout;
use crate::graph::DType;

/// A gradient in a device buffer. One implementation per device kind; the executor only calls
/// these methods.
pub trait DeviceGrad: Send + 'static {
    /// Element type.
    fn dtype(&self) -> DType;
    /// Element count.
    fn len(&self) -> usize;
    /// Whether it holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The concrete value, for the implementation's own downcasts.
    fn as_any(&self) -> &dyn Any;
    /// The concrete value, by value (the backend turns it back into a tensor).
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
    /// Copies it into host memory.
    fn read(&self) -> Result<HostBuffer, KernelError>;
    /// Packs `members` (this one among them, in layout order) on the device into a new flat
    /// buffer of the layout's wire dtype, dividing by `scale_div` when set. `Ok(None)`: this
    /// device cannot (a member of another kind, or a dtype it does not run), and the caller
    /// packs on the host.
    fn pack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        scale_div: Option<u32>,
    ) -> Result<Option<Box<dyn DeviceBucket>>, KernelError>;
    /// A copy of it as a flat bucket of its own dtype (its buffer may be shared with other
    /// tensors), for a communicator that reduces device memory in place to reduce a gradient
    /// that has an all-reduce of its own. `Ok(None)`: this device cannot.
    fn copy_to_bucket(&self) -> Result<Option<Box<dyn DeviceBucket>>, KernelError> {
        Ok(None)
    }
    /// Unpacks the reduced flat buffer into device gradients, one per member, in layout order
    /// (the members' own buffers may be shared with other tensors, so they are not written). A
    /// bucket in host memory is written to the device first. With `views`, a member of the
    /// wire dtype whose offset the device can address is handed back as a view of the reduced
    /// bucket (no copy, no new memory: PyTorch DDP's `gradient_as_bucket_view`); every other
    /// member is copied out by the unpack kernel into a new buffer.
    fn unpack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        reduced: &Packed,
        views: bool,
    ) -> Result<Unpacked, KernelError>;
}

/// The reduced members of a bucket, unpacked on the device.
pub struct Unpacked {
    /// One per member, in layout order.
    pub grads: Vec<Box<dyn DeviceGrad>>,
    /// How many of them are views of the reduced bucket rather than copies.
    pub views: u32,
}

/// A bucket packed in device memory: the flat buffer a collective reduces.
pub trait DeviceBucket: Send + 'static {
    /// Wire element type.
    fn dtype(&self) -> DType;
    /// Element count.
    fn len(&self) -> usize;
    /// Whether it holds no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The concrete value, for the implementation's own downcasts.
    fn as_any(&self) -> &dyn Any;
    /// Copies it into host memory (after the kernels that wrote it).
    fn read(&self) -> Result<HostBuffer, KernelError>;
    /// The bucket as a device gradient of its own dtype and length (the reduced copy of a
    /// gradient with an all-reduce of its own).
    fn into_grad(self: Box<Self>) -> Box<dyn DeviceGrad>;
    /// Its CUDA device memory, for a communicator that reduces it in place. Call it on the
    /// thread that launched the kernels that wrote it, right after them: it does not wait for
    /// them, it orders a wait after them, which [`CudaMemory::wait_ready`] then performs on
    /// the communicator's thread. `Ok(None)`: it is not CUDA memory.
    fn cuda_memory(&self) -> Result<Option<CudaMemory>, KernelError> {
        Ok(None)
    }
}

/// A device gradient with an all-reduce of its own, handed to a communicator that does not
/// reduce its memory as a bucket of one, so that the communicator reads it into host memory
/// on its own thread ([`Communicator::all_reduce_read`](super::Communicator::all_reduce_read)).
pub(crate) struct WholeGrad(pub Box<dyn DeviceGrad>);

impl DeviceBucket for WholeGrad {
    fn dtype(&self) -> DType {
        self.0.dtype()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn read(&self) -> Result<HostBuffer, KernelError> {
        self.0.read()
    }

    fn into_grad(self: Box<Self>) -> Box<dyn DeviceGrad> {
        self.0
    }
}

/// Waits until the kernels that wrote a bucket have finished; an error names what failed.
pub type ReadyWait = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// A device bucket's CUDA memory, to be reduced in place once [`CudaMemory::wait_ready`]
/// returns.
pub struct CudaMemory {
    /// The device pointer (a `CUdeviceptr`) of its first element.
    pub ptr: u64,
    /// Bytes of device memory from `ptr` that the allocation holds (at least the bucket's).
    pub bytes: u64,
    /// Keeps the allocation alive (and out of the allocator's reuse) while it is held.
    pub keep_alive: Box<dyn Any + Send>,
    /// The wait for the kernels that wrote it; `None` once waited.
    ready: Option<ReadyWait>,
}

impl CudaMemory {
    /// Memory at `ptr` (`bytes` of it), held by `keep_alive`, written once `ready` returns.
    pub fn new(ptr: u64, bytes: u64, keep_alive: Box<dyn Any + Send>, ready: ReadyWait) -> Self {
        Self {
            ptr,
            bytes,
            keep_alive,
            ready: Some(ready),
        }
    }

    /// Blocks this thread until the kernels that wrote the memory have finished (at once
    /// after the first call).
    pub fn wait_ready(&mut self) -> Result<(), String> {
        self.ready.take().map_or(Ok(()), |wait| wait())
    }
}

/// A packed bucket: in host memory, or in device memory.
pub enum Packed {
    /// Packed on the host, or read there for a host communicator.
    Host(HostBuffer),
    /// Packed on the device.
    Device(Box<dyn DeviceBucket>),
}

impl Packed {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Packed::Host(b) => b.dtype(),
            Packed::Device(d) => d.dtype(),
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            Packed::Host(b) => b.len(),
            Packed::Device(d) => d.len(),
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Into host memory.
    pub fn into_host(self) -> Result<HostBuffer, KernelError> {
        match self {
            Packed::Host(b) => Ok(b),
            Packed::Device(d) => d.read(),
        }
    }
}

/// One gradient slot of a plan.
pub enum Grad {
    /// In host memory.
    Host(HostBuffer),
    /// In a device buffer.
    Device(Box<dyn DeviceGrad>),
}

impl Default for Grad {
    fn default() -> Self {
        Grad::Host(HostBuffer::default())
    }
}

impl std::fmt::Debug for Grad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Grad::Host(b) => write!(f, "Host({}[{}])", b.dtype(), b.len()),
            Grad::Device(d) => write!(f, "Device({}[{}])", d.dtype(), d.len()),
        }
    }
}

impl From<HostBuffer> for Grad {
    fn from(b: HostBuffer) -> Self {
        Grad::Host(b)
    }
}

impl Grad {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Grad::Host(b) => b.dtype(),
            Grad::Device(d) => d.dtype(),
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        match self {
            Grad::Host(b) => b.len(),
            Grad::Device(d) => d.len(),
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device gradient, if it is one.
    pub fn device(&self) -> Option<&dyn DeviceGrad> {
        match self {
            Grad::Device(d) => Some(d.as_ref()),
            Grad::Host(_) => None,
        }
    }

    /// The host buffer, reading a device gradient into host memory first.
    pub fn host_mut(&mut self) -> Result<&mut HostBuffer, KernelError> {
        if let Grad::Device(d) = self {
            *self = Grad::Host(d.read()?);
        }
        match self {
            Grad::Host(b) => Ok(b),
            Grad::Device(d) => Err(KernelError::Device {
                what: format!("reading a {}[{}] device gradient", d.dtype(), d.len()),
                why: "it is still on the device after the read".into(),
            }),
        }
    }

    /// Into host memory.
    pub fn into_host(self) -> Result<HostBuffer, KernelError> {
        match self {
            Grad::Host(b) => Ok(b),
            Grad::Device(d) => d.read(),
        }
    }
}

/// A reduced gradient as [`Execution::unpack`](super::exec::Execution::unpack) hands it over: a
/// gradient of its own, or a member still in its reduced host bucket, which the receiver copies
/// where it goes (over the memory of the gradient it replaces, where it can: no buffer of its
/// own, as DDP copies a bucket back into its gradients) or into a buffer of its own
/// ([`Handed::into_grad`]).
pub enum Handed<'a> {
    /// A gradient of its own.
    Grad(Grad),
    /// Member `member` of a reduced host bucket laid out as `layout`.
    Member {
        /// The bucket's layout.
        layout: &'a BucketLayout,
        /// The member's index in it.
        member: usize,
        /// The reduced bucket.
        bucket: &'a HostBuffer,
    },
}

impl Handed<'_> {
    /// The member's reduced elements, as a slice of its bucket, where the member is of the
    /// bucket's own dtype `T` (nothing to cast back); `None` for a gradient of its own, or a
    /// member of another dtype.
    pub fn wire_slice<T: super::buffer::Element>(&self) -> Option<&[T]> {
        let Handed::Member {
            layout,
            member,
            bucket,
        } = self
        else {
            return None;
        };
        let l = layout.members.get(*member)?;
        (l.dtype == layout.wire_dtype && l.dtype == T::DTYPE.name())
            .then(|| T::slice(bucket))
            .flatten()?
            .get(l.range())
    }

    /// The gradient in a buffer of its own (a member is copied out of its bucket, cast back to
    /// its dtype).
    pub fn into_grad(self) -> Result<Grad, KernelError> {
        match self {
            Handed::Grad(g) => Ok(g),
            Handed::Member {
                layout,
                member,
                bucket,
            } => super::host::unpack_member(layout, member, bucket).map(Grad::Host),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_bucket_is_waited_for_once_and_its_failure_is_reported() {
        let waits = Arc::new(AtomicUsize::new(0));
        let counted = waits.clone();
        let mut memory = CudaMemory::new(
            0x1000,
            64,
            Box::new(()),
            Box::new(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                Err("pack kernel of bucket 3 failed".to_string())
            }),
        );
        assert_eq!(
            memory.wait_ready(),
            Err("pack kernel of bucket 3 failed".to_string())
        );
        assert_eq!(memory.wait_ready(), Ok(()));
        assert_eq!(waits.load(Ordering::SeqCst), 1);
    }
}

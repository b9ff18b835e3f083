//! Where a rank's gradient lives while a plan runs: in host memory ([`HostBuffer`]), or in a
//! device buffer of the inner backend ([`DeviceGrad`]), so that a bucket of device gradients is
//! packed and unpacked by the CubeCL kernels on the tensors' own buffers and crosses to the host
//! (for a host communicator) once per bucket instead of once per gradient.
//!
//! The executor packs a bucket on the device when every member is a device gradient and the
//! device runs the bucket's dtypes; otherwise it reads the device members into host memory and
//! packs there. Either way the numbers are the same: the kernels and the host path share their
//! arithmetic (checked bitwise in the kernel tests).

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
    /// Packs `members` (this one among them, in layout order) on the device into a flat buffer
    /// of the layout's wire dtype, dividing by `scale_div` when set, and returns that buffer
    /// read back to the host. `Ok(None)`: this device cannot (a member of another kind, or a
    /// dtype it does not run), and the caller packs on the host.
    fn pack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        scale_div: Option<u32>,
    ) -> Result<Option<HostBuffer>, KernelError>;
    /// Writes the reduced flat buffer to the device and unpacks it into new device buffers, one
    /// per member, in layout order (the members' own buffers may be shared with other tensors,
    /// so they are not written).
    fn unpack(
        &self,
        layout: &BucketLayout,
        members: &[&dyn DeviceGrad],
        reduced: &HostBuffer,
    ) -> Result<Vec<Box<dyn DeviceGrad>>, KernelError>;
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

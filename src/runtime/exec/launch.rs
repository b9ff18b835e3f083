//! Launching a plan's collectives on the communicator and waiting for them: a packed bucket as
//! one call, an unpacked collective as one call per gradient, a user's all-reduce outside any
//! plan; device memory in place where the communicator reduces it, else read into host memory
//! on the communicator's own thread.

use std::time::Duration;

use super::{ExecError, ExecReport};
use crate::codegen::plan::{Plan, PlanCollective};
use crate::graph::DType;
use crate::runtime::comm::{
    CollectiveDesc, CommError, CommSpan, Communicator, DeviceLaunch, PendingReduce,
};
use crate::runtime::grad::{DeviceBucket, Grad, Packed, WholeGrad};

pub(super) fn desc_of(
    plan: &Plan,
    c: &PlanCollective,
    count: u64,
    dtype: DType,
    slots: &[u32],
) -> CollectiveDesc {
    CollectiveDesc {
        collective: c.id,
        bucket: c.bucket,
        op: c.op,
        dtype,
        count,
        params: slots
            .iter()
            .map(|s| plan.slots[*s as usize].param.clone())
            .collect(),
    }
}

pub(super) enum InFlight {
    /// One packed bucket.
    Bucket(Pending),
    /// One call per slot.
    Slots(Vec<(u32, Pending)>),
}

/// One all-reduce in flight: of host memory, or in place in device memory.
pub(super) enum Pending {
    Host(PendingReduce),
    Device(PendingReduce<Box<dyn DeviceBucket>>),
}

impl Pending {
    /// Enqueues the all-reduce of `buf`: a device bucket goes to the communicator in place when
    /// it reduces that memory; otherwise the communicator reads it into host memory on its own
    /// thread ([`Communicator::all_reduce_read`]), so this one goes on.
    pub(super) fn launch(
        comm: &dyn Communicator,
        buf: Packed,
        what: CollectiveDesc,
        report: &mut ExecReport,
    ) -> Result<Self, ExecError> {
        let bucket = match buf {
            Packed::Host(b) => return Ok(Pending::Host(comm.all_reduce(b, what)?)),
            Packed::Device(bucket) => bucket,
        };
        match comm.all_reduce_device(bucket, what.clone())? {
            DeviceLaunch::Launched(p) => {
                report.device_collectives += 1;
                Ok(Pending::Device(p))
            }
            // Read into host memory on the communicator's thread, not this one.
            DeviceLaunch::Declined(bucket) => {
                Ok(Pending::Host(comm.all_reduce_read(bucket, what)?))
            }
        }
    }

    pub(super) fn wait(self, bound: Duration) -> Result<(Packed, CommSpan), CommError> {
        match self {
            Pending::Host(p) => p.wait(bound).map(|(b, s)| (Packed::Host(b), s)),
            Pending::Device(p) => p.wait(bound).map(|(b, s)| (Packed::Device(b), s)),
        }
    }
}

/// Enqueues one all-reduce per slot of an unpacked collective. A device gradient goes to a
/// communicator that reduces device memory as a copy (its buffer may be shared), else to the
/// communicator to read into host memory on its own thread.
pub(super) fn launch_slots(
    plan: &Plan,
    c: &PlanCollective,
    comm: &dyn Communicator,
    grads: &mut [Grad],
    report: &mut ExecReport,
    rank: usize,
) -> Result<Vec<(u32, Pending)>, ExecError> {
    let mut calls = Vec::with_capacity(c.slots.len());
    for s in &c.slots {
        let g = std::mem::take(&mut grads[*s as usize]);
        let buf = whole(comm, g, rank)?;
        let what = desc_of(plan, c, buf.len() as u64, buf.dtype(), &[*s]);
        calls.push((*s, Pending::launch(comm, buf, what, report)?));
    }
    Ok(calls)
}

/// A gradient with an all-reduce of its own, as the communicator takes it: a copy of it as a
/// bucket where the communicator reduces device memory in place; else a device gradient is
/// read on the communicator's thread, as a declined bucket of one.
fn whole(comm: &dyn Communicator, g: Grad, rank: usize) -> Result<Packed, ExecError> {
    let copy = match g.device() {
        Some(d) if comm.reduces_device_memory() => d
            .copy_to_bucket()
            .map_err(|source| ExecError::Kernel { rank, source })?,
        _ => None,
    };
    Ok(match (copy, g) {
        (Some(bucket), _) => Packed::Device(bucket),
        (None, Grad::Device(d)) => Packed::Device(Box::new(WholeGrad(d))),
        (None, Grad::Host(b)) => Packed::Host(b),
    })
}

/// One all-reduce of a whole tensor outside any plan (a user's `all_reduce`), in flight on the
/// communicator's stream: enqueued in program order, waited for when its value is needed.
pub struct UserAllReduce(Pending);

impl UserAllReduce {
    /// Enqueues the all-reduce of `g` as `what` (device memory in place where the communicator
    /// reduces it, else read on its thread); returns at once.
    pub fn launch(
        comm: &dyn Communicator,
        g: Grad,
        what: CollectiveDesc,
    ) -> Result<Self, ExecError> {
        let rank = comm.rank();
        let buf = whole(comm, g, rank)?;
        let mut report = ExecReport::default();
        Ok(UserAllReduce(Pending::launch(
            comm,
            buf,
            what,
            &mut report,
        )?))
    }

    /// Waits for the reduced tensor, at most `bound`.
    pub fn wait(self, bound: Duration) -> Result<Grad, CommError> {
        Ok(match self.0.wait(bound)?.0 {
            Packed::Host(b) => Grad::Host(b),
            Packed::Device(b) => Grad::Device(b.into_grad()),
        })
    }
}

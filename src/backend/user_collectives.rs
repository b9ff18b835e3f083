//! The user's collectives: `DistributedBackend::all_reduce` on `Collective<I>`, lazy.
//!
//! `all_reduce` enqueues the collective on the rank's communicator stream and returns at once:
//! its result is a recorded node whose value, when first needed (a read, an op that runs on it,
//! the queue forced for another reason), waits for the collective. `sync_collective` (which
//! Burn's `CollectiveTensor::resolve` calls) waits for every collective the rank launched.
//! Collectives run in the order each rank issued them, on the same stream as the gradient
//! buckets, so a rank never waits for a peer that has yet to reach its own call: every rank
//! contributes when it calls. A device tensor is reduced in place where the communicator
//! reduces device memory (NCCL), read into host memory on the communicator's thread otherwise.
//!
//! Requires: every rank issues the same collectives in the same order (as for any collective).
//! Guarantees: a failed collective (a timeout, a mismatch, an aborted group) fails the group
//! and panics, with the typed error's message, on the thread that needs its value or waits for
//! it; the autodiff backward of an all-reduce is another all-reduce, lazy alike.

use std::sync::{Arc, Mutex};

use burn_backend::distributed::{CollectiveTensor, ReduceOperation};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DeviceId, TensorMetadata};
use smallvec::SmallVec;

use super::distributed::{Session, from_host, graph_dtype, read_host};
use super::lazy::Record;
use super::{CTensor, Collective};
use crate::graph::{ComputeKind, ReduceOp};
use crate::runtime::Grad;
use crate::runtime::comm::{CollectiveDesc, wait_bound};
use crate::runtime::exec::UserAllReduce;

/// Where one user all-reduce is.
enum Stage {
    InFlight(UserAllReduce),
    Done(Grad),
    Failed(String),
    Taken,
}

/// One user all-reduce, shared by its result node and the rank's list of outstanding ones.
pub(super) struct UserReduce {
    what: CollectiveDesc,
    stage: Mutex<Stage>,
}

impl UserReduce {
    fn lock(&self) -> std::sync::MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for it (once); the error's message if it failed.
    fn wait(&self, timeout: std::time::Duration) -> Result<(), String> {
        let mut st = self.lock();
        if let Stage::InFlight(_) = &*st {
            let Stage::InFlight(f) = std::mem::replace(&mut *st, Stage::Taken) else {
                unreachable!("matched above")
            };
            *st = match f.wait(wait_bound(timeout)) {
                Ok(g) => Stage::Done(g),
                Err(e) => Stage::Failed(e.to_string()),
            };
        }
        match &*st {
            Stage::Failed(m) => Err(m.clone()),
            _ => Ok(()),
        }
    }

    /// Waits for it and takes the reduced tensor.
    fn take(&self, timeout: std::time::Duration) -> Result<Grad, String> {
        self.wait(timeout)?;
        match std::mem::replace(&mut *self.lock(), Stage::Taken) {
            Stage::Done(g) => Ok(g),
            Stage::Failed(m) => Err(m),
            _ => Err(format!("{} was taken twice", self.what)),
        }
    }

    fn finished(&self) -> bool {
        matches!(*self.lock(), Stage::Taken)
    }
}

/// `DistributedBackend::all_reduce` for `Collective<I>`.
pub(super) fn all_reduce<I: Backend>(
    s: Arc<Session<I>>,
    tensor: FloatTensor<Collective<I>>,
    op: ReduceOperation,
    device_ids: Vec<DeviceId>,
) -> CollectiveTensor<Collective<I>> {
    let rank = tensor.rank as usize;
    if device_ids.len() != s.world {
        s.fail(
            rank,
            format!(
                "all_reduce over {} devices, but the communication server has {} ranks",
                device_ids.len(),
                s.world
            ),
        );
    }
    let Some(dtype) = graph_dtype(tensor.dtype()) else {
        s.fail(
            rank,
            format!(
                "all_reduce of a {:?} tensor: only float tensors are reduced",
                tensor.dtype()
            ),
        );
    };
    let shape = tensor.shape();
    let input = tensor.seq();
    // Runs what produces the tensor (queued on the device; a host backend computes it now).
    let inner = tensor.inner_for("all_reduce");
    let device = I::float_device(&inner);
    let grad = match s
        .options
        .device_buckets
        .then(|| super::device::device_grad(&inner))
        .flatten()
    {
        Some(g) => Grad::Device(g),
        None => match read_host::<I>(inner.clone()) {
            Ok(b) => Grad::Host(b),
            Err(e) => s.fail(rank, format!("all_reduce: reading the tensor: {e}")),
        },
    };
    let what = {
        let mut st = s.state(rank, "all_reduce");
        st.user_collectives += 1;
        st.user_pending.retain(|c| !c.finished());
        CollectiveDesc {
            // User all-reduces count down from the top so they never match a gradient bucket.
            collective: u32::MAX - st.user_collectives,
            bucket: None,
            op: match op {
                ReduceOperation::Sum => ReduceOp::Sum,
                ReduceOperation::Mean => ReduceOp::Mean,
            },
            dtype,
            count: shape.num_elements() as u64,
            params: Vec::new(),
        }
    };
    let cell = match UserAllReduce::launch(s.comm(rank), grad, what.clone()) {
        Ok(f) => Arc::new(UserReduce {
            what,
            stage: Mutex::new(Stage::InFlight(f)),
        }),
        Err(e) => s.fail(rank, e.to_string()),
    };
    s.state(rank, "all_reduce").user_pending.push(cell.clone());
    let rec = Record {
        op: "all_reduce",
        kind: ComputeKind::Opaque,
        device: Arc::new(device.clone()),
        shape: Some(shape.clone()),
        dtype: Some(tensor.dtype()),
        inputs: input.into_iter().collect::<SmallVec<[u64; 3]>>(),
        flops: 0,
    };
    let out = CTensor::lazy(rank as u32, rec, move || {
        let timeout = s.options.timeout;
        let reduced = match cell.take(timeout) {
            Ok(g) => g,
            Err(e) => s.fail(rank, e),
        };
        let buf = match reduced {
            Grad::Host(b) => b,
            Grad::Device(g) => match super::device::tensor_from(&inner, g).map_err(|g| g.read()) {
                Ok(p) => return p,
                Err(Ok(b)) => b,
                Err(Err(e)) => s.fail(rank, format!("all_reduce: {e}")),
            },
        };
        I::float_from_data(from_host(buf, shape), &device)
    });
    CollectiveTensor::new(out)
}

/// `DistributedBackend::sync_collective` for `Collective<I>`: waits for every all-reduce `rank`
/// launched; a failed one fails the group and panics here.
pub(super) fn sync<I: Backend>(s: &Session<I>, rank: usize) {
    let outstanding = std::mem::take(&mut s.state(rank, "sync_collective").user_pending);
    for c in outstanding {
        if let Err(e) = c.wait(s.options.timeout) {
            s.fail(rank, e);
        }
    }
}

//! Running plans: host buffers and kernels, communicators, the executor, the plan cache, and the
//! CubeCL launches of the bucket kernels.
//!
//! - [`agree`]: ranks compare a new plan's collective sequence before its first collective.
//! - [`buffer`]: typed host tensors and the element arithmetic every host path shares.
//! - [`host`]: host pack/unpack (for host-memory tensors, and the reference for the kernels).
//! - [`comm`]: the [`Communicator`] trait, collective descriptors, errors, pending handles.
//! - [`comm_thread`]: the shell communicators run in (a thread and its queue); the host
//!   communicators as one type over their group state.
//! - [`inprocess`]: N ranks as threads of one process; deterministic rank-order reduction.
//! - [`recording`]: a communicator wrapper that records every call, for tests.
//! - [`grad`]: a gradient slot in host memory or in a device buffer ([`DeviceGrad`]).
//! - [`exec`]: runs a plan on a rank (compute stream here, comm stream on the communicator).
//! - [`cache`]: compiled plans keyed by the structural hash of the recorded graph.
//! - [`cube`]: launches the CubeCL bucket kernels on a CubeCL runtime.
//! - `nccl` (feature `cuda`): the NCCL communicator, libraries loaded at run time.
//! - [`tcp`]: one rank per process over TCP (a star through rank 0, in-process arithmetic).
//! - [`rendezvous`]: multi-process start-up: rank 0 shares bytes (the NCCL id) over TCP.
//! - [`peer_watch`]: the rendezvous connections kept open: which ranks departed, and how.

pub mod agree;
pub mod buffer;
pub mod cache;
pub mod comm;
pub mod comm_thread;
pub mod cube;
pub mod exec;
pub mod grad;
pub mod host;
pub mod inprocess;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod peer_watch;
pub mod probe;
pub mod recording;
pub mod rendezvous;
pub mod synthetic;
pub mod tcp;
pub mod transport;

pub use buffer::{Element, HostBuffer, HostSlice};
pub use comm::{CollectiveDesc, CommError, Communicator, DeviceLaunch, PendingReduce};
pub use exec::{
    ExecError, ExecOptions, ExecReport, Workspace, execute, execute_in, run_in_process,
};
pub use grad::{CudaMemory, DeviceBucket, DeviceGrad, Grad, Handed, Packed, ReadyWait, Unpacked};
pub use inprocess::{InProcessComm, InProcessGroup};

//! How `Collective<I>` compiles and runs its gradient sync: [`CollectiveOptions`], installed per
//! inner backend type before its communication server starts.

use std::any::TypeId;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use burn_backend::Backend;
use hashbrown::HashMap;

use super::replicas::InitialWeights;
use crate::config::{CompileConfig, ConfigError};
pub use crate::runtime::tcp::TcpOptions;
pub use crate::runtime::transport::Transport;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// How `Collective<I>` compiles and runs its gradient sync.
#[derive(Clone, Debug)]
pub struct CollectiveOptions {
    /// Compiler options (bucketing policy and caps, overlap, reduce dtype, verification).
    pub config: CompileConfig,
    /// Bound on every wait for another rank.
    pub timeout: Duration,
    /// Keep a trace of every rank's pack, all-reduce, wait and unpack spans ([`take_trace`](super::take_trace)).
    pub trace: bool,
    /// Check every gradient for NaN and infinity as it arrives; a bad one fails the step on
    /// every rank with an error naming the parameter (off by default: it reads every element).
    pub check_finite: bool,
    /// What a step does about a parameter whose gradient did not arrive on some rank.
    pub unused: UnusedParameters,
    /// Keep the gradients of a device inner backend on the device: for Burn's wgpu or CUDA
    /// backend (fused or not) a bucket is packed and unpacked by the CubeCL kernels on the
    /// gradients' buffers; for `burn::Dispatch` on a GPU device, by Dispatch's own tensor ops
    /// (flatten, scale, cast, concatenate; slice back). Either way a bucket crosses to a host
    /// communicator as one flat buffer, read on the communicator's thread. Off, or for a host
    /// inner backend (NdArray, Dispatch's NdArray device), every gradient is read into host
    /// memory on arrival. A step under [`no_sync`](super::no_sync), or with `check_finite`,
    /// reads gradients into host memory anyway.
    pub device_buckets: bool,
    /// How the ranks talk: threads of this process, or one rank per process.
    pub transport: Transport,
    /// How a TCP group ([`Transport::Tcp`]) moves its all-reduces: from how many bytes through
    /// a mesh of every rank, each reducing one shard, rather than through rank 0 (or never,
    /// which makes no mesh: for a network where only rank 0's ports are reachable). Every rank
    /// has the same (rank 0 checks at start-up and in every collective).
    /// [`from_env`](Self::from_env) reads `CF_TCP_SHARDED_MIN_BYTES` (bytes, or `never`).
    pub tcp: TcpOptions,
    /// What `mark_distributed` does about the ranks' parameter values: give every rank rank
    /// 0's (the default), or check that they already are.
    pub initial_weights: InitialWeights,
    /// Launch the user's all-reduces together: queued at the call, launched when a value is
    /// needed or another collective comes, as one plan (bucketed like the gradients) for those
    /// issued back to back (see [`all_reduce`](super::all_reduce)); on by default. Off, each is
    /// launched at the call, alone, which overlaps it with whatever the rank does until it
    /// needs the value.
    pub coalesce_user_collectives: bool,
    /// What a group of one rank does at a sync point (see [`SingleRank`]).
    pub single_rank: SingleRank,
    /// Record every collective each rank's communicator is asked for
    /// ([`recorded_collectives`](super::recorded_collectives)); off by default.
    pub record_collectives: bool,
    /// At the first gradient sync, time a few all-reduces of known sizes
    /// ([`probe_link`](crate::runtime::probe::probe_link): 4 KiB, 1 MiB and 16 MiB, twice each)
    /// so that [`measured_link`](super::measured_link) has a fit even when every step runs
    /// collectives of one size. Off by default (about 40 MiB through the link once); `run`
    /// turns it on. Without it the link is fitted from the steps' own collectives.
    pub probe_link: bool,
    /// Under the `cost` bucketing policy, compile the plans from measured steps (see
    /// [`MeasuredPlans`]); `None` keeps the plan of the recorded order alone. The other
    /// policies do not read times, so for them this changes nothing.
    pub measured_plans: Option<MeasuredPlans>,
}

/// How the `cost` policy's plans follow what the steps measured.
///
/// After the first and the second synced step, and then every [`MeasuredPlans::every_steps`]
/// synced steps (a check step: the same steps on every rank), the ranks share rank 0's measured
/// profile (its gradients' ready times, its link fit and what its collectives paid during the
/// backward and after it, [`MeasuredProfile`](crate::measure::MeasuredProfile)) in one small
/// all-reduce. (The first step runs before any plan, every collective at its sync point; the
/// second is the first to run collectives under the backward.) The first check compiles the plan from it: the sync segment with the
/// measured time before each gradient, under the measured link. A later check compiles again
/// (a re-plan, counted in [`SyncStats::replans`](super::SyncStats)) only when the profile drifted
/// from the one the plan came from by more than [`MeasuredPlans::drift`], or when some rank's
/// step left the plan (its gradients came in another order). Every rank decides from the same
/// shared numbers, so every rank compiles the same plan at the same step; the plan agreement
/// checks it before its first collective.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeasuredPlans {
    /// Synced steps between checks (at least 1).
    pub every_steps: u64,
    /// The drift that re-plans, as a fraction (see
    /// [`MeasuredProfile::drift`](crate::measure::MeasuredProfile::drift)): 0.5 re-plans when a
    /// gradient's ready time, or the link's cost of the step's bytes, moved by half the longer of
    /// the backward pass (first to last gradient) and that link cost.
    pub drift: f64,
}

impl Default for MeasuredPlans {
    fn default() -> Self {
        MeasuredPlans {
            every_steps: 10,
            drift: 0.5,
        }
    }
}

/// What the gradient sync of a group of one rank does. A sum or mean over one rank is its own
/// input, so by default it leaves every gradient as backward made it: no read into host memory,
/// no bucket, no collective (the step counts in [`SyncStats::local_steps`](super::SyncStats)).
/// A step that accumulates under `no_sync`, or checks gradients (`check_finite`), still runs
/// the full path; so does a registered parameter whose gradient is missing still fail.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SingleRank {
    /// Leave the gradients as they are (the default).
    #[default]
    Skip,
    /// Run the plan as for any group (read, pack, all-reduce over one rank, write back): what
    /// tests of that path on a machine with one device need.
    Run,
}

/// What a step does about a parameter whose gradient did not arrive on a rank: a registered
/// parameter that received no gradient, or one that some ranks use and others do not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnusedParameters {
    /// Fail the step on every rank with an error naming the parameters (the default: an unused
    /// parameter is usually a bug, and ranks that disagree on the parameters cannot agree on a
    /// plan).
    #[default]
    Error,
    /// DDP's `find_unused_parameters`: a rank without a parameter's gradient contributes zeros,
    /// so the ranks that have it still reduce it with every rank's contribution. Every step
    /// exchanges a small manifest (the gradients the previous step's plan does not know and the
    /// ones this rank zero-filled): every rank then runs the same plans, which stay in the
    /// next step's plan, and a parameter zero-filled on every rank leaves it. The reduced value
    /// of a zero-filled parameter has no gradient to go to on that rank (a Burn backend cannot
    /// create one), so its optimizer skips it there: see [`SyncStats::zero_filled`](super::SyncStats::zero_filled).
    ZeroFill,
}

impl Default for CollectiveOptions {
    /// The defaults; reads no environment variable (see [`CollectiveOptions::from_env`]).
    fn default() -> Self {
        CollectiveOptions {
            config: CompileConfig::default(),
            timeout: crate::runtime::inprocess::DEFAULT_TIMEOUT,
            trace: false,
            check_finite: false,
            unused: UnusedParameters::Error,
            device_buckets: true,
            transport: Transport::InProcess,
            tcp: TcpOptions::default(),
            initial_weights: InitialWeights::default(),
            coalesce_user_collectives: true,
            single_rank: SingleRank::default(),
            record_collectives: false,
            probe_link: false,
            measured_plans: Some(MeasuredPlans::default()),
        }
    }
}

impl CollectiveOptions {
    /// The defaults with the compiler and TCP options the `CF_*` environment variables set; a
    /// value that does not parse is an error naming the variable.
    pub fn from_env() -> Result<Self, ConfigError> {
        Ok(CollectiveOptions {
            config: CompileConfig::from_env()?,
            tcp: TcpOptions::from_env()?,
            ..CollectiveOptions::default()
        })
    }

    /// Makes these the options of the next communication server started for `Collective<I>`
    /// (`start_communication_server` reads and clears them; without a call it uses
    /// [`CollectiveOptions::from_env`]).
    pub fn install<I: Backend>(self) {
        lock(next_options()).insert(TypeId::of::<I>(), self);
    }

    /// The options installed for `Collective<I>`'s next server, cleared; else
    /// [`CollectiveOptions::from_env`].
    pub(super) fn take<I: Backend>() -> Result<Self, ConfigError> {
        match lock(next_options()).remove(&TypeId::of::<I>()) {
            Some(o) => Ok(o),
            None => CollectiveOptions::from_env(),
        }
    }
}

fn next_options() -> &'static Mutex<HashMap<TypeId, CollectiveOptions>> {
    static NEXT: OnceLock<Mutex<HashMap<TypeId, CollectiveOptions>>> = OnceLock::new();
    NEXT.get_or_init(Default::default)
}

//! How the ranks of a group talk ([`Transport`]) and the communicators a process gets for it
//! ([`communicators`]).

use std::time::Duration;

use super::comm::Communicator;
use super::inprocess::InProcessGroup;
use super::rendezvous::{RendezvousConfig, RendezvousError};

/// How the ranks of a communication server talk to each other.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// Every rank is a thread of this process: `start_communication_server` gets every rank's
    /// device, ranks `0..n` once each.
    #[default]
    InProcess,
    /// One rank per process over TCP ([`TcpComm`](super::tcp::TcpComm)), joining the
    /// group the configuration names (usually [`RendezvousConfig::from_env`], the launcher's
    /// `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`): `start_communication_server` gets this
    /// process's one device, whose rank is the configuration's.
    Tcp(RendezvousConfig),
    /// One rank per process over NCCL on GPU `local_rank`, rank 0's NCCL id shared through the
    /// rendezvous; otherwise as [`Transport::Tcp`].
    #[cfg(feature = "cuda")]
    Nccl(RendezvousConfig),
    /// Single-process multi-GPU over NCCL: every rank is a thread of this process, as with
    /// [`Transport::InProcess`], and each rank's device is a CUDA device of its own
    /// (`Collective<Cuda>`), whose NCCL communicator the rank gets.
    #[cfg(feature = "cuda")]
    NcclLocal,
}

/// Why a process got no communicators.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A one-rank-per-process transport was given other devices than this process's one.
    #[error(
        "start_communication_server over {transport} takes this process's one device, of rank {rank} (RANK), got devices of ranks {given:?}"
    )]
    NotOneRank {
        /// The transport.
        transport: &'static str,
        /// This process's rank.
        rank: usize,
        /// The ranks of the devices given.
        given: Vec<u32>,
    },
    /// An in-process transport was not given ranks `0..world` once each.
    #[error("start_communication_server needs the ranks 0..{world} once each, got {given:?}")]
    Ranks {
        /// The number of devices given.
        world: usize,
        /// Their ranks.
        given: Vec<u32>,
    },
    /// In-process NCCL was given a rank that is not on a CUDA device.
    #[error(
        "start_communication_server over in-process NCCL needs a CUDA device per rank (Collective<Cuda>); rank {rank} is on {device}"
    )]
    NotCuda {
        /// The rank.
        rank: u32,
        /// Its device type.
        device: String,
    },
    /// A rank's inner device has autodiff on (a `DispatchDevice::autodiff` put in a
    /// `CollectiveDevice` by hand; [`CollectiveDevice::new`](crate::backend::CollectiveDevice::new)
    /// takes it off).
    #[error(
        "start_communication_server: rank {rank}'s inner device {device} has autodiff on; Autodiff<Collective<B>> differentiates, so give the rank its device without autodiff (CollectiveDevice::new takes it off)"
    )]
    InnerAutodiff {
        /// The rank.
        rank: u32,
        /// Its inner device.
        device: String,
    },
    /// The options in the environment (`CF_*`) do not parse.
    #[error("start_communication_server: the environment: {0}")]
    Environment(#[from] crate::config::ConfigError),
    /// Joining the group failed.
    #[error("start_communication_server: {0}")]
    Rendezvous(#[from] RendezvousError),
    /// NCCL failed to start.
    #[cfg(feature = "cuda")]
    #[error("start_communication_server: {0}")]
    Nccl(#[from] super::nccl::NcclInitError),
}

/// This process's communicators, by rank (`None` for the ranks of other processes).
pub type ByRank = Vec<Option<Box<dyn Communicator>>>;

/// The group's size and this process's communicators by rank, as `transport` says (with `tcp`,
/// how a TCP group moves its all-reduces). `given` are the ranks of the devices this process
/// was given; `cuda_index` maps a rank to its CUDA device index, where its device is a CUDA
/// device (in-process NCCL only), and `device` names the device type for the error when it is
/// not.
// Only in-process NCCL (feature `cuda`) asks for CUDA devices.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn communicators(
    (transport, tcp): (&Transport, super::tcp::TcpOptions),
    given: &[u32],
    cuda_index: &dyn Fn(u32) -> Option<usize>,
    device: &str,
    timeout: Duration,
) -> Result<(usize, ByRank), StartError> {
    let one_rank = |cfg: &RendezvousConfig, transport: &'static str| {
        if given != [cfg.rank as u32] {
            return Err(StartError::NotOneRank {
                transport,
                rank: cfg.rank,
                given: given.to_vec(),
            });
        }
        Ok(())
    };
    let place = |world: usize, rank: usize, c: Box<dyn Communicator>| {
        let mut v: ByRank = (0..world).map(|_| None).collect();
        v[rank] = Some(c);
        (world, v)
    };
    let every_rank = || {
        let world = given.len();
        let mut ranks = given.to_vec();
        ranks.sort_unstable();
        if ranks != (0..world as u32).collect::<Vec<_>>() {
            return Err(StartError::Ranks {
                world,
                given: given.to_vec(),
            });
        }
        Ok(world)
    };
    Ok(match transport {
        Transport::InProcess => {
            let world = every_rank()?;
            let comms = InProcessGroup::ranks(world, timeout)
                .into_iter()
                .map(|c| Some(Box::new(c) as Box<dyn Communicator>))
                .collect();
            (world, comms)
        }
        Transport::Tcp(cfg) => {
            one_rank(cfg, "TCP")?;
            let c = super::tcp::TcpComm::connect_with(cfg, timeout, tcp)?;
            place(cfg.world, cfg.rank, Box::new(c))
        }
        #[cfg(feature = "cuda")]
        Transport::NcclLocal => {
            let world = every_rank()?;
            let mut gpus = vec![0usize; world];
            for r in given {
                gpus[*r as usize] = cuda_index(*r).ok_or_else(|| StartError::NotCuda {
                    rank: *r,
                    device: device.to_string(),
                })?;
            }
            let comms = super::nccl::NcclComm::group(&gpus, timeout)?;
            (
                world,
                comms
                    .into_iter()
                    .map(|c| Some(Box::new(c) as Box<dyn Communicator>))
                    .collect(),
            )
        }
        #[cfg(feature = "cuda")]
        Transport::Nccl(cfg) => {
            one_rank(cfg, "NCCL")?;
            let c = super::nccl::NcclComm::join(cfg, timeout)?;
            place(cfg.world, cfg.rank, Box::new(c))
        }
    })
}

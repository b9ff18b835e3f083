//! What a running step measured, and the link fitted to it.
//!
//! A rank of the Burn backend reads the clock once per gradient (when its value exists, at
//! `submit_gradient_sync`) and a few times per collective (launch, the communicator's span, the
//! compute stream's wait); nothing is synchronised for it. A step's measurements are a
//! [`MeasuredStep`]; the collectives of many steps fit the alpha-beta link of the cost model
//! ([`LinkSamples::fit`], in [`link`]). Times are microseconds from the start of the step: the
//! end of the previous sync on that rank (for the first step, its first gradient).
//!
//! A [`MeasuredProfile`] (in [`profile`]: one rank's ready times and link) is what the backend
//! compiles its plans from once a step has been measured: [`MeasuredProfile::segment`] is the
//! sync segment with the measured time before each gradient as compute,
//! [`MeasuredProfile::system_profile`] the cost model's system.
//!
//! Plain data: no device, no Burn; the backend fills it, `run` prints it, the cost model reads it.

use std::fmt;

pub mod link;
pub mod profile;

pub use link::{LinkFit, LinkSamples};
pub use profile::{MEASURED_TFLOPS, MeasuredProfile};

/// One gradient of a measured step.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredGradient {
    /// Its parameter.
    pub param: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// When its value existed, µs from the start of the step.
    pub ready_us: f64,
}

/// One collective of a measured step, µs from the start of the step.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredCollective {
    /// Plan collective id.
    pub collective: u32,
    /// Bytes each rank contributed.
    pub bytes: u64,
    /// This rank launched it.
    pub launch_us: f64,
    /// The communication stream was free for it, it had been launched and, where the
    /// communicator tells ([`CommSpan::joined`](crate::runtime::comm::CommSpan::joined)), every
    /// rank had joined it: from here to `end_us` is this rank's view of its duration (the
    /// link's cost, where the communicator tells when the last rank joined or on that rank).
    pub start_us: f64,
    /// Its result was on this rank.
    pub end_us: f64,
    /// How long the compute stream waited for it (the part not overlapped).
    pub wait_us: f64,
    /// CPU time this rank's communicator thread spent on it ([`CommSpan::cpu_us`](crate::runtime::comm::CommSpan::cpu_us)).
    pub cpu_us: f64,
}

impl MeasuredCollective {
    /// This rank's view of how long it took.
    pub fn duration_us(&self) -> f64 {
        (self.end_us - self.start_us).max(0.0)
    }
}

/// One pack or unpack of a measured step: host (or device) copy work for communication.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredCopy {
    /// The bucket's bytes.
    pub bytes: u64,
    /// An unpack (else a pack).
    pub unpack: bool,
    /// When it ended, µs from the start of the step.
    pub end_us: f64,
    /// How long it took, µs.
    pub us: f64,
}

/// One synced step as a rank measured it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MeasuredStep {
    /// Ranks in the group.
    pub world: u32,
    /// When the step started, µs from an epoch every rank of this process shares (the
    /// process's first measured step): the ranks of one process line their steps up by it.
    pub start_us: f64,
    /// Gradients in the order they were submitted (ready order).
    pub gradients: Vec<MeasuredGradient>,
    /// Collectives in the order this rank finished waiting for them.
    pub collectives: Vec<MeasuredCollective>,
    /// The packs and unpacks it ran, in the order they ended.
    pub copies: Vec<MeasuredCopy>,
    /// The backward pass reached the sync point.
    pub sync_us: f64,
    /// The hand-back at the end of the sync: from the moment every collective was done to the
    /// sync's return, writing the reduced gradients back into the tensors they came from
    /// (host work the step spends per gradient, whatever the plan).
    pub handback_us: f64,
    /// The sync returned: every gradient reduced and written back.
    pub end_us: f64,
    /// Ranks of this process per CPU core: each rank's backward runs on a thread of its own,
    /// so from one up the cores are all taken by the backward and a communicator thread's
    /// work takes time from it ([`MeasuredStep::interference_us`]).
    pub ranks_per_core: f64,
}

impl MeasuredStep {
    /// Exposed communication: what the step spent at its sync point (the collectives not
    /// hidden behind backward, the last packs and unpacks, the write-back).
    pub fn exposed_us(&self) -> f64 {
        (self.end_us - self.sync_us).max(0.0)
    }

    /// The part of [`Self::exposed_us`] spent waiting for collectives: the union of the waits
    /// inside the sync point. The rest of it is host work at the sync point (packs, unpacks
    /// and the write-back of the reduced gradients), which the simulator does not model.
    pub fn waited_at_sync_us(&self) -> f64 {
        let mut spans: Vec<(f64, f64)> = self
            .collectives
            .iter()
            .map(|c| {
                (
                    (c.end_us - c.wait_us).max(self.sync_us),
                    c.end_us.min(self.end_us),
                )
            })
            .filter(|(a, b)| b > a)
            .collect();
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (mut total, mut reach) = (0.0, f64::NEG_INFINITY);
        for (a, b) in spans {
            let a = a.max(reach);
            if b > a {
                total += b - a;
                reach = b;
            }
        }
        total.min(self.exposed_us())
    }

    /// Busy time of the communication stream.
    pub fn comm_us(&self) -> f64 {
        self.collectives
            .iter()
            .map(MeasuredCollective::duration_us)
            .sum()
    }
}

impl MeasuredStep {
    /// The fixed cost of one collective as this step's collectives paid it beyond `link`'s
    /// bandwidth term, µs: the mean over the collectives that began while the backward passes
    /// took every core ([`MeasuredStep::cores_free_us`]), and over those that began after;
    /// `None` for a side without collectives. Each collective is timed from the moment every
    /// rank had launched it (this rank and `peers`, the same step on other ranks of this
    /// process, lined up by `start_us`; peers whose collectives do not line up are left out)
    /// and this rank's communication stream was free, to its end, so the wait for a late rank
    /// is not in it, but the time the communicator threads took to be scheduled is.
    ///
    /// The mean, not the median: what the simulator needs of a side is how fast the stream
    /// gets through a queue of collectives, and on shared cores that is bursty (a few
    /// collectives at tens of µs, then one that waited milliseconds for its threads). The
    /// median keeps the fast ones and predicted a backlog of many small collectives drained
    /// by the sync point when it was not.
    pub fn alpha_split_us(&self, peers: &[MeasuredStep], link: &LinkFit) -> [Option<f64>; 2] {
        let busy_until = self.cores_free_us(peers);
        let peers: Vec<&MeasuredStep> = peers
            .iter()
            .filter(|p| p.collectives.len() == self.collectives.len())
            .collect();
        let n = f64::from(self.world.max(1));
        let wire = 2.0 * (n - 1.0) / n;
        let mut sides: [Vec<f64>; 2] = Default::default();
        let mut free = f64::NEG_INFINITY;
        for (i, c) in self.collectives.iter().enumerate() {
            let joined = peers
                .iter()
                .map(|p| p.start_us + p.collectives[i].launch_us - self.start_us)
                .fold(c.launch_us, f64::max);
            let begin = joined.max(free).min(c.end_us);
            free = c.end_us;
            let bandwidth_us = c.bytes as f64 * wire / (link.busbw_gbs * 1e3);
            let side = usize::from(begin >= busy_until);
            sides[side].push((c.end_us - begin - bandwidth_us).max(0.0));
        }
        sides.map(|v| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64))
    }

    /// When the backward passes of this process's ranks stop taking every core, µs into this
    /// step: the moment fewer of them are still computing than the process has cores (a rank
    /// computes until its last gradient; `peers` are the same step on the other ranks of this
    /// process, lined up by `start_us`). Until then each collective needs every rank's
    /// communicator thread to be given a core beside the backward passes, so it costs the busy
    /// alpha; from then on the threads run at once ([`MeasuredStep::alpha_split_us`]). Ranks
    /// that share cores are seldom in step: on 4 ranks and 2 cores the OS runs some ranks'
    /// backward passes well ahead of the others', and collectives queued behind them drain fast
    /// as soon as the third rank is done, long before the last rank's sync point. 0 with a core
    /// for every rank; this rank's sync point where the cores are not known
    /// ([`MeasuredStep::ranks_per_core`] 0).
    pub fn cores_free_us(&self, peers: &[MeasuredStep]) -> f64 {
        if self.ranks_per_core <= 0.0 {
            return self.sync_us;
        }
        let local = 1 + peers.len();
        let cores = (local as f64 / self.ranks_per_core).round().max(1.0) as usize;
        // The ranks that must be done before fewer than `cores` still compute.
        let Some(k) = (local + 1).checked_sub(cores).filter(|k| *k > 0) else {
            return 0.0;
        };
        let mut ends: Vec<f64> = std::iter::once(self)
            .chain(peers)
            .map(|s| {
                s.start_us - self.start_us + s.gradients.last().map_or(s.sync_us, |g| g.ready_us)
            })
            .collect();
        ends.sort_by(f64::total_cmp);
        ends[k - 1]
    }
}

impl MeasuredStep {
    /// The compute time one collective that began under the backward (before the sync point)
    /// took from it, µs: where the ranks' backward passes take every core
    /// ([`MeasuredStep::ranks_per_core`] at least one), each rank's communicator thread runs on
    /// time some backward needed, so one collective costs the backward the median CPU time the
    /// communicator spent on it times the ranks per core; with cores to spare, nothing. `None`
    /// without collectives under the backward.
    pub fn interference_us(&self) -> Option<f64> {
        let cpu = median(
            self.collectives
                .iter()
                .filter(|c| c.start_us < self.sync_us)
                .map(|c| c.cpu_us)
                .collect(),
        )?;
        Some(if self.ranks_per_core >= 1.0 {
            cpu * self.ranks_per_core
        } else {
            0.0
        })
    }

    /// The compute time the collectives that began before `t` (µs into the step) under the
    /// backward took from it, at `interference_us` each.
    pub fn interfered_before_us(&self, t: f64, interference_us: f64) -> f64 {
        let n = self
            .collectives
            .iter()
            .filter(|c| c.start_us < t.min(self.sync_us))
            .count();
        n as f64 * interference_us
    }
}

/// The median of `v` (the mean of the middle two for an even count); `None` when empty.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    quantile(&v, 0.5)
}

/// The `q` quantile (0 to 1) of `sorted`, interpolated linearly between the two values beside
/// it (the median: the middle one, or the mean of the middle two); `None` when empty.
pub fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let at = q.clamp(0.0, 1.0) * last as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    let f = at - lo as f64;
    // Halves of each for the median's mean of two: the same bits as their sum halved.
    Some(if lo == hi {
        sorted[lo]
    } else {
        sorted[lo] * (1.0 - f) + sorted[hi] * f
    })
}

impl fmt::Display for MeasuredStep {
    /// A short human summary (what `run` prints).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = self.gradients.first().map_or(0.0, |g| g.ready_us);
        let last = self.gradients.last().map_or(0.0, |g| g.ready_us);
        write!(
            f,
            "step {:.0} us: {} gradients ready from {:.0} to {:.0} us, sync point at {:.0} us; {} collectives, {:.0} us on the link, {:.0} us exposed",
            self.end_us,
            self.gradients.len(),
            first,
            last,
            self.sync_us,
            self.collectives.len(),
            self.comm_us(),
            self.exposed_us()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The waits inside the sync point, overlaps counted once; the rest of the exposed time
    /// is host work.
    #[test]
    fn the_exposed_time_splits_into_waits_and_host_work() {
        let c = |end_us: f64, wait_us: f64| MeasuredCollective {
            collective: 0,
            bytes: 4,
            launch_us: 0.0,
            start_us: 0.0,
            end_us,
            wait_us,
            cpu_us: 0.0,
        };
        let step = MeasuredStep {
            world: 2,
            gradients: Vec::new(),
            // Waits [90, 110] (before the sync from 100 on), [105, 120] and [130, 135].
            collectives: vec![c(110.0, 20.0), c(120.0, 15.0), c(135.0, 5.0)],
            sync_us: 100.0,
            end_us: 150.0,
            ..MeasuredStep::default()
        };
        assert_eq!(step.exposed_us(), 50.0);
        assert_eq!(step.waited_at_sync_us(), 25.0);
    }

    /// A link of 1 us and 1 GB/s: the bandwidth term of a collective of 0 bytes is 0.
    fn unit_link() -> LinkFit {
        LinkFit {
            alpha_us: 1.0,
            busbw_gbs: 1.0,
            sizes: 2,
            samples: 2,
        }
    }

    /// A collective of 0 bytes launched (and started) at `launch_us`, ended at `end_us`.
    fn launched(launch_us: f64, end_us: f64) -> MeasuredCollective {
        MeasuredCollective {
            collective: 0,
            bytes: 0,
            launch_us,
            start_us: launch_us,
            end_us,
            wait_us: 0.0,
            cpu_us: 0.0,
        }
    }

    #[test]
    fn a_collective_is_timed_from_the_last_rank_s_launch_and_split_at_the_sync_point() {
        let c = launched;
        let mine = MeasuredStep {
            world: 2,
            start_us: 0.0,
            // Launched at 100 (the peer at 300) and ended at 700; then one that ended 50 us
            // after it; then one launched at 990 and one at 1030, the sync point at 1000.
            collectives: vec![
                c(100.0, 700.0),
                c(650.0, 750.0),
                c(990.0, 1030.0),
                c(1030.0, 1040.0),
            ],
            sync_us: 1000.0,
            end_us: 1100.0,
            ..MeasuredStep::default()
        };
        let peer = MeasuredStep {
            // Started 100 us later: launched the first at 200 + 100 = 300 on this rank's clock,
            // the second at 700 (after this rank's first ended), the rest early.
            start_us: 100.0,
            collectives: vec![c(200.0, 0.0), c(600.0, 0.0), c(0.0, 0.0), c(0.0, 0.0)],
            ..mine.clone()
        };
        let link = unit_link();
        // From the last launch (or the stream free): 700 - 300, 750 - 700, 1030 - 990 began
        // before the sync point (the cores are not known: mean 490 / 3), 1040 - 1030 after it.
        assert_eq!(
            mine.alpha_split_us(std::slice::from_ref(&peer), &link),
            [Some(490.0 / 3.0), Some(10.0)]
        );
        // Alone, the first counts from its own launch: [600, 50, 40] → 230; a peer with another
        // number of collectives is left out.
        let odd = MeasuredStep {
            collectives: vec![c(0.0, 0.0)],
            ..peer
        };
        assert_eq!(
            mine.alpha_split_us(&[odd], &link),
            [Some(230.0), Some(10.0)]
        );
        assert_eq!(
            MeasuredStep::default().alpha_split_us(&[], &link),
            [None, None]
        );
    }

    #[test]
    fn the_cores_free_up_when_fewer_ranks_compute_than_there_are_cores() {
        let g = |ready_us: f64| MeasuredGradient {
            param: "w".into(),
            bytes: 4,
            ready_us,
        };
        // Four ranks on two cores, their last gradients at 400, 100 + 50, 300 and 250 on this
        // rank's clock (the second started 100 us later).
        let rank = |start_us: f64, last: f64| MeasuredStep {
            world: 4,
            start_us,
            gradients: vec![g(10.0), g(last)],
            sync_us: 500.0,
            end_us: 600.0,
            ranks_per_core: 2.0,
            ..MeasuredStep::default()
        };
        let mine = rank(0.0, 400.0);
        let peers = [rank(100.0, 50.0), rank(0.0, 300.0), rank(0.0, 250.0)];
        // Two cores: busy until the third rank is done (150, 250, then 300).
        assert_eq!(mine.cores_free_us(&peers), 300.0);
        // A core for every rank: never taken; cores unknown: this rank's sync point.
        let spare = MeasuredStep {
            ranks_per_core: 0.5,
            ..mine.clone()
        };
        assert_eq!(spare.cores_free_us(&peers), 0.0);
        let unknown = MeasuredStep {
            ranks_per_core: 0.0,
            ..mine.clone()
        };
        assert_eq!(unknown.cores_free_us(&peers), 500.0);
        // The alpha split follows it: a collective begun at 350, before this rank's sync point
        // but after the cores freed, is on the idle side.
        let c = launched;
        let link = unit_link();
        let with = |s: &MeasuredStep| MeasuredStep {
            collectives: vec![c(100.0, 200.0), c(350.0, 360.0)],
            ..s.clone()
        };
        assert_eq!(
            with(&mine).alpha_split_us(&peers, &link),
            [Some(100.0), Some(10.0)]
        );
        assert_eq!(
            with(&unknown).alpha_split_us(&peers, &link),
            [Some(55.0), None]
        );
    }
}

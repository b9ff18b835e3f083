//! A rank's clock over its steps: one read per gradient, the executor's collective timings,
//! the sync point and its end, turned into a [`MeasuredStep`] at each synced step, and the
//! collectives of recent steps kept to fit the link ([`LinkSamples`]).

use std::time::Instant;

use crate::measure::{
    LinkSamples, MeasuredCollective, MeasuredCopy, MeasuredGradient, MeasuredStep,
};
use crate::runtime::exec::{CollectiveTiming, Span};
use crate::trace::SpanKind;

/// One rank's measurements.
#[derive(Debug, Default)]
pub(super) struct StepClock {
    /// The current step began: the previous sync returned (or its first gradient arrived).
    start: Option<Instant>,
    gradients: Vec<(String, u64, Instant)>,
    collectives: Vec<CollectiveTiming>,
    /// Packs and unpacks: bytes, whether an unpack, start, end.
    copies: Vec<(u64, bool, Instant, Instant)>,
    sync: Option<Instant>,
    handback: Option<Instant>,
    /// The last synced step.
    pub(super) last: Option<MeasuredStep>,
    /// The collectives of recent steps.
    pub(super) link: LinkSamples,
}

impl StepClock {
    pub(super) fn new(world: usize) -> Self {
        StepClock {
            link: LinkSamples::new(world as u32),
            ..Self::default()
        }
    }

    /// A gradient's value exists now.
    pub(super) fn gradient(&mut self, param: &str, bytes: u64) {
        let now = Instant::now();
        self.start.get_or_insert(now);
        self.gradients.push((param.to_string(), bytes, now));
    }

    /// Collectives an execution of this step waited for.
    pub(super) fn collectives(&mut self, timings: &[CollectiveTiming]) {
        self.collectives.extend_from_slice(timings);
    }

    /// The packs and unpacks among an execution's spans.
    pub(super) fn copies(&mut self, spans: &[Span]) {
        self.copies.extend(
            spans
                .iter()
                .filter(|s| matches!(s.kind, SpanKind::Pack | SpanKind::Unpack) && s.bytes > 0)
                .map(|s| (s.bytes, s.kind == SpanKind::Unpack, s.start, s.end)),
        );
    }

    /// Every collective of the step is done: the reduced gradients are handed back now (the
    /// moment returned).
    pub(super) fn handback(&mut self) -> Instant {
        let now = Instant::now();
        self.handback = Some(now);
        now
    }

    /// The hand-back began `d` later than [`StepClock::handback`] said: `d` of it was the
    /// plan's own work (its unpacks), measured as such.
    pub(super) fn handback_later(&mut self, d: std::time::Duration) {
        if let Some(h) = &mut self.handback {
            *h += d;
        }
    }

    /// The backward pass reached the sync point.
    pub(super) fn sync_point(&mut self) {
        self.sync = Some(Instant::now());
    }

    /// A backward pass that did not sync (under `no_sync`): its gradients are not a step's.
    pub(super) fn discard(&mut self) {
        self.gradients.clear();
        self.collectives.clear();
        self.copies.clear();
        self.sync = None;
        self.handback = None;
    }

    /// The sync returned: the step's measurements become [`StepClock::last`], its collectives
    /// join the link samples, and the next step starts now.
    pub(super) fn end_step(&mut self, world: usize, local_ranks: usize) {
        let end = Instant::now();
        let start = self.start.unwrap_or(end);
        let us = |t: Instant| micros_between(start, t);
        let mut timings = std::mem::take(&mut self.collectives);
        // The communication stream runs collectives in launch order: one starts when it was
        // launched, the one before it had finished and (where the communicator tells) the last
        // rank had joined it.
        timings.sort_by_key(|t| t.launched);
        let mut free = start;
        let collectives = timings
            .iter()
            .map(|t| {
                let begin = t
                    .launched
                    .max(free)
                    .max(t.comm.joined.unwrap_or(t.launched))
                    .min(t.comm.end);
                free = t.comm.end;
                MeasuredCollective {
                    collective: t.collective,
                    bytes: t.bytes,
                    launch_us: us(t.launched),
                    start_us: us(begin),
                    end_us: us(t.comm.end),
                    wait_us: t
                        .wait_end
                        .saturating_duration_since(t.wait_start)
                        .as_secs_f64()
                        * 1e6,
                    cpu_us: t.comm.cpu_us,
                }
            })
            .collect();
        // One epoch for every rank of the process, so ranks' steps can be laid side by side.
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let epoch = *EPOCH.get_or_init(|| start);
        let step = MeasuredStep {
            world: world as u32,
            start_us: micros_between(epoch, start),
            gradients: std::mem::take(&mut self.gradients)
                .into_iter()
                .map(|(param, bytes, t)| MeasuredGradient {
                    param,
                    bytes,
                    ready_us: us(t),
                })
                .collect(),
            collectives,
            copies: std::mem::take(&mut self.copies)
                .into_iter()
                .map(|(bytes, unpack, a, b)| MeasuredCopy {
                    bytes,
                    unpack,
                    end_us: us(b),
                    us: b.saturating_duration_since(a).as_secs_f64() * 1e6,
                })
                .collect(),
            sync_us: us(self.sync.take().unwrap_or(end)),
            handback_us: self.handback.take().map_or(0.0, |h| {
                end.saturating_duration_since(h).as_secs_f64() * 1e6
            }),
            end_us: us(end),
            ranks_per_core: local_ranks as f64 / cores() as f64,
        };
        self.link.add_step(&step);
        self.last = Some(step);
        self.start = Some(end);
    }
}

/// `t - from` in microseconds, negative when `t` is earlier.
fn micros_between(from: Instant, t: Instant) -> f64 {
    if t >= from {
        t.duration_since(from).as_secs_f64() * 1e6
    } else {
        -(from.duration_since(t).as_secs_f64() * 1e6)
    }
}

/// CPU cores this process may run on.
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

//! The alpha-beta link fitted to the collectives a rank has run.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use super::MeasuredStep;

/// The alpha-beta link fitted to measured collectives: `alpha + bytes * 2(n-1)/n / busbw`, the
/// cost model's all-reduce (see [`crate::cost`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkFit {
    /// Fixed cost of one all-reduce, µs.
    pub alpha_us: f64,
    /// Bus bandwidth, GB/s (10^9 bytes per second).
    pub busbw_gbs: f64,
    /// Distinct sizes the fit used.
    pub sizes: usize,
    /// Samples behind it.
    pub samples: usize,
}

impl fmt::Display for LinkFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "alpha {:.1} us, bus bandwidth {:.3} GB/s ({} sizes, {} collectives)",
            self.alpha_us, self.busbw_gbs, self.sizes, self.samples
        )
    }
}

/// Collective durations by size, the last [`LinkSamples::WINDOW`] of each, to fit the link.
///
/// Each size's estimate is the minimum of its window: the noise of a shared machine and the
/// wait for a late rank only ever add time, so the fastest recent run of a size is the best
/// estimate of what the link needs for it, and the window lets a changed link show.
#[derive(Clone, Debug, Default)]
pub struct LinkSamples {
    world: u32,
    by_size: BTreeMap<u64, VecDeque<f64>>,
    samples: usize,
}

impl LinkSamples {
    /// Durations kept per size.
    pub const WINDOW: usize = 16;
    /// Sizes kept (the most recent ones when more were seen).
    pub const SIZES: usize = 64;

    /// Empty, for a group of `world` ranks.
    pub fn new(world: u32) -> Self {
        LinkSamples {
            world,
            ..Self::default()
        }
    }

    /// Adds one collective of `bytes` that took `us`.
    pub fn add(&mut self, bytes: u64, us: f64) {
        if !us.is_finite() || us < 0.0 {
            return;
        }
        if !self.by_size.contains_key(&bytes) && self.by_size.len() >= Self::SIZES {
            // Forget the size nearest the new one: the spread of sizes is what fits beta.
            let nearest = self
                .by_size
                .keys()
                .copied()
                .min_by_key(|b| b.abs_diff(bytes))
                .unwrap_or(bytes);
            self.by_size.remove(&nearest);
        }
        let w = self.by_size.entry(bytes).or_default();
        if w.len() == Self::WINDOW {
            w.pop_front();
        }
        w.push_back(us);
        self.samples += 1;
    }

    /// Adds every collective of a measured step.
    pub fn add_step(&mut self, step: &MeasuredStep) {
        for c in &step.collectives {
            self.add(c.bytes, c.duration_us());
        }
    }

    /// The link that explains the samples: least squares of each size's minimum against the
    /// ring's bytes on the wire, the intercept kept at or above zero. `None` with fewer than
    /// two sizes or a bandwidth that does not come out positive (every size as fast). A group
    /// of one rank has no link: `None`.
    pub fn fit(&self) -> Option<LinkFit> {
        if self.world < 2 {
            return None;
        }
        let n = f64::from(self.world);
        let wire = 2.0 * (n - 1.0) / n;
        let pts: Vec<(f64, f64)> = self
            .by_size
            .iter()
            .filter_map(|(b, w)| {
                let t = w.iter().copied().fold(f64::INFINITY, f64::min);
                t.is_finite().then_some((*b as f64 * wire, t))
            })
            .collect();
        if pts.len() < 2 {
            return None;
        }
        let k = pts.len() as f64;
        let (sx, sy) = pts.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
        let (mx, my) = (sx / k, sy / k);
        let sxx: f64 = pts.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
        let sxy: f64 = pts.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
        if sxx <= 0.0 {
            return None;
        }
        let (mut alpha, mut beta) = (my - sxy / sxx * mx, sxy / sxx);
        if alpha < 0.0 {
            // Through the origin instead.
            alpha = 0.0;
            let sxx0: f64 = pts.iter().map(|(x, _)| x * x).sum();
            beta = pts.iter().map(|(x, y)| x * y).sum::<f64>() / sxx0;
        }
        // beta is µs per wire byte; busbw in GB/s is 1e-3 / beta.
        (beta > 0.0 && beta.is_finite()).then(|| LinkFit {
            alpha_us: alpha,
            busbw_gbs: 1e-3 / beta,
            sizes: pts.len(),
            samples: self.samples,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples drawn from a known link (alpha 50 us, 2 GB/s over 4 ranks) with noise that only
    /// adds time: the fit finds the link within a few percent.
    #[test]
    fn the_fit_recovers_a_known_link_from_noisy_samples() {
        let mut s = LinkSamples::new(4);
        let wire = 2.0 * 3.0 / 4.0;
        let mut noise = crate::runtime::synthetic::SplitMix64(7);
        for bytes in [4u64 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20] {
            for _ in 0..10 {
                let t = 50.0 + bytes as f64 * wire / 2e3;
                s.add(
                    bytes,
                    t * (1.0 + 0.3 * (noise.next_u64() % 1000) as f64 / 1000.0),
                );
            }
            // The clean run of each size.
            s.add(bytes, 50.0 + bytes as f64 * wire / 2e3);
        }
        let f = s.fit().unwrap();
        assert!((f.alpha_us - 50.0).abs() < 2.0, "{f}");
        assert!((f.busbw_gbs - 2.0).abs() < 0.02, "{f}");
        assert_eq!((f.sizes, f.samples), (5, 55));
    }

    #[test]
    fn no_fit_without_two_sizes_or_a_link() {
        let mut s = LinkSamples::new(2);
        s.add(1024, 10.0);
        s.add(1024, 12.0);
        assert_eq!(s.fit(), None);
        let mut one = LinkSamples::new(1);
        one.add(1024, 10.0);
        one.add(4096, 20.0);
        assert_eq!(one.fit(), None);
        // Larger is not slower: no positive bandwidth.
        let mut flat = LinkSamples::new(2);
        flat.add(1024, 20.0);
        flat.add(4096, 10.0);
        assert_eq!(flat.fit(), None);
    }

    #[test]
    fn the_window_forgets_old_durations_and_sizes_stay_bounded() {
        let mut s = LinkSamples::new(2);
        s.add(1 << 20, 1.0);
        for _ in 0..LinkSamples::WINDOW {
            s.add(1 << 20, 500.0);
        }
        s.add(1 << 10, 10.0);
        let f = s.fit().unwrap();
        // The 1 us run is out of the window: 1 MiB now costs 500 us.
        assert!(f.busbw_gbs < 3.0, "{f}");
        for b in 0..200u64 {
            s.add(b * 4096 + 1, 1.0 + b as f64);
        }
        assert!(s.by_size.len() <= LinkSamples::SIZES);
    }
}

//! `run --compare-policies`: the same steps trained under every bucketing policy, each
//! measured beside what the simulator predicts for it, and the policies' step times and
//! exposed communication compared step by step.

use super::{RunOptions, RunReport, StepRecord, run};
use crate::config::BucketPolicy;
use crate::measure::{LinkFit, MeasuredStep, quantile};

/// One policy's row of [`compare_policies`]: medians over the compared steps of rank
/// `local_ranks[0]`, milliseconds, each measured value beside what the simulator predicts for
/// that very step ([`crate::profile::predict_measured`]: the step's measured backward from its
/// first gradient and the run's fitted link, compiled under the policy and simulated).
#[derive(Clone, Debug)]
pub struct PolicyRun {
    /// The policy.
    pub policy: BucketPolicy,
    /// Steps compared (the ones after the warm-up, of every round).
    pub steps: usize,
    /// Collectives per step, measured and predicted.
    pub collectives: (f64, f64),
    /// The whole step (forward, backward with sync, optimizer), measured and predicted (the
    /// measured forward and optimizer plus the predicted backward from the first gradient).
    pub step_ms: (f64, f64),
    /// From the first gradient to the end of the sync: the part the simulator models.
    pub backward_ms: (f64, f64),
    /// What the step spent at its sync point (the exposed communication).
    pub exposed_ms: (f64, f64),
    /// Of that, waiting for collectives.
    pub wait_ms: (f64, f64),
    /// Of that, host work: the last packs and unpacks, and the hand-back of the reduced
    /// gradients.
    pub host_ms: (f64, f64),
    /// The run's link fit.
    pub link: Option<LinkFit>,
    /// Plans compiled from measured steps, and re-plans.
    pub measured_plans: (u64, u64),
    /// The digest of the final weights (equal digests: equal weights) and whether the ranks
    /// agreed.
    pub weights_digest: u64,
    /// Whether every rank ended with the same weights.
    pub ranks_agree: bool,
}

impl PolicyRun {
    /// `predicted / measured - 1` of a pair.
    pub fn error(pair: (f64, f64)) -> f64 {
        if pair.0 > 0.0 {
            pair.1 / pair.0 - 1.0
        } else {
            0.0
        }
    }
}

/// Trains `opts` under each bucketing policy (`per-param`, `ddp`, `cost`; the same seed, data
/// and steps), `rounds` times in turn, each round in the order of the one before turned by one
/// (per-param, ddp, cost; ddp, cost, per-param; cost, per-param, ddp; ...: a machine whose speed
/// drifts during the comparison slows every policy alike, and no policy always runs first or
/// right after the same other), and compares the measured steps after the first `warmup` of
/// every run with what the simulator predicts for them: medians over all rounds, and the
/// policies paired step by step ([`StepGap`]). `progress` is told the policy and the step.
pub fn compare_policies(
    opts: &RunOptions,
    warmup: usize,
    rounds: usize,
    progress: &(dyn Fn(&str, usize) + Sync),
) -> Result<PolicyComparison, String> {
    use crate::graph::ReduceOp;
    if opts.steps <= warmup {
        return Err(format!(
            "comparing policies needs more than {warmup} steps (the first {warmup} warm up); got {}",
            opts.steps
        ));
    }
    const POLICIES: [BucketPolicy; 3] = [
        BucketPolicy::PerParam,
        BucketPolicy::Ddp,
        BucketPolicy::Cost,
    ];
    // By policy: the columns of every compared step, and the last run's report.
    let mut cols: [[Vec<f64>; 12]; 3] = Default::default();
    let mut last: [Option<RunReport>; 3] = Default::default();
    let mut agree = [true; 3];
    // By policy: each compared step's round and index in its run, in the order of `cols`.
    let mut keys: [Vec<(usize, usize)>; 3] = Default::default();
    for (round, k, policy) in (0..rounds.max(1)).flat_map(|round| {
        (0..POLICIES.len()).map(move |j| {
            let k = (round + j) % POLICIES.len();
            (round, k, POLICIES[k])
        })
    }) {
        let mut o = opts.clone();
        o.collective.config.bucket.policy = policy;
        let report = run(&o, &|s| progress(policy.name(), s))?;
        // One measurement per synced step; align them with the steps from the end.
        let skip = report
            .steps
            .len()
            .saturating_sub(report.measured_steps.len());
        let pairs: Vec<(usize, &StepRecord, &MeasuredStep)> = report.steps[skip..]
            .iter()
            .zip(&report.measured_steps)
            .enumerate()
            .skip(warmup.saturating_sub(skip))
            .map(|(i, (r, m))| (i, r, m))
            .collect();
        if pairs.is_empty() {
            return Err(format!(
                "policy {}: no step after the warm-up was measured (a group of one rank syncs nothing)",
                policy.name()
            ));
        }
        for (i, rec, m) in &pairs {
            // The same step on the other ranks of this process.
            let peers: Vec<MeasuredStep> = report
                .peer_measured_steps
                .iter()
                .filter_map(|steps| steps.get(*i).cloned())
                .collect();
            let p = crate::profile::predict_measured(
                m,
                &peers,
                report.link,
                ReduceOp::Mean,
                &o.collective.config,
                policy,
            )
            .map_err(|e| format!("predicting a {} step: {e}", policy.name()))?;
            let first = m.gradients.first().map_or(m.sync_us, |g| g.ready_us);
            let backward = (m.end_us - first) / 1e3;
            let predicted = p.total * 1e3;
            let step = rec.secs * 1e3;
            let values = [
                step,
                step - backward + predicted,
                backward,
                predicted,
                m.exposed_us() / 1e3,
                p.at_sync() * 1e3,
                m.collectives.len() as f64,
                p.collectives as f64,
                m.waited_at_sync_us() / 1e3,
                (p.at_sync() - p.tail_copies - p.host).max(0.0) * 1e3,
                (m.exposed_us() - m.waited_at_sync_us()) / 1e3,
                (p.tail_copies + p.host) * 1e3,
            ];
            keys[k].push((round, *i));
            for (c, v) in cols[k].iter_mut().zip(values) {
                c.push(v);
            }
        }
        agree[k] &= report.ranks_agree;
        last[k] = Some(report);
    }
    // Cost against DDP, DDP against per-param, cost against per-param, by a column of `cols`
    // (0: the step, 4: the exposed communication).
    let gaps = |col: usize| {
        let keyed = |k: usize| -> Vec<((usize, usize), f64)> {
            keys[k]
                .iter()
                .copied()
                .zip(cols[k][col].iter().copied())
                .collect()
        };
        [(2, 1), (1, 0), (2, 0)]
            .into_iter()
            .map(|(a, b)| StepGap::paired(POLICIES[a], &keyed(a), POLICIES[b], &keyed(b)))
            .collect()
    };
    let (step_gaps, exposed_gaps) = (gaps(0), gaps(4));
    let mut rows = Vec::new();
    for ((policy, cols), (report, agree)) in POLICIES
        .into_iter()
        .zip(cols)
        .zip(last.into_iter().zip(agree))
    {
        let report = report.expect("every policy ran at least once");
        let steps = cols[0].len();
        let [s, sp, b, bp, e, ep, c, cp, w, wp, h, hp] =
            cols.map(|v| crate::measure::median(v).unwrap_or(0.0));
        let st = report.stats[0];
        rows.push(PolicyRun {
            policy,
            steps,
            collectives: (c, cp),
            step_ms: (s, sp),
            backward_ms: (b, bp),
            exposed_ms: (e, ep),
            wait_ms: (w, wp),
            host_ms: (h, hp),
            link: report.link,
            measured_plans: (st.measured_plans, st.replans),
            weights_digest: report.weights_digest,
            ranks_agree: agree,
        });
    }
    Ok(PolicyComparison {
        rows,
        step_gaps,
        exposed_gaps,
    })
}

/// What [`compare_policies`] measured: a row per policy, and the policies' step times compared
/// pairwise.
#[derive(Clone, Debug)]
pub struct PolicyComparison {
    /// `per-param`, `ddp`, `cost`.
    pub rows: Vec<PolicyRun>,
    /// Step times, paired: `cost − ddp`, `ddp − per-param`, `cost − per-param`.
    pub step_gaps: Vec<StepGap>,
    /// The exposed communication (the time at the sync point), paired likewise. On shared
    /// cores the step time varies by far more than the communication a policy saves; this is
    /// the part a policy changes.
    pub exposed_gaps: Vec<StepGap>,
}

/// Policy `a`'s time minus policy `b`'s (of the whole step, or of a part of it), step by step:
/// each compared step under `a` paired
/// with the same step (same data) of the same round under `b`, so that what varies from step to
/// step and from round to round falls on both sides. The medians of [`PolicyRun`] cannot say
/// whether a difference of a few tenths of a millisecond is more than noise; this can.
#[derive(Clone, Debug, PartialEq)]
pub struct StepGap {
    /// The policy whose steps come first in the difference.
    pub a: BucketPolicy,
    /// The policy subtracted.
    pub b: BucketPolicy,
    /// Steps paired.
    pub pairs: usize,
    /// The median difference, ms (negative: `a` faster).
    pub median_ms: f64,
    /// The lower and upper quartiles of the differences, ms.
    pub quartiles_ms: (f64, f64),
    /// A distribution-free 95% confidence interval for the median difference, ms: the
    /// order statistics the sign test puts at least 95% of the chance between (`None` under 6
    /// pairs, too few for one). An interval that holds 0 and is narrow says the two policies
    /// tie to within its ends, which a large p-value alone does not.
    pub median_ci_ms: Option<(f64, f64)>,
    /// Pairs in which `a`'s time was the lower.
    pub a_lower: usize,
    /// The two-sided sign test's p-value for "neither is faster" (each pair equally likely to
    /// go either way): small when one policy is faster in far more pairs than chance gives.
    pub sign_test_p: f64,
}

impl StepGap {
    /// Pairs the steps of `a` and `b` by key (round, step index); keys on one side only are
    /// left out.
    pub fn paired(
        a: BucketPolicy,
        steps_a: &[((usize, usize), f64)],
        b: BucketPolicy,
        steps_b: &[((usize, usize), f64)],
    ) -> StepGap {
        let of_b: std::collections::HashMap<(usize, usize), f64> =
            steps_b.iter().copied().collect();
        let mut diffs: Vec<f64> = steps_a
            .iter()
            .filter_map(|(key, ta)| of_b.get(key).map(|tb| ta - tb))
            .collect();
        diffs.sort_by(f64::total_cmp);
        let a_lower = diffs.iter().filter(|d| **d < 0.0).count();
        let b_lower = diffs.iter().filter(|d| **d > 0.0).count();
        StepGap {
            a,
            b,
            pairs: diffs.len(),
            median_ms: quantile(&diffs, 0.5).unwrap_or(0.0),
            quartiles_ms: (
                quantile(&diffs, 0.25).unwrap_or(0.0),
                quantile(&diffs, 0.75).unwrap_or(0.0),
            ),
            median_ci_ms: median_ci(&diffs),
            a_lower,
            sign_test_p: sign_test(a_lower, b_lower),
        }
    }
}

/// The two-sided sign test: the chance, were each of `wins + losses` pairs a fair coin, of a
/// split at least as lopsided as this one (ties left out); 1 with no pairs.
fn sign_test(wins: usize, losses: usize) -> f64 {
    let n = wins + losses;
    let tail = half_binomial_cdf(n).nth(wins.min(losses)).unwrap_or(1.0);
    (2.0 * tail).min(1.0)
}

/// The 95% interval of [`StepGap::median_ci_ms`] over `sorted` differences: from the `j`-th
/// smallest to the `j`-th largest (0-based), `j` the most with P(X ≤ j) ≤ 2.5% for
/// X ~ Binomial(n, 1/2), so that the median lies outside with a chance of at most 5%.
fn median_ci(sorted: &[f64]) -> Option<(f64, f64)> {
    let n = sorted.len();
    // How many indices qualify, less one: the last that does.
    let j = half_binomial_cdf(n)
        .take_while(|p| *p <= 0.025)
        .count()
        .checked_sub(1)?;
    Some((sorted[j], sorted[n - 1 - j]))
}

/// P(X ≤ i) for X ~ Binomial(n, 1/2), for i = 0, 1, ..., n: each term C(n, i) / 2^n from the
/// one before, in logs so that a large n neither overflows nor underflows to nothing before
/// the sum.
fn half_binomial_cdf(n: usize) -> impl Iterator<Item = f64> {
    let mut ln_term = -(n as f64) * std::f64::consts::LN_2;
    let mut cdf = 0.0;
    (0..=n).map(move |i| {
        if i > 0 {
            ln_term += ((n - i + 1) as f64 / i as f64).ln();
        }
        cdf += ln_term.exp();
        cdf
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sign_test_matches_the_binomial_tails() {
        // 9 of 10 one way: 2 · (1 + 10) / 1024.
        assert!((sign_test(9, 1) - 22.0 / 1024.0).abs() < 1e-12);
        assert!((sign_test(1, 9) - 22.0 / 1024.0).abs() < 1e-12);
        // An even split, and no pairs at all, say nothing.
        assert_eq!(sign_test(5, 5), 1.0);
        assert_eq!(sign_test(0, 0), 1.0);
        // 18 of 18: 2 / 2^18.
        assert!((sign_test(18, 0) - 2.0 / 262_144.0).abs() < 1e-15);
    }

    #[test]
    fn the_median_interval_takes_the_order_statistics_the_binomial_gives() {
        let sorted = |n: usize| (0..n).map(|i| i as f64).collect::<Vec<_>>();
        // Under 6 pairs even the extremes hold the median with less than 95%.
        assert_eq!(median_ci(&sorted(5)), None);
        assert_eq!(median_ci(&[]), None);
        // 6 pairs: P(X ≤ 0) = 1/64 ≤ 2.5% < P(X ≤ 1) = 7/64, the extremes.
        assert_eq!(median_ci(&sorted(6)), Some((0.0, 5.0)));
        // 20 pairs: P(X ≤ 5) = 2.07% ≤ 2.5% < P(X ≤ 6) = 5.77%, the 6th from each end.
        assert_eq!(median_ci(&sorted(20)), Some((5.0, 14.0)));
        // 100 pairs: the textbook 40th and 61st (0-based 39 and 60).
        assert_eq!(median_ci(&sorted(100)), Some((39.0, 60.0)));
    }

    #[test]
    fn steps_pair_by_round_and_index_only() {
        let a = [
            ((0, 2), 10.0),
            ((0, 3), 12.0),
            ((1, 2), 11.0),
            ((1, 3), 9.0),
        ];
        // b lacks (1, 3) and has (2, 2), which a lacks: three pairs.
        let b = [
            ((0, 2), 11.0),
            ((0, 3), 11.0),
            ((1, 2), 13.0),
            ((2, 2), 0.0),
        ];
        let g = StepGap::paired(BucketPolicy::Cost, &a, BucketPolicy::Ddp, &b);
        assert_eq!(g.pairs, 3);
        // Differences -2, -1, +1.
        assert_eq!(g.median_ms, -1.0);
        assert_eq!(g.quartiles_ms, (-1.5, 0.0));
        assert_eq!(g.a_lower, 2);
        assert_eq!(g.median_ci_ms, None);
        assert!((g.sign_test_p - 1.0).abs() < 1e-12);
    }
}

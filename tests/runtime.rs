//! The CPU runtime: exact numerics of bucketed, overlapped plans against one all-reduce per
//! gradient; the in-process communicator's errors; the plan cache.

mod common;

use std::time::{Duration, Instant};

use collective_fusion::codegen::plan::{Plan, lower};
use collective_fusion::config::BucketPolicy::{self, Ddp, PerParam};
use collective_fusion::config::MIB;
use collective_fusion::graph::ReduceOp;
use collective_fusion::graph::builder::{BuildOptions, build_step_graph};
use collective_fusion::model::ModelProfile;
use collective_fusion::passes::compile;
use collective_fusion::runtime::agree::is_agreement;
use collective_fusion::runtime::cache::PlanCache;
use collective_fusion::runtime::comm::{CollectiveDesc, CommError, Communicator};
use collective_fusion::runtime::exec::{ExecError, NoHooks};
use collective_fusion::runtime::recording::Recording;
use collective_fusion::runtime::synthetic::seeded_gradients;
use collective_fusion::runtime::{
    Element, ExecOptions, HostBuffer, InProcessGroup, execute, run_in_process,
};
use common::{bucket, config};

const WORLD: u32 = 4;

fn plan_for(model: &str, policy: BucketPolicy, cap: u64, reduce: ReduceOp, overlap: bool) -> Plan {
    let profile = ModelProfile::load(model).unwrap();
    let opts = BuildOptions {
        world: WORLD,
        batch: 8,
        reduce,
    };
    let mut g = build_step_graph(&profile, &opts);
    compile(&mut g, &config(bucket(policy, MIB.min(cap), cap), overlap)).unwrap();
    lower(&g).unwrap()
}

/// `plan` with every collective on a group of `n` ranks (to run it on fewer ranks).
fn on_group_of(plan: &Plan, n: u32) -> Plan {
    Plan {
        collectives: plan
            .collectives
            .iter()
            .cloned()
            .map(|mut k| {
                k.group_size = n;
                k
            })
            .collect(),
        ..plan.clone()
    }
}

fn inputs(plan: &Plan, seed: u64) -> Vec<Vec<HostBuffer>> {
    (0..WORLD as usize)
        .map(|r| seeded_gradients(plan, r, seed))
        .collect()
}

/// Runs `plan` on 4 ranks and returns rank 0's reduced gradients by parameter name, after
/// checking every rank holds the same bits.
fn run(plan: &Plan, seed: u64) -> Vec<(String, HostBuffer)> {
    run_with(plan, inputs(plan, seed))
}

/// Runs `plan` on `inputs` (per rank, per slot in the plan's slot order).
fn run_with(plan: &Plan, inputs: Vec<Vec<HostBuffer>>) -> Vec<(String, HostBuffer)> {
    let out = run_in_process(plan, inputs, ExecOptions::default()).unwrap();
    let (first, _) = &out[0];
    for (r, (g, _)) in out.iter().enumerate().skip(1) {
        for (i, (a, b)) in first.iter().zip(g).enumerate() {
            assert!(
                a.bits_eq(b),
                "rank {r} differs from rank 0 on {}",
                plan.slots[i].param
            );
        }
    }
    let mut named: Vec<(String, HostBuffer)> = plan
        .slots
        .iter()
        .map(|s| s.param.clone())
        .zip(out.into_iter().next().unwrap().0)
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// Element `i` of slot `slot` reduced by hand: every rank's value (divided by the group size
/// first for a mean) added in rank order.
fn by_hand(inputs: &[Vec<HostBuffer>], slot: usize, i: usize, reduce: ReduceOp) -> f32 {
    let vals: Vec<f32> = inputs
        .iter()
        .map(|g| match &g[slot] {
            HostBuffer::F32(v) => v[i],
            other => panic!("expected f32, got {}", other.dtype()),
        })
        .collect();
    let term = |x: f32| match reduce {
        ReduceOp::Sum => x,
        ReduceOp::Mean => x.scale_div(WORLD),
    };
    vals[1..]
        .iter()
        .fold(term(vals[0]), |acc, x| acc + term(*x))
}

fn numerics(model: &str) {
    for reduce in [ReduceOp::Sum, ReduceOp::Mean] {
        let reference_plan = plan_for(model, PerParam, 25 * MIB, reduce, true);
        let ins = inputs(&reference_plan, 7);
        let reference = run_with(&reference_plan, ins.clone());
        // Spot-check the reference itself against a reduction done by hand.
        for (slot, s) in reference_plan.slots.iter().enumerate().step_by(7) {
            let n = s.ty.numel() as usize;
            let got = &reference.iter().find(|(p, _)| *p == s.param).unwrap().1;
            let HostBuffer::F32(got) = got else { panic!() };
            for i in [0, n / 2, n - 1] {
                let want = by_hand(&ins, slot, i, reduce);
                assert_eq!(
                    got[i].to_bits(),
                    want.to_bits(),
                    "{model} {} [{i}]",
                    s.param
                );
            }
        }
        for cap in [MIB, 25 * MIB, u64::MAX / 4] {
            let plan = plan_for(model, Ddp, cap, reduce, true);
            if cap == u64::MAX / 4 {
                assert_eq!(
                    plan.collectives.len(),
                    2,
                    "{model}: first bucket + one bucket"
                );
            }
            // Same gradients: slots are in ready order whatever the policy.
            assert!(
                plan.slots
                    .iter()
                    .zip(&reference_plan.slots)
                    .all(|(a, b)| a.param == b.param)
            );
            let got = run_with(&plan, ins.clone());
            assert_eq!(got.len(), reference.len());
            for ((p, a), (q, b)) in got.iter().zip(&reference) {
                assert_eq!(p, q);
                assert!(
                    a.bits_eq(b),
                    "{model} {reduce:?} cap {cap}: {p} differs from one all-reduce per gradient"
                );
            }
        }
    }
}

#[test]
fn resnet50_bucketed_overlapped_equals_one_all_reduce_per_gradient_bitwise() {
    numerics("resnet50");
}

#[test]
fn gpt2_bucketed_overlapped_equals_one_all_reduce_per_gradient_bitwise() {
    numerics("gpt2");
}

#[test]
fn blocking_plan_equals_overlapped_plan_bitwise() {
    let a = run(
        &plan_for("resnet50", Ddp, 25 * MIB, ReduceOp::Mean, false),
        3,
    );
    let b = run(
        &plan_for("resnet50", Ddp, 25 * MIB, ReduceOp::Mean, true),
        3,
    );
    for ((p, x), (_, y)) in a.iter().zip(&b) {
        assert!(x.bits_eq(y), "{p}");
    }
}

#[test]
fn collectives_launch_in_plan_order_on_every_rank() {
    let plan = plan_for("resnet50", Ddp, 25 * MIB, ReduceOp::Mean, true);
    let comms: Vec<Recording<_>> = InProcessGroup::ranks(2, Duration::from_secs(30))
        .into_iter()
        .map(Recording::new)
        .collect();
    std::thread::scope(|s| {
        for c in &comms {
            let plan = &plan;
            s.spawn(move || {
                let mut g = seeded_gradients(plan, c.rank(), 1);
                let plan2 = on_group_of(plan, 2);
                execute(&plan2, c, &mut g, &mut NoHooks, ExecOptions::default()).unwrap();
            });
        }
    });
    let want: Vec<u32> = plan.collectives.iter().map(|c| c.id).collect();
    for c in &comms {
        let calls: Vec<CollectiveDesc> =
            c.calls().into_iter().filter(|d| !is_agreement(d)).collect();
        let got: Vec<u32> = calls.iter().map(|d| d.collective).collect();
        assert_eq!(got, want, "rank {}", c.rank());
        assert!(
            calls.iter().all(|d| d.op == ReduceOp::Sum),
            "packs prescale; the wire sums"
        );
        // One agreement (two exchanges) comes first.
        assert_eq!(c.calls().len(), calls.len() + 2);
        assert!(c.calls().iter().take(2).all(is_agreement));
    }
}

fn desc(collective: u32, count: u64) -> CollectiveDesc {
    CollectiveDesc {
        collective,
        bucket: Some(collective),
        op: ReduceOp::Sum,
        dtype: collective_fusion::graph::DType::F32,
        count,
        params: vec!["a.weight".into(), "b.bias".into()],
    }
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_naming_rank_bucket_and_op() {
    let comms = InProcessGroup::ranks(3, Duration::from_millis(300));
    let t = Instant::now();
    // Ranks 0 and 1 call; rank 2 never does.
    let p0 = comms[0]
        .all_reduce(HostBuffer::F32(vec![1.0; 8]), desc(0, 8))
        .unwrap();
    let p1 = comms[1]
        .all_reduce(HostBuffer::F32(vec![2.0; 8]), desc(0, 8))
        .unwrap();
    let e0 = p0.wait(Duration::from_secs(10)).unwrap_err();
    let e1 = p1.wait(Duration::from_secs(10)).unwrap_err();
    let waited = t.elapsed();
    assert!(waited < Duration::from_secs(5), "failed after {waited:?}");
    let msg = e0.to_string();
    // Rank 0 reports its own timeout, or the abort caused by rank 1's timeout if that came first;
    // either way the message names this rank, the collective and the missing rank.
    assert!(
        matches!(
            e0,
            CommError::Timeout { rank: 0, .. } | CommError::Aborted { rank: 0, .. }
        ),
        "{msg}"
    );
    for needle in ["rank 0", "bucket b0", "sum", "f32×8", "[2]", "a.weight"] {
        assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
    }
    // The other waiting rank fails too (its own timeout or the abort), and so does any later
    // collective: nothing hangs.
    assert!(
        matches!(e1, CommError::Timeout { .. } | CommError::Aborted { .. }),
        "{e1}"
    );
    let later = comms[0]
        .all_reduce(HostBuffer::F32(vec![0.0; 8]), desc(1, 8))
        .unwrap();
    assert!(matches!(
        later.wait(Duration::from_secs(5)),
        Err(CommError::Aborted { .. })
    ));
}

/// `all_gather_u64` gives every rank every rank's 64-bit value whole, in rank order (each
/// crosses as two 32-bit halves, exact in the f64 all-reduce), in one exchange.
#[test]
fn an_all_gather_of_fingerprints_keeps_all_64_bits() {
    use collective_fusion::runtime::agree::all_gather_u64;
    let mine = [u64::MAX, (1 << 53) + 1, 0x0123_4567_89ab_cdef];
    let comms = InProcessGroup::ranks(3, Duration::from_secs(10));
    let got: Vec<Vec<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(mine)
            .map(|(c, m)| s.spawn(move || all_gather_u64(c, m, Duration::from_secs(10))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g, &mine, "rank {r}");
    }
}

/// Each rank's communicator reports the CPU time its thread spent on a collective: what it
/// takes from a backward on the same cores.
#[test]
fn an_in_process_collective_reports_its_communicators_cpu_time() {
    let comms = InProcessGroup::ranks(2, Duration::from_secs(10));
    let n = 1 << 20;
    let pending: Vec<_> = comms
        .iter()
        .map(|c| {
            c.all_reduce(HostBuffer::F32(vec![1.0; n]), desc(0, n as u64))
                .unwrap()
        })
        .collect();
    for (r, p) in pending.into_iter().enumerate() {
        let (buf, span) = p.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(buf.to_f64()[n - 1], 2.0);
        if cfg!(unix) {
            // A 4 MiB reduction split between two threads takes some CPU on each.
            assert!(span.cpu_us > 0.0, "rank {r}: {}", span.cpu_us);
        }
        assert!(span.cpu_us.is_finite() && span.cpu_us >= 0.0, "rank {r}");
    }
}

/// The in-process communicator tells every rank when the last one joined a collective: the
/// link's time starts there, so a rank that called early does not count its wait for a late
/// one as the link's (what the link fit and the probe read).
#[test]
fn an_in_process_collective_reports_when_the_last_rank_joined() {
    let comms = InProcessGroup::ranks(2, Duration::from_secs(10));
    let early_call = Instant::now();
    let early = comms[0]
        .all_reduce(HostBuffer::F32(vec![1.0; 16]), desc(0, 16))
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let late_call = Instant::now();
    let late = comms[1]
        .all_reduce(HostBuffer::F32(vec![1.0; 16]), desc(0, 16))
        .unwrap();
    for (r, p) in [early, late].into_iter().enumerate() {
        let (buf, span) = p.wait(Duration::from_secs(10)).unwrap();
        assert_eq!(buf.to_f64(), vec![2.0; 16]);
        let joined = span
            .joined
            .expect("the in-process group knows when all joined");
        assert!(joined >= late_call, "rank {r}");
        assert!(joined <= span.end, "rank {r}");
        // The early rank's span from the join leaves its 50 ms wait out.
        assert!(joined.duration_since(early_call) >= Duration::from_millis(50));
    }
}

#[test]
fn ranks_calling_different_collectives_fail_on_every_rank_before_reducing() {
    let comms = InProcessGroup::ranks(2, Duration::from_secs(10));
    let a = HostBuffer::F32(vec![1.0; 8]);
    let p0 = comms[0].all_reduce(a.clone(), desc(0, 8)).unwrap();
    let p1 = comms[1]
        .all_reduce(HostBuffer::F32(vec![1.0; 4]), desc(0, 4))
        .unwrap();
    for (r, p) in [p0, p1].into_iter().enumerate() {
        match p.wait(Duration::from_secs(10)) {
            Err(CommError::Mismatch {
                rank, other_rank, ..
            }) => {
                assert_eq!((rank, other_rank), (r, 1 - r));
            }
            other => panic!("rank {r}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_gradient_of_the_wrong_shape_is_named() {
    let plan = plan_for("resnet50", Ddp, 25 * MIB, ReduceOp::Mean, true);
    let comms = InProcessGroup::ranks(1, Duration::from_secs(1));
    let mut g = seeded_gradients(&plan, 0, 1);
    g[3] = HostBuffer::F32(vec![0.0; 5]);
    let plan1 = on_group_of(&plan, 1);
    let err = execute(
        &plan1,
        &comms[0],
        &mut g,
        &mut NoHooks,
        ExecOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, ExecError::Gradient { .. }), "{err}");
    assert!(err.to_string().contains(&plan.slots[3].param), "{err}");
}

#[test]
fn a_plan_for_another_group_size_is_refused() {
    let plan = plan_for("resnet50", Ddp, 25 * MIB, ReduceOp::Mean, true);
    let err = run_in_process(
        &plan,
        (0..2).map(|r| seeded_gradients(&plan, r, 1)).collect(),
        ExecOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            ExecError::Group {
                group_size: 4,
                world: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_second_identical_step_reuses_the_compiled_plan() {
    let profile = ModelProfile::load("gpt2").unwrap();
    let mut cache = PlanCache::new();
    let cfg = config(bucket(Ddp, MIB, 25 * MIB), true);
    let step = || build_step_graph(&profile, &BuildOptions::default());
    let a = cache.get_or_compile(&step(), &cfg).unwrap();
    let b = cache.get_or_compile(&step(), &cfg).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &b));
    assert_eq!((cache.hits(), cache.misses(), cache.len()), (1, 1, 1));
    // Another bucket cap is another plan; another batch size changes only compute costs, which
    // are part of the structure.
    let c = cache
        .get_or_compile(&step(), &config(bucket(Ddp, MIB, 4 * MIB), true))
        .unwrap();
    assert!(!std::sync::Arc::ptr_eq(&a, &c));
    assert_eq!((cache.hits(), cache.misses()), (1, 2));
}

#[test]
fn ranks_with_different_plans_fail_before_launching_anything() {
    // Rank 0 compiled with 25 MiB buckets, rank 1 with 1 MiB buckets: their sequences differ.
    let plans = [
        plan_for("resnet50", Ddp, 25 * MIB, ReduceOp::Mean, true),
        plan_for("resnet50", Ddp, MIB, ReduceOp::Mean, true),
    ];
    let plans: Vec<Plan> = plans.iter().map(|p| on_group_of(p, 2)).collect();
    let comms: Vec<Recording<_>> = InProcessGroup::ranks(2, Duration::from_secs(30))
        .into_iter()
        .map(Recording::new)
        .collect();
    let errors: Vec<ExecError> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .zip(&plans)
            .map(|(c, plan)| {
                s.spawn(move || {
                    let mut g = seeded_gradients(plan, c.rank(), 1);
                    execute(plan, c, &mut g, &mut NoHooks, ExecOptions::default()).unwrap_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, e) in errors.iter().enumerate() {
        match e {
            ExecError::Comm(CommError::PlanMismatch {
                rank,
                other_rank,
                index,
                mine,
                theirs,
            }) => {
                assert_eq!((*rank, *other_rank), (r, 1 - r));
                assert!(mine.is_some() && theirs.is_some());
                // Both sides name the same position.
                assert_eq!(
                    *index,
                    match &errors[1 - r] {
                        ExecError::Comm(CommError::PlanMismatch { index, .. }) => *index,
                        _ => unreachable!(),
                    }
                );
            }
            other => panic!("rank {r}: expected a plan mismatch, got {other}"),
        }
        let msg = e.to_string();
        assert!(
            msg.contains("would launch all-reduce #") && msg.contains("bucket b"),
            "{msg}"
        );
        // Nothing but the agreement was launched.
        assert!(
            comms[r].calls().iter().all(is_agreement),
            "rank {r} launched a bucket"
        );
    }
}

#[test]
fn zero_size_gradients_reduce_to_zero_size_gradients() {
    use collective_fusion::graph::parse::parse;
    let text = common::chain(&[
        common::G("a", "f32[0]", "mean", "g0"),
        common::G("b", "f32[5]", "mean", "g0"),
        common::G("c", "f32[3,0]", "sum", "g0"),
    ]);
    for policy in [PerParam, Ddp] {
        let mut g = parse(&text).unwrap();
        compile(&mut g, &config(bucket(policy, MIB, 25 * MIB), true)).unwrap();
        let plan = lower(&g).unwrap();
        let ins: Vec<Vec<HostBuffer>> = (0..4).map(|r| seeded_gradients(&plan, r, 5)).collect();
        let out = run_in_process(&plan, ins, ExecOptions::default()).unwrap();
        for (r, (grads, _)) in out.iter().enumerate() {
            let lens: Vec<usize> = grads.iter().map(HostBuffer::len).collect();
            assert_eq!(lens, vec![0, 5, 0], "rank {r}, {policy:?}");
        }
    }
}

/// Every element of every rank's result is `((x0 + x1) + x2) + …` in rank order (each term
/// divided by the group size first for a mean), for every group size: those the communicator
/// reduces in one fused pass (up to 8) and larger ones, every dtype, a count that is not a
/// multiple of the reduction block and splits unevenly over the ranks.
#[test]
fn the_in_process_all_reduce_adds_in_rank_order_for_every_group_size() {
    // Element `i` is read from every rank's input and output.
    #[allow(clippy::needless_range_loop)]
    fn check<E: Element>(world: usize, op: ReduceOp, make: fn(Vec<E>) -> HostBuffer) {
        const COUNT: usize = 5003;
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (world as u64) << 8;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            E::from_f64(((state >> 40) as f64 / (1u64 << 24) as f64 - 0.5) * 8.0)
        };
        let inputs: Vec<Vec<E>> = (0..world)
            .map(|_| (0..COUNT).map(|_| next()).collect())
            .collect();
        let comms = InProcessGroup::ranks(world, Duration::from_secs(30));
        let what = CollectiveDesc {
            collective: 0,
            bucket: Some(0),
            op,
            dtype: E::DTYPE,
            count: COUNT as u64,
            params: Vec::new(),
        };
        let pending: Vec<_> = comms
            .iter()
            .zip(&inputs)
            .map(|(c, x)| c.all_reduce(make(x.clone()), what.clone()).unwrap())
            .collect();
        let outs: Vec<HostBuffer> = pending
            .into_iter()
            .map(|p| p.wait(Duration::from_secs(30)).unwrap().0)
            .collect();
        let term = |x: E| match op {
            ReduceOp::Sum => x,
            ReduceOp::Mean => x.scale_div(world as u32),
        };
        for i in 0..COUNT {
            let want = (1..world).fold(term(inputs[0][i]), |a, r| a.add(term(inputs[r][i])));
            for (rank, out) in outs.iter().enumerate() {
                let got = E::slice(out).unwrap()[i];
                assert!(
                    got == want || (got != got && want != want),
                    "{} ranks, {op:?}, {}: rank {rank} element {i} is {got:?}, want {want:?}",
                    world,
                    E::DTYPE,
                );
            }
        }
    }
    for world in [1, 2, 3, 4, 5, 8, 9, 12] {
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            check::<f32>(world, op, HostBuffer::F32);
            check::<f64>(world, op, HostBuffer::F64);
            check::<half::f16>(world, op, HostBuffer::F16);
            check::<half::bf16>(world, op, HostBuffer::BF16);
        }
    }
}

/// Without the fused pack, a bucket is one all-reduce per gradient: the executor brackets
/// those calls as one group (one `ncclGroupStart`/`ncclGroupEnd` on NCCL), and nothing else.
#[test]
fn the_calls_of_one_unpacked_collective_are_one_group() {
    let profile = ModelProfile::load("resnet50").unwrap();
    let mut g = build_step_graph(
        &profile,
        &BuildOptions {
            world: 2,
            batch: 8,
            reduce: ReduceOp::Mean,
        },
    );
    let mut cfg = config(bucket(Ddp, MIB, 25 * MIB), true);
    cfg.disabled_passes = vec!["fuse-bucket-io".into()];
    compile(&mut g, &cfg).unwrap();
    let plan = lower(&g).unwrap();
    assert!(plan.collectives.iter().all(|c| !c.packed));
    let multi = plan
        .collectives
        .iter()
        .filter(|c| c.slots.len() > 1)
        .count();
    assert!(
        multi >= 2,
        "the plan should have several multi-gradient buckets"
    );
    let comms: Vec<Recording<_>> = InProcessGroup::ranks(2, Duration::from_secs(30))
        .into_iter()
        .map(Recording::new)
        .collect();
    let reduced: Vec<Vec<HostBuffer>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|c| {
                let plan = &plan;
                s.spawn(move || {
                    let mut g = seeded_gradients(plan, c.rank(), 9);
                    execute(plan, c, &mut g, &mut NoHooks, ExecOptions::default()).unwrap();
                    g
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for c in &comms {
        let calls = c.calls();
        // Every multi-gradient collective's calls, and nothing else, form one group each.
        let mut want = Vec::new();
        let mut i = calls.iter().take_while(|d| is_agreement(d)).count();
        for k in &plan.collectives {
            if k.slots.len() > 1 {
                want.push(i..i + k.slots.len());
            }
            i += k.slots.len();
        }
        assert_eq!(i, calls.len(), "rank {}", c.rank());
        assert_eq!(c.groups(), want, "rank {}", c.rank());
        for r in &want {
            let ids: Vec<u32> = calls[r.clone()].iter().map(|d| d.collective).collect();
            assert!(ids.windows(2).all(|w| w[0] == w[1]), "{ids:?}");
        }
    }
    // Grouping changes nothing in the numbers.
    let reference = run_in_process(
        &plan,
        (0..2).map(|r| seeded_gradients(&plan, r, 9)).collect(),
        ExecOptions::default(),
    )
    .unwrap();
    for (r, (got, (want, _))) in reduced.iter().zip(&reference).enumerate() {
        for (s, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(a.bits_eq(b), "rank {r} slot {s}");
        }
    }
}

/// A device bucket double: holds host values, notes which thread reads it, and can fail the
/// read. Only what the communicators call on a declined bucket is implemented.
struct NotingBucket {
    values: HostBuffer,
    fail: bool,
    read_on: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl collective_fusion::runtime::DeviceBucket for NotingBucket {
    fn dtype(&self) -> collective_fusion::graph::DType {
        self.values.dtype()
    }

    fn len(&self) -> usize {
        self.values.len()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn read(&self) -> Result<HostBuffer, collective_fusion::runtime::host::KernelError> {
        let name = std::thread::current().name().unwrap_or("?").to_string();
        self.read_on.lock().unwrap().push(name);
        if self.fail {
            return Err(collective_fusion::runtime::host::KernelError::Device {
                what: "reading packed bucket b0 from the device".into(),
                why: "the device is lost".into(),
            });
        }
        Ok(self.values.clone())
    }

    fn into_grad(self: Box<Self>) -> Box<dyn collective_fusion::runtime::DeviceGrad> {
        unreachable!("a declined bucket is read, not unpacked on the device")
    }
}

#[test]
fn a_declined_device_bucket_is_read_on_the_communicators_thread_not_the_callers() {
    let comms = InProcessGroup::ranks(2, Duration::from_secs(10));
    let read_on = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let pending: Vec<_> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let bucket = NotingBucket {
                values: HostBuffer::F32(vec![r as f32 + 1.0; 8]),
                fail: false,
                read_on: read_on.clone(),
            };
            c.all_reduce_read(Box::new(bucket), desc(0, 8)).unwrap()
        })
        .collect();
    for p in pending {
        let (out, _) = p.wait(Duration::from_secs(10)).unwrap();
        assert!(out.bits_eq(&HostBuffer::F32(vec![3.0; 8])));
    }
    let mut names = read_on.lock().unwrap().clone();
    names.sort();
    assert_eq!(names, ["cf-comm-r0", "cf-comm-r1"]);
}

#[test]
fn a_bucket_that_cannot_be_read_fails_its_rank_and_aborts_the_others_at_once() {
    let comms = InProcessGroup::ranks(2, Duration::from_secs(60));
    let read_on = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let p0 = comms[0]
        .all_reduce(HostBuffer::F32(vec![1.0; 8]), desc(0, 8))
        .unwrap();
    let bad = NotingBucket {
        values: HostBuffer::F32(vec![2.0; 8]),
        fail: true,
        read_on,
    };
    let p1 = comms[1].all_reduce_read(Box::new(bad), desc(0, 8)).unwrap();
    let e1 = p1.wait(Duration::from_secs(30)).unwrap_err();
    assert!(
        matches!(&e1, CommError::Failed { rank: 1, .. }),
        "rank 1: {e1}"
    );
    for needle in ["rank 1", "bucket b0", "the device is lost"] {
        assert!(e1.to_string().contains(needle), "`{needle}` missing: {e1}");
    }
    // Rank 0 is not left waiting for its 60 s timeout: the group was aborted with the reason.
    let e0 = p0.wait(Duration::from_secs(30)).unwrap_err();
    assert!(
        matches!(&e0, CommError::Aborted { rank: 0, reason, .. } if reason.contains("the device is lost")),
        "rank 0: {e0}"
    );
}

/// Rank 0 of what it says is a group of two (over a group of one, so it reduces alone and needs
/// no peer thread) whose second all-reduce of a plan fails.
struct FailsSecond {
    inner: collective_fusion::runtime::InProcessComm,
    calls: std::sync::atomic::AtomicUsize,
}

impl Communicator for FailsSecond {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        2
    }
    fn all_reduce(
        &self,
        buffer: HostBuffer,
        what: collective_fusion::runtime::CollectiveDesc,
    ) -> Result<collective_fusion::runtime::PendingReduce, CommError> {
        if !collective_fusion::runtime::agree::is_agreement(&what)
            && self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1
        {
            return Err(CommError::Closed { rank: 0, what });
        }
        self.inner.all_reduce(buffer, what)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }
}

#[test]
fn execute_leaves_every_buffer_as_it_was_when_a_collective_fails() {
    let plan = on_group_of(&plan_for("resnet50", Ddp, MIB, ReduceOp::Mean, true), 2);
    assert!(plan.collectives.len() > 2, "several collectives");
    let comm = FailsSecond {
        inner: InProcessGroup::ranks(1, Duration::from_secs(10))
            .pop()
            .unwrap(),
        calls: std::sync::atomic::AtomicUsize::new(0),
    };
    let before = seeded_gradients(&plan, 0, 2);
    let mut g = before.clone();
    let err = execute(&plan, &comm, &mut g, &mut NoHooks, ExecOptions::default());
    assert!(err.is_err(), "the second collective failed");
    for (i, (a, b)) in g.iter().zip(&before).enumerate() {
        assert!(a.bits_eq(b), "slot {i} changed");
    }
}

/// Seven gradients (one with no elements) in buckets of at most 16 KiB under DDP.
fn small_buckets() -> Plan {
    buckets_of(&[])
}

/// [`small_buckets`] with the gradients `more` after the seven.
fn buckets_of(more: &[common::G]) -> Plan {
    use collective_fusion::graph::parse::parse;
    let mut grads = vec![
        common::G("a", "f32[1500]", "mean", "g0"),
        common::G("b", "f32[700]", "mean", "g0"),
        common::G("c", "f32[0]", "mean", "g0"),
        common::G("d", "f32[3000]", "mean", "g0"),
        common::G("e", "f32[40,30]", "mean", "g0"),
        common::G("f", "f32[900]", "mean", "g0"),
        common::G("g", "f32[2500]", "mean", "g0"),
    ];
    grads.extend(more.iter().map(|g| common::G(g.0, g.1, g.2, g.3)));
    let text = common::chain(&grads);
    let mut g = parse(&text).unwrap();
    compile(&mut g, &config(bucket(Ddp, 16 * 1024, 16 * 1024), true)).unwrap();
    lower(&g).unwrap()
}

/// The slots of `plan` in the order its compute stream takes their gradients.
fn gradient_order(plan: &Plan) -> Vec<u32> {
    use collective_fusion::codegen::plan::Step;
    plan.compute
        .iter()
        .filter_map(|s| match s {
            Step::Gradient { slot } => Some(*slot),
            _ => None,
        })
        .collect()
}

/// Runs `per_rank` on every rank of a group of `WORLD` (its communicator and its gradients, seeded
/// from `seed`), each in a thread of its own, and checks that every rank ends with the bits of
/// the plain in-process run of `plan` on the same gradients.
fn each_rank_ends_as_the_plain_run(
    plan: &Plan,
    seed: u64,
    per_rank: impl Fn(&dyn Communicator, Vec<HostBuffer>) -> Vec<HostBuffer> + Sync,
) {
    let ins = inputs(plan, seed);
    let eager = run_in_process(plan, ins.clone(), ExecOptions::default()).unwrap();
    let comms = InProcessGroup::ranks(WORLD as usize, ExecOptions::default().timeout);
    let got: Vec<Vec<HostBuffer>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(ins)
            .map(|(comm, g)| {
                let per_rank = &per_rank;
                s.spawn(move || per_rank(comm, g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, (got, (want, _))) in got.iter().zip(&eager).enumerate() {
        for (slot, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(a.bits_eq(b), "rank {r}, {}", plan.slots[slot].param);
        }
    }
}

/// An execution whose unpacks are deferred ([`Execution::defer_unpacks`], the backend's
/// hand-back) lets each host bucket's member copies go once the bucket is launched, leaves every
/// packed collective's unpack to the caller, refuses to finish before they are done or to
/// unpack one twice, and ends with the same bits as the eager run.
#[test]
fn deferred_unpacks_let_the_member_copies_go_and_give_the_same_bits() {
    use collective_fusion::runtime::Grad;
    use collective_fusion::runtime::exec::{Execution, Workspace};
    let plan = small_buckets();
    let packed: Vec<u32> = plan
        .collectives
        .iter()
        .filter(|c| c.packed)
        .map(|c| c.id)
        .collect();
    assert!(packed.len() > 1, "several buckets: {:?}", plan.collectives);
    let opts = ExecOptions::default();
    each_rank_ends_as_the_plain_run(&plan, 11, |comm, g| {
        let (plan, packed) = (&plan, &packed);
        let mut grads: Vec<Grad> = g.into_iter().map(Grad::Host).collect();
        let mut ws = Workspace::default();
        let mut ex = Execution::new(plan, comm, &mut ws, opts).unwrap();
        ex.defer_unpacks();
        let ready = vec![true; plan.slots.len()];
        let run = |ex: &mut Execution, grads: &mut [Grad], ws: &mut Workspace, block| {
            ex.run(plan, comm, grads, &ready, &mut NoHooks, opts, ws, block)
                .unwrap()
        };
        // To the first wait: every bucket launched so far has let its members go.
        run(&mut ex, &mut grads, &mut ws, false);
        let first = plan.collectives[packed[0] as usize].slots.clone();
        for slot in &first {
            let Grad::Host(b) = &grads[*slot as usize] else {
                panic!("a host gradient")
            };
            assert!(b.is_empty(), "slot {slot} kept its copy past the launch");
        }
        run(&mut ex, &mut grads, &mut ws, true);
        assert!(ex.is_done());
        assert_eq!(ex.deferred(), &packed[..], "every packed unpack deferred");
        // Each bucket's members handed over one by one, in layout order.
        let mut out: Vec<Option<Grad>> = (0..grads.len()).map(|_| None).collect();
        for c in packed.iter().rev() {
            let mut order = Vec::new();
            ex.unpack(plan, comm, &mut grads, opts, &mut ws, *c, &mut |s, g| {
                order.push(s);
                out[s as usize] = Some(g.into_grad()?);
                Ok(())
            })
            .unwrap();
            assert_eq!(order, plan.collectives[*c as usize].slots);
        }
        let again = ex.unpack(
            plan,
            comm,
            &mut grads,
            opts,
            &mut ws,
            packed[0],
            &mut |_, _| Ok(()),
        );
        let err = again.expect_err("a second unpack").to_string();
        assert!(err.contains(&format!("collective #{}", packed[0])), "{err}");
        ex.finish().unwrap();
        // Gradients with an all-reduce of their own are in their slots.
        grads
            .into_iter()
            .zip(out)
            .map(|(g, o)| o.unwrap_or(g).into_host().unwrap())
            .collect::<Vec<_>>()
    });
}

/// An execution that defers its unpacks does not finish before the caller did them.
#[test]
fn an_execution_with_unpacks_left_does_not_finish() {
    use collective_fusion::runtime::Grad;
    use collective_fusion::runtime::exec::{Execution, Workspace};
    let plan = on_group_of(&small_buckets(), 1);
    let comms = InProcessGroup::ranks(1, Duration::from_secs(10));
    let opts = ExecOptions::default();
    let mut grads: Vec<Grad> = seeded_gradients(&plan, 0, 3)
        .into_iter()
        .map(Grad::Host)
        .collect();
    let mut ws = Workspace::default();
    let mut ex = Execution::new(&plan, &comms[0], &mut ws, opts).unwrap();
    ex.defer_unpacks();
    let ready = vec![true; plan.slots.len()];
    ex.run(
        &plan,
        &comms[0],
        &mut grads,
        &ready,
        &mut NoHooks,
        opts,
        &mut ws,
        true,
    )
    .unwrap();
    let first = *ex.deferred().first().expect("a deferred unpack");
    let err = ex.finish().expect_err("unpacks left").to_string();
    assert!(
        err.contains(&format!("collective #{first} is never unpacked")),
        "{err}"
    );
}

/// A step that stops following its plan (`drain`) gives back, exactly as they arrived, the
/// gradients it copied into buckets it never launched; those of launched buckets come back
/// reduced.
#[test]
fn a_drained_execution_gives_back_the_gradients_of_buckets_it_never_launched() {
    use collective_fusion::runtime::Grad;
    use collective_fusion::runtime::exec::{Execution, Workspace};
    let plan = on_group_of(&small_buckets(), 1);
    let comms = InProcessGroup::ranks(1, Duration::from_secs(10));
    let opts = ExecOptions::default();
    let given = seeded_gradients(&plan, 0, 7);
    let mut grads: Vec<Grad> = given.iter().cloned().map(Grad::Host).collect();
    let mut ws = Workspace::default();
    let mut ex = Execution::new(&plan, &comms[0], &mut ws, opts).unwrap();
    // Every gradient but the plan's last: the last bucket is never complete.
    let last = *gradient_order(&plan).last().unwrap();
    let mut ready = vec![true; plan.slots.len()];
    ready[last as usize] = false;
    ex.run(
        &plan,
        &comms[0],
        &mut grads,
        &ready,
        &mut NoHooks,
        opts,
        &mut ws,
        false,
    )
    .unwrap();
    let open = plan
        .collectives
        .iter()
        .find(|c| c.slots.contains(&last))
        .unwrap();
    assert!(open.packed && open.slots.len() > 1, "{open:?}");
    let copied: Vec<u32> = open.slots.iter().copied().filter(|s| *s != last).collect();
    for s in &copied {
        let Grad::Host(b) = &grads[*s as usize] else {
            panic!("a host gradient")
        };
        assert!(
            b.is_empty(),
            "slot {s} was not copied into its bucket as it arrived"
        );
    }
    let reduced = ex
        .drain(&plan, &comms[0], &mut grads, opts, &mut ws)
        .unwrap();
    for s in &copied {
        assert!(!reduced.contains(s));
        let Grad::Host(b) = &grads[*s as usize] else {
            panic!("a host gradient")
        };
        assert!(b.bits_eq(&given[*s as usize]), "slot {s} came back changed");
    }
    assert!(
        !reduced.is_empty(),
        "the complete buckets were launched and reduced"
    );
}

/// Gradients copied into their buckets ahead of their steps (`Execution::copy_in`, the
/// backend's read of a CPU backend's gradient where it lies) reduce to the same bits as
/// gradients handed over whole; a gradient whose collective is its own (no bucket) is left to
/// the caller, and one of the wrong dtype or length is an error naming its parameter.
#[test]
fn gradients_copied_in_ahead_of_their_steps_reduce_to_the_same_bits() {
    use collective_fusion::runtime::exec::{Execution, Workspace};
    use collective_fusion::runtime::{Grad, HostSlice};
    // A gradient over the 16 KiB cap, in a collective of its own.
    let plan = buckets_of(&[common::G("h", "f32[5000]", "mean", "g0")]);
    let alone: Vec<u32> = plan
        .collectives
        .iter()
        .filter(|c| !c.packed)
        .flat_map(|c| c.slots.clone())
        .collect();
    assert!(!alone.is_empty(), "a gradient with a collective of its own");
    let opts = ExecOptions::default();
    let order = gradient_order(&plan);
    each_rank_ends_as_the_plain_run(&plan, 5, |comm, given| {
        let (plan, order, alone) = (&plan, &order, &alone);
        let mut grads: Vec<Grad> = (0..given.len()).map(|_| Grad::default()).collect();
        let mut ready = vec![false; given.len()];
        let mut ws = Workspace::default();
        let mut ex = Execution::new(plan, comm, &mut ws, opts).unwrap();
        let run =
            |ex: &mut Execution, grads: &mut [Grad], ready: &[bool], ws: &mut Workspace, block| {
                ex.run(plan, comm, grads, ready, &mut NoHooks, opts, ws, block)
                    .unwrap()
            };
        for &slot in order {
            let g = &given[slot as usize];
            if let HostBuffer::F32(v) = g
                && v.len() > 1
            {
                let short = HostSlice::F32(&v[1..]);
                let err = ex.copy_in(plan, slot, short, &mut ws).unwrap_err();
                let param = &plan.slots[slot as usize].param;
                assert!(err.to_string().contains(param.as_str()), "{err}");
                let f64s = vec![0.0f64; v.len()];
                let err = ex.copy_in(plan, slot, HostSlice::F64(&f64s), &mut ws);
                assert!(err.is_err(), "an f64 gradient for an f32 slot");
            }
            let took = ex.copy_in(plan, slot, g.as_host_slice(), &mut ws).unwrap();
            assert_eq!(took, !alone.contains(&slot), "slot {slot}");
            if !took {
                grads[slot as usize] = Grad::Host(g.clone());
            }
            ready[slot as usize] = true;
            run(&mut ex, &mut grads, &ready, &mut ws, false);
        }
        run(&mut ex, &mut grads, &ready, &mut ws, true);
        ex.finish().unwrap();
        grads
            .into_iter()
            .map(|g| g.into_host().unwrap())
            .collect::<Vec<_>>()
    });
}

/// A bucket filled as its members arrive (copied in, the rest packed, the copied ones scaled
/// at the launch) is the bucket `pack` makes, bit for bit, for a mean over 3 ranks in every
/// float dtype; a member of another dtype than the wire's (a bf16 bucket of f32 gradients) is
/// not copied in.
#[test]
fn a_bucket_filled_as_its_members_arrive_is_packs_bucket() {
    use collective_fusion::codegen::layout::BucketLayout;
    use collective_fusion::graph::DType;
    use collective_fusion::runtime::host;
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let members: Vec<HostBuffer> = [5usize, 0, 17, 3]
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let v: Vec<f64> = (0..*n)
                    .map(|k| (k as f64 - 4.5) * 0.37 + i as f64)
                    .collect();
                HostBuffer::from_f64(dtype, &v).unwrap()
            })
            .collect();
        let sizes: Vec<u64> = members.iter().map(|m| m.len() as u64).collect();
        let layout = BucketLayout::of_sizes(&sizes, dtype, dtype, Some(3), 16);
        let refs: Vec<&HostBuffer> = members.iter().collect();
        let want = host::pack(&layout, &refs, Some(3)).unwrap();
        let mut flat = HostBuffer::default();
        for j in [2, 0] {
            assert!(host::copies_in(&layout, j));
            host::copy_member(&layout, j, members[j].as_host_slice(), &mut flat).unwrap();
            let back = host::unpack_member(&layout, j, &flat).unwrap();
            assert!(back.bits_eq(&members[j]), "{dtype}: member {j} read back");
        }
        let rest: Vec<Option<&HostBuffer>> = (0..members.len())
            .map(|j| (j != 0 && j != 2).then_some(&members[j]))
            .collect();
        host::pack_rest(&layout, &rest, Some(3), &mut flat).unwrap();
        host::scale_copied(&layout, &[0, 2], Some(3), &mut flat).unwrap();
        assert!(flat.bits_eq(&want), "{dtype}");
    }
    let cast = BucketLayout::of_sizes(&[4, 6], DType::F32, DType::BF16, Some(2), 16);
    assert!(!host::copies_in(&cast, 0));
}

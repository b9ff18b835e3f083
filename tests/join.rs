//! Uneven inputs (`join`): ranks that run out of batches at different steps end with the model
//! one rank trains on every rank's batches of each step (a finished rank adding nothing), and a
//! finished rank that cannot take part fails every rank instead of leaving one waiting.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::Duration;

use burn_backend::distributed::{DistributedBackend, ReduceOperation};
use burn_core::tensor::Tensor;
use burn_ndarray::{NdArray, NdArrayDevice};
use collective_fusion::backend::{
    Collective, CollectiveDevice, CollectiveOptions, JoinError, JoinOptions, JoinReport, join,
    join_with, mark_distributed, no_sync,
};

mod common;

type Inner = Collective<NdArray>;
type B = common::join::B<NdArray>;
type Net = common::join::Net<NdArray>;
type Dev = CollectiveDevice<NdArrayDevice>;

/// Sessions are per backend type: tests that start one run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn devices(world: usize) -> Vec<Dev> {
    (0..world as u32)
        .map(|r| CollectiveDevice::new(NdArrayDevice::Cpu, r))
        .collect()
}

fn options(timeout: Duration) -> CollectiveOptions {
    CollectiveOptions {
        timeout,
        ..CollectiveOptions::default()
    }
}

fn start(world: usize) -> Vec<Dev> {
    let devices = devices(world);
    let options = options(Duration::from_secs(60));
    common::ranks::start_server::<NdArray>(&devices, options, ReduceOperation::Mean);
    devices
}

/// `f`'s result, or the message it panicked with (a rank's failed gradient sync panics).
fn caught<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// Ranks of 2, 4 and 3 batches end where one rank ends that steps on the batches every rank had
/// at each step, all with rank 1's weights; the early ranks took part in the steps they had no
/// batch for.
#[test]
fn ranks_with_uneven_inputs_train_as_one_rank_and_end_alike() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let options = options(Duration::from_secs(60));
    common::join::assert_uneven_ranks_train_as_one_rank::<NdArray>(
        &devices(3),
        &[2, 4, 3],
        options,
        JoinOptions::default(),
        1e-4,
    );
}

/// PyTorch's `throw_on_early_termination`, as a value: ranks of 2, 4 and 3 batches that stop
/// once `finished_ranks` names a rank all stop after step 2 (in which rank 0, out of inputs,
/// took part with zeros), and end as ranks of 2, 3 and 3 batches do.
#[test]
fn ranks_that_stop_when_one_runs_out_stop_after_the_same_step() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let options = options(Duration::from_secs(60));
    let ended = common::join::assert_ranks_that_stop_at_the_first_finish_train_as_one_rank::<NdArray>(
        &devices(3),
        &[2, 4, 3],
        options,
        1e-4,
    );
    let shadowed: Vec<u64> = ended.iter().map(|e| e.report.shadowed_steps).collect();
    assert_eq!(shadowed, [1, 0, 0]);
}

/// PyTorch's `divide_by_initial_world_size=False`: the same ranks of 2, 4 and 3 batches end
/// where one rank ends that steps on the losses of the ranks that had a batch divided by their
/// number (3, 3, 2, then 1), not by the world.
#[test]
fn ranks_that_divide_by_the_ranks_that_trained_step_on_their_mean() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let options = options(Duration::from_secs(60));
    let by_trained = JoinOptions {
        divide_by_initial_world_size: false,
    };
    let ended = common::join::assert_uneven_ranks_train_as_one_rank::<NdArray>(
        &devices(3),
        &[2, 4, 3],
        options.clone(),
        by_trained,
        1e-4,
    );
    // Not what dividing by the world gives.
    let by_world = common::join::assert_uneven_ranks_train_as_one_rank::<NdArray>(
        &devices(3),
        &[2, 4, 3],
        options,
        JoinOptions::default(),
        1e-4,
    );
    assert_ne!(ended[1].after, by_world[1].after);
}

/// Gradient accumulation inside the scope: each step is two micro-batches, the first under
/// `no_sync`. Ranks of 1 and 3 steps end where one rank ends that steps on the losses of both
/// micro-batches of every rank that had them, divided by the world: a `no_sync` backward
/// starts no round, the synced one does, and the finished rank's zeros stand for the sums.
#[test]
fn uneven_ranks_that_accumulate_micro_batches_train_as_one_rank() {
    use common::join::{loss, net, step};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let steps = [1, 3];
    let d0 = devices(1).remove(0);
    let initial = collective_fusion::train::module_weights::<B, Net>(&net::<NdArray>(&d0));
    let mut one = net::<NdArray>(&d0);
    for s in 0..3 {
        let total = (0..2)
            .filter(|r| s < steps[*r])
            .flat_map(|r| [(r, 2 * s), (r, 2 * s + 1)])
            .map(|(r, k)| loss::<NdArray>(&one, r, k, &d0))
            .reduce(|a, b| a + b)
            .expect("rank 1 trains every step")
            / 2.0;
        one = step::<NdArray>(one, total);
    }
    let one = collective_fusion::train::module_weights::<B, Net>(&one);

    let devices = start(2);
    let ended =
        common::ranks::forked_per_rank::<B, _, _>(&devices, &net::<NdArray>(&d0), |m, d, r| {
            let mut net = mark_distributed::<B, Net>(m).expect("marking the model");
            let scope = join::<NdArray>(d);
            for s in 0..steps[r] {
                {
                    let _accumulate = no_sync::<NdArray>(d);
                    drop(loss::<NdArray>(&net, r, 2 * s, d).backward());
                }
                // A backward pass consumes Burn's mark: mark again before the next micro-batch.
                net = mark_distributed::<B, Net>(net).expect("marking again");
                let l = loss::<NdArray>(&net, r, 2 * s + 1, d);
                net = step::<NdArray>(net, l);
            }
            let (net, report) = scope
                .finish_model::<B, Net>(net)
                .expect("finishing the scope");
            (
                collective_fusion::train::module_weights::<B, Net>(&net),
                report,
            )
        });
    Collective::<NdArray>::close_communication_server(&d0);
    assert_eq!(ended[0].1.shadowed_steps, 2);
    assert_eq!(ended[1].1.shadowed_steps, 0);
    assert_eq!(ended[0].0, ended[1].0, "the ranks end alike");
    common::ranks::assert_ends_as_one_rank(&ended[1].0, &one, &initial, 1e-4, 1e-3);
}

/// What each of two ranks' `body` (given its copy of the model, marked, inside a join scope that
/// it finishes) returned, or the message it panicked with; asserts the ranks were done well
/// before the 60 s timeout (a failure fails every rank at once, never a wait).
fn two_ranks_failing(
    body: impl Fn(Net, &Dev, usize) -> Result<JoinReport, JoinError> + Sync,
) -> Vec<Result<Result<JoinReport, JoinError>, String>> {
    let devices = start(2);
    let started = std::time::Instant::now();
    let d0 = devices[0];
    let results = common::ranks::forked_per_rank::<B, _, _>(
        &devices,
        &common::join::net::<NdArray>(&d0),
        |m, d, r| {
            caught(|| {
                body(
                    mark_distributed::<B, Net>(m).expect("marking the model"),
                    d,
                    r,
                )
            })
        },
    );
    Collective::<NdArray>::close_communication_server(&d0);
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    results
}

/// A rank that runs out of inputs before its first step cannot take part in the others' steps
/// (it knows no step to replay): it gets `JoinError::NoStep`, and the rank still training fails
/// in its gradient sync with the group's abort.
#[test]
fn a_rank_without_a_step_to_replay_fails_every_rank() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let results = two_ranks_failing(|net, d, r| {
        let scope = join::<NdArray>(d);
        if r == 1 {
            drop(common::join::loss::<NdArray>(&net, r, 0, d).backward());
        }
        scope.finish()
    });
    match &results[0] {
        Ok(Err(e @ JoinError::NoStep { rank: 0, training })) => {
            assert_eq!(training, &vec![1]);
            assert!(e.to_string().contains("before it synced any step"), "{e}");
        }
        other => panic!("rank 0: expected JoinError::NoStep, got {other:?}"),
    }
    match &results[1] {
        Err(msg) => assert!(msg.contains("before it synced any step"), "rank 1: {msg}"),
        Ok(r) => panic!("rank 1: expected its gradient sync to fail, got {r:?}"),
    }
}

/// While a rank has finished, another collective of the others (a user all-reduce) meets its
/// round: every rank fails with the communicator's mismatch error naming the round.
#[test]
fn another_collective_while_a_rank_has_finished_fails_every_rank() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let devices = devices(2);
    let results = two_ranks_failing(|net, d, r| {
        let scope = join::<NdArray>(d);
        let l = common::join::loss::<NdArray>(&net, r, 0, d);
        let net = common::join::step::<NdArray>(net, l);
        if r == 1 {
            let t = Tensor::<Inner, 1>::ones([4], d);
            let summed = collective_fusion::backend::all_reduce::<Inner, 1>(
                t,
                ReduceOperation::Sum,
                &devices,
            );
            let _ = summed.resolve().into_data();
        }
        drop(net);
        scope.finish()
    });
    for (r, result) in results.iter().enumerate() {
        let m = match result {
            Ok(Ok(report)) => panic!("rank {r}: expected a failure, got {report:?}"),
            Ok(Err(e)) => e.to_string(),
            Err(msg) => msg.clone(),
        };
        assert!(m.contains("uneven-inputs round"), "rank {r}: {m}");
    }
}

/// Ranks whose scopes divide differently would part: the first round says so, and every rank
/// fails naming the option and which ranks take which side: rank 0, out of inputs at once, with
/// `JoinError::Options` (before it would fail for having no step to replay), rank 1 in its
/// first step's gradient sync.
#[test]
fn ranks_whose_scopes_divide_differently_fail_every_rank() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let results = two_ranks_failing(|net, d, r| {
        let options = JoinOptions {
            divide_by_initial_world_size: r == 0,
        };
        let scope = join_with::<NdArray>(d, options);
        if r == 1 {
            let l = common::join::loss::<NdArray>(&net, r, 0, d);
            drop(common::join::step::<NdArray>(net, l));
        }
        scope.finish()
    });
    let sides = "rank(s) [0] by the initial world size, rank(s) [1] by the ranks that trained";
    match &results[0] {
        Ok(Err(e @ JoinError::Options { rank: 0, .. })) => {
            assert!(e.to_string().contains(sides), "{e}");
        }
        other => panic!("rank 0: expected JoinError::Options, got {other:?}"),
    }
    match &results[1] {
        Err(msg) => assert!(msg.contains(sides), "rank 1: {msg}"),
        Ok(r) => panic!("rank 1: expected its gradient sync to fail, got {r:?}"),
    }
}

//! Running a plan on every rank of an in-process group, one thread per rank (tests, benches and
//! the command line's synthetic steps).

use super::{ExecError, ExecOptions, ExecReport, NoHooks, Workspace, execute_in};
use crate::codegen::plan::Plan;
use crate::runtime::buffer::HostBuffer;
use crate::runtime::comm::Communicator;
use crate::runtime::grad::Grad;

/// Runs `plan` on `grads.len()` ranks of an in-process group, one thread per rank; returns each
/// rank's reduced gradients and report.
pub fn run_in_process(
    plan: &Plan,
    grads: Vec<Vec<HostBuffer>>,
    opts: ExecOptions,
) -> Result<Vec<(Vec<HostBuffer>, ExecReport)>, ExecError> {
    let slots = grads
        .into_iter()
        .map(|g| g.into_iter().map(Grad::Host).collect())
        .collect();
    run_in_process_grads(plan, slots, opts)?
        .into_iter()
        .enumerate()
        .map(|(rank, (g, rep))| {
            let host = g
                .into_iter()
                .map(Grad::into_host)
                .collect::<Result<_, _>>()
                .map_err(|source| ExecError::Kernel { rank, source })?;
            Ok((host, rep))
        })
        .collect()
}

/// [`run_in_process`] on gradient slots that may be device buffers.
pub fn run_in_process_grads(
    plan: &Plan,
    grads: Vec<Vec<Grad>>,
    opts: ExecOptions,
) -> Result<Vec<(Vec<Grad>, ExecReport)>, ExecError> {
    let world = grads.len();
    let comms = crate::runtime::inprocess::InProcessGroup::ranks(world, opts.timeout);
    let results: Vec<Result<(Vec<Grad>, ExecReport), ExecError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .iter()
            .zip(grads)
            .map(|(comm, mut g)| {
                scope.spawn(move || {
                    let r = execute_in(
                        plan,
                        comm,
                        &mut g,
                        &mut NoHooks,
                        opts,
                        &mut Workspace::default(),
                    );
                    if let Err(e) = &r {
                        comm.abort(&e.to_string());
                    }
                    r.map(|rep| (g, rep))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    results.into_iter().collect()
}

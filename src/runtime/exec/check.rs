//! The checks of a plan and of the gradients given to it, before anything launches: a bad
//! plan or a gradient of the wrong type is an [`ExecError`] naming it, never a hang.

use super::{ExecError, desc_of};
use crate::codegen::plan::{Event, Plan, Step};
use crate::runtime::grad::Grad;

/// Checks that the comm stream runs the collectives in the order the compute stream makes them
/// ready, that each is waited for, and that groups match the communicator.
pub(super) fn check_plan(plan: &Plan, rank: usize, world: usize) -> Result<(), ExecError> {
    let bad = |why: String| ExecError::Plan {
        plan: plan.name.clone(),
        why,
    };
    let readies: Vec<u32> = plan
        .compute
        .iter()
        .filter_map(|s| match s {
            Step::Record(Event::Ready(c)) => Some(*c),
            _ => None,
        })
        .collect();
    let calls: Vec<u32> = plan
        .comm
        .iter()
        .filter_map(|s| match s {
            Step::AllReduce { collective } => Some(*collective),
            _ => None,
        })
        .collect();
    if readies != calls {
        return Err(bad(format!(
            "the comm stream calls collectives in order {calls:?}, the compute stream readies them in order {readies:?}"
        )));
    }
    let mut waits = vec![0usize; plan.collectives.len()];
    for s in &plan.compute {
        if let Step::Wait(Event::Done(c)) = s
            && let Some(n) = waits.get_mut(*c as usize)
        {
            *n += 1;
        }
    }
    for c in &plan.collectives {
        if c.group_size as usize != world {
            let (count, dtype) = (c.layout.numel, c.wire_dtype());
            return Err(ExecError::Group {
                rank,
                what: desc_of(plan, c, count, dtype, &c.slots),
                group_size: c.group_size,
                world,
            });
        }
        let waits = waits[c.id as usize];
        if waits != 1 {
            return Err(bad(format!(
                "collective #{} is waited for {waits} times",
                c.id
            )));
        }
    }
    Ok(())
}

/// Checks that `grads` fill the plan's slots, each of its slot's type.
pub(super) fn check_grads(plan: &Plan, rank: usize, grads: &[Grad]) -> Result<(), ExecError> {
    if grads.len() != plan.slots.len() {
        return Err(ExecError::Plan {
            plan: plan.name.clone(),
            why: format!(
                "{} gradients given for {} slots",
                grads.len(),
                plan.slots.len()
            ),
        });
    }
    for (g, s) in grads.iter().zip(&plan.slots) {
        check_slot(s, rank, g)?;
    }
    Ok(())
}

/// Checks that `g` is of slot `s`'s type.
pub(super) fn check_slot(
    s: &crate::codegen::plan::Slot,
    rank: usize,
    g: &Grad,
) -> Result<(), ExecError> {
    check_slot_values(s, rank, g.dtype(), g.len())
}

/// Checks a gradient of `dtype` and `len` elements against its slot.
pub(super) fn check_slot_values(
    s: &crate::codegen::plan::Slot,
    rank: usize,
    dtype: crate::graph::DType,
    len: usize,
) -> Result<(), ExecError> {
    if dtype != s.ty.dtype || len as u64 != s.ty.numel() {
        return Err(ExecError::Gradient {
            rank,
            param: s.param.clone(),
            expected: s.ty.to_string(),
            got: format!("{dtype}[{len}]"),
        });
    }
    Ok(())
}

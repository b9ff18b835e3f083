//! A gradient arriving in its execution: checked against its slot and, where its bucket is in
//! host memory and of its dtype, copied into the bucket at once, as DDP's hook copies a gradient
//! into its bucket, so only one copy of it is held from there on. A CPU backend's gradient can
//! be copied in from its own memory ([`Execution::copy_in`]), with no host copy of its own.

use super::check::{check_slot, check_slot_values};
use super::{ExecError, Execution, StepHooks, Workspace};
use crate::codegen::plan::Plan;
use crate::runtime::buffer::{HostBuffer, HostSlice};
use crate::runtime::grad::Grad;
use crate::runtime::host;

impl Execution {
    /// Copies `member`, the gradient of `slot`, straight into its host bucket, ahead of the
    /// slot's step (which then takes it as arrived): one copy where the backend reads a gradient
    /// in its own memory, instead of a host copy and then the copy into the bucket. True where it
    /// did; false, nothing done, where the slot's bucket does not take members as they arrive (a
    /// device bucket, a member cast on the wire, no bucket) or is packed already. An error where
    /// `member` is not of the slot's dtype and length.
    pub fn copy_in(
        &mut self,
        plan: &Plan,
        slot: u32,
        member: HostSlice<'_>,
        ws: &mut Workspace,
    ) -> Result<bool, ExecError> {
        self.same_plan(plan)?;
        let s = slot as usize;
        let Some(spec) = plan.slots.get(s) else {
            return Ok(false);
        };
        check_slot_values(spec, self.rank, member.dtype(), member.len())?;
        self.copy_member(plan, s, member, ws)
    }

    /// The step of a gradient that arrived in `grads` (unless [`Execution::copy_in`] took it
    /// before): checked against its slot, and copied into its bucket where it can be.
    pub(super) fn arrive(
        &mut self,
        plan: &Plan,
        s: usize,
        grads: &mut [Grad],
        hooks: &mut dyn StepHooks,
        ws: &mut Workspace,
    ) -> Result<(), ExecError> {
        if self.copied[s] {
            // Copied in at its submission, and checked then.
            return Ok(());
        }
        hooks.gradient(s as u32, &plan.slots[s].param, &mut grads[s]);
        check_slot(&plan.slots[s], self.rank, &grads[s])?;
        if let Grad::Host(b) = &grads[s]
            && self.copy_member(plan, s, b.as_host_slice(), ws)?
        {
            grads[s] = Grad::Host(HostBuffer::default());
        }
        Ok(())
    }

    /// Copies slot `s`'s values into its host bucket where the bucket takes them as they arrive
    /// and is not packed yet; whether it did.
    fn copy_member(
        &mut self,
        plan: &Plan,
        s: usize,
        member: HostSlice<'_>,
        ws: &mut Workspace,
    ) -> Result<bool, ExecError> {
        let Some(&Some((c, j))) = ws.member_of.get(s) else {
            return Ok(false);
        };
        if self.packed[c as usize].is_some() || self.flight[c as usize].is_some() {
            return Ok(false);
        }
        let rank = self.rank;
        let kerr = |source| ExecError::Kernel { rank, source };
        let layout = &plan.collectives[c as usize].layout;
        let bucket = ws.bucket(c, layout).map_err(kerr)?;
        host::copy_member(layout, j as usize, member, bucket).map_err(kerr)?;
        self.copied[s] = true;
        Ok(true)
    }
}

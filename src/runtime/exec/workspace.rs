//! [`Workspace`]: the bucket buffers a rank keeps from one step to the next.

use crate::codegen::plan::Plan;
use crate::runtime::buffer::HostBuffer;
use crate::runtime::host;

/// Bucket buffers kept from one step to the next, so a steady-state step allocates nothing.
#[derive(Default)]
pub struct Workspace {
    pub(super) plan_hash: u64,
    pub(super) buffers: Vec<HostBuffer>,
    /// Slot → (packed collective, member) where the member is copied into its bucket as it
    /// arrives ([`host::copies_in`]).
    pub(super) member_of: Vec<Option<(u32, u32)>>,
    /// The ranks agreed on this plan (see [`agree`](crate::runtime::agree)).
    pub(super) agreed: bool,
}

impl Workspace {
    /// A workspace for `plan` whose ranks already agreed on it ([`agree`](crate::runtime::agree::agree)
    /// ran), so [`Execution::new`](super::Execution::new) does not agree again.
    pub fn agreed_on(plan: &Plan) -> Self {
        let mut member_of = vec![None; plan.slots.len()];
        for c in plan.collectives.iter().filter(|c| c.packed) {
            for (j, s) in c.slots.iter().enumerate() {
                if host::copies_in(&c.layout, j)
                    && let Some(m) = member_of.get_mut(*s as usize)
                {
                    *m = Some((c.id, j as u32));
                }
            }
        }
        Workspace {
            plan_hash: plan.graph_hash,
            buffers: vec![HostBuffer::default(); plan.collectives.len()],
            member_of,
            agreed: true,
        }
    }

    /// Bytes of the buckets it holds (what it keeps from one step to the next).
    pub fn held_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .map(|b| b.len() as u64 * b.dtype().size())
            .sum()
    }

    /// Readies this workspace for `plan`, on which the ranks already agreed (its buffers kept
    /// when it was `plan`'s already), so [`Execution::new`](super::Execution::new) does not agree again.
    pub fn agreed(&mut self, plan: &Plan) {
        if self.plan_hash != plan.graph_hash || self.buffers.len() != plan.collectives.len() {
            *self = Workspace::agreed_on(plan);
        }
        self.agreed = true;
    }
}

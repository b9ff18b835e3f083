//! [`Workspace`]: the bucket buffers a rank keeps from one step to the next.

use crate::codegen::layout::BucketLayout;
use crate::codegen::plan::{Plan, PlanCollective};
use crate::runtime::buffer::HostBuffer;
use crate::runtime::host::{self, KernelError};

/// Bucket buffers kept from one step to the next, so a steady-state step allocates nothing: the
/// steps of one plan, and also steps that switch plans (a GAN's generator and discriminator
/// steps, a schedule that skips layers), whose new plan takes the previous plan's buffers of
/// its buckets' dtype and size.
#[derive(Default)]
pub struct Workspace {
    pub(super) plan_hash: u64,
    pub(super) buffers: Vec<HostBuffer>,
    /// Slot → (packed collective, member) where the member is copied into its bucket as it
    /// arrives ([`host::copies_in`]).
    pub(super) member_of: Vec<Option<(u32, u32)>>,
    /// The ranks agreed on this plan (see [`agree`](crate::runtime::agree)).
    pub(super) agreed: bool,
    /// Buffers of the plan before this one that this plan's buckets did not take, kept for the
    /// next switch (a plan that comes back); let go at the switch after, unless taken then.
    spare: Vec<HostBuffer>,
    /// Host buckets allocated in this workspace's life.
    allocations: u64,
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
            spare: Vec::new(),
            allocations: 0,
        }
    }

    /// Bytes of the buckets it holds (what it keeps from one step to the next), the spare ones
    /// included.
    pub fn held_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .chain(&self.spare)
            .map(|b| b.capacity() as u64 * b.dtype().size())
            .sum()
    }

    /// Host buckets allocated so far: a bucket whose buffer this workspace held (from the
    /// previous step of its plan, or from another plan of the same bucket sizes) allocates none.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    /// Readies this workspace for `plan`, on which the ranks already agreed (its buffers kept
    /// when it was `plan`'s already), so [`Execution::new`](super::Execution::new) does not agree again.
    pub fn agreed(&mut self, plan: &Plan) {
        self.ready_for(plan);
        self.agreed = true;
    }

    /// Readies this workspace for `plan`; `false` when it was another plan's (the ranks have not
    /// agreed on `plan` here yet). Another plan's buffers go to `plan`'s packed buckets of the
    /// same wire dtype, each to the bucket it fits best (the same length first, else the
    /// smallest that holds it); the ones left are kept for one more switch.
    pub(super) fn ready_for(&mut self, plan: &Plan) -> bool {
        if self.plan_hash == plan.graph_hash && self.buffers.len() == plan.collectives.len() {
            return true;
        }
        let recent = std::mem::take(&mut self.buffers);
        let older = std::mem::take(&mut self.spare);
        let allocations = self.allocations;
        *self = Workspace::agreed_on(plan);
        self.allocations = allocations;
        let mut pool: Vec<(HostBuffer, bool)> = recent
            .into_iter()
            .map(|b| (b, true))
            .chain(older.into_iter().map(|b| (b, false)))
            .filter(|(b, _)| b.capacity() > 0)
            .collect();
        // The largest buckets choose first, so a small one does not take the only buffer a
        // large one fits.
        let mut packed: Vec<&PlanCollective> =
            plan.collectives.iter().filter(|c| c.packed).collect();
        packed.sort_by_key(|c| std::cmp::Reverse(c.layout.numel));
        for c in packed {
            let numel = c.layout.numel as usize;
            let fit = pool
                .iter()
                .enumerate()
                .filter(|(_, (b, _))| {
                    b.dtype().name() == c.layout.wire_dtype && b.capacity() >= numel
                })
                .min_by_key(|(_, (b, _))| (b.len() != numel, b.capacity()))
                .map(|(i, _)| i);
            if let Some(i) = fit {
                let (mut b, _) = pool.swap_remove(i);
                b.resize(numel);
                self.buffers[c.id as usize] = b;
            }
        }
        self.spare = pool
            .into_iter()
            .filter_map(|(b, recent)| recent.then_some(b))
            .collect();
        false
    }

    /// Lets go of every buffer it holds (its count of allocations stays): for the workspace of a
    /// step that left the plan it followed, once a step did not need it, so a rank does not keep
    /// the buckets of a one-off step to the end of training.
    pub fn let_go(&mut self) {
        if self.held_bytes() > 0 {
            *self = Workspace {
                allocations: self.allocations,
                ..Workspace::default()
            };
        }
    }

    /// Collective `c`'s bucket, made the layout's flat buffer (allocated, and counted, only
    /// when the workspace held none of its dtype and length).
    pub(super) fn bucket(
        &mut self,
        c: u32,
        layout: &BucketLayout,
    ) -> Result<&mut HostBuffer, KernelError> {
        let b = &mut self.buffers[c as usize];
        if b.dtype().name() != layout.wire_dtype || b.len() as u64 != layout.numel {
            self.allocations += 1;
            host::ensure_flat(layout, b)?;
        }
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::plan::lower;

    /// A plan of two ranks whose buckets (DDP's, closed at 2 KiB) pack f32 gradients of the given
    /// lengths, in ready order.
    fn plan(name: &str, lens: &[u64]) -> Plan {
        use crate::config::{BucketConfig, BucketPolicy, CompileConfig};
        use crate::graph::{DType, Graph, Op, ReduceOp, TensorType};
        let mut g = Graph::new(name);
        let group = g.add_group(2);
        let mut syncs = Vec::new();
        for (i, len) in lens.iter().enumerate() {
            let ty = TensorType::new(DType::F32, &[*len]);
            let p = format!("{name}{i}");
            let src = g.add_node(
                Op::Input {
                    name: format!("{p}.grad"),
                },
                [ty.clone()],
                &[],
            );
            syncs.push(crate::graph::builder::add_gradient_sync(
                &mut g,
                &p,
                &ty,
                src,
                i as u32,
                ReduceOp::Sum,
                group,
            ));
        }
        g.add_node(Op::Sync, [], &syncs);
        let bucket = BucketConfig {
            policy: BucketPolicy::Ddp,
            cap_bytes: 2048,
            first_bucket_bytes: 2048,
        };
        crate::passes::compile(
            &mut g,
            &CompileConfig {
                bucket,
                ..CompileConfig::default()
            },
        )
        .unwrap();
        lower(&g).unwrap()
    }

    /// Readies `ws` for `plan` and makes each of its packed buckets (as a step does); the
    /// buckets' addresses.
    fn step(ws: &mut Workspace, plan: &Plan) -> Vec<*const u8> {
        ws.agreed(plan);
        plan.collectives
            .iter()
            .filter(|c| c.packed)
            .map(|c| ws.bucket(c.id, &c.layout).unwrap().as_bytes().as_ptr())
            .collect()
    }

    #[test]
    fn a_plan_switched_to_takes_the_buckets_it_fits_and_the_rest_wait_one_switch() {
        // Buckets of 512 and 256 elements; 512 and 64; 600 and 600.
        let a = plan("a", &[256, 256, 128, 128]);
        let b = plan("b", &[256, 256, 32, 32]);
        let big = plan("c", &[300, 300, 300, 300]);
        let buckets = |p: &Plan| -> Vec<u64> {
            let packed = p.collectives.iter().filter(|c| c.packed);
            packed.map(|c| c.layout.numel).collect()
        };
        assert_eq!(
            [buckets(&a), buckets(&b), buckets(&big)],
            [[512, 256], [512, 64], [600, 600]]
        );
        let mut ws = Workspace::default();
        let in_a = step(&mut ws, &a);
        assert_eq!((in_a.len(), ws.allocations()), (2, 2));
        let held = ws.held_bytes();
        assert_eq!(held, (512 + 256) * 4);
        // b's 512 takes a's 512 (the same length), its 64 a's 256 (the only one left).
        assert_eq!(step(&mut ws, &b), in_a);
        assert_eq!((ws.allocations(), ws.held_bytes()), (2, held));
        // And back, in the same memory: a's 256 grows back within its capacity.
        assert_eq!(step(&mut ws, &a), in_a);
        assert_eq!(step(&mut ws, &a), in_a);
        assert_eq!((ws.allocations(), ws.held_bytes()), (2, held));
        // A plan nothing fits allocates; a's buckets wait one switch, and come back, each to
        // the bucket of its own length.
        let in_big = step(&mut ws, &big);
        assert_eq!(ws.allocations(), 4);
        assert_eq!(ws.held_bytes(), held + 1200 * 4);
        assert_eq!(step(&mut ws, &a), in_a);
        assert_eq!(step(&mut ws, &big), in_big);
        assert_eq!(ws.allocations(), 4);
        // A second switch that does not take a's buckets (to a plan of big's sizes) lets them go.
        let same_as_big = plan("d", &[300, 300, 300, 300]);
        assert_eq!(step(&mut ws, &same_as_big), in_big);
        assert_eq!((ws.allocations(), ws.held_bytes()), (4, 1200 * 4));
    }
}

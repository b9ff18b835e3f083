//! The zero-fill sync ([`UnusedParameters::ZeroFill`](super::UnusedParameters::ZeroFill)):
//! DDP's `find_unused_parameters` for `Collective<I>`.
//!
//! Requires: every rank reaches the sync point of the same step.
//! Guarantees: every rank runs the same plans (the previous step's, then one for the union of
//! the gradients that plan does not know), zeros standing in for gradients a rank does not
//! have; the next step's plan is the same on every rank.

use burn_backend::Backend;
use hashbrown::HashMap;

use super::session::{Live, RankState, Session};
use crate::graph::{DType, TensorType};
use crate::runtime::exec::{NoHooks, execute_in};
use crate::runtime::{Grad, HostBuffer};

/// What a rank tells the others at a zero-fill sync.
#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    /// Gradients the expected plan does not know.
    extras: Vec<Extra>,
    /// Parameters of the expected plan this rank zero-filled.
    zero: Vec<String>,
}

/// A gradient the expected plan does not know: its parameter and type.
#[derive(serde::Serialize, serde::Deserialize)]
struct Extra {
    name: String,
    dtype: DType,
    dims: Vec<u64>,
}

impl<I: Backend> Session<I> {
    /// The zero-fill sync ([`UnusedParameters::ZeroFill`]). Every rank runs the previous step's
    /// plan to the end, zeros standing in for gradients that did not arrive here; then the
    /// ranks exchange manifests (gradients that plan does not know, names they zero-filled) and
    /// all run one plan for the union of the unknown ones, zero-filling likewise. The next
    /// step's plan, the same on every rank: this plan's entries, less those zero-filled on every
    /// rank, then the union. Returns the union's reduced gradients by submission index and,
    /// when there was a previous plan, its execution, run to the end with its unpacks left to
    /// the hand-back (with whether it launched during backward), as
    /// [`Session::reduce_following`] does.
    pub(super) fn reduce_zero_fill(
        &self,
        rank: usize,
        st: &mut RankState<I>,
    ) -> (Vec<Option<Grad>>, Option<(Live, bool)>) {
        let opts = self.opts();
        let comm = self.comm(rank);
        let n = st.submitted.len();
        let mut reduced: Vec<Option<Grad>> = (0..n).map(|_| None).collect();
        let mut zero: Vec<String> = Vec::new();
        // Gradients the previous plan reduces (handed back from its execution, `handed`).
        let mut covered = vec![false; n];
        let mut handed = None;
        let zeros = |ty: &TensorType, name: &str| {
            HostBuffer::zeros(ty.dtype, ty.numel() as usize)
                .map(Grad::Host)
                .ok_or_else(|| {
                    format!("cannot zero-fill the gradient of {name}: {ty} is not a float type")
                })
        };
        if let Some(plan) = st.expected.clone() {
            let mut live = match st.live.take() {
                Some(l) => l,
                None => self.start_live(rank, st, plan.clone()),
            };
            let launched_early = live.ready.iter().any(|r| *r);
            for (slot, s) in plan.slots.iter().enumerate() {
                if live.ready[slot] {
                    continue;
                }
                live.grads[slot] = match st.index.get(&s.param).copied() {
                    Some(i) if st.submitted[i].ty == s.ty => {
                        live.source[slot] = Some(i);
                        st.submitted[i].data.take().unwrap_or_default()
                    }
                    Some(i) => self.fail(
                        rank,
                        format!(
                            "the gradient of {} is {}, but it was {} in the previous step",
                            s.param, st.submitted[i].ty, s.ty
                        ),
                    ),
                    None => {
                        zero.push(s.param.clone());
                        zeros(&s.ty, &s.param).unwrap_or_else(|e| self.fail(rank, e))
                    }
                };
                live.ready[slot] = true;
            }
            self.finish_live(rank, &mut live, &mut st.workspace);
            for i in live.source.iter().flatten() {
                covered[*i] = true;
            }
            handed = Some((live, launched_early));
        }
        // The manifests.
        let extras: Vec<usize> = (0..n).filter(|i| !covered[*i]).collect();
        let manifest = Manifest {
            extras: extras
                .iter()
                .map(|i| {
                    let s = &st.submitted[*i];
                    Extra {
                        name: s.name.clone(),
                        dtype: s.ty.dtype,
                        dims: s.ty.shape.to_vec(),
                    }
                })
                .collect(),
            zero: zero.clone(),
        };
        let bytes = serde_json::to_vec(&manifest).unwrap_or_default();
        let all = match crate::runtime::agree::all_gather_bytes(comm, &bytes, opts.timeout) {
            Ok(a) => a,
            Err(e) => self.fail(rank, format!("exchanging gradient manifests: {e}")),
        };
        let mut union: Vec<(String, TensorType)> = Vec::new();
        let mut owner: HashMap<String, (usize, TensorType)> = HashMap::new();
        let mut zero_count: HashMap<String, usize> = HashMap::new();
        for (r, bytes) in all.iter().enumerate() {
            let Manifest {
                extras,
                zero: zeroed,
            } = match serde_json::from_slice(bytes) {
                Ok(m) => m,
                Err(e) => self.fail(rank, format!("the gradient manifest of rank {r}: {e}")),
            };
            for name in zeroed {
                *zero_count.entry(name).or_default() += 1;
            }
            for Extra { name, dtype, dims } in extras {
                let ty = TensorType::new(dtype, &dims);
                match owner.get(&name) {
                    Some((r0, t0)) if *t0 != ty => self.fail(
                        rank,
                        format!("the gradient of {name} is {t0} on rank {r0} but {ty} on rank {r}"),
                    ),
                    Some(_) => {}
                    None => {
                        owner.insert(name.clone(), (r, ty.clone()));
                        union.push((name, ty));
                    }
                }
            }
        }
        if union.is_empty() || handed.is_none() {
            // No rest reduced with a plan of its own: the buckets a step did so for go.
            st.leftover_workspace.let_go();
        }
        if !union.is_empty() {
            let (_, plan) = self.compile_segment(rank, &mut st.cache, &union);
            let mut grads: Vec<Grad> = Vec::with_capacity(plan.slots.len());
            let mut source = Vec::with_capacity(plan.slots.len());
            for s in &plan.slots {
                match st.index.get(&s.param).copied() {
                    Some(i) if !covered[i] => {
                        grads.push(st.submitted[i].data.take().unwrap_or_default());
                        source.push(Some(i));
                    }
                    _ => {
                        zero.push(s.param.clone());
                        grads.push(zeros(&s.ty, &s.param).unwrap_or_else(|e| self.fail(rank, e)));
                        source.push(None);
                    }
                }
            }
            // With no previous plan this one reduces the whole step: its buckets are the ones
            // the next step's plan reuses.
            let ws = if handed.is_none() {
                &mut st.workspace
            } else {
                &mut st.leftover_workspace
            };
            self.agree_once(rank, &mut st.agreed, &plan);
            ws.agreed(&plan);
            match execute_in(&plan, comm, &mut grads, &mut NoHooks, opts, ws) {
                Ok(report) => self.record(rank, &report),
                Err(e) => self.fail(rank, e.to_string()),
            }
            for (buf, i) in grads.into_iter().zip(source) {
                if let Some(i) = i {
                    reduced[i] = Some(buf);
                }
            }
            st.flushed_steps += 1;
        }
        let unused_everywhere: Vec<&String> = zero_count
            .iter()
            .filter(|(_, c)| **c == self.world)
            .map(|(n, _)| n)
            .collect();
        if !union.is_empty() || !unused_everywhere.is_empty() {
            let mut entries: Vec<(String, TensorType)> = st
                .expected_entries
                .iter()
                .filter(|(n, _)| !unused_everywhere.contains(&n))
                .cloned()
                .collect();
            entries.extend(union);
            if entries.is_empty() {
                st.expected = None;
                st.expected_segment = None;
            } else {
                let (g, plan) = self.compile_segment(rank, &mut st.cache, &entries);
                st.expected = Some(plan);
                st.expected_segment = Some(g);
            }
            st.expected_entries = entries;
        }
        if !zero.is_empty() {
            tracing::debug!(rank, params = ?zero, "zero-filled gradients of unused parameters");
        }
        st.zero_filled += zero.len() as u64;
        st.last_zero_filled = zero;
        (reduced, handed)
    }
}

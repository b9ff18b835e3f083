//! The tensor handle of `Collective<I>` ([`CTensor`]): the inner backend's tensor or a recorded
//! op ([`Node`]) that computes it when forced through its rank's [`Recorder`]; what it knows of
//! its shape, dtype and random draws. The guarantees are the parent module's.

use std::any::Any;
use std::sync::{Arc, Mutex};

use burn_backend::{QTensorPrimitive, TensorMetadata};
use burn_std::{DType, Shape};

use super::{ForceReason, Pending, Record, lock, recorder};
use crate::backend::rules::{Meta, copy_shape};

/// Where a node's op stands: its closure until it runs, then its value.
pub(super) enum Stage<P, F> {
    Pending(F),
    /// Taken off to run (or its value moved out); still so after a run that panicked.
    Running,
    Done(P),
}

/// The closure type of a node recorded with its value already computed (never called).
pub(super) type Computed<P> = fn() -> P;

/// A node's stage, whatever its closure's type: what [`Node`] holds behind the `Arc`, so the
/// node, its closure and later its value live in one allocation.
pub(crate) trait Slot<P>: Pending {
    /// Whether the op is still to run.
    fn is_pending(&self) -> bool;
    /// Whether the value is computed.
    fn is_done(&self) -> bool;
    /// A clone of the value, if computed.
    fn cloned(&self) -> Option<P>;
    /// The value moved out, if computed (the handle that asks holds the only reference).
    fn take(&mut self) -> Option<P>;
}

impl<P: Send, F: FnOnce() -> P + Send> Pending for Mutex<Stage<P, F>> {
    fn run(&self) -> bool {
        let mut st = lock(self);
        if !matches!(*st, Stage::Pending(_)) {
            return false;
        }
        let Stage::Pending(f) = std::mem::replace(&mut *st, Stage::Running) else {
            unreachable!("checked above")
        };
        // The lock is held while the op runs: another thread that needs this value waits.
        *st = Stage::Done(f());
        true
    }
}

impl<P: Clone + Send, F: FnOnce() -> P + Send> Slot<P> for Mutex<Stage<P, F>> {
    fn is_pending(&self) -> bool {
        matches!(*lock(self), Stage::Pending(_))
    }
    fn is_done(&self) -> bool {
        matches!(*lock(self), Stage::Done(_))
    }
    fn cloned(&self) -> Option<P> {
        match &*lock(self) {
            Stage::Done(p) => Some(p.clone()),
            _ => None,
        }
    }
    fn take(&mut self) -> Option<P> {
        let st = self.get_mut().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(st, Stage::Running) {
            Stage::Done(p) => Some(p),
            other => {
                *st = other;
                None
            }
        }
    }
}

/// The inner backend's device of a node, type-erased (`CTensor` does not name the backend).
pub(crate) type AnyDevice = Arc<dyn Any + Send + Sync>;

/// A recorded op: what the recorder knows of it, and its stage (`S`: a `Mutex<Stage<P, F>>` when
/// built, a `dyn Slot<P>` behind a tensor's `Arc`).
pub(crate) struct Node<S: ?Sized> {
    pub(super) seq: u64,
    pub(super) op: &'static str,
    pub(super) device: AnyDevice,
    pub(super) shape: Option<Shape>,
    pub(super) dtype: Option<DType>,
    pub(super) state: S,
}

/// A recorded op computing a `P`, as tensors hold it.
pub(crate) type DynNode<P> = Node<dyn Slot<P>>;

impl<S: Pending + ?Sized> Pending for Node<S> {
    fn run(&self) -> bool {
        self.state.run()
    }
}

impl<P> DynNode<P> {
    fn value(&self) -> P {
        self.state.cloned().unwrap_or_else(|| {
            if self.state.is_pending() {
                unreachable!("node {} was forced", self.seq)
            }
            panic!(
                "lazy tensor: the op {} (node {}) panicked while it ran; its value does not exist",
                self.op, self.seq
            )
        })
    }
}

enum Repr<P> {
    Ready(P),
    Lazy(Arc<DynNode<P>>),
}

/// The value of a computed node, moved out without a lock, when `n` is its last handle and the
/// node is off the queue (nothing else can reach it); `None` otherwise (the caller clones).
fn take_last<P>(n: &mut Arc<DynNode<P>>) -> Option<P> {
    Arc::get_mut(n).and_then(|node| node.state.take())
}

/// A tensor of `Collective<I>`: the inner backend's tensor, or a recorded op that will compute
/// it, and the rank it lives on.
pub struct CTensor<P> {
    repr: Repr<P>,
    /// Its rank.
    pub rank: u32,
    /// Whether the value derives from a random draw of this rank since the ranks last agreed on
    /// it (see [`Self::is_drawn`]).
    drawn: bool,
}

/// What a recorded op knows of one of its tensor inputs: its node (if recorded) and whether its
/// value derives from a random draw.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Input {
    /// Its node number, if an op recorded it.
    pub seq: Option<u64>,
    /// Whether it derives from a random draw.
    pub drawn: bool,
}

impl<P: Clone> Clone for CTensor<P> {
    fn clone(&self) -> Self {
        CTensor {
            repr: match &self.repr {
                Repr::Ready(p) => Repr::Ready(p.clone()),
                Repr::Lazy(n) => Repr::Lazy(Arc::clone(n)),
            },
            rank: self.rank,
            drawn: self.drawn,
        }
    }
}

impl<P: std::fmt::Debug> std::fmt::Debug for CTensor<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.repr {
            Repr::Ready(p) => write!(f, "CTensor(rank {}, {p:?})", self.rank),
            Repr::Lazy(n) => write!(
                f,
                "CTensor(rank {}, lazy {} #{}, {:?} {:?})",
                self.rank, n.op, n.seq, n.dtype, n.shape
            ),
        }
    }
}

impl<P: Clone + Send + 'static> CTensor<P> {
    /// `inner`, already computed, on `rank`.
    pub fn new(inner: P, rank: u32) -> Self {
        CTensor {
            repr: Repr::Ready(inner),
            rank,
            drawn: false,
        }
    }

    /// `inner`, a random draw of `rank` (`float_random`, `int_random`): values another rank's
    /// generator would not draw alike unless seeded alike.
    pub(crate) fn random(inner: P, rank: u32) -> Self {
        CTensor {
            drawn: true,
            ..CTensor::new(inner, rank)
        }
    }

    /// Whether the value derives from a random draw of this rank (a random op, or an op that
    /// read such a value) since the ranks last agreed on it: a gradient sync's result and a
    /// replicated parameter do not. What `mark_distributed` looks at to see that a parameter
    /// it replicated before holds freshly drawn values again (a lazily initialized model forked
    /// again, a layer initialized again): replicas that would otherwise drift apart silently.
    pub(crate) fn is_drawn(&self) -> bool {
        self.drawn
    }

    /// The same value, as one the ranks agree on (the parameters a marking replicated).
    pub(crate) fn agreed(&self) -> Self {
        CTensor {
            drawn: false,
            ..self.clone()
        }
    }

    /// What an op that reads this tensor records of it.
    pub(crate) fn input(&self) -> Input {
        Input {
            seq: self.seq(),
            drawn: self.drawn,
        }
    }

    /// The node number of this tensor, if an op recorded it.
    pub(crate) fn seq(&self) -> Option<u64> {
        match &self.repr {
            Repr::Ready(_) => None,
            Repr::Lazy(n) => Some(n.seq),
        }
    }

    fn force(&self, why: ForceReason) {
        if let Repr::Lazy(n) = &self.repr {
            if n.state.is_done() {
                return;
            }
            recorder(self.rank).run_until(n.seq, why);
            // Another thread may have taken it off the queue and still be running it; taking
            // the lock waits for that.
            n.run();
        }
    }

    /// [`Self::inner_for`], running only this node's queued producers when what that leaves
    /// queued keeps at most `max_bytes` alive (see [`Recorder::run_producers`]); 0 runs
    /// everything recorded before it, as [`Self::inner_for`] does.
    pub(crate) fn inner_hoisted(&self, why: &'static str, max_bytes: u64) -> P {
        if max_bytes == 0 {
            return self.inner_for(why);
        }
        if let Repr::Lazy(n) = &self.repr {
            if !n.state.is_done() {
                recorder(self.rank).run_producers(n.seq, max_bytes, ForceReason::Value(why));
                n.run();
            }
            return n.value();
        }
        self.inner_for(why)
    }

    /// The computed tensor, consuming the handle: moved out when this was the last handle.
    pub fn into_inner(self) -> P {
        self.into_inner_for("value")
    }

    /// [`Self::into_inner`], counting `why` as what forced the queue.
    pub fn into_inner_for(mut self, why: &'static str) -> P {
        // A node computed already needs neither the queue nor its lock.
        if let Repr::Lazy(n) = &mut self.repr
            && let Some(p) = take_last(n)
        {
            return p;
        }
        self.force(ForceReason::Value(why));
        match self.repr {
            Repr::Ready(p) => p,
            Repr::Lazy(mut n) => take_last(&mut n).unwrap_or_else(|| n.value()),
        }
    }

    /// The computed tensor (a clone: cheap for Burn's reference-counted primitives).
    pub fn inner(&self) -> P {
        self.inner_for("value")
    }

    /// [`Self::inner`], counting `why` as what forced the queue.
    pub fn inner_for(&self, why: &'static str) -> P {
        self.force(ForceReason::Value(why));
        match &self.repr {
            Repr::Ready(p) => p.clone(),
            Repr::Lazy(n) => n.value(),
        }
    }

    /// The inner device, without computing anything: `of` asks the inner backend for a computed
    /// tensor; a node answers with the device recorded from its first input (Burn checks the
    /// devices of operands on every op, so asking must not force).
    pub(crate) fn device<D: Clone + Send + Sync + 'static>(&self, of: impl FnOnce(&P) -> D) -> D {
        match &self.repr {
            Repr::Ready(p) => of(p),
            Repr::Lazy(n) => match n.device.downcast_ref::<D>() {
                Some(d) => d.clone(),
                None => of(&self.inner()),
            },
        }
    }

    /// The inner device as a node records it (shared with the input's node when it is lazy).
    pub(crate) fn device_handle<D: Send + Sync + 'static>(
        &self,
        of: impl FnOnce(&P) -> D,
    ) -> AnyDevice {
        match &self.repr {
            Repr::Ready(p) => Arc::new(of(p)),
            Repr::Lazy(n) => Arc::clone(&n.device),
        }
    }

    /// Replaces the value with a computed tensor (the gradient write-back).
    pub fn set(&mut self, inner: P) {
        self.repr = Repr::Ready(inner);
        self.drawn = false;
    }

    /// Changes the computed value in place with `write` (which says whether it wrote), where
    /// this handle is its only one: a ready value, or the last handle of a computed node (whose
    /// value moves out of it). False, nothing written, while the value is pending or its node
    /// shared. (`write` itself checks that the inner tensor's memory is not shared.)
    pub(crate) fn write_in_place(&mut self, write: impl FnOnce(&mut P) -> bool) -> bool {
        if let Repr::Lazy(n) = &mut self.repr {
            match take_last(n) {
                Some(v) => self.repr = Repr::Ready(v),
                None => return false,
            }
        }
        let Repr::Ready(p) = &mut self.repr else {
            return false;
        };
        let wrote = write(p);
        if wrote {
            self.drawn = false;
        }
        wrote
    }

    /// Whether the value is still to be computed.
    pub fn is_pending(&self) -> bool {
        match &self.repr {
            Repr::Ready(_) => false,
            Repr::Lazy(n) => n.state.is_pending(),
        }
    }
}

impl<P: TensorMetadata + Clone + Send + 'static> CTensor<P> {
    /// The result `p` of an op that ran eagerly on `rank`: logged like a recorded op (its
    /// shape and dtype taken from `p`), so the step graph stays connected through it.
    pub(crate) fn eager(rank: u32, mut rec: Record, p: P) -> Self {
        rec.shape = Some(p.shape());
        rec.dtype = Some(p.dtype());
        if rec.flops == 0 {
            rec.flops = rec.shape.as_ref().map_or(0, |s| s.num_elements() as u64);
        }
        let drawn = rec.drawn;
        let node = recorder(rank).push(rec, Stage::<P, Computed<P>>::Done(p));
        CTensor {
            repr: Repr::Lazy(node),
            rank,
            drawn,
        }
    }

    /// A node of `rank` that computes its value with `f` when forced. Debug builds check the
    /// computed tensor against the shape and dtype the record claimed (its rule in
    /// `op_table.rs`), so a wrong rule fails where it is, not as a wrong graph later.
    pub(crate) fn lazy(rank: u32, rec: Record, f: impl FnOnce() -> P + Send + 'static) -> Self {
        #[cfg(debug_assertions)]
        let f = {
            let (op, shape, dtype) = (rec.op, rec.shape.clone(), rec.dtype);
            move || {
                let p = f();
                if let Some(s) = &shape {
                    assert_eq!(&p.shape(), s, "record rule of {op}: shape");
                }
                if let Some(d) = dtype {
                    assert_eq!(p.dtype(), d, "record rule of {op}: dtype");
                }
                p
            }
        };
        let drawn = rec.drawn;
        let node = recorder(rank).push(rec, Stage::Pending(f));
        CTensor {
            repr: Repr::Lazy(node),
            rank,
            drawn,
        }
    }

    /// What is known of this tensor without computing it (for a record rule).
    pub(crate) fn meta(&self) -> Meta {
        Meta {
            shape: self.shape_hint(),
            dtype: self.dtype_hint(),
        }
    }

    /// The shape if known without computing anything.
    pub(crate) fn shape_hint(&self) -> Option<Shape> {
        match &self.repr {
            Repr::Ready(p) => Some(p.shape()),
            Repr::Lazy(n) => n.shape.as_ref().map(copy_shape),
        }
    }

    /// The dtype if known without computing anything.
    pub(crate) fn dtype_hint(&self) -> Option<DType> {
        match &self.repr {
            Repr::Ready(p) => Some(p.dtype()),
            Repr::Lazy(n) => n.dtype,
        }
    }

    fn computed_metadata<T>(&self, f: impl FnOnce(&P) -> T) -> T {
        self.force(ForceReason::Metadata);
        match &self.repr {
            Repr::Ready(p) => f(p),
            Repr::Lazy(n) => f(&n.value()),
        }
    }
}

impl<P: TensorMetadata + Clone + Send + 'static> TensorMetadata for CTensor<P> {
    fn dtype(&self) -> DType {
        match self.dtype_hint() {
            Some(d) => d,
            None => self.computed_metadata(|p| p.dtype()),
        }
    }
    fn shape(&self) -> Shape {
        match self.shape_hint() {
            Some(s) => s,
            None => self.computed_metadata(|p| p.shape()),
        }
    }
}

impl<P: QTensorPrimitive + TensorMetadata + Clone + Send + 'static> QTensorPrimitive
    for CTensor<P>
{
    fn scheme(&self) -> &burn_backend::quantization::QuantScheme {
        match &self.repr {
            Repr::Ready(p) => p.scheme(),
            // Quantized ops run eagerly, so a quantized tensor is never lazy.
            Repr::Lazy(n) => panic!("lazy tensor: quantized node {} was recorded", n.seq),
        }
    }
    fn acc_precision(&self) -> burn_std::quantization::QuantAcc {
        match &self.repr {
            Repr::Ready(p) => p.acc_precision(),
            Repr::Lazy(n) => panic!("lazy tensor: quantized node {} was recorded", n.seq),
        }
    }
    fn propagation(&self) -> burn_backend::quantization::QuantPropagation {
        match &self.repr {
            Repr::Ready(p) => p.propagation(),
            Repr::Lazy(n) => panic!("lazy tensor: quantized node {} was recorded", n.seq),
        }
    }
    fn default_scheme() -> burn_backend::quantization::QuantScheme {
        P::default_scheme()
    }
}

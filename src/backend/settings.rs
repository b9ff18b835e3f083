//! A rank's device settings passed on to its inner device.
//!
//! Burn keeps each device's default dtypes (`burn_backend::set_default_dtypes`, read with
//! `get_device_settings`) in a registry keyed by the device's type and id. A user of
//! `Collective<I>` sets them on the `CollectiveDevice`; the inner backend, which sees only its
//! own device, reads its own entry wherever Burn's default op bodies pick a dtype the caller
//! did not give: the float dtype a quantized op dequantizes to, the int dtype of `topk`'s and
//! `max_dim`'s indices, the bool dtype of a clamp's mask, the dtypes inside attention and CTC. Without this, a program that
//! sets f16 on its device would get f32 from those ops under `Collective` and f16 without it
//! (Burn's own f16 suite, `quant_scheme_should_inhibit_by_default`, found it).
//!
//! [`inherit_settings`] runs in every op that takes a device (every tensor is made by one, on
//! its device, before any op on it): the first time a thread meets a device it initialises the
//! inner device's entry with the rank's settings. Burn lets an entry be set once; an inner
//! device whose entry is already set (the same device under another rank, or the inner backend
//! used on its own first) keeps it, and a difference is logged (once per thread).

use std::any::TypeId;
use std::cell::RefCell;

use burn_backend::{Backend, Device, DeviceId, get_device_settings, set_default_dtypes};
use hashbrown::HashSet;

use super::{Collective, CollectiveDevice};

thread_local! {
    /// The devices (inner device type and `CollectiveDevice` id) this thread passed on.
    static DONE: RefCell<HashSet<(TypeId, DeviceId)>> = RefCell::new(HashSet::new());
}

/// Gives `device`'s inner device the settings of `device` (see the module doc); a look in a
/// thread-local set after the first call for a device.
pub(crate) fn inherit_settings<I: Backend>(device: &CollectiveDevice<I::Device>) {
    let key = (TypeId::of::<I::Device>(), device.to_id());
    if DONE.with(|d| d.borrow().contains(&key)) {
        return;
    }
    let ours = get_device_settings::<Collective<I>>(device);
    // An entry already set keeps its values; the comparison below says whether they differ.
    let _ = set_default_dtypes::<I>(&device.inner, ours.float_dtype, ours.int_dtype);
    let theirs = get_device_settings::<I>(&device.inner);
    if theirs != ours {
        tracing::warn!(
            "rank {}: the inner device {:?} keeps its default dtypes {theirs:?}, set before this \
             rank's {ours:?}: ops of the inner backend that pick a default dtype use its own",
            device.rank,
            device.inner
        );
    }
    DONE.with(|d| d.borrow_mut().insert(key));
}

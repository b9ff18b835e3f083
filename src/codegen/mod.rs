//! Lowering of an optimized graph to data a runtime executes. Pure: graph in, data out; never a
//! device, a stream or Burn.
//!
//! - [`layout`]: bucket layouts (which gradient sits at which offset of which flat buffer).
//! - [`plan`]: the per-stream step lists one rank runs (compute, pack/unpack kernels, collective
//!   calls, events), with a deterministic text form.
//! - [`kernels`]: the CubeCL definitions of the bucket pack and unpack kernels.
//! - [`launches`]: how a bucket's members are split into kernel launches, and their tables.

pub mod kernels;
pub mod launches;
pub mod layout;
pub mod plan;

pub use plan::{Plan, lower};

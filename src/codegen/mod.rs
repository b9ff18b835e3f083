//! Lowering of an optimized graph to data a runtime executes. Pure: graph in, data out; never a
//! device, a stream or Burn.
//!
//! Today it derives the bucket layouts (which gradient sits at which offset of which flat buffer,
//! in launch order). The per-stream step plan and the CubeCL kernels build on these layouts.

pub mod layout;

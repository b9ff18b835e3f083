//! collective-fusion: a lazy graph compiler for the gradient communication of data-parallel
//! training.
//!
//! The crate records a training step as a graph ([`graph`]), optimizes it at a sync point with
//! passes ([`passes`]): gradient bucketing, start/done splitting, overlap scheduling and fusion of
//! the bucket copies. [`codegen`] lowers the result to a two-stream plan that [`runtime`] executes
//! on ranks. [`profile`] simulates a step under every policy; [`trace`] writes what happened as
//! Chrome trace JSON or SVG. See `ARCHITECTURE.md` for the codemap.
#![warn(missing_docs)]

pub mod backend;
pub mod codegen;
pub mod config;
pub mod cost;
pub mod graph;
pub mod measure;
pub mod model;
pub mod passes;
pub mod profile;
pub mod runtime;
pub mod trace;
pub mod train;

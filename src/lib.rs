//! kvfs: a KV-cache storage layer for LLM inference.
//!
//! Layers, lowest first (imports go downward only): `geometry` (shape and
//! naming), `tier` (backing stores), `gpu` (host/pinned memory, CUDA),
//! `cascade` (T1 over a backing tier), `stats`. See DESIGN.md in the
//! project's shared folder for the whole shape.

pub mod bench;
pub mod cascade;
pub mod client;
pub mod control;
pub mod fs;
pub mod geometry;
pub mod gpu;
pub mod stats;
pub mod tier;

//! Everything CUDA, and the host memory T1 and staging are made of.
//!
//! The only layer that touches the CUDA driver (through cudarc). Rooms:
//! - `host`: `HostBuf`, page-aligned host memory: pinned, portable and
//!   device-mapped (`cuMemHostAlloc`) where a driver is present, plain
//!   anonymous mappings otherwise (zero pages handed out lazily, so a
//!   large T1 costs nothing until used). Callers must not assume which.
//! - `cuda`: the driver, probed without letting cudarc panic where libcuda
//!   is absent; contexts, device memory, streams, IPC memory and events,
//!   and the gather kernel's launch.
//! - `engine`: the GPU transfer engine: batches of resolved copies between
//!   pinned host memory and device memory, with its pools of tables,
//!   staging, streams and events; `restore` and `store` are its API.
//!
//! Nothing here knows of groups' meaning: the cascade resolves which slot
//! or staging bytes a copy reads or writes, and pins them meanwhile.

pub mod cuda;
pub mod engine;
mod host;

pub use host::{HostBuf, huge_vec};

//! Host memory for T1 and staging buffers; later, everything CUDA.
//!
//! This is the only layer that will touch the CUDA driver. Today it owns the
//! host-memory allocator the cascade draws T1 slots and bounce buffers from:
//! page-aligned anonymous mappings, so every slot is aligned for O_DIRECT
//! and the kernel hands out zero pages lazily (a large T1 costs nothing until
//! it is used). The GPU issue swaps pinned `cuMemHostAlloc` memory in behind
//! the same `HostBuf` API; callers must not assume how the memory was made.
//! `cuda` probes for the driver without letting cudarc panic; where there
//! is one, every `HostBuf` is pinned, portable and device-mapped.

pub mod cuda;
mod host;

pub use host::HostBuf;

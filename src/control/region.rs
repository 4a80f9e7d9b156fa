//! Regions: client memory a session may restore into and store from.
//!
//! A host region is a shared mapping of a regular file the client named
//! (opened O_NOFOLLOW, checked against the requesting user's own rights,
//! as the daemon may run as root), entered in the SIGBUS guard so a client
//! that shrinks the file cannot kill the daemon. A CUDA region is another
//! process's device allocation opened through its IPC handle and closed
//! when the region drops. Regions are reference-counted: a job holds the
//! regions of its batch, so UNREGISTER or closing the fd never frees
//! memory a copy still uses.

use super::guard;
use super::wire;
use super::{Rejection, reject};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use wire::NO_ENTRY;

/// A region registered by a client: a shared mapping of its file, or a
/// CUDA allocation of another process opened through its IPC handle.
pub struct Region {
    len: u64,
    /// The host file, or `cuda:DEVICE` for a CUDA region.
    pub path: std::path::PathBuf,
    mem: Memory,
}

enum Memory {
    Host {
        ptr: *mut u8,
        /// Dropped before the mapping (field order): no stale table entry.
        guard: guard::Guard,
        _map: memmap2::MmapMut,
    },
    Cuda {
        /// The region's first byte on the device.
        dptr: u64,
        /// What cuIpcOpenMemHandle returned (closed on drop).
        ipc_base: u64,
        /// The CUDA device the memory is on.
        device: i32,
    },
}

// SAFETY: host regions are shared memory that lives as long as the Region;
// the executor reaches them only through bounds-checked, non-overlapping
// ranges of one request (see `admit_io`). CUDA regions are device
// addresses, touched only by the copy engine and kernels.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        if let Memory::Cuda {
            ipc_base, device, ..
        } = self.mem
            && let Ok(c) = crate::gpu::cuda::cuda_on(device)
        {
            c.close_ipc_mem_later(ipc_base);
        }
    }
}

impl Region {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self.mem, Memory::Cuda { .. })
    }

    /// The CUDA device of a CUDA region.
    pub(super) fn cuda_device(&self) -> Option<i32> {
        match self.mem {
            Memory::Cuda { device, .. } => Some(device),
            Memory::Host { .. } => None,
        }
    }

    /// The device address of byte `offset` of a CUDA region.
    pub(super) fn device_addr(&self, offset: u64) -> Option<u64> {
        match self.mem {
            Memory::Cuda { dptr, .. } => Some(dptr + offset),
            Memory::Host { .. } => None,
        }
    }

    /// The client shrank the region's file under a copy (see `guard`).
    pub fn damaged(&self) -> bool {
        match &self.mem {
            Memory::Host { guard, .. } => guard.damaged(),
            Memory::Cuda { .. } => false,
        }
    }

    fn host_ptr(&self) -> *mut u8 {
        match self.mem {
            Memory::Host { ptr, .. } => ptr,
            Memory::Cuda { .. } => unreachable!("host copies only reach host regions (admission)"),
        }
    }

    /// # Safety
    /// A host region; `offset + len <= self.len()` and no other live slice
    /// covers the range.
    #[expect(clippy::mut_from_ref, reason = "ranges are made disjoint by admission")]
    pub(super) unsafe fn range_mut(&self, offset: u64, len: usize) -> &mut [u8] {
        // SAFETY: in bounds by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.host_ptr().add(offset as usize), len) }
    }

    /// # Safety
    /// A host region; `offset + len <= self.len()`.
    pub(super) unsafe fn range(&self, offset: u64, len: usize) -> &[u8] {
        // SAFETY: in bounds by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.host_ptr().add(offset as usize), len) }
    }
}

impl Region {
    /// Maps `len` bytes of the host file at `path` for a client with
    /// these credentials (REGISTER flags 0).
    pub(super) fn map_host(path: &[u8], len: u64, uid: u32, gid: u32) -> Result<Region, Rejection> {
        let path = std::str::from_utf8(path)
            .map_err(|_| reject(libc::EINVAL, NO_ENTRY, "region path is not UTF-8"))?;
        let p = std::path::Path::new(path);
        if !p.is_absolute() {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("region path {path:?} must be absolute"),
            ));
        }
        if len == 0 {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                "region length must be at least 1 byte",
            ));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(p)
            .map_err(|e| {
                let errno = e.raw_os_error().unwrap_or(libc::EIO);
                let why = if errno == libc::ELOOP {
                    "is a symbolic link".to_string()
                } else {
                    e.to_string()
                };
                reject(
                    errno,
                    NO_ENTRY,
                    format!("cannot open region file {path}: {why}"),
                )
            })?;
        let md = file
            .metadata()
            .map_err(|e| reject(libc::EIO, NO_ENTRY, format!("cannot stat {path}: {e}")))?;
        if !md.file_type().is_file() {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("region {path} is not a regular file"),
            ));
        }
        // The daemon may run as root: check the requester's own rights.
        if uid != 0 {
            let mode = md.mode();
            let bits = if md.uid() == uid {
                (mode >> 6) & 0o7
            } else if md.gid() == gid {
                (mode >> 3) & 0o7
            } else {
                mode & 0o7
            };
            if bits & 0o6 != 0o6 {
                return Err(reject(
                    libc::EACCES,
                    NO_ENTRY,
                    format!("uid {uid} may not read and write {path}"),
                ));
            }
        }
        if md.len() < len {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "region file {path} is {} bytes, shorter than the length {len}",
                    md.len()
                ),
            ));
        }
        if len > isize::MAX as u64 {
            return Err(reject(libc::EINVAL, NO_ENTRY, "region length too large"));
        }
        // SAFETY: a shared mapping of a regular file we just checked; the
        // client may change the bytes at any time, which the daemon treats
        // as data, never as structure.
        let map = unsafe { memmap2::MmapOptions::new().len(len as usize).map_mut(&file) }.map_err(
            |e| {
                reject(
                    e.raw_os_error().unwrap_or(libc::EIO),
                    NO_ENTRY,
                    format!("cannot map {path}: {e}"),
                )
            },
        )?;
        let ptr = map.as_ptr() as *mut u8;
        let guard = guard::Guard::new(ptr as usize, len as usize).ok_or_else(|| {
            reject(
                libc::ENOSPC,
                NO_ENTRY,
                format!("too many regions registered (at most {})", guard::SLOTS),
            )
        })?;
        Ok(Region {
            len,
            path: p.to_path_buf(),
            mem: Memory::Host {
                ptr,
                guard,
                _map: map,
            },
        })
    }

    /// Opens a CUDA allocation (REGISTER flags 1): payload = IPC memory
    /// handle (64 bytes), offset into the allocation (u64), device ordinal
    /// (u32), pad.
    pub(super) fn open_cuda(payload: &[u8], len: u64) -> Result<Region, Rejection> {
        if crate::gpu::cuda::cuda().is_none() {
            return Err(reject(
                libc::ENODEV,
                NO_ENTRY,
                format!(
                    "{}: CUDA regions are unavailable",
                    crate::gpu::cuda::unavailable_reason()
                ),
            ));
        }
        if payload.len() != wire::CUDA_REGISTER_BYTES {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "a CUDA REGISTER carries {} bytes (IPC handle, offset, device, pad), got {}",
                    wire::CUDA_REGISTER_BYTES,
                    payload.len()
                ),
            ));
        }
        let mut handle = [0u8; 64];
        handle.copy_from_slice(&payload[..64]);
        let offset = u64::from_le_bytes(payload[64..72].try_into().expect("8 bytes"));
        let device = u32::from_le_bytes(payload[72..76].try_into().expect("4 bytes"));
        // Any device the driver reports, in that device's own context.
        let c = i32::try_from(device)
            .map_err(|_| format!("CUDA device {device}: no such device"))
            .and_then(crate::gpu::cuda::cuda_on)
            .map_err(|e| reject(libc::ENODEV, NO_ENTRY, e))?;
        if len == 0 {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                "region length must be at least 1 byte",
            ));
        }
        let (base, avail) = c.open_ipc_mem(&handle).map_err(|e| {
            reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("cannot open the CUDA IPC handle: {e}"),
            )
        })?;
        let region = Region {
            len,
            path: format!("cuda:{device}").into(),
            mem: Memory::Cuda {
                dptr: base + offset,
                ipc_base: base,
                device: c.device,
            },
        };
        if offset.checked_add(len).is_none_or(|end| end > avail) {
            return Err(reject(
                libc::EFAULT,
                NO_ENTRY,
                format!(
                    "bytes {offset}..{} lie outside the CUDA allocation ({avail} bytes)",
                    offset.saturating_add(len)
                ),
            ));
        }
        Ok(region)
    }
}

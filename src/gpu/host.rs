//! `HostBuf`: page-aligned host memory that never moves, pinned and
//! device-mapped where a CUDA driver is present (see the module note).

use std::io;
use std::ptr::NonNull;

/// Page size assumed for alignment (O_DIRECT needs at most this).
const PAGE: usize = 4096;

/// Buffers this large ask for transparent huge pages: fewer TLB misses and
/// fewer pages to pin per O_DIRECT transfer or GPU copy.
const HUGE_PAGE: usize = 2 << 20;

/// A page-aligned, zero-initialised host allocation that never moves.
///
/// Its address is stable for its whole life, so raw pointers into it may be
/// handed to io_uring (and later to the GPU copy engine) while it lives.
pub struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Where the GPU sees this memory, when it is pinned and mapped.
    device: Option<u64>,
    /// What the allocator returned, where `ptr` had to be aligned up from it.
    base: *mut u8,
}

// SAFETY: HostBuf owns its mapping exclusively; shared access goes through
// `&self` methods that hand out raw pointers whose use the callers
// synchronise (the cascade's slot locks), or `&mut self` for exclusive use.
unsafe impl Send for HostBuf {}
// SAFETY: see `Send`; `&HostBuf` only exposes the pointer and length.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// `len` bytes of zeroed memory: pinned and mapped for the GPU where
    /// a CUDA driver is present, plain page-aligned memory otherwise.
    pub fn alloc(len: usize) -> io::Result<HostBuf> {
        match super::cuda::cuda() {
            Some(c) if len > 0 => {
                // The driver promises no alignment: ask for a page more and
                // align up, so O_DIRECT transfers into it always work.
                let (base, d) = c.alloc_pinned(len + PAGE).map_err(io::Error::other)?;
                let skip = (PAGE - base as usize % PAGE) % PAGE;
                // SAFETY: skip < PAGE, so [base+skip, base+skip+len) lies in
                // the len + PAGE bytes just allocated.
                let p = unsafe { base.add(skip) };
                // SAFETY: as above.
                unsafe { std::ptr::write_bytes(p, 0, len) };
                let ptr = NonNull::new(p)
                    .ok_or_else(|| io::Error::other("cuMemHostAlloc returned null"))?;
                Ok(HostBuf {
                    ptr,
                    len,
                    device: Some(d + skip as u64),
                    base,
                })
            }
            _ => HostBuf::alloc_plain(len),
        }
    }

    /// The device pointer of a pinned, mapped buffer.
    pub fn device_ptr(&self) -> Option<u64> {
        self.device
    }

    /// `len` bytes (rounded up to a page) of zeroed, page-aligned plain memory.
    pub fn alloc_plain(len: usize) -> io::Result<HostBuf> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot allocate an empty host buffer",
            ));
        }
        // SAFETY: an anonymous private mapping with no address hint touches no
        // existing memory; the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        if len >= HUGE_PAGE {
            // SAFETY: advice on the mapping just made; failure is harmless
            // (transparent huge pages may be off).
            unsafe {
                libc::madvise(p, len, libc::MADV_HUGEPAGE);
            }
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(HostBuf {
            ptr,
            len,
            device: None,
            base: p.cast(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes that live as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `&mut self` gives exclusive access to the `len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        if self.device.is_some() {
            if let Some(c) = super::cuda::cuda() {
                // SAFETY: pinned by alloc_pinned; the owner is gone.
                unsafe { c.free_pinned(self.base, self.len + PAGE) };
            }
            return;
        }
        // SAFETY: ptr/len are exactly what mmap returned and nothing borrows
        // them once the owner is dropped.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = HostBuf::alloc(3 * 4096 + 1).unwrap();
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[5] = 7;
        assert_eq!(b.as_slice()[5], 7);
        assert!(HostBuf::alloc(0).is_err());
    }
}

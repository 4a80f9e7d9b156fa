use std::io;
use std::ptr::NonNull;

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
}

// SAFETY: HostBuf owns its mapping exclusively; shared access goes through
// `&self` methods that hand out raw pointers whose use the callers
// synchronise (the cascade's slot locks), or `&mut self` for exclusive use.
unsafe impl Send for HostBuf {}
// SAFETY: see `Send`; `&HostBuf` only exposes the pointer and length.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    /// Maps `len` bytes (rounded up to a page) of zeroed memory.
    pub fn alloc(len: usize) -> io::Result<HostBuf> {
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
        Ok(HostBuf { ptr, len })
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

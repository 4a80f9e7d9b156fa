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
    /// Who allocated it, so who frees it.
    from: From,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum From {
    /// `mmap`, `len` bytes at `ptr`.
    Plain,
    /// The driver (`cuMemHostAlloc`), `len + PAGE` bytes at `base`.
    Driver,
    /// `mmap` of `len + HUGE_PAGE` bytes at `base`, huge pages asked
    /// for, `len` bytes at `ptr` registered with the driver.
    Registered,
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
                    from: From::Driver,
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
            from: From::Plain,
        })
    }

    /// `alloc` on transparent huge pages where the system gives them:
    /// plain memory aligned to 2 MiB, advised huge, then pinned and mapped
    /// by registering it with the driver. The GPU then reaches scattered
    /// slots of it through far fewer page-table entries than through the
    /// driver's own allocation. Falls back to `alloc` (which also serves
    /// machines with no driver) where registering fails.
    pub fn alloc_huge(len: usize) -> io::Result<HostBuf> {
        let Some(c) = super::cuda::cuda() else {
            return HostBuf::alloc(len);
        };
        if len < HUGE_PAGE {
            return HostBuf::alloc(len);
        }
        let whole = len + HUGE_PAGE;
        // SAFETY: a fresh anonymous private mapping, checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                whole,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return HostBuf::alloc(len);
        }
        let skip = (HUGE_PAGE - base as usize % HUGE_PAGE) % HUGE_PAGE;
        // SAFETY: skip < HUGE_PAGE, so [p, p + len) lies in the mapping.
        let p = unsafe { base.cast::<u8>().add(skip) };
        // SAFETY: advice on the mapping just made; failure is harmless.
        unsafe { libc::madvise(p.cast(), len, libc::MADV_HUGEPAGE) };
        match c.register_pinned(p, len) {
            Ok(d) => Ok(HostBuf {
                ptr: NonNull::new(p).ok_or_else(|| io::Error::other("mmap returned null"))?,
                len,
                device: Some(d),
                base: base.cast(),
                from: From::Registered,
            }),
            Err(e) => {
                tracing::warn!("huge-page T1 chunk not pinned ({e}): the driver allocates it");
                // SAFETY: the mapping just made, used by nothing.
                unsafe { libc::munmap(base, whole) };
                HostBuf::alloc(len)
            }
        }
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

/// `n` values from `f`, in memory that asks for transparent huge pages
/// before anything is written to it: for large tables read at scattered
/// places (T1's per-slot records, its group map), where with 4 KiB pages
/// nearly every access also misses the TLB.
pub fn huge_vec<T>(n: usize, f: impl FnMut(usize) -> T) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge(v.as_ptr().cast(), n * std::mem::size_of::<T>());
    v.extend((0..n).map(f));
    v
}

/// Asks for transparent huge pages over the whole huge pages inside
/// `[p, p + bytes)`, memory of an allocation the caller owns. Advice only:
/// it changes no contents, and failure is harmless (huge pages may be off).
fn advise_huge(p: *const u8, bytes: usize) {
    if bytes < 2 * HUGE_PAGE {
        return;
    }
    let start = (p as usize).next_multiple_of(HUGE_PAGE);
    let end = (p as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: advice on pages of the caller's allocation (see above).
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        match self.from {
            From::Driver => {
                if let Some(c) = super::cuda::cuda() {
                    // SAFETY: pinned by alloc_pinned; the owner is gone.
                    unsafe { c.free_pinned(self.base, self.len + PAGE) };
                }
            }
            From::Registered => {
                if let Some(c) = super::cuda::cuda() {
                    // SAFETY: registered by alloc_huge; the owner is gone.
                    unsafe { c.unregister_pinned(self.ptr.as_ptr(), self.len) };
                }
                // SAFETY: the mapping alloc_huge made; nothing uses it now.
                unsafe { libc::munmap(self.base.cast(), self.len + HUGE_PAGE) };
            }
            // SAFETY: ptr/len are exactly what mmap returned and nothing
            // borrows them once the owner is dropped.
            From::Plain => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            },
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

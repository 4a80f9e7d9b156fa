//! The CUDA driver, found at run time or not at all.
//!
//! cudarc (dynamic loading) panics on first use where libcuda is absent, so
//! `probe` first opens the library itself with libloading, under the names
//! cudarc will try, and only then initialises the driver through cudarc.
//! Without a driver (or without a device) kvfs runs on plain host memory
//! and says so once. The primary context of device 0 is retained for the
//! process and made current on each thread before a driver call.

use cudarc::driver::{result, sys};
use std::sync::OnceLock;

/// The driver and the device kvfs pins its memory for.
pub struct Cuda {
    ctx: sys::CUcontext,
    pub device: i32,
    pub name: String,
}

// SAFETY: a CUcontext handle may be made current on any thread; the
// primary context is retained for the life of the process.
unsafe impl Send for Cuda {}
// SAFETY: as for Send; the handle is never mutated.
unsafe impl Sync for Cuda {}

static CUDA: OnceLock<Option<Cuda>> = OnceLock::new();

/// Names under which cudarc looks for the driver (a subset that covers Linux).
const LIB_NAMES: [&str; 2] = ["libcuda.so", "libcuda.so.1"];

fn library_present() -> bool {
    LIB_NAMES.iter().any(|n| {
        // SAFETY: loading the CUDA driver library runs its initialisers,
        // which is what using CUDA at all requires; the handle is dropped.
        unsafe { libloading::Library::new(*n) }.is_ok()
    })
}

fn init() -> Result<Cuda, String> {
    if !library_present() {
        return Err(format!(
            "no CUDA driver was found ({} not loadable)",
            LIB_NAMES.join(", ")
        ));
    }
    result::init().map_err(|e| format!("the CUDA driver did not initialise: {e:?}"))?;
    let n = result::device::get_count().map_err(|e| format!("cannot count CUDA devices: {e:?}"))?;
    if n < 1 {
        return Err("the CUDA driver sees no device".into());
    }
    let dev = result::device::get(0).map_err(|e| format!("cannot open CUDA device 0: {e:?}"))?;
    let name = result::device::get_name(dev).unwrap_or_else(|_| "?".into());
    // SAFETY: dev came from device::get.
    let ctx = unsafe { result::primary_ctx::retain(dev) }
        .map_err(|e| format!("cannot retain the context: {e:?}"))?;
    Ok(Cuda {
        ctx,
        device: 0,
        name,
    })
}

/// The CUDA driver, probed once; None (logged once) where there is none.
pub fn cuda() -> Option<&'static Cuda> {
    CUDA.get_or_init(|| match init() {
        Ok(c) => {
            tracing::info!(
                "CUDA device {} ({}): T1 and staging buffers are pinned",
                c.device,
                c.name
            );
            Some(c)
        }
        Err(why) => {
            tracing::info!("{why}: T1 stays in plain host memory; CUDA regions are unavailable");
            None
        }
    })
    .as_ref()
}

/// Why CUDA work cannot be done here, for error messages.
pub fn unavailable_reason() -> &'static str {
    "no CUDA driver was found on this machine"
}

impl Cuda {
    /// Makes the context current on this thread.
    pub fn bind(&self) -> Result<(), String> {
        // SAFETY: ctx is the retained primary context.
        unsafe { result::ctx::set_current(self.ctx) }
            .map_err(|e| format!("cannot bind the CUDA context: {e:?}"))
    }

    /// Pinned, portable, device-mapped host memory: (host pointer, device pointer).
    pub fn alloc_pinned(&self, len: usize) -> Result<(*mut u8, u64), String> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of len bytes; released by free_pinned.
        let p = unsafe { result::malloc_host(len, flags) }
            .map_err(|e| format!("cuMemHostAlloc({len}): {e:?}"))?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: p is mapped (DEVICEMAP) memory just allocated.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: p came from malloc_host and is not used elsewhere.
            unsafe {
                let _ = result::free_host(p);
            }
            return Err(format!("cuMemHostGetDevicePointer: {r:?}"));
        }
        Ok((p.cast(), d))
    }

    /// # Safety
    /// `p` came from `alloc_pinned` and nothing uses it any more.
    pub unsafe fn free_pinned(&self, p: *mut u8) {
        if self.bind().is_ok() {
            // SAFETY: the caller's contract.
            unsafe {
                let _ = result::free_host(p.cast());
            }
        }
    }
}

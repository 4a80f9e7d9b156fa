//! Survives clients that shrink a registered region's file.
//!
//! A region is a shared mapping of a client's file; if the client truncates
//! the file, the daemon's next copy into or out of the lost pages raises
//! SIGBUS, which would kill the daemon and every other client with it. A
//! SIGBUS handler looks the faulting address up in a lock-free table of
//! region ranges; inside one, it maps a private zero page over the faulting
//! page (so the copy completes harmlessly) and marks the region damaged:
//! the ticket's entries on that region fail with EFAULT and later requests
//! naming it are refused. A fault outside every region restores the default
//! action and re-faults: a real bug still crashes loudly.

use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Regions registered at once, across all sessions.
pub const SLOTS: usize = 4096;

static START: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static END: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static DAMAGED: [AtomicBool; SLOTS] = [const { AtomicBool::new(false) }; SLOTS];
static INSTALL: Once = Once::new();

/// A region's entry in the table; removed on drop.
pub struct Guard {
    slot: usize,
}

impl Guard {
    /// Enters `[start, start+len)`; None when the table is full.
    pub fn new(start: usize, len: usize) -> Option<Guard> {
        INSTALL.call_once(install);
        for slot in 0..SLOTS {
            if START[slot]
                .compare_exchange(0, start, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                DAMAGED[slot].store(false, Ordering::Release);
                END[slot].store(start + len, Ordering::Release);
                return Some(Guard { slot });
            }
        }
        None
    }

    /// Whether a copy touched pages the file no longer has.
    pub fn damaged(&self) -> bool {
        DAMAGED[self.slot].load(Ordering::Acquire)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        END[self.slot].store(0, Ordering::Release);
        START[self.slot].store(0, Ordering::Release);
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in 0..SLOTS {
        let (s, e) = (
            START[slot].load(Ordering::Acquire),
            END[slot].load(Ordering::Acquire),
        );
        if s != 0 && s <= addr && addr < e {
            let page = addr & !4095;
            // SAFETY: replaces one page inside a region mapping this process
            // owns with a private zero page; mmap is async-signal-safe.
            unsafe {
                libc::mmap(
                    page as *mut libc::c_void,
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
            }
            DAMAGED[slot].store(true, Ordering::Release);
            return;
        }
    }
    // Not a region: let the default action happen on the retried access.
    // SAFETY: signal(2) is async-signal-safe.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
    }
}

fn install() {
    // SAFETY: installs a handler whose body only reads atomics and calls
    // async-signal-safe functions.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

//! Done words: a RESTORE into CUDA regions may name one (`wire::done_word`,
//! RESTORE `arg0` bits 16–31), a u64 of the fd's done-word region (REGISTER
//! flags `REGISTER_CUDA | REGISTER_DONE_WORDS`, device memory of the
//! client's). The ticket's stream writes the ticket number into it right
//! after the copy, before the ticket's IPC event: a client's stream waits
//! on the word (`cuStreamWaitValue64`, GEQ the ticket) instead of on the
//! IPC event, whose cross-process wait cost about 0.27 ms a ticket on an
//! H100. A word serves one running ticket at a time (the ticket numbers
//! of a fd only grow, so GEQ cannot be met by an older ticket's write).

use super::region::Region;
use super::session::Session;
use super::wire::{Command, NO_ENTRY, Reply};
use super::{Rejection, reject};
use crate::gpu::cuda::Signal;
use std::sync::Arc;

/// A done word claimed for a ticket: the region, held until the word is
/// written (the ticket's completion drops it), and the word's device
/// address.
pub(super) struct DoneWord {
    _region: Arc<Region>,
    pub(super) addr: u64,
}

impl DoneWord {
    /// What the copy of `ticket` writes, if it names a done word.
    pub(super) fn signal(done: Option<&DoneWord>, ticket: u64) -> Signal {
        done.map(|d| (d.addr, ticket))
    }
}

impl Session {
    /// REGISTER flags 3: this fd's done words, a CUDA allocation of u64s.
    pub(super) fn register_done_words(&self, payload: &[u8], len: u64) -> Result<Reply, Rejection> {
        if let Some((id, _)) = &self.st.lock().done_words {
            return Err(reject(
                libc::EBUSY,
                NO_ENTRY,
                format!("this fd has done words already (region {id}); UNREGISTER them first"),
            ));
        }
        let region = Region::open_cuda(payload, len)?;
        if len < 8 || !len.is_multiple_of(8) {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "done words are u64s: the region's length must be a multiple of 8 bytes, at least 8 (got {len})"
                ),
            ));
        }
        let addr = region.device_addr(0).expect("a CUDA region");
        if addr % 8 != 0 {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("done words must be 8-byte aligned (device address {addr:#x})"),
            ));
        }
        let device = region.cuda_device().expect("a CUDA region");
        let c = crate::gpu::cuda::cuda_on(device).map_err(|e| reject(libc::ENODEV, NO_ENTRY, e))?;
        if !c.has_u64_stream_words() {
            return Err(reject(
                libc::EOPNOTSUPP,
                NO_ENTRY,
                format!(
                    "CUDA device {device} cannot write 64-bit words from a stream (no 64-bit stream memory operations)"
                ),
            ));
        }
        let region = Arc::new(region);
        let id = self.add_region(region.clone());
        let mut st = self.st.lock();
        if st.done_words.is_some() {
            // Another REGISTER of this fd got there meanwhile.
            st.regions.remove(&id);
            return Err(reject(
                libc::EBUSY,
                NO_ENTRY,
                "this fd has done words already; UNREGISTER them first",
            ));
        }
        st.done_words = Some((id, region));
        let mut r = Reply::ok(Command::Register, id as u64);
        r.message = format!("done words: {}", (len / 8).min(u16::MAX as u64));
        Ok(r)
    }

    /// Claims done word `word` for `ticket`, a RESTORE whose copies are on
    /// CUDA device `device`: until the ticket ends, no other ticket may
    /// name it.
    pub(super) fn claim_done_word(
        &self,
        word: u16,
        ticket: u64,
        device: i32,
    ) -> Result<DoneWord, Rejection> {
        let mut st = self.st.lock();
        let Some((id, region)) = &st.done_words else {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "the RESTORE names done word {word}, but this fd has no done words (REGISTER flags 3)"
                ),
            ));
        };
        let words = region.len() / 8;
        if word as u64 >= words {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!("done word {word}: this fd has {words} (region {id})"),
            ));
        }
        let on = region.cuda_device().expect("a CUDA region");
        if on != device {
            return Err(reject(
                libc::EINVAL,
                NO_ENTRY,
                format!(
                    "the done words are on CUDA device {on}, this RESTORE's copies on device {device}"
                ),
            ));
        }
        let addr = region.device_addr(word as u64 * 8).expect("a CUDA region");
        let region = region.clone();
        if let Some(t) = st.done_busy.get(&word) {
            return Err(reject(
                libc::EBUSY,
                NO_ENTRY,
                format!(
                    "done word {word} is still to be written by ticket {t} (a word serves one running ticket at a time)"
                ),
            ));
        }
        st.done_busy.insert(word, ticket);
        Ok(DoneWord {
            _region: region,
            addr,
        })
    }
}

//! Rust client of the control file (engines, tests, benches).
//!
//! Speaks only the wire format (`control::wire`). Small requests whose
//! reply fits go by one ioctl(2); larger ones by write(2) of the request
//! and read(2) of its reply, serialised per client so replies pair with
//! their requests. A failed request or ticket is a `ClientError` carrying
//! the errno, the offending entry and the daemon's message.

use crate::control::wire::{
    self, Command, HEADER_BYTES, IoEntry, MAX_IOCTL_BYTES, MountLayout, RawKey, Reply, Request,
    STATE_ENTRY_BYTES, StateEntry,
};
use crate::geometry::GroupKey;
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{message} (errno {errno}{})", entry_note(message, *entry))]
    Refused {
        errno: i32,
        entry: Option<u32>,
        message: String,
    },
    #[error("control file I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad reply from kvfs: {0}")]
    Protocol(String),
}

/// ", entry N" for a refusal naming entry N, unless its message already
/// begins with "entry N:" (the daemon's messages about one entry do).
fn entry_note(message: &str, entry: Option<u32>) -> String {
    match entry {
        Some(e) if !message.starts_with(&format!("entry {e}:")) => format!(", entry {e}"),
        _ => String::new(),
    }
}

impl ClientError {
    pub fn errno(&self) -> Option<i32> {
        match self {
            ClientError::Refused { errno, .. } => Some(*errno),
            ClientError::Io(e) => e.raw_os_error(),
            ClientError::Protocol(_) => None,
        }
    }
}

/// How requests travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// ioctl(2) where the request and reply fit, write/read otherwise.
    Auto,
    /// Always write(2) then read(2).
    WriteRead,
}

/// A finished ticket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub ticket: u64,
    pub status: i32,
    pub failed: u32,
    pub first_failed: Option<u32>,
    pub message: String,
}

pub struct Client {
    file: File,
    transport: Transport,
    /// Serialises write/read pairs.
    stream: Mutex<()>,
}

/// Makes the region file `path` of `len` zero bytes, mode 0600, if it
/// does not exist; an existing file is left as it is.
fn create_region_file(path: &Path, len: u64) -> Result<(), ClientError> {
    use std::os::unix::fs::OpenOptionsExt;
    let failed = |e: std::io::Error| ClientError::Refused {
        errno: e.raw_os_error().unwrap_or(libc::EIO),
        entry: None,
        message: format!("cannot make region file {}: {e}", path.display()),
    };
    match OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f.set_len(len).map_err(|e| {
            let _ = std::fs::remove_file(path);
            failed(e)
        }),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(failed(e)),
    }
}

fn check(r: Reply) -> Result<Reply, ClientError> {
    if r.status != 0 {
        return Err(ClientError::Refused {
            errno: r.status as i32,
            entry: (r.entry != wire::NO_ENTRY).then_some(r.entry),
            message: r.message,
        });
    }
    Ok(r)
}

impl Client {
    /// Opens `MOUNT/.kvfs/control`.
    pub fn open(mount: &Path) -> Result<Client, ClientError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(mount.join(".kvfs/control"))?;
        Ok(Client {
            file,
            transport: Transport::Auto,
            stream: Mutex::new(()),
        })
    }

    pub fn with_transport(mut self, t: Transport) -> Client {
        self.transport = t;
        self
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    /// Sends raw request bytes by write(2) and reads one reply.
    pub fn call_bytes(&self, req: &[u8]) -> Result<Reply, ClientError> {
        let _one = self.stream.lock();
        (&self.file).write_all(req)?;
        self.read_reply()
    }

    /// Reads one output item (a reply or a completion record).
    pub fn read_reply(&self) -> Result<Reply, ClientError> {
        let mut buf = Vec::with_capacity(64 << 10);
        let mut need = HEADER_BYTES + 4;
        let mut chunk = vec![0u8; 128 << 10];
        loop {
            while buf.len() < need {
                let want = (need - buf.len()).max(4096).min(chunk.len());
                let n = (&self.file).read(&mut chunk[..want])?;
                buf.extend_from_slice(&chunk[..n]);
            }
            let count = u32::from_le_bytes(buf[12..16].try_into().expect("4 bytes")) as usize;
            let states_end = HEADER_BYTES + count * STATE_ENTRY_BYTES;
            if buf.len() < states_end + 4 {
                need = states_end + 4;
                continue;
            }
            let msg =
                u32::from_le_bytes(buf[states_end..states_end + 4].try_into().expect("4 bytes"))
                    as usize;
            let total = states_end + 4 + msg;
            if buf.len() < total {
                need = total;
                continue;
            }
            let (r, n) = Reply::decode(&buf).map_err(ClientError::Protocol)?;
            if n != buf.len() {
                return Err(ClientError::Protocol(format!(
                    "read {} bytes past a {n}-byte reply",
                    buf.len() - n
                )));
            }
            return Ok(r);
        }
    }

    /// Sends one request by ioctl(2) with a buffer of `len` bytes.
    pub fn ioctl_bytes(&self, req: &[u8], len: usize) -> Result<Reply, ClientError> {
        let mut buf = vec![0u8; len.max(req.len())];
        buf[..req.len()].copy_from_slice(req);
        // SAFETY: the buffer is as long as the size encoded in the command,
        // which is what the kernel copies in and out.
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                wire::ioctl_cmd(buf.len()) as _,
                buf.as_mut_ptr(),
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(Reply::decode(&buf).map_err(ClientError::Protocol)?.0)
    }

    fn call(&self, req: &Request, reply_entries: usize) -> Result<Reply, ClientError> {
        let bytes = wire::encode_request(req);
        // Room for the reply: header, states, and a message of any length we write.
        let reply_len = HEADER_BYTES + reply_entries * STATE_ENTRY_BYTES + 4 + 1024;
        let len = bytes.len().max(reply_len);
        if self.transport == Transport::Auto && len <= MAX_IOCTL_BYTES {
            return check(self.ioctl_bytes(&bytes, len)?);
        }
        check(self.call_bytes(&bytes)?)
    }

    /// Protocol version and the geometry as JSON.
    pub fn hello(&self) -> Result<(u64, String), ClientError> {
        let r = self.call(&Request::Hello, 0)?;
        Ok((r.value, r.message))
    }

    /// The mount's shape, from HELLO.
    pub fn layout(&self) -> Result<MountLayout, ClientError> {
        let (_, json) = self.hello()?;
        MountLayout::from_json(&json)
            .map_err(|e| ClientError::Protocol(format!("HELLO's layout: {e}")))
    }

    /// Registers `len` bytes of a regular file (e.g. in /dev/shm) as a
    /// region of this fd. A file that does not exist yet is made (mode
    /// 0600, `len` bytes of zeros); an existing one is used as it is (never
    /// truncated or grown: one shorter than `len` is refused).
    pub fn register_host_region(&self, path: &Path, len: u64) -> Result<u32, ClientError> {
        let path = std::path::absolute(path).map_err(|e| ClientError::Refused {
            errno: libc::EINVAL,
            entry: None,
            message: format!("region path {}: {e}", path.display()),
        })?;
        create_region_file(&path, len)?;
        let path = path.as_os_str().as_encoded_bytes().to_vec();
        let r = self.call(
            &Request::Register {
                path,
                len,
                flags: 0,
            },
            0,
        )?;
        Ok(r.value as u32)
    }

    /// Registers `len` bytes at `offset` of a CUDA allocation named by its
    /// IPC memory handle (cuIpcGetMemHandle), on `device`.
    pub fn register_cuda_region(
        &self,
        handle: &[u8; 64],
        len: u64,
        device: u32,
        offset: u64,
    ) -> Result<u32, ClientError> {
        let mut path = handle.to_vec();
        path.extend_from_slice(&offset.to_le_bytes());
        path.extend_from_slice(&device.to_le_bytes());
        path.extend_from_slice(&0u32.to_le_bytes());
        let r = self.call(
            &Request::Register {
                path,
                len,
                flags: wire::REGISTER_CUDA,
            },
            0,
        )?;
        Ok(r.value as u32)
    }

    pub fn unregister(&self, region: u32) -> Result<(), ClientError> {
        self.call(&Request::Unregister { region }, 0).map(|_| ())
    }

    /// Starts restoring groups into regions; returns the ticket.
    pub fn restore(&self, entries: &[(GroupKey, u32, u64)]) -> Result<u64, ClientError> {
        Ok(self.call(&Request::Restore(io_entries(entries)), 0)?.value)
    }

    /// Starts storing region bytes as groups; returns the ticket.
    pub fn store(&self, entries: &[(GroupKey, u32, u64)]) -> Result<u64, ClientError> {
        Ok(self.call(&Request::Store(io_entries(entries)), 0)?.value)
    }

    /// `restore` with strided entries (an engine's interleaved layout).
    pub fn restore_strided(&self, entries: &[Strided]) -> Result<u64, ClientError> {
        Ok(self
            .call(&Request::RestoreStrided(strided_entries(entries)), 0)?
            .value)
    }

    /// `store` with strided entries.
    pub fn store_strided(&self, entries: &[Strided]) -> Result<u64, ClientError> {
        Ok(self
            .call(&Request::StoreStrided(strided_entries(entries)), 0)?
            .value)
    }

    pub fn query(&self, keys: &[GroupKey]) -> Result<Vec<StateEntry>, ClientError> {
        let keys = keys.iter().map(|k| RawKey::from_key(*k)).collect();
        Ok(self.call(&Request::Query(keys), 0)?.states)
    }

    /// Starts bringing groups into T1; returns the ticket.
    pub fn prefetch(&self, keys: &[GroupKey]) -> Result<u64, ClientError> {
        let keys = keys.iter().map(|k| RawKey::from_key(*k)).collect();
        Ok(self.call(&Request::Prefetch(keys), 0)?.value)
    }

    /// Waits for a ticket; an error if it failed (or timed out).
    pub fn wait(&self, ticket: u64, timeout: Option<Duration>) -> Result<Completion, ClientError> {
        let timeout_ms = timeout.map(|d| d.as_millis() as u64).unwrap_or(u64::MAX);
        let r = self.call(&Request::Wait { ticket, timeout_ms }, 0)?;
        Ok(completion(r))
    }

    /// Reads the next completion record (blocks; use poll(2) on `fd()` to
    /// wait without blocking). Only valid when no write/read request is
    /// outstanding on this client.
    pub fn next_completion(&self) -> Result<Completion, ClientError> {
        let _one = self.stream.lock();
        let r = self.read_reply()?;
        if r.command != Command::Completion as u16 {
            return Err(ClientError::Protocol(format!(
                "expected a completion record, got command {}",
                r.command
            )));
        }
        Ok(completion(r))
    }
}

fn completion(r: Reply) -> Completion {
    Completion {
        ticket: r.value,
        status: r.status as i32,
        failed: r.failed,
        first_failed: (r.entry != wire::NO_ENTRY).then_some(r.entry),
        message: r.message,
    }
}

fn io_entries(entries: &[(GroupKey, u32, u64)]) -> Vec<IoEntry> {
    entries
        .iter()
        .map(|&(k, region, offset)| IoEntry::new(RawKey::from_key(k), region, offset))
        .collect()
}

/// A RESTORE/STORE entry whose group lies strided in its region: `rows =
/// group_bytes / row_bytes` runs of `row_bytes`, `pitch` bytes apart, the
/// first at `offset` (see `wire::ENTRIES_STRIDED`). `row_bytes` 0, or the
/// group's size, is a contiguous group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub key: GroupKey,
    pub region: u32,
    pub offset: u64,
    pub row_bytes: u32,
    pub pitch: u64,
}

fn strided_entries(entries: &[Strided]) -> Vec<IoEntry> {
    entries
        .iter()
        .map(|e| IoEntry {
            key: RawKey::from_key(e.key),
            region: e.region,
            offset: e.offset,
            row_bytes: e.row_bytes,
            pitch: e.pitch,
        })
        .collect()
}

impl Completion {
    /// The completion as a Result: Err when any entry failed.
    pub fn ok(self) -> Result<Completion, ClientError> {
        if self.status != 0 {
            return Err(ClientError::Refused {
                errno: self.status,
                entry: self.first_failed,
                message: self.message,
            });
        }
        Ok(self)
    }
}

/// A completion entry of a ring (see `control::ring`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingCompletion {
    pub user_data: u64,
    /// 0 when the submission was refused.
    pub ticket: u64,
    /// 0 or an errno.
    pub status: i32,
    pub first_failed: Option<u32>,
    pub failed: u32,
}

/// A client's submission/completion ring (`Client::ring`): RESTORE and
/// STORE through shared memory, no system call while the daemon is busy.
/// Entries are written into the ring's data area (`put_entries`) and
/// named by their offset there, so a batch encoded once can be submitted
/// again and again.
pub struct RingClient {
    map: memmap2::MmapMut,
    _file: File,
    region: u32,
    entries: u32,
    data_at: usize,
    sq_tail: u32,
    cq_head: u32,
}

use crate::control::ring::{
    CQ_HEAD, CQ_TAIL, CQ_WAITING, CQE_BYTES, RING_HEADER_BYTES, SQ_HEAD, SQ_SLEEPING, SQ_TAIL,
    SQE_BYTES, futex, ring_bytes, spare_cores,
};
use std::sync::atomic::{AtomicU32, Ordering as AtomicOrdering};

impl Client {
    /// Sets up this fd's ring: `entries` (a power of two) submission and
    /// completion slots, and `data_bytes` of room for entries, in a new
    /// file under `dir` (e.g. /dev/shm), registered as a region.
    pub fn ring(
        &self,
        dir: &Path,
        entries: u32,
        data_bytes: u64,
    ) -> Result<RingClient, ClientError> {
        let data_at = ring_bytes(entries);
        let len = data_at + data_bytes;
        // Named while the daemon opens it, then unlinked (both keep their mappings).
        let named = tempfile::Builder::new()
            .prefix("kvfs-ring-")
            .tempfile_in(dir)?;
        named.as_file().set_len(len)?;
        // SAFETY: a file of ours, mapped shared; the daemon maps it too.
        let map = unsafe { memmap2::MmapMut::map_mut(named.as_file())? };
        let region = self.register_host_region(named.path(), len)?;
        let file = named.into_file();
        self.call(
            &Request::Ring {
                region,
                offset: 0,
                entries,
            },
            0,
        )?;
        Ok(RingClient {
            map,
            _file: file,
            region,
            entries,
            data_at: data_at as usize,
            sq_tail: 0,
            cq_head: 0,
        })
    }
}

/// How long `RingClient::reap` looks for completions before it sleeps.
const REAP_SPIN: Duration = Duration::from_millis(1);

impl RingClient {
    fn word(&self, at: usize) -> &AtomicU32 {
        // SAFETY: a 4-aligned header word of the page-aligned mapping.
        unsafe { &*(self.map.as_ptr().add(at) as *const AtomicU32) }
    }

    /// The ring's region id (its data area is bytes `data_offset()..`).
    pub fn region(&self) -> u32 {
        self.region
    }

    pub fn data_offset(&self) -> u64 {
        self.data_at as u64
    }

    /// Writes contiguous entries at byte `at` of the data area; returns
    /// their offset in the region, for `submit`.
    pub fn put_entries(&mut self, at: usize, entries: &[(GroupKey, u32, u64)]) -> u64 {
        let mut b = Vec::with_capacity(entries.len() * wire::IO_ENTRY_BYTES);
        wire::encode_io_entries(&mut b, &io_entries(entries));
        let off = self.data_at + at;
        self.map[off..off + b.len()].copy_from_slice(&b);
        off as u64
    }

    /// Writes raw bytes at byte `at` of the data area (e.g. group bytes
    /// that entries name in the ring's region).
    pub fn put_raw(&mut self, at: usize, bytes: &[u8]) {
        let off = self.data_at + at;
        self.map[off..off + bytes.len()].copy_from_slice(bytes);
    }

    /// `len` bytes at byte `at` of the ring's region.
    pub fn read_raw(&self, at: usize, len: usize) -> Vec<u8> {
        self.map[at..at + len].to_vec()
    }

    /// Submission slots free now.
    pub fn room(&self) -> u32 {
        let head = self.word(SQ_HEAD).load(AtomicOrdering::Acquire);
        self.entries - self.sq_tail.wrapping_sub(head)
    }

    /// Submits a RESTORE or STORE of `count` contiguous entries at
    /// `entries_at` of the ring's region; false when the submission ring is
    /// full (reap, then try again).
    pub fn submit(
        &mut self,
        user_data: u64,
        command: Command,
        count: u32,
        entries_at: u64,
    ) -> bool {
        self.submit_raw(
            user_data,
            command as u32,
            count,
            ((self.region as u64) << 32) | wire::ENTRIES_IN_REGION,
            entries_at,
        )
    }

    /// A submission as its raw fields (any region of the fd, any flags).
    pub fn submit_raw(
        &mut self,
        user_data: u64,
        command: u32,
        count: u32,
        arg0: u64,
        arg1: u64,
    ) -> bool {
        if self.room() == 0 {
            return false;
        }
        let slot = (self.sq_tail & (self.entries - 1)) as usize;
        let at = RING_HEADER_BYTES as usize + slot * SQE_BYTES as usize;
        let s = &mut self.map[at..at + SQE_BYTES as usize];
        s[0..8].copy_from_slice(&user_data.to_le_bytes());
        s[8..12].copy_from_slice(&command.to_le_bytes());
        s[12..16].copy_from_slice(&count.to_le_bytes());
        s[16..24].copy_from_slice(&arg0.to_le_bytes());
        s[24..32].copy_from_slice(&arg1.to_le_bytes());
        self.sq_tail = self.sq_tail.wrapping_add(1);
        self.word(SQ_TAIL)
            .store(self.sq_tail, AtomicOrdering::Release);
        std::sync::atomic::fence(AtomicOrdering::SeqCst);
        if self.word(SQ_SLEEPING).load(AtomicOrdering::Acquire) != 0 {
            futex(self.word(SQ_TAIL), libc::FUTEX_WAKE, i32::MAX as u32, None);
        }
        true
    }

    /// Completions ready now (at most `max`), reaped.
    pub fn peek(&mut self, max: usize) -> Vec<RingCompletion> {
        let tail = self.word(CQ_TAIL).load(AtomicOrdering::Acquire);
        let mut out = Vec::new();
        while self.cq_head != tail && out.len() < max {
            let slot = (self.cq_head & (self.entries - 1)) as usize;
            let at = (RING_HEADER_BYTES + SQE_BYTES * self.entries as u64) as usize
                + slot * CQE_BYTES as usize;
            let c = &self.map[at..at + CQE_BYTES as usize];
            let u = |i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
            let w = |i: usize| u32::from_le_bytes(c[i..i + 4].try_into().expect("4 bytes"));
            out.push(RingCompletion {
                user_data: u(0),
                ticket: u(8),
                status: w(16) as i32,
                first_failed: (w(20) != wire::NO_ENTRY).then_some(w(20)),
                failed: w(24),
            });
            self.cq_head = self.cq_head.wrapping_add(1);
        }
        self.word(CQ_HEAD)
            .store(self.cq_head, AtomicOrdering::Release);
        out
    }

    /// Waits until at least `min` completions are ready (or `timeout`
    /// passes), then reaps up to `max`. It looks for them without sleeping
    /// for up to REAP_SPIN first where cores are to spare (a 16 MiB ticket
    /// takes about half a millisecond on a GPU, and a futex wake-up tens
    /// of microseconds; on two cores, a few microseconds), then sleeps
    /// until the daemon wakes it.
    pub fn reap(
        &mut self,
        min: usize,
        max: usize,
        timeout: Option<Duration>,
    ) -> Vec<RingCompletion> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut out = self.peek(max);
        let mut idle_since: Option<std::time::Instant> = None;
        while out.len() < min {
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                break;
            }
            let tail = self.word(CQ_TAIL).load(AtomicOrdering::Acquire);
            if tail == self.cq_head {
                if idle_since
                    .get_or_insert_with(std::time::Instant::now)
                    .elapsed()
                    < match spare_cores() {
                        true => REAP_SPIN,
                        false => Duration::from_micros(2),
                    }
                {
                    std::hint::spin_loop();
                } else {
                    self.word(CQ_WAITING).store(1, AtomicOrdering::Release);
                    std::sync::atomic::fence(AtomicOrdering::SeqCst);
                    if self.word(CQ_TAIL).load(AtomicOrdering::Acquire) == self.cq_head {
                        futex(
                            self.word(CQ_TAIL),
                            libc::FUTEX_WAIT,
                            tail,
                            Some(Duration::from_millis(10)),
                        );
                    }
                    self.word(CQ_WAITING).store(0, AtomicOrdering::Release);
                }
                continue;
            }
            idle_since = None;
            out.extend(self.peek(max - out.len()));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::ClientError;

    #[test]
    fn a_refusal_names_its_entry_once() {
        let refused = |message: &str, entry| ClientError::Refused {
            errno: libc::ERANGE,
            entry,
            message: message.to_string(),
        };
        let named = refused("entry 3: layer 99 is out of range", Some(3));
        assert_eq!(
            named.to_string(),
            "entry 3: layer 99 is out of range (errno 34)"
        );
        let unnamed = refused("region 1 is busy", Some(2));
        assert_eq!(unnamed.to_string(), "region 1 is busy (errno 34, entry 2)");
        let other = refused("entry 30: x", Some(3));
        assert_eq!(other.to_string(), "entry 30: x (errno 34, entry 3)");
        assert_eq!(refused("no entry", None).to_string(), "no entry (errno 34)");
    }
}

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
    #[error("{message} (errno {errno}{})", entry.map(|e| format!(", entry {e}")).unwrap_or_default())]
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
    /// region of this fd.
    pub fn register_host_region(&self, path: &Path, len: u64) -> Result<u32, ClientError> {
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

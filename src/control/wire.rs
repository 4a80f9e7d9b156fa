//! The control protocol's wire format: little-endian, versioned, fixed-size.
//!
//! A request is a 32-byte header and `count` fixed-size entries (or, for
//! REGISTER, `count` bytes of path). A reply is a 32-byte header, `count`
//! entries and `msg_len` bytes of UTF-8 message. The same bytes travel by
//! ioctl(2) (request in, reply out of one buffer) or by write(2) of a
//! request and read(2) of its reply. README.md specifies every field; this
//! file is the one implementation of it, shared by the daemon and the Rust
//! client. Decoding never panics and never trusts a count: every length is
//! checked against the bytes actually present.

use crate::geometry::{GroupKey, GroupLayout, Kind};
use serde::{Deserialize, Serialize};

pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"KVFQ");
pub const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"KVFR");
pub const VERSION: u16 = 1;
pub const HEADER_BYTES: usize = 32;
/// RESTORE/STORE entry: block u64, layer u32, head u32, kind u32, region u32, offset u64.
pub const IO_ENTRY_BYTES: usize = 32;
/// QUERY/PREFETCH entry: block u64, layer u32, head u32, kind u32, pad u32.
pub const KEY_ENTRY_BYTES: usize = 24;
/// QUERY reply entry: state u8, dirty u8, flags u16 (STATE_WRITTEN), crc32c u32.
pub const STATE_ENTRY_BYTES: usize = 8;
/// Most entries one request may carry: 1 Mi entries is 32 MiB of request,
/// far beyond any batch an engine sends, small enough to bound memory.
pub const MAX_ENTRIES: u32 = 1 << 20;
/// RESTORE/STORE `arg0` flag: the `count` entries are not in the request
/// but in a host region of this fd (id in `arg0`'s upper 32 bits), from
/// byte `arg1`. A request of any batch size is then a bare header, small
/// enough for one ioctl(2).
pub const ENTRIES_IN_REGION: u64 = 1;
/// RESTORE/STORE `arg0` flag: the entries are strided, `STRIDED_ENTRY_BYTES`
/// each (with or without `ENTRIES_IN_REGION`). A strided entry places its
/// group in the region as `group_bytes / row_bytes` rows of `row_bytes`,
/// `pitch` bytes apart, the first at `offset` (the group itself stays
/// contiguous in kvfs): an engine's layout where K and V, or heads,
/// interleave. `row_bytes` 0 means the group is contiguous at `offset`.
pub const ENTRIES_STRIDED: u64 = 2;
/// RESTORE `arg0` bits 16–31: a done word of the fd (its index + 1; 0:
/// none). After the ticket's copy into CUDA regions, the daemon's stream
/// writes the ticket number (u64) into word `index` of the fd's done-word
/// region (REGISTER flags `REGISTER_CUDA | REGISTER_DONE_WORDS`), so a
/// client's GPU stream can wait on it (`cuStreamWaitValue64`, GEQ)
/// without a cross-process event. A word serves one running ticket at a
/// time.
pub const DONE_WORD_SHIFT: u32 = 16;
pub const DONE_WORD_BITS: u64 = 0xffff << DONE_WORD_SHIFT;
/// Strided RESTORE/STORE entry: the 32 bytes of an IO entry, then
/// row_bytes u32, pad u32 (send 0; ignored), pitch u64.
pub const STRIDED_ENTRY_BYTES: usize = 48;
/// Longest REGISTER path.
pub const MAX_PATH: u32 = 4096;
/// ioctl(2) command number ('K' = 0x4b, nr 1); the size field of `_IOWR`
/// carries the buffer length, at most `MAX_IOCTL_BYTES`.
pub const IOCTL_TYPE: u32 = 0x4b;
pub const IOCTL_NR: u32 = 1;
pub const MAX_IOCTL_BYTES: usize = (1 << 14) - 1;
/// REGISTER flags: a CUDA allocation named by its IPC handle.
pub const REGISTER_CUDA: u64 = 1;
/// REGISTER flag, with `REGISTER_CUDA`: the allocation holds the fd's done
/// words (u64 each, 8-byte aligned; see `DONE_WORD_SHIFT`), one such
/// region a fd.
pub const REGISTER_DONE_WORDS: u64 = 2;

/// The done word a RESTORE names (its index), from its header.
pub fn done_word(h: &Header) -> Option<u16> {
    if h.command != Command::Restore as u16 {
        return None;
    }
    (((h.arg0 & DONE_WORD_BITS) >> DONE_WORD_SHIFT) as u16).checked_sub(1)
}

/// The mount's shape, as JSON: HELLO's message and `.kvfs/layout`. The
/// geometry, then T1's size, the backing tier and the replacement policy.
/// One definition for the daemon, the Rust client and the CLI.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountLayout {
    pub layers: u32,
    pub blocks: u64,
    pub kv_heads: u32,
    pub block_tokens: u32,
    pub head_dim: u32,
    /// `bf16`, `fp16`, `fp32` or `fp8`.
    pub dtype: String,
    pub group_bytes: u64,
    /// Bytes between groups in the backing file and T1 (4096-aligned).
    pub stride: u64,
    pub groups: u64,
    pub t1_bytes: u64,
    pub t1_slots: u32,
    pub tier: String,
    pub policy: String,
    /// T1 is pinned, device-mapped memory (a CUDA driver is present).
    pub t1_pinned: bool,
    /// The remote tier's servers (`--tier redis`); absent for local tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
}

impl MountLayout {
    pub fn new(l: &GroupLayout, t1_slots: u32, tier: &str, policy: &str, t1_pinned: bool) -> Self {
        MountLayout {
            layers: l.layers,
            blocks: l.blocks,
            kv_heads: l.kv_heads,
            block_tokens: l.block_tokens,
            head_dim: l.head_dim,
            dtype: l.dtype.to_string(),
            group_bytes: l.group_bytes(),
            stride: l.stride(),
            groups: l.group_count(),
            t1_bytes: t1_slots as u64 * l.stride(),
            t1_slots,
            tier: tier.into(),
            policy: policy.into(),
            t1_pinned,
            remote: None,
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain fields always serialise")
    }

    pub fn from_json(s: &str) -> Result<MountLayout, serde_json::Error> {
        serde_json::from_str(s)
    }
}
/// CUDA REGISTER payload: IPC memory handle 64, offset u64, device u32, pad u32.
pub const CUDA_REGISTER_BYTES: usize = 80;

/// "No entry" in `entry_index` fields.
pub const NO_ENTRY: u32 = u32::MAX;

/// `_IOWR('K', 1, len)`: the ioctl command for a buffer of `len` bytes.
pub fn ioctl_cmd(len: usize) -> u32 {
    // _IOC(dir = read|write = 3, type, nr, size)
    (3 << 30) | ((len as u32 & 0x3fff) << 16) | (IOCTL_TYPE << 8) | IOCTL_NR
}

/// Splits an ioctl command into its buffer size, if it is ours.
pub fn ioctl_len(cmd: u32) -> Option<usize> {
    ((cmd >> 30) == 3 && (cmd >> 8) & 0xff == IOCTL_TYPE && cmd & 0xff == IOCTL_NR)
        .then_some(((cmd >> 16) & 0x3fff) as usize)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Command {
    Hello = 1,
    Register = 2,
    Unregister = 3,
    Restore = 4,
    Store = 5,
    Query = 6,
    Prefetch = 7,
    Wait = 8,
    /// Reply-only: an unsolicited completion record read from the fd.
    Completion = 9,
    /// Sets up this fd's submission/completion ring (see `control::ring`).
    Ring = 10,
}

impl Command {
    pub fn from_u16(v: u16) -> Option<Command> {
        use Command::*;
        [
            Hello, Register, Unregister, Restore, Store, Query, Prefetch, Wait, Completion, Ring,
        ]
        .into_iter()
        .find(|c| *c as u16 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            Command::Hello => "hello",
            Command::Register => "register",
            Command::Unregister => "unregister",
            Command::Restore => "restore",
            Command::Store => "store",
            Command::Query => "query",
            Command::Prefetch => "prefetch",
            Command::Wait => "wait",
            Command::Completion => "completion",
            Command::Ring => "ring",
        }
    }
}

/// A request header. Fields by command:
/// - HELLO: nothing. REGISTER: `count` = path bytes, `arg0` = flags (0
///   host file, `REGISTER_CUDA`, with `REGISTER_DONE_WORDS`), `arg1` =
///   region length. UNREGISTER: `arg0` = region id.
/// - RESTORE, STORE: `count` IO entries, `arg0` flags (RESTORE: and a done
///   word, `DONE_WORD_SHIFT`). QUERY, PREFETCH: `count` key entries.
/// - WAIT: `arg0` = ticket, `arg1` = timeout in ms (u64::MAX: forever).
/// - RING: `count` = ring entries (a power of two), `arg0` = the host
///   region holding the ring, `arg1` = the ring's offset in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub command: u16,
    pub count: u32,
    pub arg0: u64,
    pub arg1: u64,
}

/// One RESTORE/STORE entry: the group named by `key` at `offset` of
/// `region`, contiguous (`row_bytes` 0) or strided (see `ENTRIES_STRIDED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoEntry {
    pub key: RawKey,
    pub region: u32,
    pub offset: u64,
    pub row_bytes: u32,
    pub pitch: u64,
}

impl IoEntry {
    /// A contiguous entry.
    pub fn new(key: RawKey, region: u32, offset: u64) -> IoEntry {
        IoEntry {
            key,
            region,
            offset,
            row_bytes: 0,
            pitch: 0,
        }
    }
}

/// A key as sent: not yet checked against the geometry (kind may be bad).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawKey {
    pub layer: u32,
    pub block: u64,
    pub head: u32,
    pub kind: u32,
}

impl RawKey {
    pub fn from_key(k: GroupKey) -> RawKey {
        RawKey {
            layer: k.layer,
            block: k.block,
            head: k.head,
            kind: match k.kind {
                Kind::K => 0,
                Kind::V => 1,
            },
        }
    }

    /// The key, if `kind` is 0 (K) or 1 (V).
    pub fn key(&self) -> Option<GroupKey> {
        let kind = match self.kind {
            0 => Kind::K,
            1 => Kind::V,
            _ => return None,
        };
        Some(GroupKey::new(self.layer, self.block, self.head, kind))
    }
}

/// Group states in QUERY replies.
pub const STATE_EMPTY: u8 = 0;
pub const STATE_BACKING: u8 = 1;
pub const STATE_T1: u8 = 2;
/// QUERY state entry flag: the group was written back at least once, and
/// crc32c is its bytes' as last written back (0 and unset if never).
pub const STATE_WRITTEN: u16 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateEntry {
    pub state: u8,
    pub dirty: bool,
    /// crc32c of the bytes last written back; None if never written back.
    pub backing_crc: Option<u32>,
}

/// A decoded request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Hello,
    Register {
        path: Vec<u8>,
        len: u64,
        flags: u64,
    },
    Unregister {
        region: u32,
    },
    /// Contiguous entries (their row_bytes and pitch are not sent).
    Restore(Vec<IoEntry>),
    Store(Vec<IoEntry>),
    /// Entries in the strided form (`ENTRIES_STRIDED`).
    RestoreStrided(Vec<IoEntry>),
    StoreStrided(Vec<IoEntry>),
    /// RESTORE with its entries in a region (`ENTRIES_IN_REGION`).
    RestoreFrom(EntriesAt),
    /// STORE with its entries in a region.
    StoreFrom(EntriesAt),
    Query(Vec<RawKey>),
    Prefetch(Vec<RawKey>),
    Wait {
        ticket: u64,
        timeout_ms: u64,
    },
    Ring {
        region: u32,
        offset: u64,
        entries: u32,
    },
}

/// Where a RESTORE/STORE's entries lie when they are not in the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntriesAt {
    pub region: u32,
    pub offset: u64,
    pub count: u32,
    /// `STRIDED_ENTRY_BYTES` each, else `IO_ENTRY_BYTES`.
    pub strided: bool,
}

impl EntriesAt {
    pub fn entry_bytes(&self) -> usize {
        if self.strided {
            STRIDED_ENTRY_BYTES
        } else {
            IO_ENTRY_BYTES
        }
    }
}

/// Decodes RESTORE/STORE entries (`IO_ENTRY_BYTES` each; a trailing
/// partial entry is ignored: callers pass whole entries).
pub fn decode_io_entries(body: &[u8]) -> Vec<IoEntry> {
    body.chunks_exact(IO_ENTRY_BYTES)
        .map(|c| IoEntry::new(decode_key(c), u32_at(c, 20), u64_at(c, 24)))
        .collect()
}

/// Decodes strided RESTORE/STORE entries (`STRIDED_ENTRY_BYTES` each).
/// The pad word is ignored (clients send 0).
pub fn decode_strided_entries(body: &[u8]) -> Vec<IoEntry> {
    body.chunks_exact(STRIDED_ENTRY_BYTES)
        .map(|c| IoEntry {
            key: decode_key(c),
            region: u32_at(c, 20),
            offset: u64_at(c, 24),
            row_bytes: u32_at(c, 32),
            pitch: u64_at(c, 40),
        })
        .collect()
}

/// Appends RESTORE/STORE entries in wire form, contiguous (row_bytes and
/// pitch are not sent: use `encode_strided_entries` for strided ones).
pub fn encode_io_entries(out: &mut Vec<u8>, entries: &[IoEntry]) {
    for x in entries {
        encode_key(out, &x.key);
        out.extend_from_slice(&x.region.to_le_bytes());
        out.extend_from_slice(&x.offset.to_le_bytes());
    }
}

/// Appends RESTORE/STORE entries in strided wire form.
pub fn encode_strided_entries(out: &mut Vec<u8>, entries: &[IoEntry]) {
    for x in entries {
        encode_key(out, &x.key);
        out.extend_from_slice(&x.region.to_le_bytes());
        out.extend_from_slice(&x.offset.to_le_bytes());
        out.extend_from_slice(&x.row_bytes.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&x.pitch.to_le_bytes());
    }
}

/// Why a request could not be decoded (all EINVAL on the wire).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("request is {0} bytes, shorter than the {HEADER_BYTES}-byte header")]
    Short(usize),
    #[error("bad magic {0:#010x} (expected \"KVFQ\")")]
    Magic(u32),
    #[error("protocol version {0} is not supported (this kvfs speaks version {VERSION})")]
    Version(u16),
    #[error("unknown command {0}")]
    Command(u16),
    #[error("{what} {count} is too many (at most {max})")]
    TooMany {
        what: &'static str,
        count: u32,
        max: u32,
    },
    #[error("{command} with {count} entries needs {want} bytes, got {got}")]
    Length {
        command: &'static str,
        count: u32,
        want: usize,
        got: usize,
    },
    #[error("reserved header field is {0}, must be 0")]
    Reserved(u32),
    #[error("region id {0} does not fit in 32 bits")]
    RegionId(u64),
    #[error(
        "unknown {command} flags {flags:#x} (1 = entries in a region, 2 = strided entries; bits 16-31 of a RESTORE: a done word)"
    )]
    Flags { command: &'static str, flags: u64 },
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

pub fn encode_header(out: &mut Vec<u8>, magic: u32, h: &Header) {
    out.extend_from_slice(&magic.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&h.command.to_le_bytes());
    out.extend_from_slice(&h.count.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&h.arg0.to_le_bytes());
    out.extend_from_slice(&h.arg1.to_le_bytes());
}

fn encode_key(out: &mut Vec<u8>, k: &RawKey) {
    out.extend_from_slice(&k.block.to_le_bytes());
    out.extend_from_slice(&k.layer.to_le_bytes());
    out.extend_from_slice(&k.head.to_le_bytes());
    out.extend_from_slice(&k.kind.to_le_bytes());
}

fn decode_key(b: &[u8]) -> RawKey {
    RawKey {
        block: u64_at(b, 0),
        layer: u32_at(b, 8),
        head: u32_at(b, 12),
        kind: u32_at(b, 16),
    }
}

/// Encodes a request (the client's side).
pub fn encode_request(r: &Request) -> Vec<u8> {
    let mut out = Vec::new();
    let (command, count, arg0, arg1) = match r {
        Request::Hello => (Command::Hello, 0, 0, 0),
        Request::Register { path, len, flags } => {
            (Command::Register, path.len() as u32, *flags, *len)
        }
        Request::Unregister { region } => (Command::Unregister, 0, *region as u64, 0),
        Request::Restore(e) => (Command::Restore, e.len() as u32, 0, 0),
        Request::Store(e) => (Command::Store, e.len() as u32, 0, 0),
        Request::RestoreStrided(e) => (Command::Restore, e.len() as u32, ENTRIES_STRIDED, 0),
        Request::StoreStrided(e) => (Command::Store, e.len() as u32, ENTRIES_STRIDED, 0),
        Request::RestoreFrom(a) | Request::StoreFrom(a) => (
            if matches!(r, Request::RestoreFrom(_)) {
                Command::Restore
            } else {
                Command::Store
            },
            a.count,
            ((a.region as u64) << 32)
                | ENTRIES_IN_REGION
                | if a.strided { ENTRIES_STRIDED } else { 0 },
            a.offset,
        ),
        Request::Query(k) => (Command::Query, k.len() as u32, 0, 0),
        Request::Prefetch(k) => (Command::Prefetch, k.len() as u32, 0, 0),
        Request::Wait { ticket, timeout_ms } => (Command::Wait, 0, *ticket, *timeout_ms),
        Request::Ring {
            region,
            offset,
            entries,
        } => (Command::Ring, *entries, *region as u64, *offset),
    };
    let h = Header {
        command: command as u16,
        count,
        arg0,
        arg1,
    };
    encode_header(&mut out, REQUEST_MAGIC, &h);
    match r {
        Request::Register { path, .. } => out.extend_from_slice(path),
        Request::RestoreStrided(e) | Request::StoreStrided(e) => {
            encode_strided_entries(&mut out, e)
        }
        Request::Restore(e) | Request::Store(e) => encode_io_entries(&mut out, e),
        Request::Query(k) | Request::Prefetch(k) => {
            for x in k {
                encode_key(&mut out, x);
                out.extend_from_slice(&0u32.to_le_bytes());
            }
        }
        _ => {}
    }
    out
}

/// Reads a request header and says how many bytes the whole request has.
pub fn request_len(b: &[u8]) -> Result<(Header, usize), DecodeError> {
    if b.len() < HEADER_BYTES {
        return Err(DecodeError::Short(b.len()));
    }
    let magic = u32_at(b, 0);
    if magic != REQUEST_MAGIC {
        return Err(DecodeError::Magic(magic));
    }
    let version = u16_at(b, 4);
    if version != VERSION {
        return Err(DecodeError::Version(version));
    }
    let h = Header {
        command: u16_at(b, 6),
        count: u32_at(b, 8),
        arg0: u64_at(b, 16),
        arg1: u64_at(b, 24),
    };
    let reserved = u32_at(b, 12);
    if reserved != 0 {
        return Err(DecodeError::Reserved(reserved));
    }
    let cmd = Command::from_u16(h.command)
        .filter(|c| *c != Command::Completion)
        .ok_or(DecodeError::Command(h.command))?;
    let per = match cmd {
        Command::Register => {
            if h.count > MAX_PATH {
                return Err(DecodeError::TooMany {
                    what: "path length",
                    count: h.count,
                    max: MAX_PATH,
                });
            }
            1
        }
        Command::Restore | Command::Store => {
            let flags = h.arg0 & 0xffff_ffff;
            let done = match cmd {
                Command::Restore => DONE_WORD_BITS,
                _ => 0,
            };
            if flags & !(ENTRIES_IN_REGION | ENTRIES_STRIDED | done) != 0 {
                return Err(DecodeError::Flags {
                    command: cmd.name(),
                    flags,
                });
            }
            if flags & ENTRIES_IN_REGION != 0 {
                // Entries in a region: a bare header, but the same count limit.
                if h.count > MAX_ENTRIES {
                    return Err(DecodeError::TooMany {
                        what: "entry count",
                        count: h.count,
                        max: MAX_ENTRIES,
                    });
                }
                0
            } else if flags & ENTRIES_STRIDED != 0 {
                STRIDED_ENTRY_BYTES
            } else {
                IO_ENTRY_BYTES
            }
        }
        Command::Query | Command::Prefetch => KEY_ENTRY_BYTES,
        _ => 0,
    };
    if per > 1 && h.count > MAX_ENTRIES {
        return Err(DecodeError::TooMany {
            what: "entry count",
            count: h.count,
            max: MAX_ENTRIES,
        });
    }
    Ok((h, HEADER_BYTES + per * h.count as usize))
}

/// Decodes one complete request; `b` must be exactly its bytes.
pub fn decode_request(b: &[u8]) -> Result<Request, DecodeError> {
    decode(b).map(|(_, r)| r)
}

/// `decode_request`, with the request's header (for `done_word`).
pub fn decode(b: &[u8]) -> Result<(Header, Request), DecodeError> {
    let (h, want) = request_len(b)?;
    let cmd = Command::from_u16(h.command).expect("checked by request_len");
    if b.len() != want {
        return Err(DecodeError::Length {
            command: cmd.name(),
            count: h.count,
            want,
            got: b.len(),
        });
    }
    let body = &b[HEADER_BYTES..];
    let r = match cmd {
        Command::Hello => Request::Hello,
        Command::Register => Request::Register {
            path: body.to_vec(),
            flags: h.arg0,
            len: h.arg1,
        },
        Command::Unregister => Request::Unregister {
            region: u32::try_from(h.arg0).map_err(|_| DecodeError::RegionId(h.arg0))?,
        },
        Command::Restore | Command::Store if h.arg0 & ENTRIES_IN_REGION != 0 => {
            let at = EntriesAt {
                region: (h.arg0 >> 32) as u32,
                offset: h.arg1,
                count: h.count,
                strided: h.arg0 & ENTRIES_STRIDED != 0,
            };
            if cmd == Command::Restore {
                Request::RestoreFrom(at)
            } else {
                Request::StoreFrom(at)
            }
        }
        Command::Restore | Command::Store if h.arg0 & ENTRIES_STRIDED != 0 => {
            let e = decode_strided_entries(body);
            if cmd == Command::Restore {
                Request::RestoreStrided(e)
            } else {
                Request::StoreStrided(e)
            }
        }
        Command::Restore | Command::Store => {
            let e = decode_io_entries(body);
            if cmd == Command::Restore {
                Request::Restore(e)
            } else {
                Request::Store(e)
            }
        }
        Command::Query | Command::Prefetch => {
            let k = body.chunks_exact(KEY_ENTRY_BYTES).map(decode_key).collect();
            if cmd == Command::Query {
                Request::Query(k)
            } else {
                Request::Prefetch(k)
            }
        }
        Command::Wait => Request::Wait {
            ticket: h.arg0,
            timeout_ms: h.arg1,
        },
        Command::Ring => Request::Ring {
            region: u32::try_from(h.arg0).map_err(|_| DecodeError::RegionId(h.arg0))?,
            offset: h.arg1,
            entries: h.count,
        },
        Command::Completion => unreachable!("refused by request_len"),
    };
    Ok((h, r))
}

/// A reply. `status` is 0 or an errno; `value` is the region id (REGISTER),
/// the ticket (RESTORE, STORE, PREFETCH, WAIT, completion records) or the
/// protocol version (HELLO); `failed` counts failed entries of a finished
/// ticket; `entry` is the first failing entry's index (or NO_ENTRY).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub command: u16,
    pub status: u32,
    pub value: u64,
    pub failed: u32,
    pub entry: u32,
    pub states: Vec<StateEntry>,
    pub message: String,
}

impl Reply {
    pub fn ok(command: Command, value: u64) -> Reply {
        Reply {
            command: command as u16,
            status: 0,
            value,
            failed: 0,
            entry: NO_ENTRY,
            states: Vec::new(),
            message: String::new(),
        }
    }

    pub fn error(command: u16, errno: i32, entry: u32, message: String) -> Reply {
        Reply {
            command,
            status: errno as u32,
            value: 0,
            failed: 0,
            entry,
            states: Vec::new(),
            message,
        }
    }

    /// Reply layout: magic u32, version u16, command u16, status u32,
    /// count u32 (state entries), value u64, failed u32, entry u32, then
    /// `count` state entries, then a u32 message length and the message.
    pub fn encode(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(HEADER_BYTES + 8 * self.states.len() + 4 + self.message.len());
        out.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.command.to_le_bytes());
        out.extend_from_slice(&self.status.to_le_bytes());
        out.extend_from_slice(&(self.states.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.value.to_le_bytes());
        out.extend_from_slice(&self.failed.to_le_bytes());
        out.extend_from_slice(&self.entry.to_le_bytes());
        for s in &self.states {
            out.push(s.state);
            out.push(s.dirty as u8);
            let flags = if s.backing_crc.is_some() {
                STATE_WRITTEN
            } else {
                0
            };
            out.extend_from_slice(&flags.to_le_bytes());
            out.extend_from_slice(&s.backing_crc.unwrap_or(0).to_le_bytes());
        }
        out.extend_from_slice(&(self.message.len() as u32).to_le_bytes());
        out.extend_from_slice(self.message.as_bytes());
        out
    }

    /// Decodes a reply (the client's side); `b` may be longer than the reply
    /// (an ioctl buffer): the rest is ignored. Returns the reply and its length.
    pub fn decode(b: &[u8]) -> Result<(Reply, usize), String> {
        if b.len() < HEADER_BYTES + 4 {
            return Err(format!("reply is {} bytes, too short", b.len()));
        }
        if u32_at(b, 0) != REPLY_MAGIC {
            return Err("reply has a bad magic number".into());
        }
        if u16_at(b, 4) != VERSION {
            return Err(format!("reply version {} is not {VERSION}", u16_at(b, 4)));
        }
        let count = u32_at(b, 12) as usize;
        let states_end = count
            .checked_mul(STATE_ENTRY_BYTES)
            .and_then(|n| n.checked_add(HEADER_BYTES))
            .filter(|&n| n + 4 <= b.len())
            .ok_or("reply is truncated (state entries)")?;
        let msg_len = u32_at(b, states_end) as usize;
        let end = states_end + 4 + msg_len;
        if end > b.len() {
            return Err("reply is truncated (message)".into());
        }
        let states = b[HEADER_BYTES..states_end]
            .chunks_exact(STATE_ENTRY_BYTES)
            .map(|c| StateEntry {
                state: c[0],
                dirty: c[1] != 0,
                backing_crc: (u16_at(c, 2) & STATE_WRITTEN != 0).then(|| u32_at(c, 4)),
            })
            .collect();
        Ok((
            Reply {
                command: u16_at(b, 6),
                status: u32_at(b, 8),
                value: u64_at(b, 16),
                failed: u32_at(b, 24),
                entry: u32_at(b, 28),
                states,
                message: String::from_utf8_lossy(&b[states_end + 4..end]).into_owned(),
            },
            end,
        ))
    }
}

#[cfg(test)]
mod tests;

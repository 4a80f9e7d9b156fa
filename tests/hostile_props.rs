//! Hostile input for the control-record decoders and the name parser: the
//! CI-sized version of the cargo-fuzz targets in fuzz/ (same oracles).
//!
//! - No input makes `decode_request`, `request_len`, `Reply::decode`,
//!   `decode_io_entries`, `parse_path`, `parse_group_name` or
//!   `name_component` panic (or read out of bounds).
//! - `request_len` and `decode_request` agree, and the bytes `request_len`
//!   frames decode.
//! - What decodes re-encodes to the same bytes, up to the fields the
//!   decoder ignores (`canonical_request`, `canonical_reply`).
//! - Only the canonical spelling of a name parses: whatever parses formats
//!   back to exactly the input.

use kvfs::control::wire::{
    Command, DecodeError, ENTRIES_IN_REGION, HEADER_BYTES, Header, IO_ENTRY_BYTES, KEY_ENTRY_BYTES,
    MAX_ENTRIES, MAX_PATH, REPLY_MAGIC, REQUEST_MAGIC, Reply, STATE_ENTRY_BYTES, STATE_WRITTEN,
    VERSION, decode_io_entries, decode_request, encode_io_entries, encode_request, request_len,
};
use kvfs::geometry::{GroupKey, Kind, ParsedPath, name_component, parse_group_name, parse_path};
use proptest::prelude::*;

const CASES: u32 = 2000;

// ---------------------------------------------------------------- oracles

/// `b` (a request `decode_request` accepted) with every field the decoder
/// does not carry into `Request` set to 0: what `encode_request` gives back.
fn canonical_request(b: &[u8], h: &Header) -> Vec<u8> {
    let mut c = b.to_vec();
    match Command::from_u16(h.command).expect("accepted command") {
        // count, arg0, arg1 (reserved is 0 already).
        Command::Hello => c[8..32].fill(0),
        Command::Register => {}
        // count and arg1.
        Command::Unregister => {
            c[8..12].fill(0);
            c[24..32].fill(0);
        }
        Command::Restore | Command::Store => {
            if h.arg0 & ENTRIES_IN_REGION == 0 {
                // arg0's high 32 bits and arg1.
                c[20..32].fill(0);
                if h.arg0 & kvfs::control::wire::ENTRIES_STRIDED != 0 {
                    // A strided entry's pad u32 (after row_bytes).
                    for e in
                        c[HEADER_BYTES..].chunks_exact_mut(kvfs::control::wire::STRIDED_ENTRY_BYTES)
                    {
                        e[36..40].fill(0);
                    }
                }
            }
        }
        Command::Query | Command::Prefetch => {
            c[16..32].fill(0);
            for e in c[HEADER_BYTES..].chunks_exact_mut(KEY_ENTRY_BYTES) {
                e[20..24].fill(0); // pad
            }
        }
        // count.
        Command::Wait => c[8..12].fill(0),
        // Every field is carried.
        Command::Ring => {}
        Command::Completion => unreachable!("refused by request_len"),
    }
    c
}

/// Every request-side check on one input.
fn check_request(data: &[u8]) -> Result<(), TestCaseError> {
    let entries = decode_io_entries(data);
    prop_assert_eq!(entries.len(), data.len() / IO_ENTRY_BYTES);
    let mut enc = Vec::new();
    encode_io_entries(&mut enc, &entries);
    prop_assert_eq!(&enc[..], &data[..entries.len() * IO_ENTRY_BYTES]);

    let len = request_len(data);
    let dec = decode_request(data);
    if let Err(e) = &dec {
        let _ = e.to_string();
    }
    match (&len, &dec) {
        (Ok((h, n)), Ok(r)) => {
            prop_assert_eq!(*n, data.len(), "decoded request of the wrong length");
            let enc = encode_request(r);
            prop_assert_eq!(&enc, &canonical_request(data, h), "re-encoding differs");
            let again = decode_request(&enc);
            prop_assert_eq!(again.as_ref(), Ok(r), "re-decoding differs");
        }
        (Ok((h, n)), Err(e)) => {
            if *n == data.len() {
                // A region id is checked when the request is decoded.
                prop_assert!(
                    (h.command == Command::Unregister as u16 || h.command == Command::Ring as u16)
                        && matches!(e, DecodeError::RegionId(_)),
                    "request_len accepted {} bytes but decode_request said {:?}",
                    n,
                    e
                );
            } else {
                prop_assert!(matches!(e, DecodeError::Length { .. }), "{:?}", e);
            }
        }
        (Err(le), Err(e)) => prop_assert_eq!(le, e),
        (Err(le), Ok(r)) => {
            prop_assert!(
                false,
                "request_len refused ({:?}) what decoded as {:?}",
                le,
                r
            )
        }
    }

    // Framing as a stream reader does it: the header gives the length,
    // and those bytes decode.
    if let Ok((h, n)) = len
        && n <= data.len()
    {
        match decode_request(&data[..n]) {
            Ok(_) => {}
            Err(DecodeError::RegionId(_))
                if h.command == Command::Unregister as u16 || h.command == Command::Ring as u16 => {
            }
            Err(e) => prop_assert!(false, "request_len said {} bytes, they give {:?}", n, e),
        }
    }
    Ok(())
}

/// The first `n` bytes of an accepted reply with dirty bytes as 0/1, of
/// each state entry's flags only the written-back bit, its crc32c 0 where
/// that bit is clear, and the message as `from_utf8_lossy` made it.
fn canonical_reply(b: &[u8], states: usize) -> Vec<u8> {
    let states_end = HEADER_BYTES + STATE_ENTRY_BYTES * states;
    let mut c = b[..states_end].to_vec();
    for e in c[HEADER_BYTES..].chunks_exact_mut(STATE_ENTRY_BYTES) {
        e[1] = (e[1] != 0) as u8;
        let written = u16::from_le_bytes([e[2], e[3]]) & STATE_WRITTEN;
        e[2..4].copy_from_slice(&written.to_le_bytes());
        if written == 0 {
            e[4..8].fill(0);
        }
    }
    let msg = String::from_utf8_lossy(&b[states_end + 4..]);
    c.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    c.extend_from_slice(msg.as_bytes());
    c
}

fn check_reply(data: &[u8]) -> Result<(), TestCaseError> {
    let Ok((r, n)) = Reply::decode(data) else {
        return Ok(());
    };
    prop_assert!(n <= data.len(), "reply of {} bytes in {}", n, data.len());
    let states_end = HEADER_BYTES + STATE_ENTRY_BYTES * r.states.len();
    let msg_len = u32::from_le_bytes(data[states_end..states_end + 4].try_into().unwrap());
    prop_assert_eq!(n, states_end + 4 + msg_len as usize);
    prop_assert_eq!(Reply::decode(&data[..n]), Ok((r.clone(), n)));
    prop_assert!(Reply::decode(&data[..n - 1]).is_err());
    let enc = r.encode();
    prop_assert_eq!(&enc, &canonical_reply(&data[..n], r.states.len()));
    prop_assert_eq!(Reply::decode(&enc), Ok((r, enc.len())));
    Ok(())
}

/// The one spelling of a parsed path.
fn format_path(p: &ParsedPath) -> String {
    match p {
        ParsedPath::Root => String::new(),
        ParsedPath::Layer(l) => format!("L{l}"),
        ParsedPath::Block(l, b) => format!("L{l}/B{b}"),
        ParsedPath::Head(l, b, h) => format!("L{l}/B{b}/H{h}"),
        ParsedPath::Group(k) => k.to_string(),
    }
}

fn check_name(s: &str) -> Result<(), TestCaseError> {
    let path = parse_path(s);
    let group = parse_group_name(s);
    match &path {
        Ok(p) => {
            prop_assert_eq!(format_path(p), s, "{:?} does not format back", p);
            let again = parse_path(&format_path(p));
            prop_assert_eq!(again.as_ref(), Ok(p));
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    match (&path, &group) {
        (Ok(ParsedPath::Group(a)), Ok(b)) => {
            prop_assert_eq!(a, b);
            prop_assert_eq!(b.to_string(), s);
        }
        (_, Ok(k)) => prop_assert!(false, "parse_group_name {:?}, parse_path {:?}", k, path),
        (_, Err(e)) => {
            let _ = e.to_string();
        }
    }
    for prefix in ['L', 'B', 'H'] {
        for comp in s.split('/') {
            if let Some(v) = name_component(comp, prefix) {
                prop_assert_eq!(format!("{prefix}{v}"), comp);
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------- strategies

/// Counts near every limit the decoders check, and anything.
fn count() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0u32..8,
        1 => Just(MAX_PATH),
        1 => Just(MAX_PATH + 1),
        1 => Just(MAX_ENTRIES),
        1 => Just(MAX_ENTRIES + 1),
        1 => Just(u32::MAX),
        1 => Just(u32::MAX / STATE_ENTRY_BYTES as u32 + 1),
        2 => any::<u32>(),
    ]
}

fn arg0() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(ENTRIES_IN_REGION),
        Just(2u64),
        Just(u64::from(u32::MAX)),
        Just(u64::from(u32::MAX) + 1),
        any::<u32>().prop_map(|r| (u64::from(r) << 32) | ENTRIES_IN_REGION),
        any::<u32>().prop_map(|r| u64::from(r) << 32),
        any::<u64>(),
    ]
}

/// A body `want` bytes long give or take: exact, truncated, extended, or
/// any length. `want` is capped so a huge count costs no memory (such a
/// request is refused for its length).
fn body_len(want: usize) -> impl Strategy<Value = usize> {
    let want = want.min(16 << 10);
    prop_oneof![
        3 => Just(want),
        2 => (0..=want.min(64)).prop_map(move |d| want - d),
        2 => (0usize..64).prop_map(move |d| want + d),
        1 => 0usize..600,
    ]
}

/// Bytes of `len` from a short random pattern, repeated.
fn fill(pattern: &[u8], len: usize) -> Vec<u8> {
    if pattern.is_empty() {
        return vec![0; len];
    }
    pattern.iter().copied().cycle().take(len).collect()
}

/// A request header, mostly well formed, with hostile count/arg fields,
/// then a body of about the size the header asks for.
fn hostile_request() -> impl Strategy<Value = Vec<u8>> {
    let command = prop_oneof![8 => 0u16..=10, 1 => any::<u16>()];
    let magic = prop_oneof![9 => Just(REQUEST_MAGIC), 1 => any::<u32>()];
    let version = prop_oneof![9 => Just(VERSION), 1 => any::<u16>()];
    let reserved = prop_oneof![9 => Just(0u32), 1 => any::<u32>()];
    (
        magic,
        version,
        command,
        count(),
        reserved,
        arg0(),
        any::<u64>(),
    )
        .prop_flat_map(|(magic, version, command, count, reserved, arg0, arg1)| {
            let per = match Command::from_u16(command) {
                Some(Command::Register) => 1,
                Some(Command::Restore | Command::Store) if arg0 & ENTRIES_IN_REGION == 0 => {
                    IO_ENTRY_BYTES
                }
                Some(Command::Query | Command::Prefetch) => KEY_ENTRY_BYTES,
                _ => 0,
            };
            let want = per.saturating_mul(count as usize);
            (
                body_len(want),
                proptest::collection::vec(any::<u8>(), 0..48),
                any::<bool>(),
            )
                .prop_map(move |(len, pattern, zero_pads)| {
                    let mut b = Vec::with_capacity(HEADER_BYTES + len);
                    b.extend_from_slice(&magic.to_le_bytes());
                    b.extend_from_slice(&version.to_le_bytes());
                    b.extend_from_slice(&command.to_le_bytes());
                    b.extend_from_slice(&count.to_le_bytes());
                    b.extend_from_slice(&reserved.to_le_bytes());
                    b.extend_from_slice(&arg0.to_le_bytes());
                    b.extend_from_slice(&arg1.to_le_bytes());
                    let mut body = fill(&pattern, len);
                    if zero_pads && per == KEY_ENTRY_BYTES {
                        for e in body.chunks_exact_mut(KEY_ENTRY_BYTES) {
                            e[20..24].fill(0);
                        }
                    }
                    b.extend_from_slice(&body);
                    b
                })
        })
}

/// A reply header, mostly well formed, with hostile state count and
/// message length, then about as many bytes as they ask for.
fn hostile_reply() -> impl Strategy<Value = Vec<u8>> {
    let magic = prop_oneof![9 => Just(REPLY_MAGIC), 1 => any::<u32>()];
    let version = prop_oneof![9 => Just(VERSION), 1 => any::<u16>()];
    let msg_len = prop_oneof![4 => 0u32..64, 1 => Just(u32::MAX), 1 => any::<u32>()];
    (
        magic,
        version,
        any::<[u8; 24]>(),
        count(),
        msg_len,
        proptest::collection::vec(any::<u8>(), 0..48),
    )
        .prop_flat_map(|(magic, version, rest, count, msg_len, pattern)| {
            let states = (count as usize).saturating_mul(STATE_ENTRY_BYTES);
            let want = states.min(16 << 10);
            (body_len(want), body_len(msg_len as usize), 0usize..16).prop_map(
                move |(states_len, msg_bytes, tail)| {
                    let mut b = Vec::new();
                    b.extend_from_slice(&magic.to_le_bytes());
                    b.extend_from_slice(&version.to_le_bytes());
                    b.extend_from_slice(&rest[..6]); // command, status
                    b.extend_from_slice(&count.to_le_bytes());
                    b.extend_from_slice(&rest[6..22]); // value, failed, entry
                    b.extend_from_slice(&fill(&pattern, states_len));
                    b.extend_from_slice(&msg_len.to_le_bytes());
                    b.extend_from_slice(&fill(&pattern, msg_bytes + tail));
                    b
                },
            )
        })
}

/// Names built from the parser's own alphabet: components with each
/// prefix (right, wrong, lower case), numbers with leading zeros, signs,
/// spaces, overflowing digits; 0 to 6 of them, joined by 1 or 2 slashes.
fn name_like() -> impl Strategy<Value = String> {
    let prefix = prop_oneof![
        Just(""),
        Just("L"),
        Just("B"),
        Just("H"),
        Just("K"),
        Just("V"),
        Just("l"),
        Just("k"),
        Just("+"),
    ];
    let number = prop_oneof![
        Just(String::new()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<u32>().prop_map(|n| n.to_string()),
        (0u8..10).prop_map(|n| n.to_string()),
        "[0-9+\\- ]{1,24}",
        Just("18446744073709551616".to_string()),
        Just("4294967296".to_string()),
        Just("0".to_string()),
        Just("00".to_string()),
        Just("٣".to_string()),
    ];
    let sep = prop_oneof![8 => Just("/"), 1 => Just("//"), 1 => Just("")];
    proptest::collection::vec((prefix, number, sep), 0..6).prop_map(|v| {
        let mut s = String::new();
        for (i, (p, n, sep)) in v.iter().enumerate() {
            if i > 0 {
                s.push_str(sep);
            }
            s.push_str(p);
            s.push_str(n);
        }
        s
    })
}

fn group_key() -> impl Strategy<Value = GroupKey> {
    (any::<u32>(), any::<u64>(), any::<u32>(), any::<bool>())
        .prop_map(|(l, b, h, v)| GroupKey::new(l, b, h, if v { Kind::V } else { Kind::K }))
}

// -------------------------------------------------------------- properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn arbitrary_bytes_never_break_the_decoders(b in proptest::collection::vec(any::<u8>(), 0..4096)) {
        check_request(&b)?;
        check_reply(&b)?;
    }

    #[test]
    fn arbitrary_bytes_behind_a_request_header(
        magic in any::<bool>(),
        command in 0u16..10,
        b in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        // Valid magic/version/command and reserved 0 over random bytes:
        // random counts and args with a random body.
        let mut b = b;
        b.resize(b.len().max(HEADER_BYTES), 0);
        if magic {
            b[0..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
            b[4..6].copy_from_slice(&VERSION.to_le_bytes());
            b[6..8].copy_from_slice(&command.to_le_bytes());
            b[12..16].fill(0);
        }
        check_request(&b)?;
    }

    #[test]
    fn hostile_request_headers(b in hostile_request()) {
        check_request(&b)?;
        // Every prefix (a short read) is refused, never misread.
        for cut in [0, 1, HEADER_BYTES - 1, HEADER_BYTES, b.len().saturating_sub(1)] {
            if cut < b.len() {
                check_request(&b[..cut])?;
            }
        }
    }

    #[test]
    fn hostile_reply_headers(b in hostile_reply()) {
        check_reply(&b)?;
        for cut in [0, HEADER_BYTES + 3, HEADER_BYTES + 4, b.len().saturating_sub(1)] {
            if cut < b.len() {
                check_reply(&b[..cut])?;
            }
        }
    }

    #[test]
    fn arbitrary_strings_never_break_the_name_parser(s in any::<String>()) {
        check_name(&s)?;
    }

    #[test]
    fn name_like_strings_parse_only_when_canonical(s in name_like()) {
        check_name(&s)?;
    }

    #[test]
    fn group_names_round_trip(k in group_key()) {
        let name = k.to_string();
        prop_assert_eq!(parse_group_name(&name), Ok(k));
        prop_assert_eq!(parse_path(&name), Ok(ParsedPath::Group(k)));
        let dirs = [
            ParsedPath::Layer(k.layer),
            ParsedPath::Block(k.layer, k.block),
            ParsedPath::Head(k.layer, k.block, k.head),
        ];
        for p in dirs {
            prop_assert_eq!(parse_path(&format_path(&p)), Ok(p));
            prop_assert!(parse_group_name(&format_path(&p)).is_err());
        }
        check_name(&name)?;
    }
}

#[test]
fn seeds_decode() {
    // A few fixed cases the strategies hit only by chance.
    let hello = encode_request(&kvfs::control::wire::Request::Hello);
    check_request(&hello).unwrap();
    let mut b = hello.clone();
    b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    check_request(&b).unwrap();
    for cmd in [Command::Register, Command::Restore, Command::Query] {
        let mut b = hello.clone();
        b[6..8].copy_from_slice(&(cmd as u16).to_le_bytes());
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_request(&b),
            Err(DecodeError::TooMany { .. })
        ));
    }
    let mut r = vec![0u8; HEADER_BYTES + 4];
    r[0..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
    r[4..6].copy_from_slice(&VERSION.to_le_bytes());
    r[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(Reply::decode(&r).is_err());
    r[12..16].fill(0);
    r[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(Reply::decode(&r).is_err());
    r[32..36].fill(0);
    assert_eq!(Reply::decode(&r).unwrap().1, HEADER_BYTES + 4);
    check_reply(&r).unwrap();
    for s in ["", "L0/B12/H3/K", "L03/B12/H3/K", "L0/B12/H3/K/", "L٣"] {
        check_name(s).unwrap();
    }
}

use super::*;
use proptest::prelude::*;

#[test]
fn the_layout_json_names_every_field_and_reads_back() {
    let l = GroupLayout::preset("llama-3.1-8b", 4096, 16).unwrap();
    let m = MountLayout::new(&l, 1000, "uring", "sieve", false);
    let json = m.to_json();
    for field in [
        "\"layers\":32",
        "\"blocks\":4096",
        "\"kv_heads\":8",
        "\"block_tokens\":16",
        "\"head_dim\":128",
        "\"dtype\":\"bf16\"",
        "\"group_bytes\":4096",
        "\"stride\":4096",
        "\"groups\":2097152",
        "\"t1_bytes\":4096000",
        "\"t1_slots\":1000",
        "\"tier\":\"uring\"",
        "\"policy\":\"sieve\"",
        "\"t1_pinned\":false",
    ] {
        assert!(json.contains(field), "{field} missing from {json}");
    }
    assert_eq!(MountLayout::from_json(&json).unwrap(), m);
    assert!(MountLayout::from_json("{\"layers\":1}").is_err());
}

fn key_strategy() -> impl Strategy<Value = RawKey> {
    (any::<u32>(), any::<u64>(), any::<u32>(), 0u32..3).prop_map(|(layer, block, head, kind)| {
        RawKey {
            layer,
            block,
            head,
            kind,
        }
    })
}

/// Contiguous entries, or strided ones (a contiguous entry has no pitch).
fn entry_strategy() -> impl Strategy<Value = IoEntry> {
    (
        key_strategy(),
        any::<u32>(),
        any::<u64>(),
        prop_oneof![Just((0u32, 0u64)), (1u32.., any::<u64>())],
    )
        .prop_map(|(key, region, offset, (row_bytes, pitch))| IoEntry {
            key,
            region,
            offset,
            row_bytes,
            pitch,
        })
}

fn request_strategy() -> impl Strategy<Value = Request> {
    prop_oneof![
        Just(Request::Hello),
        (
            proptest::collection::vec(any::<u8>(), 0..100),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(path, len, flags)| Request::Register { path, len, flags }),
        any::<u32>().prop_map(|region| Request::Unregister { region }),
        (any::<u32>(), any::<u64>(), 0..=MAX_ENTRIES, any::<bool>()).prop_map(
            |(region, offset, count, restore)| {
                let at = EntriesAt {
                    region,
                    offset,
                    count,
                    strided: count % 2 == 1,
                };
                if restore {
                    Request::RestoreFrom(at)
                } else {
                    Request::StoreFrom(at)
                }
            }
        ),
        (proptest::collection::vec(entry_strategy(), 0..20), 0..4u8).prop_map(|(v, how)| {
            let plain = || {
                v.iter()
                    .map(|e| IoEntry::new(e.key, e.region, e.offset))
                    .collect()
            };
            match how {
                0 => Request::Restore(plain()),
                1 => Request::Store(plain()),
                2 => Request::RestoreStrided(v),
                _ => Request::StoreStrided(v),
            }
        }),
        proptest::collection::vec(key_strategy(), 0..20).prop_map(Request::Query),
        proptest::collection::vec(key_strategy(), 0..20).prop_map(Request::Prefetch),
        (any::<u64>(), any::<u64>())
            .prop_map(|(ticket, timeout_ms)| Request::Wait { ticket, timeout_ms }),
        (any::<u32>(), any::<u64>(), any::<u32>()).prop_map(|(region, offset, entries)| {
            Request::Ring {
                region,
                offset,
                entries,
            }
        }),
    ]
}

proptest! {
    #[test]
    fn requests_round_trip(r in request_strategy()) {
        let b = encode_request(&r);
        prop_assert_eq!(request_len(&b).unwrap().1, b.len());
        prop_assert_eq!(decode_request(&b).unwrap(), r);
    }

    #[test]
    fn decoding_garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = decode_request(&b);
        let _ = request_len(&b);
        let _ = Reply::decode(&b);
    }

    #[test]
    fn mutated_requests_never_panic(r in request_strategy(), at in any::<usize>(), x in any::<u8>(), cut in any::<usize>()) {
        let mut b = encode_request(&r);
        if !b.is_empty() {
            let i = at % b.len();
            b[i] ^= x;
            let c = cut % (b.len() + 1);
            let _ = decode_request(&b[..c]);
            let _ = decode_request(&b);
        }
    }

    #[test]
    fn replies_round_trip(status in any::<u32>(), value in any::<u64>(), failed in any::<u32>(), entry in any::<u32>(),
                          states in proptest::collection::vec((0u8..3, any::<bool>(), any::<Option<u32>>()), 0..10), message in ".{0,40}") {
        let r = Reply { command: 6, status, value, failed, entry,
            states: states.into_iter().map(|(state, dirty, backing_crc)| StateEntry { state, dirty, backing_crc }).collect(), message };
        let mut b = r.encode();
        let n = b.len();
        b.extend_from_slice(&[0xaa; 7]);
        prop_assert_eq!(Reply::decode(&b).unwrap(), (r, n));
    }
}

#[test]
fn bad_requests_say_why() {
    let good = encode_request(&Request::Query(vec![RawKey {
        layer: 1,
        block: 2,
        head: 3,
        kind: 0,
    }]));
    assert_eq!(decode_request(&good[..10]), Err(DecodeError::Short(10)));
    let e = decode_request(&good[..good.len() - 1]).unwrap_err();
    assert!(e.to_string().contains("needs 56 bytes, got 55"), "{e}");
    let mut b = good.clone();
    b[4] = 9;
    assert_eq!(decode_request(&b), Err(DecodeError::Version(9)));
    let mut b = good.clone();
    b[6] = 77;
    assert_eq!(decode_request(&b), Err(DecodeError::Command(77)));
    let mut b = good.clone();
    b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode_request(&b),
        Err(DecodeError::TooMany { .. })
    ));
    let mut b = good;
    b[0] = b'X';
    assert!(matches!(decode_request(&b), Err(DecodeError::Magic(_))));
}

/// A RESTORE's arg0 bits 16–31 name a done word (index + 1) and
/// decode as the same request; a STORE's are unknown flags.
#[test]
fn a_restore_names_a_done_word_in_arg0() {
    let e = vec![IoEntry {
        key: RawKey {
            layer: 1,
            block: 2,
            head: 0,
            kind: 1,
        },
        region: 3,
        offset: 4096,
        row_bytes: 0,
        pitch: 0,
    }];
    let plain = encode_request(&Request::Restore(e.clone()));
    let header = |b: &[u8]| request_len(b).unwrap().0;
    assert_eq!(done_word(&header(&plain)), None);
    for word in [0u16, 7, u16::MAX - 1] {
        let mut b = plain.clone();
        b[16..24].copy_from_slice(&((word as u64 + 1) << DONE_WORD_SHIFT).to_le_bytes());
        assert_eq!(done_word(&header(&b)), Some(word));
        assert_eq!(decode_request(&b).unwrap(), Request::Restore(e.clone()));
    }
    let mut b = encode_request(&Request::Store(e));
    b[16..24].copy_from_slice(&(1u64 << DONE_WORD_SHIFT).to_le_bytes());
    let err = decode_request(&b).unwrap_err();
    assert!(matches!(err, DecodeError::Flags { .. }), "{err}");
    assert!(err.to_string().contains("done word"), "{err}");
    let store = Header {
        command: Command::Store as u16,
        count: 1,
        arg0: 1 << DONE_WORD_SHIFT,
        arg1: 0,
    };
    assert_eq!(done_word(&store), None);
}

#[test]
fn ioctl_numbers() {
    let c = ioctl_cmd(4096);
    assert_eq!(ioctl_len(c), Some(4096));
    assert_eq!(ioctl_len(0x5401), None); // TCGETS
    // _IOWR('K', 1, 32) as C computes it.
    assert_eq!(ioctl_cmd(32), 0xc020_4b01);
}

//! Fuzzes the control-request decoder (`request_len`, `decode_request`,
//! `decode_io_entries`): no panic, no out-of-bounds access, and these
//! oracles:
//! - `request_len` and `decode_request` agree: a decoded request is exactly
//!   `request_len` bytes, and a `request_len` error is `decode_request`'s;
//! - framing: whenever `request_len` says `n` and `n` bytes are present,
//!   the first `n` bytes decode (only UNREGISTER's region-id check remains);
//! - round trip: `encode_request(decode_request(b))` is `b` with the fields
//!   the decoder ignores set to 0 (see `canonical`), and decodes back to the
//!   same request.
#![no_main]

use kvfs::control::wire::{
    Command, DecodeError, ENTRIES_IN_REGION, HEADER_BYTES, Header, IO_ENTRY_BYTES, KEY_ENTRY_BYTES,
    decode_io_entries, decode_request, encode_request, request_len,
};
use libfuzzer_sys::fuzz_target;

/// `b` (a request `decode_request` accepted) with every field the decoder
/// does not carry into `Request` set to 0, i.e. what `encode_request`
/// must give back. REGISTER and RESTORE/STORE with entries in a region
/// keep every header field verbatim.
fn canonical(b: &[u8], h: &Header) -> Vec<u8> {
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
                // arg0's high 32 bits (a region id without the flag) and arg1.
                c[20..32].fill(0);
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
        Command::Completion => unreachable!("refused by request_len"),
    }
    c
}

fuzz_target!(|data: &[u8]| {
    let entries = decode_io_entries(data);
    assert_eq!(entries.len(), data.len() / IO_ENTRY_BYTES);

    let len = request_len(data);
    let dec = decode_request(data);
    if let Err(e) = &dec {
        let _ = e.to_string();
    }
    match (&len, &dec) {
        (Ok((h, n)), Ok(r)) => {
            assert_eq!(*n, data.len(), "decoded request of the wrong length");
            let enc = encode_request(r);
            assert_eq!(enc, canonical(data, h), "re-encoding differs");
            assert_eq!(decode_request(&enc).as_ref(), Ok(r), "re-decoding differs");
        }
        (Ok((h, n)), Err(e)) => {
            if *n == data.len() {
                assert!(
                    h.command == Command::Unregister as u16
                        && matches!(e, DecodeError::RegionId(_)),
                    "request_len accepted {n} bytes but decode_request said {e:?}"
                );
            } else {
                assert!(matches!(e, DecodeError::Length { .. }), "{e:?}");
            }
        }
        (Err(le), Err(e)) => assert_eq!(le, e),
        (Err(le), Ok(r)) => panic!("request_len refused ({le:?}) what decoded as {r:?}"),
    }

    // Framing, as a stream reader does it: the header says how long the
    // request is; those bytes then decode.
    if let Ok((h, n)) = len
        && n <= data.len()
    {
        match decode_request(&data[..n]) {
            Ok(_) => {}
            Err(DecodeError::RegionId(_)) if h.command == Command::Unregister as u16 => {}
            Err(e) => panic!("request_len said {n} bytes but they do not decode: {e:?}"),
        }
    }
});

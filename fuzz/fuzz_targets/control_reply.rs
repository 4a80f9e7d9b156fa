//! Fuzzes the client's reply decoder (`Reply::decode`): no panic, no
//! out-of-bounds access, and these oracles for an accepted reply of `n`
//! bytes:
//! - `n` is `32 + 8 × count + 4 + message length` and at most the input;
//! - the first `n` bytes alone decode the same; `n - 1` bytes do not;
//! - `Reply::encode` gives back those `n` bytes with state pads set to 0,
//!   dirty bytes as 0/1 and the message as `from_utf8_lossy` made it, and
//!   that encoding decodes to the same reply.
#![no_main]

use kvfs::control::wire::{HEADER_BYTES, Reply, STATE_ENTRY_BYTES};
use libfuzzer_sys::fuzz_target;

fn canonical(b: &[u8], states: usize) -> Vec<u8> {
    let states_end = HEADER_BYTES + STATE_ENTRY_BYTES * states;
    let mut c = b[..states_end].to_vec();
    for e in c[HEADER_BYTES..].chunks_exact_mut(STATE_ENTRY_BYTES) {
        e[1] = (e[1] != 0) as u8;
        e[2..4].fill(0);
    }
    let msg = String::from_utf8_lossy(&b[states_end + 4..]);
    c.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    c.extend_from_slice(msg.as_bytes());
    c
}

fuzz_target!(|data: &[u8]| {
    let Ok((r, n)) = Reply::decode(data) else {
        return;
    };
    assert!(
        n <= data.len(),
        "reply of {n} bytes in {} bytes",
        data.len()
    );
    let states_end = HEADER_BYTES + STATE_ENTRY_BYTES * r.states.len();
    let msg_len = u32::from_le_bytes(data[states_end..states_end + 4].try_into().unwrap());
    assert_eq!(n, states_end + 4 + msg_len as usize);

    assert_eq!(Reply::decode(&data[..n]), Ok((r.clone(), n)));
    assert!(Reply::decode(&data[..n - 1]).is_err());

    let enc = r.encode();
    assert_eq!(enc, canonical(&data[..n], r.states.len()));
    assert_eq!(Reply::decode(&enc), Ok((r, enc.len())));
});

//! Cluster routing: which master owns a key.
//!
//! Redis Cluster splits keys into 16384 slots, `CRC16/XMODEM(tag) mod
//! 16384`, where the tag is the text between the first `{` and the next `}`
//! when that is non-empty, else the whole key. The slot map is a plain
//! array of node numbers (32 KiB), rebuilt from `CLUSTER SLOTS` whenever a
//! `MOVED` reply shows it stale. A standalone server is the map where every
//! slot is node 0.

/// Slots in a Redis Cluster (fixed by the protocol).
pub(super) const SLOTS: usize = 16384;

/// Marks a slot no master serves.
const UNOWNED: u16 = u16::MAX;

/// CRC16/XMODEM (poly 0x1021, init 0), the checksum Redis Cluster hashes with.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The cluster slot of `key`, honouring hash tags.
pub(super) fn key_slot(key: &[u8]) -> u16 {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(tag) % SLOTS as u16
}

/// Slot → node number.
#[derive(Clone)]
pub(super) struct SlotMap {
    owner: Vec<u16>,
}

impl SlotMap {
    /// Every slot on node 0: a standalone server.
    pub(super) fn single() -> SlotMap {
        SlotMap {
            owner: vec![0; SLOTS],
        }
    }

    pub(super) fn empty() -> SlotMap {
        SlotMap {
            owner: vec![UNOWNED; SLOTS],
        }
    }

    /// Gives slots `start..=end` to `node` (ranges past the last slot are clipped).
    pub(super) fn assign(&mut self, start: u16, end: u16, node: u16) {
        let end = (end as usize).min(SLOTS - 1);
        for s in start as usize..=end {
            self.owner[s] = node;
        }
    }

    pub(super) fn owner(&self, slot: u16) -> Option<usize> {
        match self.owner.get(slot as usize) {
            Some(&n) if n != UNOWNED => Some(n as usize),
            _ => None,
        }
    }

    /// Slots no node serves.
    pub(super) fn unowned(&self) -> usize {
        self.owner.iter().filter(|&&n| n == UNOWNED).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_and_slots_match_redis() {
        // From the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
    }

    #[test]
    fn map_assigns_and_reports_holes() {
        let mut m = SlotMap::empty();
        m.assign(0, 8191, 0);
        assert_eq!(m.unowned(), 8192);
        m.assign(8192, 16383, 1);
        assert_eq!(m.owner(0), Some(0));
        assert_eq!(m.owner(16383), Some(1));
        assert_eq!(m.unowned(), 0);
    }
}

//! The inode scheme: arithmetic, no tables.
//!
//! Inodes below `FIRST_DYNAMIC` are fixed (root and `.kvfs/…`). Above it,
//! ranges follow in order: layer directories, block directories, head
//! directories, group files, then `.kvfs/resident/` symlinks (one per
//! group index). Each range is as long as the layout needs, so every inode
//! decodes back to what it names by subtraction and division alone.

use crate::geometry::{GroupIndex, GroupLayout};

pub const ROOT: u64 = 1;
pub const KVFS_DIR: u64 = 2;
pub const STATS: u64 = 3;
pub const LAYOUT: u64 = 4;
pub const RESIDENT_DIR: u64 = 5;
pub const FLUSH: u64 = 6;
pub const PID: u64 = 7;
pub const CONTROL: u64 = 8;
/// First inode of the computed ranges; room below for more fixed files.
pub const FIRST_DYNAMIC: u64 = 64;

/// What an inode names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    Root,
    KvfsDir,
    Stats,
    Layout,
    ResidentDir,
    Flush,
    Pid,
    Control,
    Layer(u32),
    Block(u32, u64),
    Head(u32, u64, u32),
    Group(GroupIndex),
    Resident(GroupIndex),
}

/// Names in `.kvfs/` and their inodes.
pub const KVFS_FILES: &[(&str, u64)] = &[
    ("stats", STATS),
    ("layout", LAYOUT),
    ("resident", RESIDENT_DIR),
    ("flush", FLUSH),
    ("pid", PID),
    ("control", CONTROL),
];

pub struct Inodes {
    layout: GroupLayout,
    block_base: u64,
    head_base: u64,
    group_base: u64,
    resident_base: u64,
    end: u64,
}

impl Inodes {
    pub fn new(layout: GroupLayout) -> Inodes {
        let layers = layout.layers as u64;
        let blocks = layers * layout.blocks;
        let heads = blocks * layout.kv_heads as u64;
        let groups = layout.group_count();
        let block_base = FIRST_DYNAMIC + layers;
        let head_base = block_base + blocks;
        let group_base = head_base + heads;
        let resident_base = group_base + groups;
        Inodes {
            layout,
            block_base,
            head_base,
            group_base,
            resident_base,
            end: resident_base + groups,
        }
    }

    pub fn ino(&self, n: Node) -> u64 {
        let l = &self.layout;
        match n {
            Node::Root => ROOT,
            Node::KvfsDir => KVFS_DIR,
            Node::Stats => STATS,
            Node::Layout => LAYOUT,
            Node::ResidentDir => RESIDENT_DIR,
            Node::Flush => FLUSH,
            Node::Pid => PID,
            Node::Control => CONTROL,
            Node::Layer(x) => FIRST_DYNAMIC + x as u64,
            Node::Block(x, b) => self.block_base + x as u64 * l.blocks + b,
            Node::Head(x, b, h) => {
                self.head_base + (x as u64 * l.blocks + b) * l.kv_heads as u64 + h as u64
            }
            Node::Group(g) => self.group_base + g.0,
            Node::Resident(g) => self.resident_base + g.0,
        }
    }

    pub fn node(&self, ino: u64) -> Option<Node> {
        let l = &self.layout;
        Some(match ino {
            ROOT => Node::Root,
            KVFS_DIR => Node::KvfsDir,
            STATS => Node::Stats,
            LAYOUT => Node::Layout,
            RESIDENT_DIR => Node::ResidentDir,
            FLUSH => Node::Flush,
            PID => Node::Pid,
            CONTROL => Node::Control,
            i if i < FIRST_DYNAMIC || i >= self.end => return None,
            i if i < self.block_base => Node::Layer((i - FIRST_DYNAMIC) as u32),
            i if i < self.head_base => {
                let k = i - self.block_base;
                Node::Block((k / l.blocks) as u32, k % l.blocks)
            }
            i if i < self.group_base => {
                let k = i - self.head_base;
                let h = (k % l.kv_heads as u64) as u32;
                let lb = k / l.kv_heads as u64;
                Node::Head((lb / l.blocks) as u32, lb % l.blocks, h)
            }
            i if i < self.resident_base => Node::Group(GroupIndex(i - self.group_base)),
            i => Node::Resident(GroupIndex(i - self.resident_base)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Dtype, GroupKey, Kind};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn inodes_round_trip(layers in 1u32..50, blocks in 1u64..3000, heads in 1u32..9, r in any::<u64>()) {
            let layout = GroupLayout::new(layers, blocks, heads, 16, 128, Dtype::Bf16).unwrap();
            let ino = Inodes::new(layout);
            let g = GroupIndex(r % layout.group_count());
            let k = layout.key(g).unwrap();
            for n in [
                Node::Group(g), Node::Resident(g), Node::Layer(k.layer),
                Node::Block(k.layer, k.block), Node::Head(k.layer, k.block, k.head),
            ] {
                prop_assert_eq!(ino.node(ino.ino(n)), Some(n));
            }
            prop_assert_eq!(ino.node(ino.end), None);
        }
    }

    #[test]
    fn fixed_and_out_of_range() {
        let layout = GroupLayout::new(2, 3, 2, 16, 128, Dtype::Bf16).unwrap();
        let ino = Inodes::new(layout);
        assert_eq!(ino.node(ROOT), Some(Node::Root));
        assert_eq!(ino.node(0), None);
        assert_eq!(ino.node(FIRST_DYNAMIC - 1), None);
        let last = layout.index(GroupKey::new(1, 2, 1, Kind::V)).unwrap();
        assert_eq!(ino.node(ino.ino(Node::Resident(last)) + 1), None);
    }
}

//! The directory tree, computed from the layout rather than stored: a name
//! resolves to a node (`child`) and a directory's entry `i` is found (`entry`)
//! by arithmetic, so memory and mount time do not grow with the geometry.
//! readdir pages through entries by offset (0 is `.`, 1 is `..`, 2 + i is
//! entry i); only `.kvfs/resident/` is listed up front, at opendir, so its
//! offsets stay stable while groups come and go.

use super::{Handle, KVFS_FILES, KvFs, Node};
use crate::cascade::Residence;
use crate::geometry::{GroupIndex, GroupKey, Kind, parse_group_name};
use fuser::{FileHandle, INodeNo, ReplyDirectory};

impl KvFs {
    /// Looks up `name` in directory `parent`.
    pub(super) fn child(&self, parent: Node, name: &str) -> Option<Node> {
        use crate::geometry::name_component as comp;
        let l = self.cascade.layout();
        let n = match parent {
            Node::Root if name == ".kvfs" => Node::KvfsDir,
            Node::Root => {
                let x = comp(name, 'L')?;
                (x < l.layers as u64).then_some(Node::Layer(x as u32))?
            }
            Node::Layer(x) => {
                let b = comp(name, 'B')?;
                (b < l.blocks).then_some(Node::Block(x, b))?
            }
            Node::Block(x, b) => {
                let h = comp(name, 'H')?;
                (h < l.kv_heads as u64).then_some(Node::Head(x, b, h as u32))?
            }
            Node::Head(x, b, h) => {
                let kind = match name {
                    "K" => Kind::K,
                    "V" => Kind::V,
                    _ => return None,
                };
                Node::Group(l.index(GroupKey::new(x, b, h, kind)).ok()?)
            }
            Node::KvfsDir => {
                let ino = KVFS_FILES.iter().find(|(n, _)| *n == name)?.1;
                self.inodes.node(ino)?
            }
            Node::ResidentDir => {
                let path = name.replace('.', "/");
                let g = l.index(parse_group_name(&path).ok()?).ok()?;
                (self.cascade.query(g).ok()?.residence == Residence::T1)
                    .then_some(Node::Resident(g))?
            }
            _ => return None,
        };
        Some(n)
    }

    /// Entry number `i` of directory `dir` (after `.` and `..`).
    fn entry(&self, dir: Node, i: u64, resident: Option<&[GroupIndex]>) -> Option<(Node, String)> {
        let l = self.cascade.layout();
        Some(match dir {
            Node::Root if i == 0 => (Node::KvfsDir, ".kvfs".into()),
            Node::Root => {
                let x = i - 1;
                (x < l.layers as u64).then(|| (Node::Layer(x as u32), format!("L{x}")))?
            }
            Node::Layer(x) => (i < l.blocks).then(|| (Node::Block(x, i), format!("B{i}")))?,
            Node::Block(x, b) => {
                (i < l.kv_heads as u64).then(|| (Node::Head(x, b, i as u32), format!("H{i}")))?
            }
            Node::Head(x, b, h) => {
                let kind = [Kind::K, Kind::V].get(i as usize)?;
                let g = l.index(GroupKey::new(x, b, h, *kind)).ok()?;
                (Node::Group(g), kind.letter().to_string())
            }
            Node::KvfsDir => {
                let (name, ino) = KVFS_FILES.get(i as usize)?;
                (self.inodes.node(*ino)?, name.to_string())
            }
            Node::ResidentDir => {
                let g = *resident?.get(i as usize)?;
                (Node::Resident(g), self.resident_name(g))
            }
            _ => return None,
        })
    }

    fn parent_of(&self, dir: Node) -> Node {
        match dir {
            Node::Layer(_) | Node::KvfsDir | Node::Root => Node::Root,
            Node::Block(x, _) => Node::Layer(x),
            Node::Head(x, b, _) => Node::Block(x, b),
            _ => Node::KvfsDir,
        }
    }

    /// Answers a readdir of `dir` from `offset` on.
    pub(super) fn list_dir(
        &self,
        dir: Node,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let handles = self.handles.lock();
        let resident = match handles.get(&fh.0) {
            Some(Handle::Resident(v)) => Some(v.as_slice()),
            _ => None,
        };
        // Offsets: 0 is ".", 1 is "..", 2 + i is entry i; the offset given
        // with each entry is the one to resume after it.
        let mut off = offset;
        loop {
            let (node, name) = match off {
                0 => (dir, ".".to_string()),
                1 => (self.parent_of(dir), "..".to_string()),
                _ => match self.entry(dir, off - 2, resident) {
                    Some(e) => e,
                    None => break,
                },
            };
            let kind = self.attr(node).kind;
            if reply.add(INodeNo(self.inodes.ino(node)), off + 1, kind, &name) {
                break;
            }
            off += 1;
        }
        drop(handles);
        reply.ok();
    }
}

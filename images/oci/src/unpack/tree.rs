//! The merged tree of an image's layers, in memory: names and metadata, with each file's bytes in a
//! [`Spool`] under a content id. Layer rules (the OCI image spec's, as umoci and containerd apply them):
//!
//! - An entry replaces what its name held, except that a directory over a directory keeps its children.
//! - `.wh.NAME` removes `NAME` as lower layers left it; `.wh..wh..opq` hides everything lower layers put in
//!   its directory. Neither removes what its own layer wrote, whatever order the entries come in.
//! - A hardlink names an earlier file of the tree and shares its content.
//! - Device nodes and FIFOs are dropped (counted): a sandbox's `/dev` is the guest kernel's.
//! - A missing parent directory is made (0755, root's).
//!
//! Refused, each with its own error: a parent that is a symlink (a later entry would be placed through it,
//! out of the tree if it points out), a parent that is a file, a malformed whiteout, a hardlink to nothing,
//! an entry type with no meaning here, and more entries or bytes than the limits allow (a decompression bomb).

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read};

use tar::EntryType;

use super::path::{self, PathError};

/// A file's bytes in the spool.
pub type ContentId = u64;

/// Where file contents go as the layers stream by.
pub trait Spool {
    /// Stores `data` (exactly `size` bytes) under `id`.
    ///
    /// # Errors
    /// The store failed.
    fn put(&mut self, id: ContentId, data: &mut dyn Read, size: u64) -> io::Result<()>;
}

/// Bounds on what the layers of one image may hold together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Entries of all layers.
    pub entries: u64,
    /// Bytes of file content of all layers (uncompressed).
    pub bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self { entries: 1_000_000, bytes: 16 * 1024 * 1024 * 1024 }
    }
}

/// Owner and mode, from the entry's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits, setuid, setgid and sticky (`0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u64,
    /// Group.
    pub gid: u64,
}

const IMPLICIT_DIR: Meta = Meta { mode: 0o755, uid: 0, gid: 0 };

/// One node of the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// A directory and its children by name.
    Dir(Meta, BTreeMap<Vec<u8>, Child>),
    /// A regular file; files that share a content id are hardlinks of each other.
    File(Meta, ContentId, u64),
    /// A symlink and its target, kept as written (it is resolved in the guest, never here).
    Symlink(Meta, Vec<u8>),
}

/// A node and the last layer that wrote it (or a path below it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Child {
    /// The node.
    pub node: Node,
    layer: u32,
}

/// Why a layer could not be applied. The path in each is the entry's name, cut for display.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The entry's name was refused.
    #[error("layer {layer}: {source}")]
    Path {
        /// Which layer, from 1.
        layer: u32,
        /// Why.
        #[source]
        source: PathError,
    },
    /// A parent of the entry is a symlink.
    #[error("layer {layer}: {entry:?} would be placed through the symlink {link:?}")]
    ThroughSymlink {
        /// Which layer.
        layer: u32,
        /// The entry.
        entry: String,
        /// The symlink on its path.
        link: String,
    },
    /// A parent of the entry is a file.
    #[error("layer {layer}: a parent of {0:?} is not a directory", entry)]
    NotADirectory {
        /// Which layer.
        layer: u32,
        /// The entry.
        entry: String,
    },
    /// `.wh.` with no name, or naming `.`, `..` or another whiteout.
    #[error("layer {layer}: malformed whiteout {entry:?}")]
    Whiteout {
        /// Which layer.
        layer: u32,
        /// The entry.
        entry: String,
    },
    /// A hardlink whose target is not a file of the tree.
    #[error("layer {layer}: hardlink {entry:?} to {target:?}, which is not a file in the image")]
    Hardlink {
        /// Which layer.
        layer: u32,
        /// The entry.
        entry: String,
        /// Its target.
        target: String,
    },
    /// An entry type with no meaning in a root filesystem (GNU sparse, multivolume...).
    #[error("layer {layer}: unsupported entry type {kind:?} for {entry:?}")]
    Unsupported {
        /// Which layer.
        layer: u32,
        /// The entry.
        entry: String,
        /// The tar type byte.
        kind: u8,
    },
    /// Over the entry limit.
    #[error("the image has more than {0} entries")]
    TooManyEntries(u64),
    /// Over the byte limit.
    #[error("the image unpacks to more than {0} bytes")]
    TooLarge(u64),
    /// The tar stream is broken (or its blob failed verification).
    #[error("layer {layer}: unreadable tar stream")]
    Tar {
        /// Which layer.
        layer: u32,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The spool failed.
    #[error("cannot store the content of {entry:?}")]
    Spool {
        /// The entry.
        entry: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// What one layer did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayerStats {
    /// Entries read.
    pub entries: u64,
    /// Content bytes stored.
    pub bytes: u64,
    /// Device nodes and FIFOs dropped.
    pub dropped: u64,
}

/// The merged tree.
#[derive(Debug)]
pub struct Tree {
    root: Child,
    limits: Limits,
    layer: u32,
    next_content: ContentId,
    entries: u64,
    bytes: u64,
}

const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";

fn shown(name: &[u8]) -> String {
    String::from_utf8_lossy(&name[..name.len().min(200)]).into_owned()
}

impl Tree {
    /// An empty tree (a root directory, 0755, root's).
    pub fn new(limits: Limits) -> Self {
        let root = Child { node: Node::Dir(IMPLICIT_DIR, BTreeMap::new()), layer: 0 };
        Self { root, limits, layer: 0, next_content: 0, entries: 0, bytes: 0 }
    }

    /// The root directory.
    pub fn root(&self) -> &Node {
        &self.root.node
    }

    /// Applies the next layer, an uncompressed tar stream, storing file contents in `spool`.
    ///
    /// # Errors
    /// [`UnpackError`]; the tree is then unusable (an image is applied whole or not at all).
    pub fn apply(&mut self, layer: impl Read, spool: &mut dyn Spool) -> Result<LayerStats, UnpackError> {
        self.layer += 1;
        let n = self.layer;
        let broken = |source| UnpackError::Tar { layer: n, source };
        let mut archive = tar::Archive::new(layer);
        let mut stats = LayerStats::default();
        for entry in archive.entries().map_err(broken)? {
            let mut entry = entry.map_err(broken)?;
            self.entries += 1;
            stats.entries += 1;
            if self.entries > self.limits.entries {
                return Err(UnpackError::TooManyEntries(self.limits.entries));
            }
            let name = entry.path_bytes().into_owned();
            let header = entry.header();
            let meta = Meta {
                mode: header.mode().map_err(broken)? & 0o7777,
                uid: header.uid().map_err(broken)?,
                gid: header.gid().map_err(broken)?,
            };
            let kind = header.entry_type();
            let parts = path::components(&name).map_err(|source| UnpackError::Path { layer: n, source })?;
            let node = match kind {
                EntryType::Directory => Node::Dir(meta, BTreeMap::new()),
                EntryType::Regular | EntryType::Continuous => {
                    let size = entry.size();
                    if self.bytes.saturating_add(size) > self.limits.bytes {
                        return Err(UnpackError::TooLarge(self.limits.bytes));
                    }
                    self.bytes += size;
                    stats.bytes += size;
                    let id = self.next_content;
                    self.next_content += 1;
                    if !is_whiteout(&parts) {
                        spool
                            .put(id, &mut entry, size)
                            .map_err(|source| UnpackError::Spool { entry: shown(&name), source })?;
                    }
                    Node::File(meta, id, size)
                }
                EntryType::Symlink => {
                    let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                    Node::Symlink(meta, target)
                }
                EntryType::Link => {
                    let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
                    self.hardlink_target(&name, &target)?
                }
                EntryType::Char | EntryType::Block | EntryType::Fifo => {
                    stats.dropped += 1;
                    continue;
                }
                EntryType::XGlobalHeader => continue,
                other => return Err(UnpackError::Unsupported { layer: n, entry: shown(&name), kind: other.as_byte() }),
            };
            self.place(&name, parts, node)?;
        }
        Ok(stats)
    }

    /// The file a hardlink names, as a node sharing its content.
    fn hardlink_target(&self, name: &[u8], target: &[u8]) -> Result<Node, UnpackError> {
        let refused = || UnpackError::Hardlink { layer: self.layer, entry: shown(name), target: shown(target) };
        let parts = path::components(target).map_err(|_| refused())?;
        let mut node = &self.root.node;
        for part in &parts {
            let Node::Dir(_, children) = node else { return Err(refused()) };
            node = &children.get(part).ok_or_else(refused)?.node;
        }
        match node {
            Node::File(..) => Ok(node.clone()),
            _ => Err(refused()),
        }
    }

    /// Puts `node` at `parts`, or applies it as a whiteout.
    fn place(&mut self, name: &[u8], mut parts: Vec<Vec<u8>>, node: Node) -> Result<(), UnpackError> {
        let layer = self.layer;
        let Some(last) = parts.pop() else {
            // `./` itself: the root's metadata.
            if let (Node::Dir(meta, _), Node::Dir(root_meta, _)) = (node, &mut self.root.node) {
                *root_meta = meta;
            }
            return Ok(());
        };
        let dir = self.parent(name, &parts)?;
        if last == OPAQUE {
            hide_lower(dir, layer);
            return Ok(());
        }
        if let Some(hidden) = last.strip_prefix(WHITEOUT) {
            if hidden.is_empty() || hidden == b"." || hidden == b".." || hidden.starts_with(WHITEOUT) {
                return Err(UnpackError::Whiteout { layer, entry: shown(name) });
            }
            if dir.get(hidden).is_some_and(|c| c.layer < layer) {
                dir.remove(hidden);
            }
            return Ok(());
        }
        match (dir.get_mut(&last), node) {
            (Some(Child { node: Node::Dir(old, _), layer: l }), Node::Dir(meta, _)) => {
                *old = meta;
                *l = layer;
            }
            (_, node) => {
                dir.insert(last, Child { node, layer });
            }
        }
        Ok(())
    }

    /// The children of the directory at `parts`, made where missing; every directory on the way is marked
    /// as written by this layer.
    fn parent(&mut self, name: &[u8], parts: &[Vec<u8>]) -> Result<&mut BTreeMap<Vec<u8>, Child>, UnpackError> {
        let layer = self.layer;
        let not_a_dir = || UnpackError::NotADirectory { layer, entry: shown(name) };
        let mut here = &mut self.root;
        here.layer = layer;
        let mut depth = 0;
        loop {
            // The root is a directory, and the walk only steps into directories.
            let Node::Dir(_, children) = &mut here.node else { return Err(not_a_dir()) };
            let Some(part) = parts.get(depth) else { return Ok(children) };
            let child = children
                .entry(part.clone())
                .or_insert_with(|| Child { node: Node::Dir(IMPLICIT_DIR, BTreeMap::new()), layer });
            match &child.node {
                Node::Dir(..) => {}
                Node::Symlink(..) => {
                    let link = parts[..=depth].join(&b'/');
                    return Err(UnpackError::ThroughSymlink { layer, entry: shown(name), link: shown(&link) });
                }
                Node::File(..) => return Err(not_a_dir()),
            }
            child.layer = layer;
            here = child;
            depth += 1;
        }
    }
}

fn is_whiteout(parts: &[Vec<u8>]) -> bool {
    parts.last().is_some_and(|p| p.starts_with(WHITEOUT))
}

/// Removes, below `dir`, everything lower layers wrote and this layer did not.
fn hide_lower(dir: &mut BTreeMap<Vec<u8>, Child>, layer: u32) {
    dir.retain(|_, c| c.layer == layer);
    for child in dir.values_mut() {
        if let Node::Dir(_, children) = &mut child.node {
            hide_lower(children, layer);
        }
    }
}

/// Every content id the tree still refers to, with the number of paths that share it.
pub fn live_contents(node: &Node) -> HashMap<ContentId, u32> {
    let mut live = HashMap::new();
    fn walk(node: &Node, live: &mut HashMap<ContentId, u32>) {
        match node {
            Node::Dir(_, children) => children.values().for_each(|c| walk(&c.node, live)),
            Node::File(_, id, _) => *live.entry(*id).or_default() += 1,
            Node::Symlink(..) => {}
        }
    }
    walk(node, &mut live);
    live
}

#[cfg(test)]
mod tests;

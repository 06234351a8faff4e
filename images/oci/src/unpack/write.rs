//! The merged tree written out as a directory, for the disk builder to read. Everything is created fresh
//! under a new root, parents before children, with names that are single components the tree already
//! checked; a symlink is only ever created, never followed, since the tree holds nothing below one. File
//! contents come from a [`DirSpool`] by rename (hardlinks by `link`), so nothing is copied twice.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::tree::{ContentId, Meta, Node, Spool};

/// File contents in a directory, one file per content id.
#[derive(Debug)]
pub struct DirSpool {
    dir: PathBuf,
}

impl DirSpool {
    /// A spool in `dir`, which must not exist yet (created 0700).
    ///
    /// # Errors
    /// `dir` exists or cannot be made.
    pub fn create(dir: &Path) -> io::Result<Self> {
        fs::DirBuilder::new().mode(0o700).create(dir)?;
        Ok(Self { dir: dir.to_owned() })
    }

    fn path(&self, id: ContentId) -> PathBuf {
        self.dir.join(id.to_string())
    }
}

impl Spool for DirSpool {
    fn put(&mut self, id: ContentId, data: &mut dyn Read, size: u64) -> io::Result<()> {
        let mut file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(self.path(id))?;
        let copied = io::copy(&mut data.take(size), &mut file)?;
        if copied != size {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        file.flush()
    }
}

/// What was written.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Directories, the root included.
    pub dirs: u64,
    /// Regular files (each path of a hardlinked file counts).
    pub files: u64,
    /// Symlinks.
    pub symlinks: u64,
}

/// Why the tree could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {} of the image's tree", path.display())]
pub struct WriteError {
    /// Where.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

/// Writes the tree rooted at `root` to `out` (which must not exist), taking contents from `spool`.
/// `owners`: give each entry its owner from the layer (needs root); otherwise everything is the caller's.
///
/// # Errors
/// [`WriteError`] naming the path that failed.
pub fn write(root: &Node, spool: &DirSpool, out: &Path, owners: bool) -> Result<Written, WriteError> {
    let mut w = Writer { spool, owners, placed: HashMap::new(), written: Written::default() };
    let fail = |source| WriteError { path: out.to_owned(), source };
    fs::DirBuilder::new().mode(0o700).create(out).map_err(fail)?;
    w.written.dirs += 1;
    if let Node::Dir(meta, _) = root {
        w.children(root, out)?;
        w.finish(out, *meta, false).map_err(fail)?;
    }
    Ok(w.written)
}

struct Writer<'a> {
    spool: &'a DirSpool,
    owners: bool,
    /// Where each content id was first placed, for its hardlinks.
    placed: HashMap<ContentId, PathBuf>,
    written: Written,
}

impl Writer<'_> {
    fn children(&mut self, dir: &Node, at: &Path) -> Result<(), WriteError> {
        let Node::Dir(_, children) = dir else { return Ok(()) };
        for (name, child) in children {
            let path = at.join(OsStr::from_bytes(name));
            let fail = |source| WriteError { path: path.clone(), source };
            match &child.node {
                Node::Dir(meta, _) => {
                    fs::DirBuilder::new().mode(0o700).create(&path).map_err(fail)?;
                    self.written.dirs += 1;
                    self.children(&child.node, &path)?;
                    self.finish(&path, *meta, false).map_err(fail)?;
                }
                Node::File(meta, id, _) => {
                    match self.placed.get(id) {
                        Some(first) => fs::hard_link(first, &path).map_err(fail)?,
                        None => {
                            fs::rename(self.spool.path(*id), &path).map_err(fail)?;
                            self.placed.insert(*id, path.clone());
                        }
                    }
                    self.written.files += 1;
                    self.finish(&path, *meta, false).map_err(fail)?;
                }
                Node::Symlink(meta, target) => {
                    std::os::unix::fs::symlink(OsStr::from_bytes(target), &path).map_err(fail)?;
                    self.written.symlinks += 1;
                    self.finish(&path, *meta, true).map_err(fail)?;
                }
            }
        }
        Ok(())
    }

    /// Owner, then mode (a symlink has none of its own). Modes go last so a read-only directory was still
    /// writable while its children were made.
    fn finish(&self, path: &Path, meta: Meta, symlink: bool) -> io::Result<()> {
        if self.owners {
            let id = |v: u64| u32::try_from(v).map_err(|_| io::Error::from(io::ErrorKind::InvalidData));
            std::os::unix::fs::lchown(path, Some(id(meta.uid)?), Some(id(meta.gid)?))?;
        }
        if !symlink {
            fs::set_permissions(path, fs::Permissions::from_mode(meta.mode))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tree::{Limits, Tree};
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vm-oci-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_tree_is_written_with_its_links_and_modes() {
        let dir = scratch("write");
        let mut b = tar::Builder::new(Vec::new());
        let mut add = |name: &str, kind: tar::EntryType, mode: u32, data: &[u8], link: Option<&str>| {
            let mut h = tar::Header::new_gnu();
            h.set_path(name).unwrap();
            h.set_entry_type(kind);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mode(mode);
            h.set_size(data.len() as u64);
            if let Some(l) = link {
                h.set_link_name(l).unwrap();
            }
            h.set_cksum();
            b.append(&h, data).unwrap();
        };
        add("ro/", tar::EntryType::Directory, 0o555, b"", None);
        add("ro/file", tar::EntryType::Regular, 0o4755, b"content", None);
        add("ro/hard", tar::EntryType::Link, 0, b"", Some("ro/file"));
        add("link", tar::EntryType::Symlink, 0o777, b"", Some("/nowhere/at/all"));
        let bytes = b.into_inner().unwrap();
        let mut spool = DirSpool::create(&dir.join("spool")).unwrap();
        let mut tree = Tree::new(Limits::default());
        tree.apply(bytes.as_slice(), &mut spool).unwrap();
        let out = dir.join("root");
        let written = write(tree.root(), &spool, &out, false).unwrap();
        assert_eq!(written, Written { dirs: 2, files: 2, symlinks: 1 });
        assert_eq!(fs::read(out.join("ro/hard")).unwrap(), b"content");
        let mode = |p: &str| fs::symlink_metadata(out.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!((mode("ro"), mode("ro/file")), (0o555, 0o4755));
        assert_eq!(fs::read_link(out.join("link")).unwrap(), Path::new("/nowhere/at/all"));
        fs::set_permissions(out.join("ro"), fs::Permissions::from_mode(0o755)).unwrap();
        let _ = fs::remove_dir_all(&dir);
    }
}

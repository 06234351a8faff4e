//! Root disks kept per image: a fresh container's rootfs is an overlay of the image's committed snapshots
//! (which never change) and an empty upper directory of its own, so its disk is the image's, made once per
//! node and image and shared read-only by every task of it, as `launch --image` shares an image's disk.
//!
//! ```text
//! <state>/containerd-roots/<key>.erofs   one per image (0444), at most MAX_KEPT: the least recently used go
//! <bundle>/vmdriver-root.erofs           a hard link to it: an eviction never takes a running task's disk
//! ```
//!
//! The key is a hash of each lower directory's path, device, inode and change time: a snapshot removed and
//! another made at the same path (containerd's root made anew) is another key. Anything else (an upper
//! directory with content, mount options beyond the plain ones, another mount type) is made into a disk of
//! its own, as before.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use containerd_shim::protos::api::Mount;
use sha2::Digest as _;

/// Disks kept; a node runs a handful of images at a time.
pub const MAX_KEPT: usize = 16;
/// A half-made disk older than this was left by a shim that died making it.
const STALE_PARTIAL: Duration = Duration::from_secs(3600);

/// The image's layers under a fresh container's overlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layers {
    /// The lower directories, topmost first, as the overlay's `lowerdir=` names them.
    lower: Vec<PathBuf>,
    /// What names this set of layers: see the module's comment.
    pub key: String,
}

impl Layers {
    /// The image's layers when `mounts` are one overlay with plain options and an empty upper directory.
    pub fn of(mounts: &[Mount]) -> Option<Self> {
        let [mount] = mounts else { return None };
        if mount.type_ != "overlay" {
            return None;
        }
        let (mut lower, mut upper) = (None, None);
        for option in &mount.options {
            match option.split_once('=') {
                Some(("lowerdir", dirs)) => lower = Some(dirs),
                Some(("upperdir", dir)) => upper = Some(Path::new(dir)),
                Some(("workdir", _)) | Some(("index", "off")) => {}
                _ => return None,
            }
        }
        let empty = fs::read_dir(upper?).ok()?.next().is_none();
        if !empty {
            return None;
        }
        let lower: Vec<PathBuf> = lower?.split(':').map(PathBuf::from).collect();
        let mut hash = sha2::Sha256::new();
        hash.update(b"vmdriver-layers-1\0");
        for dir in &lower {
            let meta = fs::metadata(dir).ok().filter(fs::Metadata::is_dir)?;
            hash.update(dir.as_os_str().as_encoded_bytes());
            for n in [meta.dev(), meta.ino(), meta.ctime().cast_unsigned(), meta.ctime_nsec().cast_unsigned()] {
                hash.update(n.to_le_bytes());
            }
        }
        let key = hash.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
        Some(Self { lower, key })
    }

    /// A read-only mount of only the image's layers: an overlay of them, or the one layer bound.
    pub fn view(&self) -> Mount {
        let mut mount = Mount::new();
        if let [only] = self.lower.as_slice() {
            mount.type_ = "bind".into();
            mount.source = only.display().to_string();
            mount.options = vec!["rbind".into(), "ro".into()];
        } else {
            let dirs: Vec<String> = self.lower.iter().map(|d| d.display().to_string()).collect();
            mount.type_ = "overlay".into();
            mount.source = "overlay".into();
            mount.options = vec![format!("lowerdir={}", dirs.join(":"))];
        }
        mount
    }
}

/// The kept disk for `key` in `dir`, and a file name to make it under before it is renamed into place.
pub fn paths(dir: &Path, key: &str) -> (PathBuf, PathBuf) {
    (dir.join(format!("{key}.erofs")), dir.join(format!("{key}.{}.partial", std::process::id())))
}

/// Marks `disk` used now, so the eviction keeps it longest.
pub fn touch(disk: &Path) {
    // futimens needs the owner, not write access: the disk is 0444.
    if let Ok(file) = fs::File::open(disk) {
        let _ = file.set_modified(SystemTime::now());
    }
}

/// Removes all but the [`MAX_KEPT`] most recently used disks of `dir`, and stale partial ones. A task's disk
/// is a hard link of its own: removing the kept name leaves it whole.
pub fn evict(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let mut kept = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let modified = entry.metadata().and_then(|m| m.modified()).unwrap_or(SystemTime::UNIX_EPOCH);
        match path.extension().and_then(|e| e.to_str()) {
            Some("erofs") => kept.push((modified, path)),
            Some("partial") if modified.elapsed().unwrap_or_default() > STALE_PARTIAL => {
                let _ = fs::remove_file(&path);
            }
            _ => {}
        }
    }
    kept.sort_by_key(|(modified, _)| std::cmp::Reverse(*modified));
    for (_, path) in kept.into_iter().skip(MAX_KEPT) {
        let _ = fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use super::*;

    fn overlay(options: &[String]) -> Mount {
        let mut m = Mount::new();
        m.type_ = "overlay".into();
        m.source = "overlay".into();
        m.options = options.to_vec();
        m
    }

    fn options(lower: &[&Path], upper: &Path) -> Vec<String> {
        let lower: Vec<String> = lower.iter().map(|d| d.display().to_string()).collect();
        vec![
            "index=off".into(),
            format!("workdir={}", upper.with_extension("work").display()),
            format!("upperdir={}", upper.display()),
            format!("lowerdir={}", lower.join(":")),
        ]
    }

    #[test]
    fn a_fresh_containers_layers_have_one_key_and_anything_else_none() {
        let t = tempfile::tempdir().unwrap();
        let (a, b, upper) = (t.path().join("1/fs"), t.path().join("2/fs"), t.path().join("3/fs"));
        for d in [&a, &b, &upper] {
            fs::create_dir_all(d).unwrap();
        }
        let layers = Layers::of(&[overlay(&options(&[&b, &a], &upper))]).unwrap();
        assert_eq!(Layers::of(&[overlay(&options(&[&b, &a], &upper))]).unwrap().key, layers.key, "stable");
        assert_eq!(layers.view().options, [format!("lowerdir={}:{}", b.display(), a.display())]);
        let one = Layers::of(&[overlay(&options(&[&a], &upper))]).unwrap();
        assert_ne!(one.key, layers.key);
        assert_eq!((one.view().type_.as_str(), one.view().options), ("bind", vec!["rbind".into(), "ro".into()]));

        // The same path made anew is another snapshot: another key.
        fs::remove_dir(&a).unwrap();
        fs::create_dir(&a).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_ne!(Layers::of(&[overlay(&options(&[&b, &a], &upper))]).unwrap().key, layers.key);

        // An upper directory with content, an option beyond the plain ones, a missing layer, a bind: none.
        let mut userxattr = options(&[&b, &a], &upper);
        userxattr.push("userxattr".into());
        assert_eq!(Layers::of(&[overlay(&userxattr)]), None);
        assert_eq!(Layers::of(&[overlay(&options(&[&t.path().join("gone")], &upper))]), None);
        let mut bind = overlay(&[]);
        bind.type_ = "bind".into();
        assert_eq!(Layers::of(&[bind]), None);
        fs::write(upper.join("written"), "x").unwrap();
        assert_eq!(Layers::of(&[overlay(&options(&[&b, &a], &upper))]), None);
    }

    #[test]
    fn eviction_keeps_the_most_recently_used() {
        let t = tempfile::tempdir().unwrap();
        for i in 0..MAX_KEPT + 2 {
            let disk = t.path().join(format!("{i:02}.erofs"));
            fs::write(&disk, "d").unwrap();
            let age = Duration::from_secs(u64::try_from(100 - i).unwrap());
            fs::File::options().append(true).open(&disk).unwrap().set_modified(SystemTime::now() - age).unwrap();
        }
        touch(&t.path().join("00.erofs"));
        evict(t.path());
        let mut left: Vec<String> =
            fs::read_dir(t.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left.len(), MAX_KEPT);
        assert!(left.contains(&"00.erofs".into()), "the one just used is kept: {left:?}");
        assert!(!left.contains(&"01.erofs".into()) && !left.contains(&"02.erofs".into()), "{left:?}");
    }
}

//! The content-addressed store under the cache directory:
//!
//! ```text
//! <store>/blobs/sha256/<hex>    verified blobs, read-only
//! <store>/ingest/<hex>.<n>      a download in progress (never read as a blob)
//! <store>/ingest/<hex>.lock     held while one process downloads that digest
//! ```
//!
//! A blob is written under `ingest/`, checked against its digest and size as it streams, synced, and only
//! then renamed into `blobs/`: a pull killed at any point leaves nothing there that looks complete. Two
//! pulls of one digest (two threads, or two processes such as two `serve` creates) share one download: the
//! second waits on the digest's lock and then finds the blob.

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::digest::{Digest, Verified};

/// A store rooted at a directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// Why a blob could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store's directories cannot be made or read.
    #[error("cannot use the image store at {}", path.display())]
    Io {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A blob of unknown digest was larger than its bound.
    #[error("a blob is larger than {0} bytes")]
    TooLarge(u64),
    /// The blob did not arrive whole, or differs from its descriptor (the source names which).
    #[error("blob {digest} was not stored")]
    Blob {
        /// The blob.
        digest: Digest,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// A hash fed by writes.
#[derive(Default)]
struct Hashing(sha2::Sha256);

impl Hashing {
    fn finish(self) -> Digest {
        use sha2::Digest as _;
        Digest::of_hash(self.0.finalize().as_slice())
    }
}

impl Write for Hashing {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        sha2::Digest::update(&mut self.0, buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes to both.
struct Tee<'a>(&'a mut fs::File, &'a mut Hashing);

impl Write for Tee<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.0.write(buf)?;
        self.1.write_all(&buf[..n])?;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// Names each download in progress apart within this process; the pid tells processes apart.
static INGESTS: AtomicU64 = AtomicU64::new(0);

impl Store {
    /// Opens (making it, 0700, if needed) the store at `root`.
    ///
    /// # Errors
    /// [`StoreError::Io`] if its directories cannot be made.
    pub fn open(root: &Path) -> Result<Self, StoreError> {
        for dir in [root.to_owned(), root.join("blobs/sha256"), root.join("ingest")] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|source| StoreError::Io { path: dir.clone(), source })?;
        }
        Ok(Self { root: root.to_owned() })
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the blob `digest` is once stored.
    pub fn blob_path(&self, digest: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(digest.hex())
    }

    /// Whether the blob is stored.
    pub fn has(&self, digest: &Digest) -> bool {
        self.blob_path(digest).is_file()
    }

    /// Stores the blob `digest` of `size` bytes, read from what `open` returns, unless it is stored already.
    /// `open` is called only by the one caller that downloads; the others wait for it.
    ///
    /// # Errors
    /// [`StoreError::Blob`] if the bytes are short, long or differ (nothing is left in the store), or
    /// [`StoreError::Io`].
    pub fn ingest<R: Read>(
        &self,
        digest: &Digest,
        size: u64,
        open: impl FnOnce() -> io::Result<R>,
    ) -> Result<PathBuf, StoreError> {
        let target = self.blob_path(digest);
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| StoreError::Io { path, source }
        };
        let lock_path = self.root.join("ingest").join(format!("{}.lock", digest.hex()));
        let _lock = crate::bounded::lock(&lock_path).map_err(io(&lock_path))?;
        if target.is_file() {
            return Ok(target);
        }
        let n = INGESTS.fetch_add(1, Ordering::Relaxed);
        let partial = self.root.join("ingest").join(format!("{}.{}-{n}", digest.hex(), std::process::id()));
        let result = (|| {
            let source = open()?;
            let mut file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&partial)?;
            io::copy(&mut Verified::new(source, digest.clone(), size), &mut file)?;
            file.flush()?;
            file.sync_all()?;
            fs::set_permissions(&partial, fs::Permissions::from_mode(0o400))
        })();
        if let Err(source) = result {
            let _ = fs::remove_file(&partial);
            return Err(StoreError::Blob { digest: digest.clone(), source });
        }
        fs::rename(&partial, &target).map_err(io(&target))?;
        fs::File::open(self.root.join("blobs/sha256")).and_then(|d| d.sync_all()).map_err(io(&target))?;
        Ok(target)
    }

    /// Stores a blob whose digest is not known beforehand (a `docker save` archive names its files, not
    /// their digests): hashed while written, then committed under the digest it has. At most `limit` bytes.
    ///
    /// # Errors
    /// [`StoreError::Io`], or [`StoreError::TooLarge`] past `limit`.
    pub fn ingest_unnamed(&self, mut from: impl Read, limit: u64) -> Result<(Digest, u64), StoreError> {
        let n = INGESTS.fetch_add(1, Ordering::Relaxed);
        let partial = self.root.join("ingest").join(format!("unnamed.{}-{n}", std::process::id()));
        let io = |source| StoreError::Io { path: partial.clone(), source };
        let result = (|| {
            let mut file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&partial)?;
            let mut hash = Hashing::default();
            let size = io::copy(&mut (&mut from).take(limit + 1), &mut Tee(&mut file, &mut hash))?;
            file.sync_all()?;
            fs::set_permissions(&partial, fs::Permissions::from_mode(0o400))?;
            Ok((hash.finish(), size))
        })();
        let (digest, size) = match result {
            Ok(v) => v,
            Err(e) => {
                let _ = fs::remove_file(&partial);
                return Err(io(e));
            }
        };
        if size > limit {
            let _ = fs::remove_file(&partial);
            return Err(StoreError::TooLarge(limit));
        }
        fs::rename(&partial, self.blob_path(&digest)).map_err(io)?;
        Ok((digest, size))
    }

    /// Removes downloads that no process is doing (left by a killed pull). Their locks are free.
    pub fn sweep_ingest(&self) {
        let Ok(entries) = fs::read_dir(self.root.join("ingest")) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str().filter(|n| !n.ends_with(".lock")) else { continue };
            let Some((hex, rest)) = name.split_once('.') else { continue };
            if hex == "unnamed" {
                // Its writer's pid is in its name; nothing else could be writing it.
                let pid = rest.split('-').next().unwrap_or_default();
                if !Path::new("/proc").join(pid).exists() {
                    let _ = fs::remove_file(entry.path());
                }
                continue;
            }
            let lock_path = self.root.join("ingest").join(format!("{hex}.lock"));
            let Ok(lock) = fs::OpenOptions::new().write(true).open(&lock_path) else { continue };
            if lock.try_lock().is_ok() {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(name: &str) -> Store {
        let dir = std::env::temp_dir().join(format!("vm-oci-store-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        Store::open(&dir).unwrap()
    }

    fn blobs(s: &Store) -> usize {
        fs::read_dir(s.root().join("blobs/sha256")).unwrap().count()
    }

    fn partials(s: &Store) -> usize {
        fs::read_dir(s.root().join("ingest"))
            .unwrap()
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().ends_with(".lock"))
            .count()
    }

    #[test]
    fn a_verified_blob_is_committed_read_only() {
        let s = store("ok");
        let data = b"layer bytes".to_vec();
        let d = Digest::of(&data);
        let path = s.ingest(&d, data.len() as u64, || Ok(data.as_slice())).unwrap();
        assert_eq!(fs::read(&path).unwrap(), data);
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o400);
        // Stored: not fetched again.
        s.ingest(&d, data.len() as u64, || -> io::Result<&[u8]> { panic!("fetched twice") }).unwrap();
        let _ = fs::remove_dir_all(s.root());
    }

    #[test]
    fn a_bad_or_broken_download_leaves_nothing() {
        let s = store("bad");
        let data = b"layer bytes".to_vec();
        let d = Digest::of(&data);
        for (bytes, size) in [(&b"layer bytez"[..], 11), (&data[..4], 11), (&b"layer bytes and more"[..], 11)] {
            let err = s.ingest(&d, size, || Ok(bytes)).unwrap_err();
            assert!(matches!(err, StoreError::Blob { .. }), "{err}");
        }
        let err = s.ingest(&d, 11, || -> io::Result<&[u8]> { Err(io::ErrorKind::TimedOut.into()) }).unwrap_err();
        assert!(matches!(err, StoreError::Blob { .. }), "{err}");
        assert_eq!((blobs(&s), partials(&s)), (0, 0));
        let _ = fs::remove_dir_all(s.root());
    }

    #[test]
    fn concurrent_pulls_of_one_digest_download_once() {
        let s = store("shared");
        let data = vec![7u8; 256 * 1024];
        let d = Digest::of(&data);
        let fetches = AtomicU64::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    s.ingest(&d, data.len() as u64, || {
                        fetches.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(std::time::Duration::from_millis(50));
                        Ok(data.as_slice())
                    })
                    .unwrap();
                });
            }
        });
        assert_eq!(fetches.load(Ordering::Relaxed), 1);
        assert_eq!(blobs(&s), 1);
        let _ = fs::remove_dir_all(s.root());
    }

    #[test]
    fn an_unnamed_blob_is_stored_under_its_digest_within_its_bound() {
        let s = store("unnamed");
        let (digest, size) = s.ingest_unnamed(&b"config"[..], 100).unwrap();
        assert_eq!((digest.clone(), size), (Digest::of(b"config"), 6));
        assert!(s.has(&digest));
        assert!(matches!(s.ingest_unnamed(&[0u8; 101][..], 100), Err(StoreError::TooLarge(100))));
        assert_eq!((blobs(&s), partials(&s)), (1, 0));
        let _ = fs::remove_dir_all(s.root());
    }

    #[test]
    fn a_killed_pulls_leftover_is_swept() {
        let s = store("sweep");
        let d = Digest::of(b"x");
        fs::write(s.root().join("ingest").join(format!("{}.999-0", d.hex())), b"half").unwrap();
        fs::write(s.root().join("ingest").join(format!("{}.lock", d.hex())), b"").unwrap();
        s.sweep_ingest();
        assert_eq!(partials(&s), 0);
        let _ = fs::remove_dir_all(s.root());
    }
}

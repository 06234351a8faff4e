//! Templates: saved boots that `launch` starts from instead of booting (`docs/templates.md`).
//!
//! ```text
//! STATE/templates/<key>/   ram (the guest's RAM, sparse, 0400), state (QEMU's device state), hello.frame,
//!                          disk.ext4 (an image root's writable layer), digests (written last)
//! ```
//!
//! - **Made** by a pooled VM of the same spec, booted with its RAM in a memfd ([`ram::for_saving`]) and
//!   saved with `x-ignore-shared` (the stream leaves the RAM out), under an exclusive lock; the files are
//!   written into a fresh directory that is renamed into place once their digests are written, so a
//!   template is whole or absent.
//! - **Used** by a restore whose RAM is a sealed memfd filled from `ram` while its digest is checked
//!   ([`ram::load_sealed`]); every other file's digest is checked first. A template that fails any check is
//!   removed, and the caller boots cold and makes it again.
//! - **Collected**: the newest [`KEEP`] are kept (a changed input makes a new key; the old one is stale).

pub mod key;
pub mod ram;

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vm_contract::claim::Origin;
use vm_contract::snapshot::SnapshotFile;
use vm_contract::tombstone::EndReason;

pub use self::key::{Ineligible, TemplateKey};
use crate::sandbox::{self, Identity, PooledStart, Running, VmSpec};
use crate::state::StateDir;
use crate::telemetry::TelemetryConfig;

/// How many templates are kept.
pub const KEEP: usize = 8;
/// The digest file's name, and the most bytes it may have.
const DIGESTS: &str = "digests";
const MAX_DIGESTS_BYTES: u64 = 4096;
/// The template's RAM file.
const RAM: &str = "ram";
/// After how long a half-made or discarded template's directory is an abandoned one.
const ABANDONED: Duration = Duration::from_secs(3600);
/// How long the saving supervisor has to exit after it said it saved.
const SAVER_EXIT: Duration = Duration::from_secs(10);

/// The digest of each file of a template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Digests {
    ram: String,
    state: String,
    hello: String,
    disk: Option<String>,
}

impl Digests {
    /// The digests of the files in `dir`, as they are now.
    fn of(dir: &Path, ram: String) -> std::io::Result<Self> {
        let disk = SnapshotFile::WritableDisk.path(dir);
        Ok(Self {
            ram,
            state: ram::digest(&SnapshotFile::State.path(dir))?,
            hello: ram::digest(&SnapshotFile::Hello.path(dir))?,
            disk: if disk.exists() { Some(ram::digest(&disk)?) } else { None },
        })
    }
}

/// Why a template was not made or not used.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A file failed.
    #[error("template files")]
    Io(#[from] std::io::Error),
    /// A file is not what was saved.
    #[error("the template's files do not match their digests; it was removed")]
    Tampered,
    /// The saving VM failed.
    #[error("the saving VM failed")]
    Start(#[from] sandbox::StartError),
    /// The saving supervisor failed.
    #[error("the saving VM failed")]
    Supervisor(#[from] sandbox::supervisor::SupervisorError),
    /// The saving supervisor answered, but not with a save.
    #[error("the saving VM did not save")]
    NotSaved,
}

/// A template loaded for one restore: its directory, and its RAM, sealed.
#[derive(Debug)]
pub struct Template {
    /// The saved files.
    pub dir: PathBuf,
    /// The guest's RAM, a sealed memfd.
    pub ram: OwnedFd,
}

/// A template `serve` keeps loaded: its RAM, and what it was checked against.
#[derive(Debug)]
struct Loaded {
    template: Arc<Template>,
    recorded: Digests,
    ram: Stamp,
}

/// What any rewrite of a file changes: its inode, size and modification and change times.
type Stamp = (u64, u64, i64, i64, i64, i64);

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok((m.ino(), m.len(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec()))
}

/// The state directory's templates.
#[derive(Debug, Clone)]
pub struct Templates {
    dir: PathBuf,
    /// `serve`'s: each template's RAM loaded once and shared by every clone, while its file is unchanged.
    loaded: Option<Arc<Mutex<HashMap<TemplateKey, Loaded>>>>,
    /// One template is made at a time in this process.
    making: Arc<tokio::sync::Semaphore>,
}

impl Templates {
    /// `STATE/templates` (made when the first template is), each load its own copy of a template's RAM.
    pub fn new(state: &StateDir) -> Self {
        Self { dir: state.templates_dir(), loaded: None, making: Arc::new(tokio::sync::Semaphore::new(1)) }
    }

    /// As [`Self::new`], with each template's RAM loaded once and shared by all its clones (`serve`).
    pub fn shared(state: &StateDir) -> Self {
        Self { loaded: Some(Arc::default()), ..Self::new(state) }
    }

    fn lock_loaded(&self) -> Option<std::sync::MutexGuard<'_, HashMap<TemplateKey, Loaded>>> {
        self.loaded.as_ref().map(|l| l.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn path(&self, key: &TemplateKey) -> PathBuf {
        self.dir.join(key.as_str())
    }

    /// The template of `key` for a guest of `bytes` of RAM, checked: `None` when there is none. One that fails
    /// a check is removed ([`TemplateError::Tampered`]).
    ///
    /// # Errors
    /// [`TemplateError`].
    pub fn load(&self, key: &TemplateKey, bytes: u64) -> Result<Option<Arc<Template>>, TemplateError> {
        let dir = self.path(key);
        let recorded = match read_digests(&dir) {
            Ok(recorded) => recorded,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.lock_loaded().map(|mut l| l.remove(key));
                return Ok(None);
            }
            Err(_) => return Err(self.discard(key)),
        };
        // The files each restore reads are checked at each; the RAM when it is loaded.
        let checked = Digests::of(&dir, recorded.ram.clone()).ok().filter(|now| *now == recorded);
        let Some(ram_stamp) = checked.and_then(|_| stamp(&dir.join(RAM)).ok()) else {
            return Err(self.discard(key));
        };
        if let Some(loaded) = self.lock_loaded().and_then(|l| {
            l.get(key).filter(|l| l.recorded == recorded && l.ram == ram_stamp).map(|l| Arc::clone(&l.template))
        }) {
            return Ok(Some(loaded));
        }
        let template = match ram::load_sealed(&dir.join(RAM), bytes, &recorded.ram) {
            Ok(ram) => Arc::new(Template { dir, ram }),
            Err(_) => return Err(self.discard(key)),
        };
        if let Some(mut loaded) = self.lock_loaded() {
            // Those no key names any more go: a template's RAM is held only while it can be used.
            loaded.retain(|k, _| self.path(k).exists());
            if loaded.len() >= KEEP {
                loaded.clear();
            }
            let entry = Loaded { template: Arc::clone(&template), recorded, ram: ram_stamp };
            loaded.insert(key.clone(), entry);
        }
        Ok(Some(template))
    }

    /// Removes the template of `key`, whose restore failed: the next start of its kind boots and makes it
    /// again.
    pub fn remove(&self, key: &TemplateKey) {
        let _ = self.discard(key);
    }

    /// Removes the template of `key` (renamed away first, so no restore finds half of it).
    fn discard(&self, key: &TemplateKey) -> TemplateError {
        self.lock_loaded().map(|mut l| l.remove(key));
        let away = self.dir.join(format!(".discarded-{}", crate::state::random_hex::<4>().unwrap_or_default()));
        if std::fs::rename(self.path(key), &away).is_ok() {
            let _ = std::fs::remove_dir_all(&away);
        }
        TemplateError::Tampered
    }

    /// Makes the template of `key` from a VM like `vm` (its layout is replaced by a fresh sandbox
    /// directory's), unless one exists or another process is making it. Returns whether it made one.
    ///
    /// # Errors
    /// [`TemplateError`]; nothing of the attempt is left.
    pub async fn make(&self, key: &TemplateKey, vm: &VmSpec, state: &StateDir) -> Result<bool, TemplateError> {
        let Ok(_turn) = self.making.try_acquire() else { return Ok(false) };
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.dir)?;
        let lock = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(self.dir.join(format!("{}.lock", key.as_str())))?;
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err()
            || self.path(key).exists()
        {
            return Ok(false);
        }
        let work = self.dir.join(format!(".new-{}", crate::state::random_hex::<8>()?));
        std::fs::DirBuilder::new().mode(0o700).create(&work)?;
        let made = match save(vm, state, &work).await {
            Ok(ram) => {
                let (work, into) = (work.clone(), self.path(key));
                tokio::task::spawn_blocking(move || publish(&work, ram, &into))
                    .await
                    .unwrap_or_else(|_| Err(std::io::Error::other("the template's publication failed")))
                    .map_err(TemplateError::Io)
            }
            Err(e) => Err(e),
        };
        if made.is_err() {
            let _ = std::fs::remove_dir_all(&work);
        }
        made?;
        self.collect(key);
        Ok(true)
    }

    /// Keeps the newest [`KEEP`] templates (`kept` among them) and removes the rest, and what a maker that
    /// died left half-made (older than [`ABANDONED`]: a live maker's is younger).
    fn collect(&self, kept: &TemplateKey) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        let mut templates: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let made = entry.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
            if TemplateKey::is_key(&name) && name != kept.as_str() {
                templates.push((made, entry.path()));
            } else if name.starts_with('.') && made.elapsed().is_ok_and(|age| age > ABANDONED) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        templates.sort_by_key(|t| std::cmp::Reverse(t.0));
        for (_, dir) in templates.into_iter().skip(KEEP.saturating_sub(1)) {
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_file(dir.with_extension("lock"));
        }
    }
}

/// Why a start from a template failed (nothing of it is left running).
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The restored VM's supervisor could not be started.
    #[error(transparent)]
    Start(#[from] sandbox::StartError),
    /// The restore failed.
    #[error(transparent)]
    Supervisor(#[from] sandbox::supervisor::SupervisorError),
    /// It did not wait for its claim.
    #[error("the restored VM did not wait for its claim")]
    NotPooled,
}

impl RestoreError {
    /// Whether the template itself failed (its saved state refused): it is to be made again. A restore that
    /// failed on the host (a timeout under load) keeps it.
    pub fn template_refused(&self) -> bool {
        matches!(self, Self::Supervisor(sandbox::supervisor::SupervisorError::SavedStateRefused(_)))
    }
}

/// Starts `who`'s sandbox on `vm` from `template`: restored as a pooled VM in the sandbox's own directory,
/// then claimed (its identity, policy and credentials written and handed over as a pool's claim is). The
/// caller waits for [`Running::ready`] next, as after a boot.
///
/// # Errors
/// [`RestoreError`]; the generation is then ended (stopped, reaped, its tombstone `failed`).
pub async fn restore(vm: &VmSpec, who: &Identity, template: &Template) -> Result<Running, RestoreError> {
    let how = PooledStart::Restore(template.dir.clone());
    let mut running =
        sandbox::start_pooled(vm, &who.id, &how, Some(template.ram.as_fd()), &TelemetryConfig::default())?;
    let claimed = match running.ready().await {
        Ok(ready) if ready.pooled => running.claim(vm, who, Origin::Template).map_err(RestoreError::from),
        Ok(_) => Err(RestoreError::NotPooled),
        Err(e) => Err(e.into()),
    };
    match claimed {
        Ok(()) => Ok(running),
        Err(e) => {
            running.stop(sandbox::HUNG_STOP_TIMEOUT).await.end(EndReason::Failed).await;
            Err(e)
        }
    }
}

/// Boots a pooled VM like `vm` in a fresh sandbox directory, its RAM in a memfd, and saves it into `work`;
/// returns the RAM's digest once `ram` is written. The saving sandbox's directory is removed after.
async fn save(vm: &VmSpec, state: &StateDir, work: &Path) -> Result<String, TemplateError> {
    let id = crate::state::random_id("template")?;
    let layout = state.create_sandbox(&id).map_err(|e| std::io::Error::other(e.to_string()))?;
    let spec = VmSpec { layout: layout.clone(), ..vm.clone() };
    let bytes = u64::from(vm.shape.memory_mib()) << 20;
    let memfd = ram::for_saving(bytes)?;
    let how = PooledStart::Save(work.to_owned());
    let started = sandbox::start_pooled(&spec, &id, &how, Some(memfd.as_fd()), &TelemetryConfig::default());
    let saved = match started {
        Ok(mut running) => {
            let ready = running.ready().await;
            let stopping = running.stop(SAVER_EXIT).await;
            let clean = stopping.stopped.in_order() && matches!(ready, Ok(ref r) if r.saved.is_some());
            stopping.end(if clean { EndReason::Stopped } else { EndReason::Failed }).await;
            match ready {
                Ok(ready) if ready.saved.is_some() => Ok(()),
                Ok(_) => Err(TemplateError::NotSaved),
                Err(e) => Err(e.into()),
            }
        }
        Err(e) => Err(e.into()),
    };
    if saved.is_ok() {
        let _ = std::fs::remove_dir_all(layout.dir());
    } else {
        // Kept for its logs, as a failed launch's is; `--keep-ended` collects it.
        eprintln!("vm-driver: the template's sandbox directory kept at {}", layout.dir().display());
    }
    saved?;
    let work = work.to_owned();
    tokio::task::spawn_blocking(move || ram::keep(memfd, &work.join(RAM)))
        .await
        .map_err(|_| std::io::Error::other("the RAM's copy failed"))?
        .map_err(TemplateError::Io)
}

/// Makes the saved files in `work` read-only, writes their digests (`ram`'s is known), and renames `work`
/// into place as `into`.
fn publish(work: &Path, ram: String, into: &Path) -> std::io::Result<()> {
    let digests = Digests::of(work, ram)?;
    for file in [SnapshotFile::State, SnapshotFile::Hello, SnapshotFile::WritableDisk] {
        let path = file.path(work);
        if path.exists() {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400))?;
        }
    }
    write_digests(work, &digests)?;
    std::fs::rename(work, into)
}

fn read_digests(dir: &Path) -> std::io::Result<Digests> {
    let mut text = Vec::new();
    std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::open(dir.join(DIGESTS))?, MAX_DIGESTS_BYTES),
        &mut text,
    )?;
    serde_json::from_slice(&text).map_err(|_| std::io::ErrorKind::InvalidData.into())
}

fn write_digests(dir: &Path, digests: &Digests) -> std::io::Result<()> {
    let text = serde_json::to_vec(digests).map_err(|_| std::io::ErrorKind::InvalidData)?;
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o400).open(dir.join(DIGESTS))?;
    std::io::Write::write_all(&mut file, &text)?;
    file.sync_all()
}

//! QEMU's confinement, from the driver's side: which mode this host gives ([`choose`]), and the uid and gid
//! each jailed VMM gets ([`reserve`], [`release`]).
//!
//! Ids are reserved host-wide, not per state directory: two drivers with different state directories must
//! never hand two VMMs the same uid, or one could signal the other. A reservation is a file
//! `<RESERVATIONS_DIR>/<id>` made with `O_EXCL`, naming the sandbox directory; the sandbox directory records the id
//! in `jail-id`. A reservation whose sandbox directory no longer records that id (removed without a release) is
//! stale and taken over. Reservations and releases hold an exclusive `flock` on the reservations directory.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use vm_contract::jail::{Confinement, IdRange, PROBE_USERNS};
use vm_contract::layout::{SandboxFile, SandboxLayout};

/// How this driver confines its VMMs: one value for every sandbox it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JailConfig {
    /// The mode ([`choose`]).
    pub confinement: Confinement,
    /// Where `jail` ids come from.
    pub ids: IdRange,
    /// The VMM's memory limit beyond its guest's memory, MiB.
    pub memory_overhead_mib: u64,
    /// The VMM's process and thread limit.
    pub pids: u32,
    /// The VMM's CPU limit, percent of one core.
    pub cpu_percent: Option<u32>,
}

impl JailConfig {
    /// The cgroup limits of a VMM whose guest has `guest_mib`.
    pub fn limits(&self, guest_mib: u64) -> crate::cgroup::limits::VmmLimits {
        crate::cgroup::limits::VmmLimits {
            memory_mib: guest_mib.saturating_add(self.memory_overhead_mib),
            pids: self.pids,
            cpu_percent: self.cpu_percent,
        }
    }
}

/// A jailed VMM's memory limit beyond its guest's memory when none is asked for, MiB (QEMU itself, TCG's
/// translation cache).
pub const DEFAULT_MEMORY_OVERHEAD_MIB: u64 = 512;
/// A jailed VMM's limit on processes and threads when none is asked for.
pub const DEFAULT_PIDS: u32 = 256;

/// What the command line asks for; [`JailRequest::resolve`] turns it into this host's [`JailConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JailRequest {
    /// The mode asked for; `None`: the strongest the host gives.
    pub asked: Option<Confinement>,
    /// As in [`JailConfig`].
    pub ids: IdRange,
    /// As in [`JailConfig`].
    pub memory_overhead_mib: u64,
    /// As in [`JailConfig`].
    pub pids: u32,
    /// As in [`JailConfig`].
    pub cpu_percent: Option<u32>,
}

impl JailRequest {
    /// Chooses the mode ([`choose`]) and says at start what is weaker than a full jail.
    ///
    /// # Errors
    /// A mode was asked that the host cannot give.
    pub fn resolve(&self, supervisor: &Path) -> Result<JailConfig, JailSetupError> {
        let confinement = choose(self.asked, &jailer_beside(supervisor))?;
        if let Some(line) = startup_line(confinement) {
            eprintln!("{line}");
        }
        if confinement == Confinement::Jail {
            match crate::cgroup::limits::available() {
                Ok(kind) => eprintln!("vm-driver: VMM limits in {}", kind.name()),
                Err(why) => eprintln!("vm-driver: warning: {why}: VMMs run without memory, pids and CPU limits"),
            }
        }
        Ok(JailConfig {
            confinement,
            ids: self.ids,
            memory_overhead_mib: self.memory_overhead_mib,
            pids: self.pids,
            cpu_percent: self.cpu_percent,
        })
    }
}

/// Where the host's id reservations live (root only).
pub const RESERVATIONS_DIR: &str = "/run/vm-driver-jail-ids";

/// Why confinement cannot be set up as asked.
#[derive(Debug, thiserror::Error)]
pub enum JailSetupError {
    /// `--confinement jail` without root.
    #[error("--confinement jail needs root (per-VMM uids); run as root, or use --confinement userns or none")]
    NeedsRoot,
    /// `--confinement userns` where the kernel refuses unprivileged user namespaces.
    #[error("--confinement userns: this host does not allow unprivileged user namespaces")]
    NoUserns,
    /// Every id of the range is reserved.
    #[error("every uid of the jail range {0} is in use (--jail-ids)")]
    RangeFull(IdRange),
    /// A reservation could not be made.
    #[error("cannot reserve a uid for the VMM in {RESERVATIONS_DIR}")]
    Reserve(#[source] io::Error),
}

/// `vm-jailer`, installed beside `vm-supervisor`.
fn jailer_beside(supervisor: &Path) -> PathBuf {
    supervisor.with_file_name("vm-jailer")
}

/// The confinement this driver uses: what was asked, or (`None`) the strongest the host gives: `jail` as
/// root, else `userns` where `vm-jailer --probe-userns` can make one, else `none`.
///
/// # Errors
/// A mode was asked that the host cannot give.
pub fn choose(asked: Option<Confinement>, jailer: &Path) -> Result<Confinement, JailSetupError> {
    let root = rustix::process::geteuid().is_root();
    let userns = || {
        std::process::Command::new(jailer)
            .arg(PROBE_USERNS)
            .env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    match asked {
        Some(Confinement::Jail) if !root => Err(JailSetupError::NeedsRoot),
        Some(Confinement::Userns) if !userns() => Err(JailSetupError::NoUserns),
        Some(mode) => Ok(mode),
        None if root => Ok(Confinement::Jail),
        None if userns() => Ok(Confinement::Userns),
        None => Ok(Confinement::None),
    }
}

/// What the driver says at start about its confinement (stderr): a warning unless every VMM gets its own
/// uid.
fn startup_line(mode: Confinement) -> Option<&'static str> {
    match mode {
        Confinement::Jail => None,
        Confinement::Userns => Some(
            "vm-driver: warning: each VMM gets its own namespaces and jail root but runs with this driver's uid \
             (--confinement userns): an escaped VMM could signal this user's processes",
        ),
        Confinement::None => Some(
            "vm-driver: warning: QEMU runs UNCONFINED (--confinement none): no jail, no separate uid, no \
             namespaces; only rlimits, no-new-privileges and QEMU's seccomp sandbox apply",
        ),
    }
}

/// Reservations a free id of `range` for the sandbox in `layout` and records it there.
///
/// # Errors
/// [`JailSetupError::RangeFull`] or [`JailSetupError::Reserve`].
pub fn reserve(range: IdRange, layout: &SandboxLayout) -> Result<u32, JailSetupError> {
    reserve_in(Path::new(RESERVATIONS_DIR), range, layout)
}

fn reserve_in(reservations: &Path, range: IdRange, layout: &SandboxLayout) -> Result<u32, JailSetupError> {
    use std::os::unix::fs::DirBuilderExt;
    match fs::DirBuilder::new().mode(0o700).create(reservations) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(JailSetupError::Reserve(e)),
        _ => {}
    }
    let _lock = lock(reservations).map_err(JailSetupError::Reserve)?;
    let offset = crate::state::random_hex::<4>().ok().and_then(|h| u32::from_str_radix(&h, 16).ok()).unwrap_or(0);
    for i in 0..range.count {
        let n = u32::try_from((u64::from(offset) + u64::from(i)) % u64::from(range.count)).unwrap_or(0);
        let Some(id) = range.nth(n) else { continue };
        let file = reservations.join(id.to_string());
        let taken = match fs::OpenOptions::new().write(true).create_new(true).open(&file) {
            Ok(_) => true,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => is_stale(&file, id),
            Err(e) => return Err(JailSetupError::Reserve(e)),
        };
        if taken {
            // The canonical path: drivers started from other directories must read the same reservation.
            let recorded = fs::canonicalize(layout.dir()).and_then(|dir| {
                fs::write(&file, dir.as_os_str().as_encoded_bytes())?;
                fs::write(layout.path(SandboxFile::JailId), id.to_string())
            });
            if let Err(e) = recorded {
                let _ = fs::remove_file(&file);
                return Err(JailSetupError::Reserve(e));
            }
            return Ok(id);
        }
    }
    Err(JailSetupError::RangeFull(range))
}

/// Whether the reservation `file` for `id` is stale: empty (its reserver died before writing it; reservations are made under
/// the lock), or naming a sandbox directory that is gone or records another id. Any other doubt keeps it.
fn is_stale(file: &Path, id: u32) -> bool {
    let Ok(dir) = fs::read_to_string(file) else { return false };
    if dir.is_empty() {
        return true;
    }
    match fs::read_to_string(SandboxLayout::new(PathBuf::from(dir)).path(SandboxFile::JailId)) {
        Ok(recorded) => recorded.trim() != id.to_string(),
        Err(e) => e.kind() == io::ErrorKind::NotFound,
    }
}

/// Releases the id recorded in `layout`, if any (at the end of every generation, and by the reaper).
pub fn release(layout: &SandboxLayout) {
    release_in(Path::new(RESERVATIONS_DIR), layout);
}

fn release_in(reservations: &Path, layout: &SandboxLayout) {
    let record = layout.path(SandboxFile::JailId);
    let Ok(id) = fs::read_to_string(&record) else { return };
    let _lock = lock(reservations);
    let file = reservations.join(id.trim());
    // Only a reservation that names this very directory is ours to remove.
    let ours = fs::canonicalize(layout.dir()).ok();
    if fs::read_to_string(&file).is_ok_and(|dir| ours.as_deref() == Some(Path::new(&dir))) {
        let _ = fs::remove_file(&file);
    }
    let _ = fs::remove_file(record);
}

/// Moves a sandbox directory (a reserved pool slot's) to `to`, which must not exist, keeping its jail id: the
/// reservation names the directory's canonical path, so it is rewritten in the same step, under the lock, and never
/// looks stale to another reserver.
///
/// # Errors
/// `to` exists, or the move or the reservation's rewrite failed (then nothing moved).
pub fn move_sandbox(from: &SandboxLayout, to: &Path) -> io::Result<SandboxLayout> {
    move_in(Path::new(RESERVATIONS_DIR), from, to)
}

fn move_in(reservations: &Path, from: &SandboxLayout, to: &Path) -> io::Result<SandboxLayout> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    let id = fs::read_to_string(from.path(SandboxFile::JailId)).ok();
    let _lock = id.as_ref().map(|_| lock(reservations)).transpose()?;
    renameat_with(CWD, from.dir(), CWD, to, RenameFlags::NOREPLACE)?;
    if let Some(id) = id {
        let rewritten = fs::canonicalize(to)
            .and_then(|dir| fs::write(reservations.join(id.trim()), dir.as_os_str().as_encoded_bytes()));
        if let Err(e) = rewritten {
            let _ = renameat_with(CWD, to, CWD, from.dir(), RenameFlags::NOREPLACE);
            return Err(e);
        }
    }
    Ok(SandboxLayout::new(to.to_owned()))
}

/// An exclusive lock on the reservations directory, held until the returned file is dropped.
fn lock(reservations: &Path) -> io::Result<fs::File> {
    let dir = fs::File::open(reservations)?;
    rustix::fs::flock(&dir, rustix::fs::FlockOperation::LockExclusive)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("jail-ids-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("a")).unwrap();
        fs::create_dir_all(dir.join("b")).unwrap();
        dir
    }

    #[test]
    fn ids_are_exclusive_released_and_stale_reservations_taken_over() {
        let dir = scratch("reservations");
        let reservations = dir.join("reservations");
        let range = IdRange { start: 5000, count: 2 };
        let (a, b) = (SandboxLayout::new(dir.join("a")), SandboxLayout::new(dir.join("b")));
        let first = reserve_in(&reservations, range, &a).unwrap();
        let second = reserve_in(&reservations, range, &b).unwrap();
        assert_ne!(first, second);
        let c = SandboxLayout::new(dir.join("c"));
        fs::create_dir_all(c.dir()).unwrap();
        assert!(matches!(reserve_in(&reservations, range, &c), Err(JailSetupError::RangeFull(_))));
        release_in(&reservations, &a);
        assert!(!a.path(SandboxFile::JailId).exists());
        assert_eq!(reserve_in(&reservations, range, &c).unwrap(), first, "a released id is free again");
        // b's directory goes without a release: its reservation is stale.
        fs::remove_dir_all(b.dir()).unwrap();
        fs::create_dir_all(a.dir()).unwrap();
        assert_eq!(reserve_in(&reservations, range, &a).unwrap(), second);
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn a_moved_sandbox_keeps_its_reservation() {
        let dir = scratch("move");
        let reservations = dir.join("reservations");
        let range = IdRange { start: 6000, count: 1 };
        let a = SandboxLayout::new(dir.join("a"));
        let id = reserve_in(&reservations, range, &a).unwrap();
        // `b` exists: the move is refused and nothing changes.
        assert!(move_in(&reservations, &a, &dir.join("b")).is_err());
        let moved = move_in(&reservations, &a, &dir.join("c")).unwrap();
        assert!(!a.dir().exists() && moved.path(SandboxFile::JailId).exists());
        // Not stale under its new name: the only id stays taken.
        let other = SandboxLayout::new(dir.join("b"));
        assert!(matches!(reserve_in(&reservations, range, &other), Err(JailSetupError::RangeFull(_))));
        release_in(&reservations, &moved);
        assert_eq!(reserve_in(&reservations, range, &other).unwrap(), id, "released under its new name");
        let _ = fs::remove_dir_all(dir);
    }
}

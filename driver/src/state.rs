//! The state directory: one private directory per sandbox.
//!
//! ```text
//! <state>/                      0700, owned by us, not a symlink
//!   sandboxes/<id>/             0700: sockets, logs, pids of one sandbox
//! ```
//!
//! Sandbox ids are validated ([`SandboxId`]) before any path is built from them.

use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxLayout;

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Creating or inspecting a directory failed.
    #[error("cannot prepare {}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The directory is a symlink, or belongs to someone else, or others can enter it.
    #[error("{} is not a private directory of this user (a symlink, another owner, or group/other access)", .0.display())]
    NotPrivate(PathBuf),
    /// A sandbox of that id exists already.
    #[error("sandbox {0} already exists")]
    Exists(SandboxId),
}

/// An opened state directory.
#[derive(Debug, Clone)]
pub struct StateDir {
    root: PathBuf,
}

/// The default state directory: `$VM_DRIVER_STATE_DIR`, else `$XDG_RUNTIME_DIR/vm-driver`, else
/// `/run/vm-driver` for root, else `/tmp/vm-driver-<uid>`.
pub fn default_root() -> PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("VM_DRIVER_STATE_DIR") {
        return dir;
    }
    if let Some(dir) = var("XDG_RUNTIME_DIR") {
        return dir.join("vm-driver");
    }
    let uid = rustix::process::getuid();
    if uid.is_root() {
        PathBuf::from("/run/vm-driver")
    } else {
        PathBuf::from(format!("/tmp/vm-driver-{}", uid.as_raw()))
    }
}

impl StateDir {
    /// Opens (creating if needed) a private state directory.
    ///
    /// # Errors
    /// [`StateError`] when it cannot be created or is not private.
    pub fn open(root: &Path) -> Result<Self, StateError> {
        // Absolute: the supervisor and the jailer work in other directories than the caller's.
        let root = std::path::absolute(root).map_err(|source| StateError::Io { path: root.to_owned(), source })?;
        private_dir(&root)?;
        private_dir(&root.join("sandboxes"))?;
        private_dir(&root.join("pool"))?;
        Ok(Self { root })
    }

    /// The directory holding the warm pool's slots (`serve --pool`): VMs with no sandbox yet. A claimed slot's
    /// directory moves to [`Self::sandboxes_dir`] under the sandbox's id.
    pub fn pool_dir(&self) -> PathBuf {
        self.root.join("pool")
    }

    /// The warm pool's snapshots (`serve --pool-snapshots`), one directory each
    /// ([`vm_contract::snapshot`]); made anew by every `serve`.
    pub fn snapshots_dir(&self) -> PathBuf {
        self.root.join("snapshots")
    }

    /// Saved boots that starts restore from ([`crate::template`]).
    pub fn templates_dir(&self) -> PathBuf {
        self.root.join("templates")
    }

    /// The directory holding every sandbox's directory.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.root.join("sandboxes")
    }

    /// The directory of sandbox `id` (whether or not it exists).
    pub fn layout(&self, id: &SandboxId) -> SandboxLayout {
        SandboxLayout::new(self.sandboxes_dir().join(id.as_str()))
    }

    /// Creates a new sandbox directory.
    ///
    /// # Errors
    /// [`StateError::Exists`] if the id is taken.
    pub fn create_sandbox(&self, id: &SandboxId) -> Result<SandboxLayout, StateError> {
        let layout = self.layout(id);
        let dir = layout.dir().to_owned();
        match DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => Ok(layout),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(StateError::Exists(id.clone())),
            Err(source) => Err(StateError::Io { path: dir, source }),
        }
    }
}

/// Creates `path` with mode 0700 if missing, then insists it is a real directory, ours, and private.
fn private_dir(path: &Path) -> Result<(), StateError> {
    match DirBuilder::new().recursive(true).mode(0o700).create(path) {
        Ok(()) => {}
        Err(source) => return Err(StateError::Io { path: path.to_owned(), source }),
    }
    let meta = fs::symlink_metadata(path).map_err(|source| StateError::Io { path: path.to_owned(), source })?;
    let ours = meta.uid() == rustix::process::getuid().as_raw();
    if !meta.file_type().is_dir() || !ours || meta.permissions().mode() & 0o077 != 0 {
        return Err(StateError::NotPrivate(path.to_owned()));
    }
    Ok(())
}

/// A fresh id for a `launch` sandbox: `launch-` and 16 random hex digits.
///
/// # Errors
/// `/dev/urandom` cannot be read.
pub fn random_id(prefix: &str) -> io::Result<SandboxId> {
    SandboxId::parse(&format!("{prefix}-{}", random_hex::<8>()?))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// `N` random bytes from the kernel, as hex.
///
/// # Errors
/// `/dev/urandom` cannot be read.
pub fn random_hex<const N: usize>() -> io::Result<String> {
    Ok(random_bytes::<N>()?.iter().map(|b| format!("{b:02x}")).collect())
}

/// `N` random bytes from the kernel.
///
/// # Errors
/// `/dev/urandom` cannot be read.
pub fn random_bytes<const N: usize>() -> io::Result<[u8; N]> {
    let mut bytes = [0u8; N];
    io::Read::read_exact(&mut fs::File::open("/dev/urandom")?, &mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("state-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_relative_state_directory_is_made_absolute() {
        // Relative to the test's directory (the crate's), as a `--state-dir` argument is to the caller's.
        let relative = PathBuf::from(format!("../target/state-relative-{}", std::process::id()));
        let state = StateDir::open(&relative).unwrap();
        let here = std::env::current_dir().unwrap();
        assert_eq!(state.sandboxes_dir(), here.join(&relative).join("sandboxes"));
        fs::remove_dir_all(&relative).unwrap();
    }

    #[test]
    fn creates_private_directories_and_refuses_duplicates() {
        let root = temp("create");
        let state = StateDir::open(&root).unwrap();
        let id = SandboxId::parse("abc").unwrap();
        let layout = state.create_sandbox(&id).unwrap();
        assert_eq!(fs::metadata(layout.dir()).unwrap().permissions().mode() & 0o777, 0o700);
        assert!(matches!(state.create_sandbox(&id), Err(StateError::Exists(_))));
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn refuses_a_symlinked_or_shared_state_directory() {
        let root = temp("link");
        fs::create_dir_all(&root).unwrap();
        let target = root.join("real");
        fs::create_dir(&target).unwrap();
        fs::set_permissions(&target, fs::Permissions::from_mode(0o700)).unwrap();
        let link = root.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(StateDir::open(&link), Err(StateError::NotPrivate(_))));
        fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(StateDir::open(&target), Err(StateError::NotPrivate(_))));
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn random_ids_are_valid_and_distinct() {
        let a = random_id("launch").unwrap();
        let b = random_id("launch").unwrap();
        assert_ne!(a, b);
        assert!(a.as_str().starts_with("launch-"));
    }
}

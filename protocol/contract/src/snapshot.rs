//! A saved VM: the files of a snapshot directory, named once for the supervisor that writes them
//! (`--save-snapshot`), the supervisor that restores from them (`--restore-snapshot`) and the driver that
//! keeps them (`STATE/snapshots/<slot>/`, named after the pool slot that saved it). See `docs/operations.md` ("Snapshots").

use std::path::{Path, PathBuf};

use crate::shape::SandboxShape;

/// Every file of a snapshot directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotFile {
    /// QEMU's migration stream of the booted, idle guest (0600: it holds all guest memory).
    State,
    /// The agent's hello, as a frame body: a restored agent already said it, to the host that saved it.
    Hello,
    /// An image root's writable layer as the saved guest left it (sparse): every restore boots on a copy of
    /// it, since the saved guest has it mounted.
    WritableDisk,
}

impl SnapshotFile {
    /// The file's name inside the snapshot directory.
    pub const fn name(self) -> &'static str {
        match self {
            Self::State => "state",
            Self::Hello => "hello.frame",
            Self::WritableDisk => "disk.ext4",
        }
    }

    /// Its path inside `dir`.
    pub fn path(self, dir: &Path) -> PathBuf {
        dir.join(self.name())
    }
}

/// The most bytes a migration stream of `shape` may take: its guest memory, and room for device state.
/// The guest writes that memory, so the supervisor stops reading (and the save fails) past it.
pub fn max_state_bytes(shape: SandboxShape) -> u64 {
    (u64::from(shape.memory_mib()) + 64) * 1024 * 1024
}

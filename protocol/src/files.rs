//! The files API: one file operation is one process of the agent's own, on the same stream machinery as
//! `Spawn` (stdin for what goes in, stdout for what comes out, credit both ways, an exit status), started by
//! [`crate::ProcessRequest::Files`]. The agent runs it as the workload identity inside the sandbox's root,
//! so a file operation can reach exactly what a workload process could.
//!
//! | op | stdin | stdout | policy |
//! |---|---|---|---|
//! | `Read` | - | the file's bytes | `files_read` |
//! | `Write` | the file's bytes (replaced whole, atomically) | - | `files_write` |
//! | `List` | - | one JSON object per entry and line | `files_read` |
//! | `Stat` | - | one JSON object | `files_read` |
//! | `MakeDir`, `Remove`, `Rename` | - | - | `files_write` |
//! | `CopyIn` | a tar stream | - | `files_write` |
//! | `CopyOut` | - | a tar stream | `files_read` |
//!
//! A failure is exit status 1 with one line on stderr (`vm-agent: PATH: No such file or directory`).
//! What a guest sends back (a `CopyOut` tar above all) is untrusted: the host extracts it only through the
//! driver's hardened extractor (`docs/files.md`).

use serde::{Deserialize, Serialize};

use crate::policy::Operation;
use crate::process::ProcId;

/// Longest path a file operation may name, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;

/// The argv word after which the agent's own binary runs one file operation instead of booting.
pub const AGENT_FILES_MODE: &str = "vm-agent-files";

/// A request to run one file operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSpawn {
    /// Chosen by the sender; shares the connection's strictly increasing ids with `Spawn`.
    pub id: ProcId,
    /// What to do.
    pub op: FileOp,
    /// Initial output credit, in bytes, shared by stdout and stderr.
    pub output_window: u32,
}

/// One file operation. Paths are the guest's: absolute, or relative to the workload's home directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileOp {
    /// Stream a regular file's bytes to stdout.
    Read {
        /// The file.
        path: String,
    },
    /// Replace (or create) a file with stdin's bytes: written beside it, then renamed over it.
    Write {
        /// The file.
        path: String,
        /// Permission bits (`0o7777` at most; set-id bits are dropped).
        mode: u32,
    },
    /// List a directory's entries, one JSON object a line.
    List {
        /// The directory.
        path: String,
    },
    /// Describe one path (not following a final symlink), as one JSON object.
    Stat {
        /// The path.
        path: String,
    },
    /// Make a directory.
    MakeDir {
        /// The directory.
        path: String,
        /// Make missing parents too, and succeed if it exists.
        parents: bool,
    },
    /// Remove a file, a symlink or an empty directory; with `recursive`, a whole tree.
    Remove {
        /// The path.
        path: String,
        /// Remove a directory with everything in it.
        recursive: bool,
    },
    /// Rename within the sandbox.
    Rename {
        /// The old path.
        from: String,
        /// The new path.
        to: String,
    },
    /// Unpack the tar on stdin.
    CopyIn {
        /// Where.
        path: String,
        /// How the tar's entries map onto `path`.
        layout: TarLayout,
    },
    /// Pack `path` (a file or a whole tree; symlinks as links) as a tar on stdout, its entries named from
    /// `path`'s last component.
    CopyOut {
        /// The file or directory.
        path: String,
    },
}

/// How a `CopyIn` tar lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TarLayout {
    /// `cp - SANDBOX:DIR`: the entries go into the existing directory `path`.
    Into,
    /// `cp SRC SANDBOX:PATH`: the tar holds one top-level entry, which becomes `PATH/NAME` when `PATH` is an
    /// existing directory and `PATH` otherwise, put in place only once complete.
    Named,
}

/// Why the host's hardened extractor refused a tar the guest sent back (`CopyOut` into a host path). The
/// driver reports it to the supervisor ([`crate::attach::SupervisorRequest::TarRefused`]), which ends the
/// operation and records a finding; the text is fixed, so a guest's bytes never reach a log through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TarRefusal {
    /// Not a tar the extractor can read: a bad header, a truncated entry, an unknown extension.
    Malformed,
    /// An absolute entry name or link target.
    AbsolutePath,
    /// A `..` component in an entry name, or a symlink target that leaves the destination.
    ParentDir,
    /// An entry whose path passes through a symlink.
    ThroughSymlink,
    /// A hard link to anything but a regular file this same tar made.
    ForeignHardLink,
    /// A device node, FIFO, socket or sparse entry.
    SpecialFile,
    /// A path already made by an earlier entry, or entries with more than one top-level name.
    Duplicate,
    /// A name or link target longer than the cap.
    PathTooLong,
    /// More entries than the cap.
    TooManyEntries,
    /// More bytes than the cap (or the destination's free space), judged from each header before its data.
    TooManyBytes,
}

impl TarRefusal {
    /// Every reason.
    pub const ALL: &'static [Self] = &[
        Self::Malformed,
        Self::AbsolutePath,
        Self::ParentDir,
        Self::ThroughSymlink,
        Self::ForeignHardLink,
        Self::SpecialFile,
        Self::Duplicate,
        Self::PathTooLong,
        Self::TooManyEntries,
        Self::TooManyBytes,
    ];

    /// Its name on the driver API (`TarRefused.reason`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::AbsolutePath => "absolute_path",
            Self::ParentDir => "parent_dir",
            Self::ThroughSymlink => "through_symlink",
            Self::ForeignHardLink => "foreign_hard_link",
            Self::SpecialFile => "special_file",
            Self::Duplicate => "duplicate",
            Self::PathTooLong => "path_too_long",
            Self::TooManyEntries => "too_many_entries",
            Self::TooManyBytes => "too_many_bytes",
        }
    }

    /// The reason [`TarRefusal::name`] names.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|r| r.name() == name)
    }

    /// Fixed text for messages and findings.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Malformed => "the tar is malformed",
            Self::AbsolutePath => "an entry or link target is an absolute path",
            Self::ParentDir => "an entry or link target leaves the destination through ..",
            Self::ThroughSymlink => "an entry passes through a symlink",
            Self::ForeignHardLink => "a hard link points outside the tar's own files",
            Self::SpecialFile => "an entry is a device node, FIFO, socket or sparse file",
            Self::Duplicate => "an entry repeats a path, or the tar has more than one top-level name",
            Self::PathTooLong => "a name or link target is too long",
            Self::TooManyEntries => "the tar has too many entries",
            Self::TooManyBytes => "the tar holds more bytes than allowed or than the destination has free",
        }
    }
}

/// Why a file operation is malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FileOpError {
    /// An empty path.
    #[error("a path is empty")]
    Empty,
    /// Longer than [`MAX_PATH_BYTES`].
    #[error("a path is longer than {MAX_PATH_BYTES} bytes")]
    TooLong,
    /// A NUL byte, which no Linux path holds.
    #[error("a path holds a NUL byte")]
    Nul,
    /// Mode bits beyond `0o7777`.
    #[error("the mode has bits beyond 0o7777")]
    Mode,
}

impl FileOp {
    /// The policy operation it needs.
    pub fn operation(&self) -> Operation {
        match self {
            Self::Read { .. } | Self::List { .. } | Self::Stat { .. } | Self::CopyOut { .. } => Operation::FilesRead,
            Self::Write { .. }
            | Self::MakeDir { .. }
            | Self::Remove { .. }
            | Self::Rename { .. }
            | Self::CopyIn { .. } => Operation::FilesWrite,
        }
    }

    /// Its name in listings and events (`read`, `write`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Read { .. } => "read",
            Self::Write { .. } => "write",
            Self::List { .. } => "list",
            Self::Stat { .. } => "stat",
            Self::MakeDir { .. } => "mkdir",
            Self::Remove { .. } => "remove",
            Self::Rename { .. } => "rename",
            Self::CopyIn { .. } => "copy_in",
            Self::CopyOut { .. } => "copy_out",
        }
    }

    /// The paths it names, first the one it acts on.
    pub fn paths(&self) -> Vec<&str> {
        match self {
            Self::Read { path }
            | Self::Write { path, .. }
            | Self::List { path }
            | Self::Stat { path }
            | Self::MakeDir { path, .. }
            | Self::Remove { path, .. }
            | Self::CopyIn { path, .. }
            | Self::CopyOut { path } => vec![path],
            Self::Rename { from, to } => vec![from, to],
        }
    }

    /// Whether it takes bytes on stdin.
    pub fn takes_input(&self) -> bool {
        matches!(self, Self::Write { .. } | Self::CopyIn { .. })
    }

    /// Checks every path and the mode.
    ///
    /// # Errors
    /// The first [`FileOpError`].
    pub fn validate(&self) -> Result<(), FileOpError> {
        for path in self.paths() {
            if path.is_empty() {
                return Err(FileOpError::Empty);
            }
            if path.len() > MAX_PATH_BYTES {
                return Err(FileOpError::TooLong);
            }
            if path.contains('\0') {
                return Err(FileOpError::Nul);
            }
        }
        match self {
            Self::Write { mode, .. } if *mode > 0o7777 => Err(FileOpError::Mode),
            _ => Ok(()),
        }
    }

    /// The op as one argv word for the agent's files mode: the frame body, in hex (argv holds no NUL).
    ///
    /// # Errors
    /// It does not encode (never for a validated op).
    pub fn to_arg(&self) -> Result<String, crate::FrameError> {
        let mut wire = Vec::new();
        crate::frame::encode(self, &mut wire)?;
        Ok(wire[crate::frame::HEADER_BYTES..].iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The op back from [`FileOp::to_arg`]'s word; `None` for anything else.
    pub fn from_arg(arg: &str) -> Option<Self> {
        if !arg.len().is_multiple_of(2) || arg.len() > 4 * MAX_PATH_BYTES + 64 {
            return None;
        }
        let bytes = (0..arg.len())
            .step_by(2)
            .map(|i| arg.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
            .collect::<Option<Vec<u8>>>()?;
        crate::frame::decode_body(&bytes).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_op_survives_the_argv_word_and_junk_does_not_decode() {
        let op = FileOp::Rename { from: "a b".into(), to: "/home/sandbox/ç".into() };
        assert_eq!(FileOp::from_arg(&op.to_arg().unwrap()), Some(op));
        for junk in ["", "0", "zz", "ffffffff", &"00".repeat(9000)] {
            assert_eq!(FileOp::from_arg(junk), None, "{junk:.20}");
        }
    }

    #[test]
    fn tar_refusals_parse_from_their_names_only() {
        for reason in TarRefusal::ALL {
            assert_eq!(TarRefusal::parse(reason.name()), Some(*reason));
        }
        assert_eq!(TarRefusal::parse("Malformed"), None);
    }

    #[test]
    fn paths_and_modes_are_checked() {
        let read = |p: &str| FileOp::Read { path: p.into() }.validate();
        assert_eq!(read(""), Err(FileOpError::Empty));
        assert_eq!(read("a\0b"), Err(FileOpError::Nul));
        assert_eq!(read(&"a".repeat(MAX_PATH_BYTES + 1)), Err(FileOpError::TooLong));
        assert_eq!(read("/etc/hostname"), Ok(()));
        assert_eq!(FileOp::Write { path: "x".into(), mode: 0o10000 }.validate(), Err(FileOpError::Mode));
        assert_eq!(FileOp::Stat { path: "x".into() }.operation(), Operation::FilesRead);
        assert_eq!(FileOp::Remove { path: "x".into(), recursive: true }.operation(), Operation::FilesWrite);
    }
}

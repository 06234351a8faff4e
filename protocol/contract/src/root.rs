//! A sandbox's root filesystem from an OCI image: what the driver hands the supervisor in
//! [`crate::layout::SandboxFile::Root`] at every start, and how the image asks its processes be run.
//!
//! Without the file, the guest keeps the boot initramfs as its root.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::layout::{SandboxFile, SandboxLayout};

/// The writable layer's size when none is asked for (`--disk`), in MiB. It is a sparse file: a sandbox
/// that writes nothing costs its metadata only.
pub const DEFAULT_DISK_MIB: u32 = 1024;
/// The largest writable layer a sandbox may ask for: 1 TiB.
pub const MAX_DISK_MIB: u32 = 1 << 20;
/// The most the supervisor reads of [`SandboxFile::Root`]: an image config's `Env` and `Cmd` fit easily.
pub const MAX_ROOT_FILE_BYTES: u64 = 1 << 20;

/// How an image asks its processes be run (the OCI image config's `config` object, the part honoured).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// `KEY=VALUE`s; a request's own variables win.
    #[serde(default)]
    pub env: Vec<String>,
    /// The default working directory.
    #[serde(default)]
    pub working_dir: Option<String>,
    /// Docker's `ENTRYPOINT`.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// Docker's `CMD`.
    #[serde(default)]
    pub cmd: Vec<String>,
    /// The signal that asks the workload to stop, by name (`SIGINT`) or number.
    #[serde(default)]
    pub stop_signal: Option<String>,
    /// The user the image asks for: reported, never obeyed (the workload identity is fixed).
    #[serde(default)]
    pub user: Option<String>,
}

impl RunConfig {
    /// The program and arguments a request's `argv` becomes, by Docker's rules: the entrypoint, then the
    /// request's arguments or, when it gives none, the image's `Cmd`. `None` when both are empty.
    pub fn command(&self, argv: &[String]) -> Option<Vec<String>> {
        let tail = if argv.is_empty() { &self.cmd } else { argv };
        let full: Vec<String> = self.entrypoint.iter().chain(tail).cloned().collect();
        (!full.is_empty()).then_some(full)
    }

    /// The image's variables as pairs; an entry without `=` is a name with an empty value, as Docker reads it.
    pub fn env_pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.env.iter().map(|e| e.split_once('=').unwrap_or((e.as_str(), "")))
    }
}

/// An image root for one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RootImage {
    /// The image's manifest digest (`sha256:…`): the sandbox uses this image while it exists.
    pub manifest: String,
    /// The image's read-only disk (EROFS), shared by every sandbox of the image.
    pub disk: PathBuf,
    /// The writable layer's size in MiB.
    pub disk_mib: u32,
    /// How the image asks its processes be run.
    pub run: RunConfig,
}

/// Why [`SandboxFile::Root`] could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum RootFileError {
    /// Reading or writing it.
    #[error("cannot access the sandbox's root file")]
    Io(#[from] std::io::Error),
    /// Over [`MAX_ROOT_FILE_BYTES`] or not the format.
    #[error("the sandbox's root file is malformed")]
    Malformed,
}

impl RootImage {
    /// Writes the file (0600) in place of any earlier one; `None` removes it (a root-less start).
    ///
    /// # Errors
    /// [`RootFileError::Io`].
    pub fn write(root: Option<&Self>, layout: &SandboxLayout) -> Result<(), RootFileError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = layout.path(SandboxFile::Root);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        let Some(root) = root else { return Ok(()) };
        let json = serde_json::to_vec(root).map_err(|_| RootFileError::Malformed)?;
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
        file.write_all(&json)?;
        Ok(())
    }

    /// Reads the file in `dir`; `None` when there is none.
    ///
    /// # Errors
    /// [`RootFileError`].
    pub fn read(dir: &Path) -> Result<Option<Self>, RootFileError> {
        use std::io::Read;
        let file = match std::fs::File::open(dir.join(SandboxFile::Root.name())) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut bytes = Vec::new();
        file.take(MAX_ROOT_FILE_BYTES + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 > MAX_ROOT_FILE_BYTES {
            return Err(RootFileError::Malformed);
        }
        let root: Self = serde_json::from_slice(&bytes).map_err(|_| RootFileError::Malformed)?;
        if root.disk_mib == 0 || root.disk_mib > MAX_DISK_MIB || !root.disk.is_absolute() {
            return Err(RootFileError::Malformed);
        }
        Ok(Some(root))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn entrypoint_and_cmd_follow_dockers_rules() {
        let both =
            RunConfig { entrypoint: strings(&["tini", "--"]), cmd: strings(&["python3"]), ..RunConfig::default() };
        assert_eq!(both.command(&[]), Some(strings(&["tini", "--", "python3"])));
        assert_eq!(both.command(&strings(&["sh", "-c", "x"])), Some(strings(&["tini", "--", "sh", "-c", "x"])));
        let cmd_only = RunConfig { cmd: strings(&["bash"]), ..RunConfig::default() };
        assert_eq!(cmd_only.command(&[]), Some(strings(&["bash"])));
        assert_eq!(cmd_only.command(&strings(&["true"])), Some(strings(&["true"])));
        assert_eq!(RunConfig::default().command(&[]), None);
    }

    #[test]
    fn env_entries_split_at_the_first_equals() {
        let run = RunConfig { env: strings(&["A=1=2", "B", "C="]), ..RunConfig::default() };
        assert_eq!(run.env_pairs().collect::<Vec<_>>(), [("A", "1=2"), ("B", ""), ("C", "")]);
    }

    #[test]
    fn the_file_round_trips_and_refuses_what_is_malformed() {
        let dir = std::env::temp_dir().join(format!("vm-contract-root-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let layout = SandboxLayout::new(&dir);
        assert!(RootImage::read(&dir).unwrap().is_none());
        let root = RootImage {
            manifest: "sha256:00".into(),
            disk: "/cache/disks/00/rootfs.erofs".into(),
            disk_mib: DEFAULT_DISK_MIB,
            run: RunConfig { env: strings(&["A=1"]), ..RunConfig::default() },
        };
        RootImage::write(Some(&root), &layout).unwrap();
        assert_eq!(RootImage::read(&dir).unwrap(), Some(root.clone()));
        for bad in [RootImage { disk_mib: 0, ..root.clone() }, RootImage { disk: "rel".into(), ..root.clone() }] {
            RootImage::write(Some(&bad), &layout).unwrap();
            assert!(matches!(RootImage::read(&dir), Err(RootFileError::Malformed)));
        }
        std::fs::write(dir.join(SandboxFile::Root.name()), b"{").unwrap();
        assert!(matches!(RootImage::read(&dir), Err(RootFileError::Malformed)));
        RootImage::write(None, &layout).unwrap();
        assert!(RootImage::read(&dir).unwrap().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

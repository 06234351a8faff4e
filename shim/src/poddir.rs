//! A CRI pod's directory on the host (`<sandbox bundle>/vmdriver-pod`): shared read-only with the pod's VM
//! at [`POD_SHARE`] when it boots, so that each container made later can bring its root into the running VM
//! (the `microvm` machine has no hotplug). A container's image disk is hard-linked in as `<name>.erofs` and
//! the files CRI binds into it are copied in as `<name>.files/<i>` ([`vm_protocol::container`]); the guest
//! reads them through the confined file server, as the VMM's jail id, so both are world-readable and hold
//! nothing of a secret's (CRI's `/etc/hosts`, `/etc/hostname`, `/etc/resolv.conf`).

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use vm_contract::share::HostMount;
use vm_protocol::container::{ContainerRoot, MAX_FILE_BYTES, POD_SHARE};

use crate::spec::FileCopy;

/// The directory's name in the sandbox's bundle.
const DIR_NAME: &str = "vmdriver-pod";

/// Why a container's root could not be put in the pod's directory.
#[derive(Debug, thiserror::Error)]
pub enum PodDirError {
    /// The container's id cannot name a root.
    #[error("the container id cannot name a root in the pod's VM: {0}")]
    Name(#[from] vm_protocol::container::RootError),
    /// A file to copy is over the bound, or not a regular file.
    #[error("the file bound at {0} is not a regular file of at most 64 KiB")]
    File(String),
    /// The host refused a step.
    #[error("cannot put the container's root in the pod's directory")]
    Io(#[from] io::Error),
}

/// One pod's directory.
#[derive(Debug, Clone)]
pub struct PodDir(PathBuf);

impl PodDir {
    /// Makes it, empty, in the sandbox's bundle.
    ///
    /// # Errors
    /// The directory cannot be made.
    pub fn make(bundle: &Path) -> io::Result<Self> {
        let dir = bundle.join(DIR_NAME);
        match fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        fs::DirBuilder::new().mode(0o755).create(&dir)?;
        // The umask may have taken bits: the jailed file server reads it as another user.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
        Ok(Self(dir))
    }

    /// The share that gives it to the VM.
    pub fn share(&self) -> HostMount {
        HostMount { source: self.0.clone(), target: POD_SHARE.to_owned(), readonly: true }
    }

    /// Puts the container `name`'s disk and files in, and returns the root its processes name.
    ///
    /// # Errors
    /// [`PodDirError`]; what was put in is removed.
    pub fn add(&self, name: &str, disk: &Path, files: &[FileCopy]) -> Result<ContainerRoot, PodDirError> {
        let root = ContainerRoot { name: name.to_owned(), files: files.iter().map(|f| f.target.clone()).collect() };
        root.check()?;
        self.remove(&root);
        let added = self.put(&root, disk, files);
        if added.is_err() {
            self.remove(&root);
        }
        added.map(|()| root)
    }

    fn put(&self, root: &ContainerRoot, disk: &Path, files: &[FileCopy]) -> Result<(), PodDirError> {
        let linked = self.0.join(root.disk_name());
        if fs::hard_link(disk, &linked).is_err() {
            // Another file system: a copy, read-only as the disk is.
            fs::copy(disk, &linked)?;
            fs::set_permissions(&linked, fs::Permissions::from_mode(0o444))?;
        }
        let dir = self.0.join(root.files_dir());
        fs::DirBuilder::new().mode(0o755).create(&dir)?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
        for (i, file) in files.iter().enumerate() {
            let refused = || PodDirError::File(file.target.clone());
            let source = fs::File::open(&file.source).map_err(|_| refused())?;
            if !source.metadata().map_err(|_| refused())?.is_file() {
                return Err(refused());
            }
            let mut bytes = Vec::new();
            source.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
            if bytes.len() as u64 > MAX_FILE_BYTES {
                return Err(refused());
            }
            let mut copy =
                fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(dir.join(i.to_string()))?;
            copy.set_permissions(fs::Permissions::from_mode(0o644))?;
            copy.write_all(&bytes)?;
        }
        Ok(())
    }

    /// Takes a container's disk and files out (the guest keeps what it mounted until the VM ends).
    pub fn remove(&self, root: &ContainerRoot) {
        let _ = fs::remove_file(self.0.join(root.disk_name()));
        let _ = fs::remove_dir_all(self.0.join(root.files_dir()));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use super::*;

    #[test]
    fn a_containers_disk_and_files_are_put_in_readable_and_taken_out() {
        let bundle = tempfile::tempdir().unwrap();
        let pod = PodDir::make(bundle.path()).unwrap();
        let disk = bundle.path().join("disk.erofs");
        fs::write(&disk, b"erofs").unwrap();
        let hosts = bundle.path().join("hosts");
        fs::write(&hosts, b"127.0.0.1 pod\n").unwrap();
        let files = [FileCopy { source: hosts.clone(), target: "/etc/hosts".into() }];
        let root = pod.add("c1", &disk, &files).unwrap();
        assert_eq!(root, ContainerRoot { name: "c1".into(), files: vec!["/etc/hosts".into()] });
        let dir = bundle.path().join(DIR_NAME);
        assert_eq!(fs::read(dir.join("c1.erofs")).unwrap(), b"erofs");
        assert_eq!(fs::read(dir.join("c1.files/0")).unwrap(), b"127.0.0.1 pod\n");
        assert_eq!(fs::metadata(dir.join("c1.files/0")).unwrap().permissions().mode() & 0o777, 0o644);
        pod.remove(&root);
        assert!(fs::read_dir(&dir).unwrap().next().is_none());

        fs::write(&hosts, vec![b'x'; 64 * 1024 + 1]).unwrap();
        assert!(matches!(pod.add("c2", &disk, &files), Err(PodDirError::File(_))));
        assert!(fs::read_dir(&dir).unwrap().next().is_none(), "a refused container leaves nothing");
        assert!(matches!(pod.add("../c3", &disk, &[]), Err(PodDirError::Name(_))));
    }
}

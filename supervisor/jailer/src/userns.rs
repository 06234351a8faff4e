//! User namespaces with chosen id maps. Root's need a helper: only a process privileged in the host's
//! namespace may map other ids than its own, and once this process has unshared it no longer is, so a
//! child that stayed behind writes the maps.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::sched::{unshare, CloneFlags};
use nix::unistd::{fork, ForkResult};

use crate::JailError;

/// The maps of a new user namespace.
#[derive(Debug, Clone)]
pub(crate) struct Maps {
    uid: String,
    gid: String,
    /// Deny `setgroups` in the namespace (needed for a map written by an unprivileged process).
    deny_setgroups: bool,
}

impl Maps {
    /// `inside` mapped to `outside`, one uid and one gid, `setgroups` denied.
    pub(crate) fn one(uid: (u32, u32), gid: (u32, u32)) -> Self {
        Self { uid: format!("{} {} 1", uid.0, uid.1), gid: format!("{} {} 1", gid.0, gid.1), deny_setgroups: true }
    }

    /// Writes these maps for the process of `proc` (a `/proc/PID` directory).
    fn write(&self, proc: &Path) -> Result<(), JailError> {
        let write = |file: &str, text: &str| {
            std::fs::write(proc.join(file), text).map_err(JailError::step("map the user namespace"))
        };
        if self.deny_setgroups {
            write("setgroups", "deny")?;
        }
        write("uid_map", &self.uid)?;
        write("gid_map", &self.gid)
    }
}

/// Unprivileged: a user namespace this process maps itself (its own ids only).
pub(crate) fn enter_self_mapped(maps: &Maps) -> Result<(), JailError> {
    unshare(CloneFlags::CLONE_NEWUSER).map_err(JailError::errno("create the user namespace"))?;
    maps.write(Path::new("/proc/self"))
}

/// Root: a user namespace whose maps a child, still in the host's namespace, writes.
pub(crate) fn enter_mapped_by_helper(maps: &Maps) -> Result<(), JailError> {
    let (ready_read, ready_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(JailError::errno("make a pipe"))?;
    let (done_read, done_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(JailError::errno("make a pipe"))?;
    let parent = std::process::id();
    // SAFETY: single-threaded (see pidns::split); the child only reads, writes three files and exits.
    #[allow(unsafe_code)]
    let forked = unsafe { fork() }.map_err(JailError::errno("fork the mapper"))?;
    match forked {
        ForkResult::Child => {
            drop((ready_write, done_read));
            let mapped = std::fs::File::from(ready_read).read_exact(&mut [0]).is_ok()
                && maps.write(&PathBuf::from(format!("/proc/{parent}"))).is_ok();
            let _ = std::fs::File::from(done_write).write_all(&[u8::from(mapped)]);
            std::process::exit(i32::from(!mapped))
        }
        ForkResult::Parent { child } => {
            drop((ready_read, done_write));
            let made = unshare(CloneFlags::CLONE_NEWUSER);
            let mut said = [0];
            let told = std::fs::File::from(ready_write).write_all(&[1]).is_ok();
            let mapped = told && made.is_ok() && std::fs::File::from(done_read).read_exact(&mut said).is_ok();
            let _ = nix::sys::wait::waitpid(child, None);
            made.map_err(JailError::errno("create the user namespace"))?;
            if !mapped || said[0] != 1 {
                return Err(JailError::Step("map the user namespace", std::io::ErrorKind::PermissionDenied.into()));
            }
            Ok(())
        }
    }
}

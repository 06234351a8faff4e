//! QEMU's PID namespace, and how the supervisor learns QEMU's pid.
//!
//! The jailer made the namespace with the others; a namespace's first process is its init, so QEMU must be
//! the jailer's child, not the jailer itself. Inside, QEMU is pid 1 and sees no other process: an escaped
//! QEMU can signal nothing of the host, and its end ends anything it made.
//!
//! The jailer stays as QEMU's parent, confined like it (same ids, jail root, no capabilities), and does only
//! this: report QEMU's pid as the host sees it ([`vm_contract::jail::vmm_pid_line`]), wait, and exit as QEMU
//! did, so the supervisor's child still ends when QEMU does. QEMU gets SIGKILL when the jailer dies (its
//! parent-death signal), and the supervisor and watchdog hold QEMU's own pid, so either way no QEMU outlives
//! its leash.

use std::io::{Read, Write};
use std::os::fd::{IntoRawFd, OwnedFd, RawFd};

use nix::fcntl::OFlag;
use nix::sys::signal::{raise, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};
use vm_contract::jail::vmm_pid_line;

use crate::{fds, JailError, Safeguards};

/// Splits into QEMU's parent and QEMU-to-be. Returns in the child only, which then execs QEMU (keeping
/// `for_qemu`: a snapshot to restore, the guest's RAM), with its link to the parent; the parent reports the child's pid,
/// closes what it inherited and `for_qemu`, and exits when the child does.
pub fn split(inherited: &[RawFd], for_qemu: Vec<OwnedFd>, safeguards: Safeguards) -> Result<Parent, JailError> {
    // Open for as long as the parent lives: the child checks it after arming its parent-death signal.
    let (alive_read, alive_write) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(JailError::errno("make a pipe"))?;
    // SAFETY: the jailer is single-threaded (no runtime, no thread started), so the child may run any code,
    // not only async-signal-safe code. No safe API forks: std only spawns (fork and exec in one), and QEMU
    // must be the namespace's first process with the jail already set up around it.
    #[allow(unsafe_code)]
    let forked = unsafe { fork() }.map_err(JailError::errno("fork QEMU"))?;
    match forked {
        ForkResult::Child => {
            drop(alive_write);
            // Open across the exec: QEMU reads it.
            for fd in for_qemu {
                let _ = fd.into_raw_fd();
            }
            become_vmm(alive_read, safeguards)
        }
        ForkResult::Parent { child } => {
            drop(alive_read);
            drop(for_qemu);
            let reported = report_pid(child.as_raw().unsigned_abs());
            fds::close(inherited);
            if let Err(e) = reported {
                // Nobody knows QEMU's pid: it must not run.
                let _ = nix::sys::signal::kill(child, Signal::SIGKILL);
                let _ = waitpid(child, None);
                return Err(e);
            }
            let status = wait_for(child);
            drop(alive_write);
            mirror(status)
        }
    }
}

/// The child's link to the parent: the read end of a pipe whose write end only the parent holds.
pub struct Parent(std::fs::File);

impl Parent {
    /// Arms SIGKILL at the parent's death (again after a change of ids, which disarms it), then checks that
    /// the parent still lives.
    pub fn die_with(&self, safeguards: Safeguards) -> Result<(), JailError> {
        if safeguards.parent_death_signal {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
                .map_err(|e| JailError::step("arm the parent-death signal")(e.into()))?;
        }
        // The parent may have died before the signal was armed; then its end of the pipe is closed.
        match (&self.0).read(&mut [0]) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            _ => Err(JailError::Step("outlive the jailer", std::io::ErrorKind::BrokenPipe.into())),
        }
    }
}

/// The child: dies with its parent, and keeps no pipe to the supervisor on its stdout.
fn become_vmm(alive: OwnedFd, safeguards: Safeguards) -> Result<Parent, JailError> {
    let parent = Parent(alive.into());
    parent.die_with(safeguards)?;
    quiet_stdout()?;
    Ok(parent)
}

/// Writes QEMU's host pid on stdout for the supervisor (a pipe it reads once), then points stdout at
/// `/dev/null`. Used by both the PID namespace's parent and, without one, by the jailer about to become QEMU.
pub fn report_pid(pid: u32) -> Result<(), JailError> {
    std::io::stdout().lock().write_all(vmm_pid_line(pid).as_bytes()).map_err(JailError::step("report QEMU's pid"))?;
    quiet_stdout()
}

fn quiet_stdout() -> Result<(), JailError> {
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null").map_err(JailError::step("open /dev/null"))?;
    nix::unistd::dup2_stdout(null).map_err(JailError::errno("point stdout at /dev/null"))
}

/// Waits for the child's end (retrying interrupted waits).
fn wait_for(child: Pid) -> WaitStatus {
    loop {
        match waitpid(child, None) {
            Ok(status @ (WaitStatus::Exited(..) | WaitStatus::Signaled(..))) => return status,
            Err(nix::Error::EINTR) | Ok(_) => {}
            // ECHILD: nothing left to wait for; report a failure rather than spin.
            Err(_) => return WaitStatus::Exited(child, i32::from(vm_contract::exit::JAILER_FAILED)),
        }
    }
}

/// Ends this process as the child ended: the same exit code, or the same signal.
fn mirror(status: WaitStatus) -> ! {
    match status {
        WaitStatus::Signaled(_, signal, _) => {
            // The jailer handles no signal, so each has its default action: for SIGKILL, SIGTERM, SIGSEGV
            // and the rest that end QEMU, the end of this process too.
            let _ = raise(signal);
            std::process::exit(128 + signal as i32)
        }
        WaitStatus::Exited(_, code) => std::process::exit(code),
        _ => std::process::exit(i32::from(vm_contract::exit::JAILER_FAILED)),
    }
}

//! A SIGKILL for the VMM that any thread can pull at once, without a trip through the event loop.
//!
//! The liveness thread pulls it the moment the driver's pipe closes: on a loaded host every extra wakeup
//! between the driver's death and the signal is time the VM outlives its leash. The event loop still does
//! the orderly rest (finding, final events, flush).
//!
//! A VMM runs niced (`crate::boot::vmm::VMM_NICE`); a dying one is no longer data plane, and at nice 10 beside busy
//! control-plane processes its exit (every one of its threads must run once to exit) can wait hundreds of
//! milliseconds for CPU. So right after the kill the switch raises every VMM thread to [`DYING_NICE`]: a
//! SIGKILLed thread runs no more user code, only its exit, so the boost cannot be abused (permitted when the supervisor runs
//! as root; otherwise it is skipped and the exit keeps the VMM's priority).

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};
use vm_contract::pids::ProcessRecord;

/// The niceness a dying VMM's threads get: ahead of the busy control plane, for the few milliseconds of exit.
pub const DYING_NICE: i32 = -10;

/// Shared by the thread that starts the VMM and any thread that may have to end it.
#[derive(Debug, Clone, Default)]
pub struct KillSwitch(Arc<Mutex<Option<(i32, OwnedFd)>>>);

impl KillSwitch {
    /// Arms it for `vmm` (first the jailer just started, then QEMU once the jailer reported it; re-arming
    /// replaces). A pidfd names that very process, checked against the record after opening: a pull after it
    /// exited signals nothing, whatever now has its pid.
    pub fn arm(&self, vmm: Option<ProcessRecord>) {
        let armed = vmm.and_then(|record| {
            let pidfd = pidfd_open(Pid::from_raw(record.pid)?, PidfdFlags::empty()).ok()?;
            record.is_alive().then_some((record.pid, pidfd))
        });
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = armed;
    }

    /// Sends the VMM SIGKILL, if one was started.
    pub fn pull(&self) {
        if let Some((pid, pidfd)) = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
            // The signal first, through the pidfd: it fails once the VMM was reaped, and then its pid may name
            // another process, which must not be reniced. Until reaped (by us, or by the jailer, which is
            // blocked until the kill lands), the pid and its threads are its own.
            if pidfd_send_signal(pidfd, Signal::KILL).is_ok() {
                for thread in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
                    let tid = thread.file_name().to_str().and_then(|t| t.parse().ok()).and_then(Pid::from_raw);
                    let _ = rustix::process::setpriority_process(tid, DYING_NICE);
                }
            }
        }
    }
}

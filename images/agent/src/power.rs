//! Powering the VM off. Only the PID 1 binary calls this; the link logic never does.
//!
//! The kernel runs with `reboot=t panic=-1` and QEMU with `-no-reboot`, so a reboot request (or a panic of
//! PID 1) makes QEMU exit under either firmware; `poweroff` would hang under qboot with ACPI off.

use std::thread;
use std::time::Duration;

use nix::sys::reboot::{reboot, RebootMode};
use nix::sys::signal::{kill, Signal};
use nix::unistd::{sync, Pid};

/// Kills every other process, flushes filesystems and resets the VM. Never returns.
pub fn off() -> ! {
    // PID 1 is spared by kill(-1); this sweeps orphans the link did not know.
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    sync();
    let _ = reboot(RebootMode::RB_AUTOBOOT);
    // Only reached if the reboot syscall failed; the host's boot and stop timeouts take over.
    loop {
        thread::sleep(Duration::from_secs(3600));
    }
}

/// A panic anywhere in PID 1 logs to the console and powers off instead of leaving a half-dead agent.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        eprintln!("vm-agent: panic; powering off");
        off();
    }));
}

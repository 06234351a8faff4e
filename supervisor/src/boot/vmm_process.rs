//! A started VMM as the supervisor holds it: `vm-jailer`, its child, and QEMU, which is the jailer's child
//! when QEMU has a PID namespace (`vm-jailer`'s `pidns`) and the jailer itself when not.
//!
//! The jailer waits for QEMU and exits as it did, so waiting for the child is waiting for QEMU. Kills go to
//! QEMU itself, through the kill switch, never to the jailer: the jailer's exit then still means that QEMU
//! has exited and been reaped, where a killed jailer would leave QEMU a moment of life (its parent-death
//! signal) after the supervisor believed it gone.

use std::process::ExitStatus;

use tokio::process::Child;
use vm_contract::pids::ProcessRecord;

use crate::stop::kill_switch::KillSwitch;

/// The jailer child and the switch that kills its QEMU.
#[derive(Debug)]
pub struct VmmProcess {
    /// `vm-jailer` (QEMU's pipes are its pipes).
    pub jailer: Child,
    kill: KillSwitch,
    qemu: Option<ProcessRecord>,
}

impl VmmProcess {
    /// Holds `jailer`, with `kill` armed for it until QEMU's own pid is known.
    pub fn new(jailer: Child, kill: KillSwitch) -> Self {
        kill.arm(jailer.id().and_then(|p| ProcessRecord::read(i32::try_from(p).ok()?)));
        Self { jailer, kill, qemu: None }
    }

    /// QEMU has exited (and been reaped).
    pub async fn wait(&mut self) -> std::io::Result<ExitStatus> {
        self.jailer.wait().await
    }

    /// Whether QEMU has exited, even if the jailer has not yet reaped it and followed: the watchdog, which
    /// holds QEMU's pidfd, can see QEMU's end a moment before the jailer's exit arrives here.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.jailer.try_wait(), Ok(Some(_))) || self.qemu.is_some_and(|qemu| !qemu.is_alive())
    }

    /// SIGKILLs QEMU (the jailer, before QEMU's pid is known). Its exit arrives through [`Self::wait`].
    pub fn start_kill(&self) {
        self.kill.pull();
    }

    /// Kills QEMU and waits for its exit.
    pub async fn kill(&mut self) {
        self.start_kill();
        let _ = self.wait().await;
    }

    /// From now on the kill switch names QEMU itself.
    pub fn arm(&mut self, qemu: ProcessRecord) {
        self.kill.arm(Some(qemu));
        self.qemu = Some(qemu);
    }
}

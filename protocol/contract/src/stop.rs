//! The stop budget: the phases of an orderly stop, and the driver's deadline, derived from them so that the
//! supervisor's flush always fits.
//!
//! ```text
//! SIGTERM --grace--> workloads SIGKILLed in the guest --power_off--> QEMU SIGKILLed if still running
//!   --vmm_exit--> QEMU reaped, clients drained --watchdog_close--> lease closed
//!   --flush--> telemetry delivered --margin--> exit
//! driver deadline = grace + power_off + vmm_exit + watchdog_close + flush + margin
//! ```
//!
//! Each phase is bounded on its own, so a guest that ignores shutdown costs `grace + power_off`, never the
//! flush's share; and the driver, which waits for the supervisor before closing the liveness pipe, waits
//! longer than the whole.

use std::time::Duration;

/// Between SIGTERM and SIGKILL of the workload's processes, inside the guest.
pub const GRACE: Duration = Duration::from_secs(3);
/// After the grace, how long the VM has to power itself off before QEMU is killed.
pub const POWER_OFF: Duration = Duration::from_secs(2);
/// For QEMU to be reaped after it was killed, and for attach clients to take their last frames.
pub const VMM_EXIT: Duration = Duration::from_secs(1);
/// For the watchdog to exit after the lease is closed (at once, normally: it exits with the VMM).
pub const WATCHDOG_CLOSE: Duration = Duration::from_secs(2);
/// The telemetry flush: last, and always whole.
pub const FLUSH: Duration = Duration::from_secs(5);
/// Process exit and scheduling.
pub const MARGIN: Duration = Duration::from_secs(1);

/// How long the driver waits for the supervisor after SIGTERM before it kills it.
pub const fn driver_deadline() -> Duration {
    Duration::from_secs(GRACE.as_secs() + POWER_OFF.as_secs() + after_vmm_exit().as_secs())
}

/// From the VMM's exit to the supervisor's: its clients drained and its telemetry flushed.
pub const fn after_vmm_exit() -> Duration {
    Duration::from_secs(VMM_EXIT.as_secs() + WATCHDOG_CLOSE.as_secs() + FLUSH.as_secs() + MARGIN.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flush_fits_inside_the_drivers_deadline() {
        assert_eq!(driver_deadline(), Duration::from_secs(14));
        assert_eq!(after_vmm_exit(), Duration::from_secs(9));
        assert!(GRACE + POWER_OFF + VMM_EXIT + WATCHDOG_CLOSE + FLUSH < driver_deadline());
    }
}

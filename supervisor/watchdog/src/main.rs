//! `vm-watchdog --vmm-pid PID --vmm-start-time TICKS` (`vm_contract::args::WatchdogArgs`): started by the
//! supervisor, never by hand. Its exit status is a `vm_contract::exit::WatchdogExit`.
#![forbid(unsafe_code)]

vm_contract::test_controls!();

use std::os::fd::{AsFd, OwnedFd};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};
use vm_contract::args::WatchdogArgs;
use vm_contract::exit::WatchdogExit;
use vm_contract::pids::ProcessRecord;
use vm_watchdog::{
    decide, own_gap, Action, Input, KillReason, Policy, KILL_ATTEMPTS, KILL_CONFIRM_MS, READY, SILENCE_MS,
};

fn main() -> ExitCode {
    // Out of the supervisor's session and process group: its signals are not ours.
    let _ = rustix::process::setsid();
    #[cfg(feature = "test-controls")]
    {
        use vm_contract::test_control::{announcement, TestControl};
        eprintln!("{}", announcement("vm-watchdog"));
        if control(TestControl::WatchdogNeverReady) {
            // Fault injection: hold on without the ready byte until the supervisor gives up and kills us.
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(WatchdogArgs { vmm }) = WatchdogArgs::parse(&args) else {
        eprintln!("vm-watchdog: usage: vm-watchdog --vmm-pid PID --vmm-start-time TICKS");
        return exit(WatchdogExit::Usage);
    };
    let pid = vmm.pid;
    let Some(pidfd) = open_vmm(vmm) else {
        eprintln!("vm-watchdog: the VMM (pid {pid}) is not running; nothing to watch");
        return exit(WatchdogExit::Unconfirmed);
    };
    if write_byte(READY).is_err() {
        // The supervisor is already gone.
        return kill(&pidfd, pid, KillReason::SupervisorGone);
    }
    watch(&pidfd, pid, policy())
}

fn watch(pidfd: &OwnedFd, pid: i32, policy: Policy) -> ExitCode {
    let stdin = rustix::stdio::stdin();
    let mut last_pulse = Instant::now();
    loop {
        let silence = Duration::from_millis(SILENCE_MS).saturating_sub(last_pulse.elapsed());
        let asked = Instant::now();
        let input = match wait(stdin, pidfd.as_fd(), silence) {
            Ok(input) => input,
            Err(_) => Input::Eof,
        };
        // Silence measures the supervisor, not this process: if the wait overran by more than the
        // tolerance, this process was not running, and that time is not the supervisor's.
        if input == Input::Silence {
            if let Some(gap) = own_gap(silence, asked.elapsed()) {
                last_pulse += gap;
                continue;
            }
        }
        match decide(input, policy) {
            Some(Action::Echo) => {
                last_pulse = Instant::now();
                if write_byte(vm_watchdog::PULSE).is_err() {
                    return kill(pidfd, pid, KillReason::SupervisorGone);
                }
            }
            Some(Action::Kill(reason)) => return kill(pidfd, pid, reason),
            Some(Action::Exit) => return exit(WatchdogExit::VmmGone),
            // Silence with the silence check off (test control): keep waiting.
            None => last_pulse = Instant::now(),
        }
    }
}

/// Waits for one pulse byte, EOF, the VMM's exit, or the end of `silence`.
fn wait(
    stdin: rustix::fd::BorrowedFd<'_>,
    pidfd: rustix::fd::BorrowedFd<'_>,
    silence: Duration,
) -> rustix::io::Result<Input> {
    let mut fds = [PollFd::new(&pidfd, PollFlags::IN), PollFd::new(&stdin, PollFlags::IN)];
    let timeout = Timespec::try_from(silence).unwrap_or(Timespec { tv_sec: 2, tv_nsec: 0 });
    loop {
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => return Ok(Input::Silence),
            Ok(_) => break,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e),
        }
    }
    if !fds[0].revents().is_empty() {
        return Ok(Input::VmmExited);
    }
    let mut byte = [0u8; 1];
    loop {
        // An interrupted read is no evidence of silence: the byte is there (poll said so); read again.
        match rustix::io::read(stdin, &mut byte) {
            Ok(0) => return Ok(Input::Eof),
            Ok(_) => return Ok(Input::Byte(byte[0])),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e),
        }
    }
}

/// SIGKILL through the pidfd, confirmed by the pidfd becoming readable; retried. The kill comes before any
/// logging, so nothing (a full stderr, say) can delay it.
fn kill(pidfd: &OwnedFd, pid: i32, reason: KillReason) -> ExitCode {
    let _ = write_byte(vm_watchdog::KILLING);
    let mut confirmed = false;
    for _ in 0..KILL_ATTEMPTS {
        match pidfd_send_signal(pidfd, Signal::KILL) {
            // ESRCH: it already exited.
            Ok(()) | Err(Errno::SRCH) => {}
            Err(_) => continue,
        }
        let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
        let timeout = Timespec { tv_sec: 0, tv_nsec: i64::try_from(KILL_CONFIRM_MS * 1_000_000).unwrap_or(0) };
        if matches!(poll(&mut fds, Some(&timeout)), Ok(n) if n > 0) {
            confirmed = true;
            break;
        }
    }
    let why = match reason {
        KillReason::SupervisorGone => "the supervisor is gone",
        KillReason::WrongByte(_) => "a wrong byte on the pulse pipe",
        KillReason::Silence => "no pulse for 2 s",
    };
    if confirmed {
        eprintln!("vm-watchdog: {why}; killed the VMM (pid {pid})");
        exit(WatchdogExit::VmmGone)
    } else {
        eprintln!("vm-watchdog: {why}; the VMM (pid {pid}) did not exit after {KILL_ATTEMPTS} SIGKILLs");
        exit(WatchdogExit::Unconfirmed)
    }
}

fn exit(how: WatchdogExit) -> ExitCode {
    ExitCode::from(how.code())
}

/// Opens a pidfd for the VMM and checks, after opening, that it is the process the record names: from then
/// on the pidfd names that process even if the pid is reused.
fn open_vmm(vmm: ProcessRecord) -> Option<OwnedFd> {
    let fd = pidfd_open(Pid::from_raw(vmm.pid)?, PidfdFlags::empty()).ok()?;
    vmm.is_alive().then_some(fd)
}

fn write_byte(byte: u8) -> rustix::io::Result<()> {
    loop {
        match rustix::io::write(rustix::stdio::stdout(), &[byte]) {
            Ok(1) => return Ok(()),
            Ok(_) => return Err(Errno::PIPE),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e),
        }
    }
}

fn policy() -> Policy {
    Policy { silence_kills: !control(vm_contract::test_control::TestControl::WatchdogEofOnly) }
}

//! `vm-watchdog --vmm-pid PID --vmm-start-time TICKS`: started by the supervisor, never by hand.
//!
//! Exit status: 0 once the VMM is gone (stopped by the supervisor, or killed here and confirmed); 1 when
//! the kill could not be confirmed or the VMM could not be watched; 2 for bad arguments.
#![forbid(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags, Signal};
use vm_watchdog::{decide, Action, Input, KillReason, Policy, KILL_ATTEMPTS, KILL_CONFIRM_MS, READY, SILENCE_MS};

fn main() -> ExitCode {
    // Out of the supervisor's session and process group: its signals are not ours.
    let _ = rustix::process::setsid();
    #[cfg(feature = "test-controls")]
    {
        use vm_contract::test_control::{announcement, TestControl};
        eprintln!("{}", announcement("vm-watchdog"));
        if TestControl::WatchdogNeverReady.is_on() {
            // Fault injection: hold on without the ready byte until the supervisor gives up and kills us.
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
    }
    let Some((pid, start_time)) = parse_args() else {
        eprintln!("vm-watchdog: usage: vm-watchdog --vmm-pid PID --vmm-start-time TICKS");
        return ExitCode::from(2);
    };
    let pidfd = match open_vmm(pid, start_time) {
        Ok(fd) => fd,
        Err(()) => {
            eprintln!("vm-watchdog: the VMM (pid {pid}) is not running; nothing to watch");
            return ExitCode::from(1);
        }
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
        let input = match wait(stdin, pidfd.as_fd(), silence) {
            Ok(input) => input,
            Err(_) => Input::Eof,
        };
        match decide(input, policy) {
            Some(Action::Echo) => {
                last_pulse = Instant::now();
                if write_byte(vm_watchdog::PULSE).is_err() {
                    return kill(pidfd, pid, KillReason::SupervisorGone);
                }
            }
            Some(Action::Kill(reason)) => return kill(pidfd, pid, reason),
            Some(Action::Exit) => return ExitCode::SUCCESS,
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
        ExitCode::SUCCESS
    } else {
        eprintln!("vm-watchdog: {why}; the VMM (pid {pid}) did not exit after {KILL_ATTEMPTS} SIGKILLs");
        ExitCode::from(1)
    }
}

/// Opens a pidfd for `pid` and checks, after opening, that it is the process that started at `start_time`:
/// from then on the pidfd names that process even if the pid is reused.
fn open_vmm(pid: i32, start_time: u64) -> Result<OwnedFd, ()> {
    let raw = Pid::from_raw(pid).ok_or(())?;
    let fd = pidfd_open(raw, PidfdFlags::empty()).map_err(|_| ())?;
    (vm_watchdog_start_time(pid) == Some(start_time)).then_some(fd).ok_or(())
}

/// Field 22 of `/proc/<pid>/stat`.
fn vm_watchdog_start_time(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    text.rsplit_once(") ")?.1.split(' ').nth(19)?.parse().ok()
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

fn parse_args() -> Option<(i32, u64)> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    Some((value("--vmm-pid")?.parse().ok()?, value("--vmm-start-time")?.parse().ok()?))
}

#[cfg(feature = "test-controls")]
fn policy() -> Policy {
    Policy { silence_kills: !vm_contract::test_control::TestControl::WatchdogEofOnly.is_on() }
}

#[cfg(not(feature = "test-controls"))]
fn policy() -> Policy {
    Policy::default()
}

//! The watchdog binary against a real process standing in for the VMM.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use vm_contract::args::WatchdogArgs;
use vm_contract::pids::ProcessRecord;
use vm_watchdog::{PULSE, READY};

struct Rig {
    vmm: Child,
    watchdog: Child,
    pulses: Option<ChildStdin>,
    echoes: ChildStdout,
}

fn record(pid: u32) -> ProcessRecord {
    ProcessRecord::read(i32::try_from(pid).unwrap()).unwrap()
}

fn rig() -> Rig {
    let vmm = Command::new("sleep").arg("1000").spawn().unwrap();
    let mut watchdog = Command::new(env!("CARGO_BIN_EXE_vm-watchdog"))
        .args(WatchdogArgs { vmm: record(vmm.id()) }.to_argv())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut echoes = watchdog.stdout.take().unwrap();
    let mut ready = [0u8];
    echoes.read_exact(&mut ready).unwrap();
    assert_eq!(ready[0], READY);
    Rig { vmm, pulses: watchdog.stdin.take(), watchdog, echoes }
}

/// Waits for `child` to exit within `limit`; returns whether it did.
fn exits_within(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn echoes_pulses_and_keeps_the_vmm_alive() {
    let mut r = rig();
    for _ in 0..12 {
        r.pulses.as_mut().unwrap().write_all(&[PULSE]).unwrap();
        let mut echo = [0u8];
        r.echoes.read_exact(&mut echo).unwrap();
        assert_eq!(echo[0], PULSE);
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(r.vmm.try_wait().unwrap().is_none(), "3 s of pulses, VMM still alive");
    r.vmm.kill().unwrap();
    r.vmm.wait().unwrap();
    assert!(exits_within(&mut r.watchdog, Duration::from_secs(2)), "VMM gone: watchdog exits");
    assert!(r.watchdog.wait().unwrap().success());
}

#[test]
fn kills_the_vmm_on_eof() {
    let mut r = rig();
    let start = Instant::now();
    drop(r.pulses.take());
    assert!(exits_within(&mut r.vmm, Duration::from_secs(2)), "VMM killed after EOF");
    eprintln!("EOF to VMM exit: {:?}", start.elapsed());
    assert!(r.watchdog.wait().unwrap().success(), "kill confirmed");
}

#[test]
fn kills_the_vmm_after_two_seconds_of_silence() {
    let mut r = rig();
    let start = Instant::now();
    assert!(!exits_within(&mut r.vmm, Duration::from_millis(1500)), "not before the silence limit");
    assert!(exits_within(&mut r.vmm, Duration::from_secs(3)), "killed after silence");
    assert!(start.elapsed() >= Duration::from_secs(2));
    assert!(r.watchdog.wait().unwrap().success());
    drop(r.pulses);
}

#[test]
fn kills_the_vmm_on_a_wrong_byte() {
    let mut r = rig();
    r.pulses.as_mut().unwrap().write_all(b"x").unwrap();
    assert!(exits_within(&mut r.vmm, Duration::from_secs(2)));
    assert!(r.watchdog.wait().unwrap().success());
}

#[test]
fn refuses_a_pid_whose_start_time_does_not_match() {
    let mut vmm = Command::new("sleep").arg("1000").spawn().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_vm-watchdog"))
        .args(WatchdogArgs { vmm: ProcessRecord { start_time: 1, ..record(vmm.id()) } }.to_argv())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(1));
    assert!(vmm.try_wait().unwrap().is_none(), "a process that is not our VMM is never touched");
    vmm.kill().unwrap();
    vmm.wait().unwrap();
}

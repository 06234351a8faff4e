//! No VM without a live supervisor: causal tests with controls, on real processes and real VMs.
//!
//! Each test first sees the workload's canary line from inside the VM, then injects the fault and watches
//! the outcome from /proc (pid and start time), never from what the code under test reports. Each control
//! turns one mechanism off through a switch compiled only into test builds (`VM_TEST_CONTROL`) and shows
//! the bad outcome appears; the test itself shows it does not with the mechanism on.

use std::io::{BufRead, Read};
use std::time::{Duration, Instant};
use vm_contract::layout::SandboxFile;

use nix::sys::signal::Signal::{SIGCONT, SIGKILL, SIGSTOP, SIGTERM};
use vm_test_support::image::with_init_that_never_stops;
use vm_test_support::procs::{self, signal};
use vm_test_support::{gone_within, sandbox, survives, Launch, Running, Scratch, TestControl, CANARY};

#[test]
fn killing_the_driver_stops_supervisor_watchdog_and_vm() {
    let s = Scratch::new("kill-driver");
    let mut run = Running::start(Launch::sleeper(&s), &[], CANARY);
    let p = run.procs();
    let start = Instant::now();
    run.driver.kill().unwrap();
    run.driver.wait().unwrap();
    for (what, proc) in [("VMM", &p.vmm), ("watchdog", &p.watchdog), ("supervisor", &p.supervisor)] {
        assert!(gone_within(proc, Duration::from_secs(5)), "{what} still running 5 s after the driver died");
    }
    eprintln!("e2e: driver SIGKILL -> all gone in {:?}", start.elapsed());
}

#[test]
fn control_a_leaked_write_end_keeps_the_vm_alive_after_the_driver_dies() {
    let s = Scratch::new("kill-driver-ctl");
    let mut run = Running::start(Launch::sleeper(&s).control(TestControl::LeakLivenessWriteEnd), &[], CANARY);
    let p = run.procs();
    run.driver.kill().unwrap();
    run.driver.wait().unwrap();
    assert!(survives(&p.vmm, Duration::from_secs(5)), "control: with the write end leaked, the VM outlives the driver");
    eprintln!("e2e: control confirmed: VM alive 5 s after the driver died");
}

#[test]
fn the_write_end_stays_in_the_driver() {
    let s = Scratch::new("write-end");
    let run = Running::start(Launch::sleeper(&s), &[], CANARY);
    let p = run.procs();
    let pipe = procs::stdin_pipe(p.supervisor.pid).expect("the supervisor's stdin is a pipe");
    let write_ends = |pid: i32| procs::pipe_fds(pid).into_iter().filter(|(i, f)| *i == pipe && f & 0o3 == 0o1).count();
    assert_eq!(write_ends(run.driver_pid()), 1, "the driver holds the write end (the probe finds it)");
    for (what, proc) in [("supervisor", &p.supervisor), ("watchdog", &p.watchdog), ("VMM", &p.vmm)] {
        assert_eq!(write_ends(proc.pid), 0, "the {what} holds the liveness pipe's write end");
    }
    drop(run);

    // Control: the same probe sees the leak when the write end is not close-on-exec.
    let s = Scratch::new("write-end-ctl");
    let run = Running::start(Launch::sleeper(&s).control(TestControl::LeakLivenessWriteEnd), &[], CANARY);
    let p = run.procs();
    let pipe = procs::stdin_pipe(p.supervisor.pid).unwrap();
    let leaked = |pid: i32| procs::pipe_fds(pid).into_iter().any(|(i, f)| i == pipe && f & 0o3 == 0o1);
    assert!(leaked(p.supervisor.pid), "control: the probe detects a write end in the supervisor");
    // vm-jailer closes every inherited fd beyond 0-2 before QEMU runs, leaked or not.
    assert!(!leaked(p.vmm.pid), "the jailer let a leaked fd reach the VMM");
}

#[test]
fn pausing_the_supervisor_lets_the_watchdog_kill_the_vm() {
    let s = Scratch::new("stop-sup");
    let run = Running::start(Launch::sleeper(&s), &[], CANARY);
    let p = run.procs();
    let start = Instant::now();
    signal(p.supervisor.pid, SIGSTOP);
    assert!(gone_within(&p.vmm, Duration::from_secs(4)), "VMM still running 4 s after the supervisor froze");
    eprintln!("e2e: supervisor SIGSTOP -> VMM gone in {:?}", start.elapsed());
    signal(p.supervisor.pid, SIGCONT);
}

#[test]
fn control_a_watchdog_that_only_watches_eof_lets_a_frozen_supervisor_keep_the_vm() {
    let s = Scratch::new("stop-sup-ctl");
    let run = Running::start(Launch::sleeper(&s).control(TestControl::WatchdogEofOnly), &[], CANARY);
    let p = run.procs();
    signal(p.supervisor.pid, SIGSTOP);
    let survived = survives(&p.vmm, Duration::from_secs(5));
    signal(p.supervisor.pid, SIGCONT);
    assert!(survived, "control: without the silence check the VM outlives a frozen supervisor");
    eprintln!("e2e: control confirmed: VM alive 5 s after the supervisor froze");
}

#[test]
fn killing_the_supervisor_kills_the_vm() {
    let s = Scratch::new("kill-sup");
    let run = Running::start(Launch::sleeper(&s), &[], CANARY);
    let p = run.procs();
    let start = Instant::now();
    signal(p.supervisor.pid, SIGKILL);
    assert!(gone_within(&p.vmm, Duration::from_secs(2)), "VMM still running 2 s after the supervisor died");
    eprintln!("e2e: supervisor SIGKILL -> VMM gone in {:?}", start.elapsed());
}

#[test]
fn pausing_the_watchdog_makes_the_supervisor_stop_the_vm() {
    let s = Scratch::new("stop-wd");
    let mut run = Running::start(Launch::sleeper(&s), &[], CANARY);
    let p = run.procs();
    let start = Instant::now();
    signal(p.watchdog.pid, SIGSTOP);
    assert!(gone_within(&p.vmm, Duration::from_secs(2)), "VMM still running 2 s after the watchdog froze");
    eprintln!("e2e: watchdog SIGSTOP -> VMM gone in {:?}", start.elapsed());
    signal(p.watchdog.pid, SIGCONT);
    assert!(gone_within(&p.supervisor, Duration::from_secs(10)));
    let status = run.driver.wait().unwrap();
    let stderr = run.stderr_text();
    assert!(stderr.contains("vm-supervisor ended with exit status: 5"), "non-zero supervisor exit:\n{stderr}");
    assert_ne!(status.code(), Some(0));
}

#[test]
fn control_a_supervisor_that_trusts_writes_keeps_the_vm_with_a_frozen_watchdog() {
    let s = Scratch::new("stop-wd-ctl");
    let run = Running::start(Launch::sleeper(&s).control(TestControl::PulseWriteOnly), &[], CANARY);
    let p = run.procs();
    signal(p.watchdog.pid, SIGSTOP);
    let survived = survives(&p.vmm, Duration::from_secs(5));
    signal(p.watchdog.pid, SIGCONT);
    assert!(survived, "control: a write that succeeds proves nothing, and the VM keeps running");
    eprintln!("e2e: control confirmed: VM alive 5 s after the watchdog froze");
}

#[test]
fn killing_the_watchdog_makes_the_supervisor_stop_the_vm() {
    let s = Scratch::new("kill-wd");
    let run = Running::start(Launch::sleeper(&s), &[], CANARY);
    let p = run.procs();
    let start = Instant::now();
    signal(p.watchdog.pid, SIGKILL);
    assert!(gone_within(&p.vmm, Duration::from_secs(2)), "VMM still running 2 s after the watchdog died");
    eprintln!("e2e: watchdog SIGKILL -> VMM gone in {:?}", start.elapsed());
}

/// A guest that ignores everything: it shows it runs on the console and never powers itself off. A
/// compromised guest behaves like this, so the host must not rely on the guest's cooperation.
fn hostile_guest(s: &Scratch) -> Launch<'_> {
    Launch::new(s, &["true"]).initrd(&with_init_that_never_stops(&s.dir)).flag("--boot-timeout").flag("600")
}

/// Starts the hostile guest, then kills driver, supervisor and watchdog so that none can react.
fn orphan_a_vm(s: &Scratch) -> (Running, procs::ProcInfo) {
    let run = Running::start(hostile_guest(s), &[], "");
    let p = run.procs();
    run.assert_console_shows(CANARY);
    let driver = run.driver_pid();
    // Freeze the two that would react, kill the watchdog, then the supervisor, then the driver.
    signal(driver, SIGSTOP);
    signal(p.supervisor.pid, SIGSTOP);
    signal(p.watchdog.pid, SIGKILL);
    signal(p.supervisor.pid, SIGKILL);
    signal(driver, SIGKILL);
    assert!(gone_within(&p.supervisor, Duration::from_secs(2)) && gone_within(&p.watchdog, Duration::from_secs(2)));
    assert!(survives(&p.vmm, Duration::from_secs(1)), "the hostile guest does not power itself off");
    (run, p.vmm)
}

/// Starts a driver (`vm-driver launch -- true`) on the same state directory; returns its stderr. Every
/// starting driver reaps first.
fn start_a_driver(s: &Scratch, controls: &[TestControl]) -> String {
    let launch = Launch::new(s, &["true"]).controls(controls);
    let out = launch.command().output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_starting_driver_reaps_a_vm_whose_supervisor_and_watchdog_died() {
    let s = Scratch::new("reap");
    let (run, vmm) = orphan_a_vm(&s);
    let report = start_a_driver(&s, &[]);
    assert!(gone_within(&vmm, Duration::from_secs(5)), "the reaper killed the orphaned VM");
    assert!(report.contains("reaped orphaned sandbox"), "{report}");
    let tombstone = sandbox::read(&run.sandbox_dir, SandboxFile::Tombstone);
    assert!(tombstone.contains("orphan reaped"), "{tombstone}");
}

#[test]
fn vm_driver_reap_kills_an_orphaned_vm_and_marks_it_terminated() {
    let s = Scratch::new("reap-cli");
    let (run, vmm) = orphan_a_vm(&s);
    let reap = || {
        let out = std::process::Command::new(&vm_test_support::harness().shipped.driver)
            .args(["reap", "--state-dir"])
            .arg(s.state())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let report = reap();
    assert!(report.contains("supervisor gone; killed its VM; marked terminated"), "{report}");
    assert!(gone_within(&vmm, Duration::from_secs(5)), "vm-driver reap killed the orphaned VM");
    let tombstone = sandbox::read(&run.sandbox_dir, SandboxFile::Tombstone);
    assert!(tombstone.contains("orphan reaped"), "{tombstone}");
    assert_eq!(reap(), "", "a second reap finds nothing to do");
}

#[test]
fn control_without_the_reaper_the_orphaned_vm_keeps_running() {
    let s = Scratch::new("reap-ctl");
    let (_run, vmm) = orphan_a_vm(&s);
    start_a_driver(&s, &[TestControl::NoReaper]);
    assert!(survives(&vmm, Duration::from_secs(5)), "control: with the reaper off the VM outlives everything");
    eprintln!("e2e: control confirmed: orphaned VM alive 5 s after a driver started");
}

/// The workload writes more than the credit window holds, so records queue inside the guest behind a sink
/// that is not reading; then the test asks for a stop and counts what arrives.
fn stop_with_queued_records(s: &Scratch, controls: &[TestControl]) -> (usize, usize) {
    const RECORDS: usize = 700_000;
    let script = format!("echo {CANARY}; seq 1 {RECORDS}; echo emitted > /dev/console; exec sleep 1000");
    let launch = Launch::new(s, &["/bin/sh", "-c", &script]).controls(controls);
    let mut run = Running::start(launch, &[], CANARY);
    // The workload wrote every record.
    run.assert_console_shows("emitted");
    // The stop a gateway or a terminal asks for: SIGTERM to the driver, which stops the sandbox.
    signal(run.driver_pid(), SIGTERM);
    let mut text = String::new();
    run.stdout.read_to_string(&mut text).unwrap();
    run.driver.wait().unwrap();
    // A stream cut short may end inside a record; only complete lines count as delivered.
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    let received: Vec<usize> = complete.lines().map(|l| l.parse().unwrap_or(0)).collect();
    if let Some((i, n)) = received.iter().enumerate().find(|(i, n)| **n != i + 1) {
        std::fs::write(s.dir.join("received.txt"), &text).unwrap();
        panic!("record {} is {n:?}: records must arrive in order and without gaps", i + 1);
    }
    (RECORDS, received.len())
}

#[test]
fn an_orderly_stop_delivers_every_queued_record() {
    let s = Scratch::new("records");
    let (written, received) = stop_with_queued_records(&s, &[]);
    eprintln!("e2e: SIGTERM -> wait -> close: {received} of {written} records delivered");
    assert_eq!(received, written);
}

#[test]
fn control_closing_the_pipe_first_loses_records() {
    let s = Scratch::new("records-ctl");
    let (written, received) = stop_with_queued_records(&s, &[TestControl::CloseLivenessFirst]);
    eprintln!("e2e: control, close -> SIGTERM: {received} of {written} records delivered, {} lost", written - received);
    assert!(received < written, "control: closing the pipe first loses the records still queued");
}

#[test]
fn liveness_survives_a_busy_sandbox() {
    // A sandbox that streams for several seconds keeps its lease: pulses ride the same loop as the data.
    let s = Scratch::new("busy");
    let out = Launch::new(&s, &["dd", "if=/dev/zero", "bs=65536", "count=2048"]).run();
    assert_eq!(out.code, Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout.len(), 2048 * 65536);
    out.assert_nothing_left();
}

#[test]
fn stdout_stays_line_readable() {
    // Sanity for the helpers above: BufRead on the driver's stdout sees the guest's lines as written.
    let s = Scratch::new("lines");
    let mut run =
        Running::start(Launch::new(&s, &["/bin/sh", "-c", &format!("echo {CANARY}; echo second")]), &[], CANARY);
    let mut line = String::new();
    run.stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "second\n");
    assert!(run.driver.wait().unwrap().success());
}

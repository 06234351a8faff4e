//! The failure modes `docs/operations.md` promises an outcome for, each provoked on a real VM: QEMU
//! crashing, a watchdog that never becomes ready, a process that escaped into the sandbox's cgroup, a
//! supervisor that dies before it reads its credentials, a guest that breaks the protocol after boot, the
//! driver's own exit statuses when it is interrupted, and a supervisor that ignores SIGTERM.
//!
//! Faults that need the code's help to happen (a watchdog that never answers, a supervisor that exits at
//! once) use the controls build; so do the controls themselves. Everything else runs the shipped build.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vm_contract::layout::SandboxFile;

use nix::sys::signal::Signal::{self, SIGCONT, SIGHUP, SIGINT, SIGKILL, SIGSTOP, SIGTERM};
use serde_json::Value;
use vm_test_support::events::{self, finding_types};
use vm_test_support::image::with_rogue_agent;
use vm_test_support::procs::signal;
use vm_test_support::{gone_within, sandbox, wait_until, Launch, Running, Scratch, TestControl, CANARY, DRIVER_ERROR};

fn tombstone(sandbox_dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(sandbox_dir.join(SandboxFile::Tombstone.name())).expect("a tombstone"))
        .unwrap()
}

#[test]
fn qemu_killed_mid_run_ends_the_sandbox_with_the_documented_status_and_record() {
    let s = Scratch::new("qemu-crash");
    let mut run = Running::start(Launch::sleeper(&s), &[], CANARY);
    let p = run.procs();
    signal(p.vmm.pid, SIGKILL);
    s.waiting_for("the driver to exit after QEMU was killed");
    let status = run.driver.wait().unwrap();
    let stderr = run.stderr_text();
    assert_eq!(status.code(), Some(DRIVER_ERROR), "{stderr}");
    assert!(stderr.contains("the sandbox stopped before the process exited"), "{stderr}");
    assert!(stderr.contains("vm-supervisor ended with exit status: 3"), "the documented exit status 3: {stderr}");
    for proc in [&p.supervisor, &p.watchdog] {
        assert!(gone_within(proc, Duration::from_secs(5)));
    }
    let events = events::read(&run.sandbox_dir);
    let stop = events
        .iter()
        .find(|e| e["class_uid"] == 6002 && e["activity_id"] == 4 && e["app"]["name"] == "microvm")
        .expect("a lifecycle stop for the VM");
    assert_eq!(stop["status_id"], 2, "a failure: {stop}");
    assert!(stop["status_detail"].as_str().unwrap().contains("VMM exited"), "{stop}");
    assert_eq!(tombstone(&run.sandbox_dir)["reason"], "failed");
}

#[test]
fn a_watchdog_that_never_becomes_ready_refuses_the_vm() {
    let s = Scratch::new("wd-not-ready");
    let out = Launch::sleeper(&s).control(TestControl::WatchdogNeverReady).run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.code, Some(DRIVER_ERROR), "{stderr}");
    assert!(stderr.contains("the lease watchdog was not ready within 5000 ms"), "{stderr}");
    assert!(out.accel().is_some(), "a VM was started, then refused");
    assert!(out.elapsed < Duration::from_secs(60), "refused within its bound: {:?}", out.elapsed);
    out.assert_nothing_left();
}

/// Starts a sandbox, moves a host process into its cgroup (as if it had escaped the VMM's process group),
/// then stops the sandbox in order. Returns the escaped process and the driver's stderr.
fn escape_into_the_cgroup(s: &Scratch, controls: &[TestControl]) -> (std::process::Child, String) {
    let launch = Launch::sleeper(s).controls(controls);
    let mut run = Running::start(launch, &[], CANARY);
    let cgroup = std::fs::read_to_string(run.sandbox_dir.join(SandboxFile::Cgroup.name()))
        .expect("this host has no writable cgroup v2, so the sweep cannot be tested (see ENVIRONMENT facts)");
    let escaped = Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().unwrap();
    std::fs::write(Path::new(cgroup.trim()).join("cgroup.procs"), escaped.id().to_string()).unwrap();
    signal(run.driver_pid(), SIGTERM);
    s.waiting_for("the driver's orderly stop");
    run.driver.wait().unwrap();
    (escaped, run.stderr_text())
}

#[test]
fn the_cgroup_sweep_kills_a_process_that_escaped_the_vmm() {
    let s = Scratch::new("sweep");
    let (mut escaped, stderr) = escape_into_the_cgroup(&s, &[]);
    assert!(wait_until(Duration::from_secs(5), || escaped.try_wait().unwrap().is_some()), "the escaped process lives");
    assert!(stderr.contains("the cgroup sweep found processes after the stop and killed them"), "{stderr}");
}

#[test]
fn control_without_the_cgroup_sweep_the_escaped_process_survives() {
    let s = Scratch::new("sweep-ctl");
    let (mut escaped, _) = escape_into_the_cgroup(&s, &[TestControl::NoCgroupSweep]);
    std::thread::sleep(Duration::from_secs(3));
    let survived = escaped.try_wait().unwrap().is_none();
    let _ = escaped.kill();
    let _ = escaped.wait();
    assert!(survived, "control: with the sweep off the escaped process outlives the sandbox");
}

/// A launch whose supervisor exits before it reads its auth bundle (fault injection), with collector
/// credentials in the environment. Returns the kept sandbox directory's auth bundle, if any is left.
fn supervisor_dies_before_reading_its_credentials(s: &Scratch, controls: &[TestControl]) -> Option<Vec<u8>> {
    let launch = Launch::new(s, &["true"]).controls(controls);
    let mut cmd = launch.control(TestControl::SupervisorExitsAtStart).flag("--id").flag("creds").command();
    let out = cmd.env("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20cred-canary").output().unwrap();
    assert_eq!(out.status.code(), Some(DRIVER_ERROR), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = s.sandbox("creds");
    assert!(dir.is_dir(), "the sandbox directory is kept after a failed start");
    std::fs::read(dir.join(SandboxFile::AuthBundle.name())).ok()
}

#[test]
fn a_failed_start_takes_the_credentials_back() {
    let s = Scratch::new("creds");
    assert_eq!(supervisor_dies_before_reading_its_credentials(&s, &[]), None, "the auth bundle is left behind");
}

#[test]
fn control_without_taking_them_back_the_credentials_stay_on_disk() {
    let s = Scratch::new("creds-ctl");
    let bundle = supervisor_dies_before_reading_its_credentials(&s, &[TestControl::KeepCredentials]);
    let bundle = bundle.expect("control: the bundle stays when nobody takes it back");
    assert!(String::from_utf8_lossy(&bundle).contains("cred-canary"));
}

#[test]
fn a_protocol_violation_after_boot_stops_the_sandbox_in_order_with_a_finding() {
    let s = Scratch::new("violation");
    let initrd = with_rogue_agent(&s.dir, "garbage-after-handshake");
    let out = Launch::new(&s, &["true"]).initrd(&initrd).flag("--id").flag("rogue").run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.code, Some(DRIVER_ERROR), "{stderr}");
    assert!(stderr.contains("vm-supervisor ended with exit status: 3"), "{stderr}");
    // Orderly: Shutdown, the grace, then QEMU killed because this guest ignores it; never the boot timeout.
    assert!(out.elapsed < Duration::from_secs(45), "{:?}", out.elapsed);
    let events = events::read(&s.sandbox("rogue"));
    assert_eq!(finding_types(&events).first(), Some(&"guest_protocol_violation"), "{events:?}");
    assert!(events.iter().any(|e| e["class_uid"] == 6002 && e["activity_id"] == 4 && e["status_id"] == 2));
    out.assert_nothing_left();
}

/// Interrupts a running launch with `signals` (after the canary) and returns its exit status.
fn interrupted(name: &str, signals: &[Signal]) -> i32 {
    let s = Scratch::new(name);
    // The workload ignores SIGINT, so only the driver's own decision can end it.
    let script = format!("trap '' INT; echo {CANARY}; while :; do sleep 1; done");
    let mut run = Running::start(Launch::new(&s, &["/bin/sh", "-c", &script]), &[], CANARY);
    let p = run.procs();
    for sig in signals {
        signal(run.driver_pid(), *sig);
        std::thread::sleep(Duration::from_millis(200));
    }
    s.waiting_for("the interrupted driver to exit");
    let status = run.driver.wait().unwrap();
    let stderr = run.stderr_text();
    assert!(!stderr.contains("vm-supervisor ended with"), "an orderly stop: {stderr}");
    for proc in [&p.vmm, &p.watchdog, &p.supervisor] {
        assert!(gone_within(proc, Duration::from_secs(5)));
    }
    status.code().unwrap()
}

#[test]
fn hangup_interrupt_and_terminate_give_129_130_and_143() {
    assert_eq!(interrupted("sighup", &[SIGHUP]), 129);
    assert_eq!(interrupted("sigterm", &[SIGTERM]), 143);
    assert_eq!(interrupted("sigint", &[SIGINT, SIGINT, SIGINT]), 130, "three Ctrl-Cs stop the sandbox");
}

#[test]
fn a_supervisor_that_ignores_sigterm_is_killed_at_the_stop_timeout() {
    let s = Scratch::new("stop-timeout");
    let mut run = Running::start(Launch::sleeper(&s).flag("--stop-timeout").flag("1"), &[], CANARY);
    let p = run.procs();
    signal(p.supervisor.pid, SIGSTOP);
    let start = Instant::now();
    signal(run.driver_pid(), SIGTERM);
    s.waiting_for("the driver to give up on the frozen supervisor");
    let status = run.driver.wait().unwrap();
    let elapsed = start.elapsed();
    let stderr = run.stderr_text();
    assert_eq!(status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("vm-supervisor did not stop in time and was killed"), "{stderr}");
    assert!(elapsed < Duration::from_secs(10), "the stop timeout bounds the wait: {elapsed:?}");
    for proc in [&p.supervisor, &p.watchdog, &p.vmm] {
        assert!(gone_within(proc, Duration::from_secs(5)), "left behind: {proc:?}");
    }
    signal(p.supervisor.pid, SIGCONT);
    eprintln!("e2e: frozen supervisor killed {elapsed:?} after SIGTERM (--stop-timeout 1)");
}

#[test]
fn the_shipped_build_has_no_test_controls_and_the_controls_build_says_so() {
    let s = Scratch::new("builds");
    let mut cmd = Launch::new(&s, &["true"]).flag("--id").flag("shipped").command();
    // Even asked to, the shipped build switches nothing off and says nothing about controls.
    let out = cmd.env("VM_TEST_CONTROL", "no-reaper,watchdog-eof-only").output().unwrap();
    assert!(out.status.success());
    let dir = s.sandbox("shipped");
    let log = sandbox::read(&dir, SandboxFile::SupervisorLog);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("test controls"));
    assert!(!log.contains("test controls"), "{log}");
    let announces = |e: &Value| e["message"].as_str().is_some_and(|m| m.contains("test controls"));
    assert!(!events::read(&dir).iter().any(announces), "the shipped build announced test controls");

    let out = Launch::new(&s, &["true"]).flag("--id").flag("controls").control(TestControl::NoReaper).run();
    assert_eq!(out.code, Some(0));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("vm-driver: WARNING: built with test controls"), "{stderr}");
    assert!(stderr.contains("(active: no-reaper)"), "{stderr}");
    let dir = s.sandbox("controls");
    let log = sandbox::read(&dir, SandboxFile::SupervisorLog);
    for binary in ["vm-supervisor", "vm-watchdog"] {
        assert!(log.contains(&format!("{binary}: WARNING: built with test controls")), "{binary}: {log}");
    }
    // The jailer's stderr is QEMU's: vmm.log.
    let vmm_log = sandbox::read(&dir, SandboxFile::VmmLog);
    assert!(vmm_log.contains("vm-jailer: WARNING: built with test controls"), "vm-jailer: {vmm_log}");
    let config = events::read(&dir).into_iter().find(|e| e["class_uid"] == 5019 && announces(e));
    assert!(config.is_some(), "no OCSF configuration event announces the controls build");
}

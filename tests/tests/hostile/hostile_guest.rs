//! A hostile guest cannot exhaust the host or erase the record. Each attack is made by the rogue agent
//! (`tests/rogue-agent`), booted in the real image in place of ours, on a real VM.
//!
//! - Every protocol attack stops its sandbox in order, with a Detection Finding, while the supervisor stays
//!   under [`RSS_BOUND_KIB`] and nothing is left running.
//! - Under the attacks the host accepts (a console flood, a guest that ignores shutdown), the leash still
//!   holds, the logs stay under their caps, and a healthy neighbour on the same `serve` keeps working.
//! - Each bound has a control that switches it off and shows the growth it prevents.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::RSS_BOUND_KIB;
use nix::sys::signal::Signal::{SIGCONT, SIGKILL, SIGSTOP, SIGTERM};
use vm_contract::layout::SandboxFile;
use vm_contract::pids::SandboxPids;
use vm_protocol::ExitStatus;
use vm_supervisor::boot::guest_logs::{CONSOLE_CAP_BYTES, VMM_LOG_CAP_BYTES};
use vm_supervisor::telemetry::{jsonl, limit};
use vm_test_support::attach::AttachClient;
use vm_test_support::events::{self, finding_types};
use vm_test_support::image::{images_with_rogues, with_rogue_agent};
use vm_test_support::otlp_receiver::{Behavior, Receiver};
use vm_test_support::output::ok;
use vm_test_support::procs::{signal, PeakRss, ProcInfo};
use vm_test_support::serve::Serve;
use vm_test_support::{
    gone_within, sandbox, wait_for_count, wait_until, Launch, Running, Scratch, TestControl, DRIVER_ERROR,
};

/// The rogue agent's polite mode runs a `Spawn` of this until it is signalled.
const HANG: &str = "hang";

/// A launch of a sandbox whose PID 1 is the rogue agent in `mode`, as the issue measured it.
fn rogue<'a>(s: &'a Scratch, mode: &str, workload: &[&str]) -> Launch<'a> {
    let initrd = with_rogue_agent(&s.dir, mode);
    Launch::new(s, workload).initrd(&initrd).flag("--id").flag("rogue").flag("--timeout").flag("60")
}

/// Asserts the guest-fed files are within their caps.
fn logs_within_caps(sandbox_dir: &Path) {
    let (console, vmm, events) = (
        sandbox::size(sandbox_dir, SandboxFile::Console),
        sandbox::size(sandbox_dir, SandboxFile::VmmLog),
        sandbox::size(sandbox_dir, SandboxFile::Events),
    );
    assert!(console <= CONSOLE_CAP_BYTES, "console.log is {console} bytes");
    assert!(vmm <= VMM_LOG_CAP_BYTES, "vmm.log is {vmm} bytes");
    assert!(events <= jsonl::CAP_BYTES, "events.jsonl is {events} bytes");
}

/// One protocol attack: the sandbox stops in order, before its timeout, with the finding, the supervisor
/// under its memory bound, and nothing left. Nobody reads the driver's stdout until the finding is recorded,
/// so the driver credits no more than its pipe holds and the guest cannot hide an overrun behind a fast
/// reader.
fn a_protocol_attack_is_stopped(mode: &str) {
    let s = Scratch::new(&format!("rogue-{mode}"));
    let peak = PeakRss::supervisors(&s.dir, "rogue");
    let start = Instant::now();
    let mut run = Running::start(rogue(&s, mode, &["/bin/sleep", "1000"]), &[], "");
    s.waiting_for("the guest's violation to be found");
    let found = wait_until(Duration::from_secs(60), || {
        finding_types(&events::read(&run.sandbox_dir)).contains(&"guest_protocol_violation")
    });
    std::io::Read::read_to_end(&mut run.stdout, &mut Vec::new()).unwrap();
    let status = run.driver.wait().unwrap();
    let elapsed = start.elapsed();
    let peak = peak.peak();
    let stderr = run.stderr_text();
    assert!(found, "a Detection Finding for the violation: {:?}", finding_types(&events::read(&run.sandbox_dir)));
    assert_eq!(status.code(), Some(DRIVER_ERROR), "{stderr}");
    assert!(stderr.contains("vm-supervisor ended with exit status: 3"), "stopped for the guest's fault: {stderr}");
    let stopped = events::read(&run.sandbox_dir)
        .iter()
        .any(|e| e["class_uid"] == 6002 && e["activity_id"] == 4 && e["status_id"] == 2);
    assert!(stopped, "the VM's stop, recorded as a failure");
    assert!(peak <= RSS_BOUND_KIB, "the supervisor peaked at {peak} KiB");
    logs_within_caps(&run.sandbox_dir);
    let seen = run.watcher.take().unwrap().stop();
    let accel = seen.iter().find(|p| p.is_qemu()).and_then(ProcInfo::accel);
    eprintln!("e2e: accelerator used: {}", accel.unwrap_or_default());
    let alive: Vec<_> = seen.iter().filter(|p| p.is_alive()).collect();
    assert!(alive.is_empty(), "processes left behind: {alive:#?}");
    eprintln!("e2e: {mode}: stopped with a finding after {elapsed:?}; supervisor peak RSS {peak} KiB");
}

#[test]
fn an_oversized_frame_stops_the_sandbox() {
    a_protocol_attack_is_stopped("oversized-frame");
}

#[test]
fn output_for_an_unknown_process_stops_the_sandbox() {
    a_protocol_attack_is_stopped("unknown-id");
}

#[test]
fn a_flood_of_empty_output_stops_the_sandbox() {
    a_protocol_attack_is_stopped("empty-output-flood");
}

#[test]
fn repeated_started_stops_the_sandbox() {
    a_protocol_attack_is_stopped("repeated-started");
}

#[test]
fn output_past_the_window_stops_the_sandbox() {
    a_protocol_attack_is_stopped("credit-overrun");
}

#[test]
fn stdin_credit_past_the_window_cap_stops_the_sandbox() {
    a_protocol_attack_is_stopped("stdin-credit-overflow");
}

#[test]
fn a_forged_signal_number_stops_the_sandbox() {
    a_protocol_attack_is_stopped("exit-signal-max");
    a_protocol_attack_is_stopped("exit-signal-negative");
}

/// Control: with the guest's invariants unchecked, an empty-output flood for a detached process grows the
/// supervisor past its bound (every empty `Output` is held for the client that went away). Even then the
/// leash holds: the service's death stops the VM. On `serve`, so no client's disconnection ends the sandbox.
#[test]
fn control_without_invariants_an_empty_output_flood_grows_the_supervisor() {
    let s = Scratch::with_deadline("rogue-flood-ctl", Duration::from_secs(420));
    let images = images_with_rogues(&s.dir, &["empty-output-flood"]);
    let serve = Serve::with(&s, &[TestControl::NoGuestInvariants], &["--boot-images", images.to_str().unwrap()]);
    ok(serve.cli("create", &["--boot-image", "rogue-empty-output-flood", "flood"]));
    let pids = SandboxPids::read(&serve.sandbox("flood")).expect("a pids file");
    let supervisor = pids.supervisor.pid;
    let vmm = ProcInfo::read(pids.vmm.expect("a VMM").pid).expect("the VMM runs");
    let peak = PeakRss::supervisors(&s.dir, "flood");
    // The client goes away at once: its process is detached, and the flood is held for it.
    let mut client = serve.cli_command("exec", &["flood", "--", "/bin/sleep", "1000"]).spawn().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let _ = client.kill();
    let _ = client.wait();
    s.waiting_for("the unchecked flood to grow the supervisor");
    // The flood's pace is the guest's CPU share: beside another flooding guest on 2 cores it is slow.
    let grew = wait_until(Duration::from_secs(240), || {
        vm_test_support::procs::status_kib(supervisor, "VmRSS").unwrap_or(0) > RSS_BOUND_KIB
    });
    let peak = peak.peak();
    let start = Instant::now();
    signal(serve.pid(), SIGKILL);
    assert!(gone_within(&vmm, Duration::from_secs(5)), "the VM outlived the service under the flood");
    let stopped = start.elapsed();
    assert!(grew, "control: unchecked, the flood grows the supervisor past {RSS_BOUND_KIB} KiB (peak {peak} KiB)");
    eprintln!("e2e: control confirmed: supervisor grew to {peak} KiB; service SIGKILL -> VMM gone in {stopped:?}");
}

/// Waits until the sandbox is ready and runs its workload (the rogue agent prints no canary).
fn workload_started(s: &Scratch, run: &Running) {
    s.waiting_for("the sandbox to start its workload");
    let launched = || events::has(&events::read(&run.sandbox_dir), 1007, 1);
    assert!(wait_until(Duration::from_secs(60), launched), "the workload was never launched");
}

/// Starts a sandbox under an attack the host accepts, with a workload that keeps it running.
fn under_attack(s: &Scratch, mode: &str) -> Running {
    let run = Running::start(rogue(s, mode, &[HANG]), &[], "");
    workload_started(s, &run);
    // Let the attack get going before the leash is tested.
    std::thread::sleep(Duration::from_secs(3));
    run
}

#[test]
fn under_a_console_flood_the_drivers_death_stops_the_vm() {
    let s = Scratch::new("flood-kill-driver");
    let mut run = under_attack(&s, "console-flood");
    let p = run.procs();
    let start = Instant::now();
    run.driver.kill().unwrap();
    run.driver.wait().unwrap();
    assert!(gone_within(&p.vmm, Duration::from_secs(2)), "the VM outlived the driver under a console flood");
    let vmm_gone = start.elapsed();
    for proc in [&p.supervisor, &p.watchdog] {
        assert!(gone_within(proc, Duration::from_secs(5)));
    }
    eprintln!("e2e: console flood: driver SIGKILL -> VMM gone in {vmm_gone:?}");
    logs_within_caps(&run.sandbox_dir);
}

#[test]
fn under_a_console_flood_a_frozen_supervisor_loses_the_vm() {
    let s = Scratch::new("flood-stop-sup");
    let run = under_attack(&s, "console-flood");
    let p = run.procs();
    let start = Instant::now();
    signal(p.supervisor.pid, SIGSTOP);
    let gone = gone_within(&p.vmm, Duration::from_secs(3));
    let elapsed = start.elapsed();
    signal(p.supervisor.pid, SIGCONT);
    assert!(gone, "the VM outlived a frozen supervisor by 3 s under a console flood");
    eprintln!("e2e: console flood: supervisor SIGSTOP -> VMM gone in {elapsed:?}");
}

/// Execs `true` in `id` through the CLI `count` times, `gap` apart; the median time an exec took, and the
/// slowest.
fn exec_times(serve: &Serve, id: &str, count: usize, gap: Duration) -> (Duration, Duration) {
    let mut samples: Vec<Duration> = (0..count)
        .map(|_| {
            std::thread::sleep(gap);
            let start = Instant::now();
            let out = serve.cli("exec", &[id, "--", "true"]);
            assert!(out.status.success(), "exec in {id}: {}", String::from_utf8_lossy(&out.stderr));
            start.elapsed()
        })
        .collect();
    samples.sort();
    (samples[samples.len() / 2], samples[samples.len() - 1])
}

/// The median `exec true` time in `healthy` while another sandbox of `serve` spins its vCPU: what any busy
/// neighbour costs, the baseline a hostile one is held to.
fn beside_a_busy_guest(serve: &Serve, healthy: &str) -> Duration {
    ok(serve.cli("create", &["busy"]));
    let mut spin = serve.cli_command("exec", &["busy", "--", "sh", "-c", "while :; do :; done"]).spawn().unwrap();
    let (usual, _) = exec_times(serve, healthy, 10, Duration::from_secs(1));
    let _ = spin.kill();
    let _ = spin.wait();
    ok(serve.cli("rm", &["busy"]));
    usual
}

/// Floods the console for a minute beside a healthy sandbox on the same service, then until the flood has
/// passed the console's cap (how fast a guest's UART fills it depends on the host's load, so the test waits
/// for the bytes, not for a time). With `controls` off, the flood is capped. Returns the flooding sandbox's
/// console.log size.
///
/// "The neighbour's usual time" is measured in the same run, beside a guest that spins its vCPU in an
/// ordinary busy loop: a console flood must cost the neighbour no more than any busy guest does.
fn a_minute_of_console_flood(s: &Scratch, controls: &[TestControl]) -> u64 {
    let images = images_with_rogues(&s.dir, &["console-flood"]);
    let serve = Serve::with(s, controls, &["--boot-images", images.to_str().unwrap()]);
    ok(serve.cli("create", &["healthy"]));
    let (idle, _) = exec_times(&serve, "healthy", 5, Duration::ZERO);
    let beside_busy = controls.is_empty().then(|| beside_a_busy_guest(&serve, "healthy"));
    let peak = PeakRss::supervisors(&s.dir, "flood");
    ok(serve.cli("create", &["--boot-image", "rogue-console-flood", "flood"]));
    let flood_dir = serve.sandbox("flood");
    let flooding = Instant::now();
    s.waiting_for("a minute of console flood");
    let (typical, slowest) = exec_times(&serve, "healthy", 30, Duration::from_secs(2));
    s.waiting_for("the console flood to pass the cap");
    let past_cap = || {
        let console = sandbox::size(&flood_dir, SandboxFile::Console);
        if controls.is_empty() {
            finding_types(&events::read(&flood_dir)).contains(&"log_capped")
        } else {
            console > CONSOLE_CAP_BYTES
        }
    };
    let passed = wait_until(Duration::from_secs(240), past_cap);
    let peak = peak.peak();
    let console = sandbox::size(&flood_dir, SandboxFile::Console);
    eprintln!(
        "e2e: console flood: past the cap {passed} after {:?}; console.log {console} bytes; flooding supervisor peak \
         RSS {peak} KiB; neighbour exec median {typical:?} (slowest {slowest:?}); idle {idle:?}, beside a busy \
         guest {beside_busy:?}",
        flooding.elapsed()
    );
    assert!(passed, "the flood never passed the cap (console.log {console} bytes)");
    if let Some(usual) = beside_busy {
        logs_within_caps(&flood_dir);
        assert!(peak <= RSS_BOUND_KIB, "the flooding sandbox's supervisor peaked at {peak} KiB");
        // Within the usual time under load, with room for a 2-core machine's noise; never a stall.
        assert!(typical <= usual * 2 + Duration::from_millis(100), "{typical:?} against {usual:?} beside a busy guest");
        assert!(slowest <= Duration::from_secs(10), "an exec took {slowest:?}");
        // SIGKILL to the driver (here, the service) still ends both VMs.
        let vmms = serve.vmms();
        let start = Instant::now();
        signal(serve.pid(), SIGKILL);
        for vmm in &vmms {
            assert!(gone_within(vmm, Duration::from_secs(2)), "a VM outlived the service under a console flood");
        }
        eprintln!("e2e: console flood: service SIGKILL -> both VMMs gone in {:?}", start.elapsed());
    }
    console
}

#[test]
fn a_console_flood_is_capped_and_the_neighbour_stays_responsive() {
    let s = Scratch::with_deadline("flood-serve", Duration::from_secs(480));
    let console = a_minute_of_console_flood(&s, &[]);
    assert!(console <= CONSOLE_CAP_BYTES);
}

#[test]
fn control_without_log_caps_a_console_flood_grows_console_log() {
    let s = Scratch::with_deadline("flood-serve-ctl", Duration::from_secs(480));
    let console = a_minute_of_console_flood(&s, &[TestControl::NoLogCaps]);
    assert!(console > CONSOLE_CAP_BYTES, "control: uncapped, console.log grows past the cap ({console} bytes)");
}

/// A guest that ignores shutdown, 10,000 events queued behind a collector that was refusing them and then
/// answers slowly (1 s a request); SIGTERM to the driver. Returns (events recorded, records received).
fn stop_with_a_slow_collector(s: &Scratch, driver_flags: &[&str]) -> (usize, usize) {
    let receiver = Receiver::start(Behavior::Reject("collector busy".into()));
    let mut launch = rogue(s, "ignore-shutdown", &[HANG])
        .flag("--otlp-ocsf-endpoint")
        .flag(&receiver.grpc_endpoint())
        .flag("--otlp-ocsf-protocol")
        .flag("grpc");
    for flag in driver_flags {
        launch = launch.flag(flag);
    }
    let mut run = Running::start(launch, &[], "");
    run.procs();
    workload_started(s, &run);
    s.waiting_for("5,000 processes (10,000 events)");
    let statuses = AttachClient::connect(&run.sandbox_dir).run_many(&["polite"], 5000, 64);
    assert!(statuses.iter().all(|st| *st == ExitStatus::Code(0)));
    // The file is written on the supervisor's own thread, which may still be behind the last exit status:
    // waited for as long as it moves (a busy host writes slowly, not never).
    let queued = wait_for_count(10_000, Duration::from_secs(30), || events::read(&run.sandbox_dir).len());
    assert!(queued >= 10_000, "{queued} events recorded");
    assert!(receiver.records().is_empty(), "the collector accepted nothing yet");
    receiver.set_behavior(Behavior::Slow(Duration::from_secs(1)));
    signal(run.driver_pid(), SIGTERM);
    s.waiting_for("the orderly stop with 10,000 events queued");
    run.driver.wait().unwrap();
    let recorded = events::read(&run.sandbox_dir).len();
    let received = receiver.records().len();
    eprintln!(
        "e2e: stop with a slow collector: {received} of {recorded} events delivered ({queued} queued at SIGTERM)"
    );
    (recorded, received)
}

#[test]
fn the_stop_budget_flushes_every_queued_event() {
    let s = Scratch::new("stop-budget");
    let (recorded, received) = stop_with_a_slow_collector(&s, &[]);
    assert_eq!(received, recorded, "events lost at the stop");
}

#[test]
fn control_a_driver_deadline_shorter_than_the_budget_loses_events() {
    let s = Scratch::new("stop-budget-ctl");
    let (recorded, received) = stop_with_a_slow_collector(&s, &["--stop-timeout", "1"]);
    assert!(received < recorded, "control: a deadline that cuts the flush loses events");
}

#[test]
fn a_reattach_replays_everything_a_vanished_client_never_read() {
    const LINES: usize = 1_000_000;
    let s = Scratch::new("replay");
    let canary = "replay-canary";
    let run =
        Running::start(Launch::new(&s, &["/bin/sh", "-c", &format!("echo {canary}; exec sleep 1000")]), &[], canary);
    // The first client starts a numbered stream and goes away without reading a byte of it.
    let pid = AttachClient::connect(&run.sandbox_dir).spawn(&["seq", "1", &LINES.to_string()]);
    s.waiting_for("the re-attached client to read the stream");
    let (stdout, status) = AttachClient::connect(&run.sandbox_dir).reattach(pid);
    assert_eq!(status, ExitStatus::Code(0));
    let text = String::from_utf8(stdout).unwrap();
    let numbers: Vec<usize> = text.lines().map(|l| l.parse().unwrap()).collect();
    if let Some((i, n)) = numbers.iter().enumerate().find(|(i, n)| **n != i + 1) {
        panic!("line {} is {n}: the replay lost or reordered output", i + 1);
    }
    assert_eq!(numbers.len(), LINES, "every line, once");
    eprintln!("e2e: re-attach replayed all {LINES} lines in order");
}

/// Lets a guest repeat `Started` for `span` with the invariants unchecked (so the attack goes on), then stops
/// the sandbox; returns the Process Launch events recorded, whether a `telemetry_dropped` finding was, and
/// the span the supervisor ran.
fn repeated_started_unchecked(s: &Scratch, controls: &[TestControl], span: Duration) -> (u64, bool, Duration) {
    let launch = controls
        .iter()
        .fold(rogue(s, "repeated-started", &["/bin/sleep", "1000"]), |l, c| l.control(*c))
        .control(TestControl::NoGuestInvariants);
    let start = Instant::now();
    let mut run = Running::start(launch, &[], "");
    workload_started(s, &run);
    std::thread::sleep(span);
    signal(run.driver_pid(), SIGTERM);
    s.waiting_for("the stop after the Started flood");
    run.driver.wait().unwrap();
    let ran = start.elapsed();
    let events = events::read(&run.sandbox_dir);
    let launches = events.iter().filter(|e| e["class_uid"] == 1007 && e["activity_id"] == 1).count() as u64;
    (launches, finding_types(&events).contains(&"telemetry_dropped"), ran)
}

/// What the limiter lets through in `span`: the burst, and the rate for the rest.
fn telemetry_bound(span: Duration) -> u64 {
    u64::from(limit::BURST) + u64::from(limit::RATE_PER_SEC) * span.as_secs().saturating_add(1)
}

#[test]
fn telemetry_the_guest_causes_is_rate_limited_and_the_drop_counted() {
    let s = Scratch::new("started-limited");
    let (launches, dropped, ran) = repeated_started_unchecked(&s, &[], Duration::from_secs(20));
    eprintln!("e2e: repeated Started, limited: {launches} launch events in {ran:?}, drop reported: {dropped}");
    assert!(launches <= telemetry_bound(ran), "{launches} events passed the limit");
    assert!(dropped, "the drop is reported as a finding");
}

#[test]
fn control_without_telemetry_limits_repeated_started_floods_the_record() {
    let s = Scratch::new("started-unlimited");
    let (launches, dropped, ran) =
        repeated_started_unchecked(&s, &[TestControl::NoTelemetryLimits], Duration::from_secs(20));
    eprintln!("e2e: control, repeated Started unlimited: {launches} launch events in {ran:?}");
    assert!(!dropped);
    assert!(launches > telemetry_bound(ran), "control: without limits the guest writes the record at will");
}

#[test]
fn data_on_a_refused_network_stream_stops_the_sandbox() {
    a_protocol_attack_is_stopped("stream-data-after-close");
}

/// A guest that opens network streams without end and never reads, beside a healthy sandbox on the same
/// `serve`: the policy's connection cap holds, each refusal is an event within the telemetry limit, findings
/// are rate-limited, the supervisor stays within its memory bound, and the neighbour keeps answering about
/// as fast as it does beside a guest that merely spins its vCPU.
#[test]
fn an_endless_flood_of_network_streams_is_refused_within_bounds_and_the_neighbour_stays_responsive() {
    let s = Scratch::with_deadline("rogue-stream-flood", Duration::from_secs(420));
    let images = images_with_rogues(&s.dir, &["stream-open-flood"]);
    let serve = Serve::with(&s, &[], &["--boot-images", images.to_str().unwrap()]);
    ok(serve.cli("create", &["healthy"]));
    let usual = beside_a_busy_guest(&serve, "healthy");

    let policy = s.dir.join("policy.json");
    let rules = r#"{"allow":["exec"],"network":{"allow":[{"host":"host.vm-driver.internal","ports":[9]}],"max_connections":8}}"#;
    std::fs::write(&policy, rules).unwrap();
    let peak = PeakRss::supervisors(&s.dir, "flood");
    let flooded = Instant::now();
    let flood = ["--boot-image", "rogue-stream-open-flood", "--policy", policy.to_str().unwrap(), "flood"];
    ok(serve.cli("create", &flood));
    let flood_dir = serve.sandbox("flood");
    s.waiting_for("the flood to be refused for a while");
    let refused =
        |dir: &Path| events::read(dir).iter().filter(|e| e["class_uid"] == 4001 && e["activity_id"] == 5).count();
    assert!(wait_until(Duration::from_secs(60), || refused(&flood_dir) > 100), "refusals recorded");
    let (typical, slowest) = exec_times(&serve, "healthy", 10, Duration::from_secs(1));
    let flood_for = flooded.elapsed();
    ok(serve.cli("stop", &["flood"]));
    let peak = peak.peak();
    let all = events::read(&flood_dir);
    let denied = finding_types(&all).iter().filter(|f| **f == "policy_denied").count();
    let refusals = refused(&flood_dir);
    eprintln!(
        "e2e: stream flood: {refusals} refusals, {denied} findings, supervisor peak RSS {peak} KiB; neighbour exec \
         median {typical:?} (slowest {slowest:?}), beside a busy guest {usual:?}"
    );
    assert!(denied >= 1, "a policy_denied finding");
    assert!(denied * 20 < refusals.max(1), "findings are rate-limited: {denied} for {refusals} refusals");
    assert!(peak <= RSS_BOUND_KIB, "the supervisor peaked at {peak} KiB");
    logs_within_caps(&flood_dir);
    // Every refusal is an event, within the telemetry limit (what is beyond it is dropped and counted).
    let bound = u64::from(limit::BURST) + u64::from(limit::RATE_PER_SEC) * (flood_for.as_secs() + 30);
    assert!(refusals as u64 <= bound, "{refusals} refusal events over the limit of {bound}");
    // Within the usual time under load, with room for a 2-core machine's noise; never a stall.
    assert!(typical <= usual * 2 + Duration::from_millis(200), "{typical:?} against {usual:?} beside a busy guest");
    assert!(slowest <= Duration::from_secs(10), "an exec took {slowest:?}");
}

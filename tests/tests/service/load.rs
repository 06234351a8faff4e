//! The leash under load: a busy host never kills a healthy sandbox, and the true-fault bounds still hold.
//!
//! CPU hogs numbering twice the cores run for the whole test, beside one `vm-driver serve` with a warm pool
//! of two: 24 sandboxes (128 MiB guests, some claimed from the pool while it refills) are created in bursts
//! of 8 and left idle for two minutes; every one must stay ready, with no lease lost, and the pooled VMs
//! must stay pooled (none replaced). Then, under the same load, a frozen supervisor, a frozen watchdog and a killed
//! service must still end their VMs within their bounds, and a sandbox whose VM died must stop being
//! reported ready.
//!
//! The two heavy tests bring their own load and run alone ([`exclusive::alone`]): beside another test, each
//! would measure that test's load too (the kill bound is for the load the issue names: CPU hogs and bursts
//! of creates, not a neighbour test's VMs), and its hogs would break that test's bounds.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal::{SIGCONT, SIGKILL, SIGSTOP};
use vm_contract::layout::SandboxFile;
use vm_contract::pids::SandboxPids;
use vm_protocol::driver_api::{exec_request, ExecRequest, ExecStart, GetCapabilitiesRequest};
use vm_test_support::output::ok;
use vm_test_support::procs::{exit_after, signal, ProcInfo};
use vm_test_support::serve::Serve;
use vm_test_support::{exclusive, gone_within, sandbox, wait_until, Launch, Running, Scratch, TestControl, CANARY};

const SANDBOXES: usize = 24;
const BURST: usize = 8;
const IDLE: Duration = Duration::from_secs(120);
/// How long a `launch`'s VM may outlive its SIGKILLed driver under this load.
const KILL_BOUND: Duration = Duration::from_millis(300);

/// Busy loops, one process each, killed when dropped. They run in the scratch directory, so a test that
/// passes its deadline takes them down with everything else.
struct Hogs(Vec<Child>);

impl Hogs {
    fn start(dir: &Path, count: usize) -> Self {
        let spawn = || {
            Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .current_dir(dir)
                .stdin(Stdio::null())
                .spawn()
                .unwrap()
        };
        Self((0..count).map(|_| spawn()).collect())
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for hog in &mut self.0 {
            let _ = hog.kill();
            let _ = hog.wait();
        }
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(2, std::num::NonZero::get)
}

/// The processes of sandbox `id`, from its pids file.
fn pids(serve: &Serve, id: &str) -> SandboxPids {
    SandboxPids::read(&serve.sandbox(id)).expect("a pids file")
}

fn info(pid: i32) -> ProcInfo {
    ProcInfo::read(pid).expect("a live process")
}

/// The warm pool's ready slots, from `vm-driver pool`.
fn pooled_ready(serve: &Serve) -> Vec<String> {
    let out = ok(serve.cli("pool", &[]));
    out.lines()
        .filter(|l| l.contains(" ready "))
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect()
}

/// Lease losses recorded in the sandboxes' and pooled VMs' logs.
fn lease_losses(serve: &Serve) -> Vec<String> {
    let mut found = Vec::new();
    let sandboxes = std::fs::read_dir(serve.state.join("sandboxes")).unwrap().flatten();
    for entry in sandboxes.chain(std::fs::read_dir(serve.state.join("pool")).unwrap().flatten()) {
        let log = sandbox::read(&entry.path(), SandboxFile::SupervisorLog);
        found.extend(
            log.lines()
                .filter(|l| l.contains("lease watchdog") || l.contains("vm-watchdog:"))
                .map(|l| format!("{}: {l}", entry.file_name().to_string_lossy())),
        );
    }
    found
}

#[test]
fn a_busy_host_keeps_every_idle_sandbox_and_the_fault_bounds() {
    let _alone = exclusive::alone();
    let s = Scratch::with_deadline("load", Duration::from_secs(900));
    let hogs = Hogs::start(&s.dir, 2 * cores());
    eprintln!("e2e: {} CPU hogs on {} cores", hogs.0.len(), cores());
    // The boot timeout is the operator's to size (docs/operations.md, "Sizing a host"): bursts of 8 TCG boots
    // beside 4 hogs on 2 cores took over 60 s in CI. What this test holds to is the leash, not boot speed; the
    // creates wait as long as the boots, which take turns (`--max-boots`), need beside the hogs.
    let serve = Serve::with(&s, &[], &["--pool", "2:1:128", "--boot-timeout", "300"]);
    let mut create_times = Vec::new();
    for burst in 0..SANDBOXES / BURST {
        s.waiting_for(&format!("burst {} of {BURST} creates", burst + 1));
        let started = Instant::now();
        let creates: Vec<_> = (0..BURST)
            .map(|i| {
                let id = format!("idle-{}", burst * BURST + i);
                serve
                    .cli_command("create", &["--memory", "128", "--wait-timeout", "600", &id])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for create in creates {
            let out = create.wait_with_output().unwrap();
            assert!(out.status.success(), "a create failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        create_times.push(started.elapsed());
    }
    eprintln!("e2e: {SANDBOXES} sandboxes ready; bursts took {create_times:?}");
    s.waiting_for("the pool to refill under load");
    assert!(wait_until(Duration::from_secs(120), || pooled_ready(&serve).len() == 2), "the pool never refilled");
    let pooled = pooled_ready(&serve);
    s.waiting_for("two idle minutes under load");
    let idle_start = Instant::now();
    let mut lowest = SANDBOXES;
    while idle_start.elapsed() < IDLE {
        lowest = lowest.min(serve.ready_count());
        std::thread::sleep(Duration::from_secs(5));
    }
    let losses = lease_losses(&serve);
    eprintln!("e2e: after {IDLE:?} idle under load: at least {lowest} of {SANDBOXES} ready throughout");
    assert!(losses.is_empty(), "lease losses on healthy sandboxes:\n{}", losses.join("\n"));
    assert_eq!(lowest, SANDBOXES, "every sandbox stays ready");
    assert_eq!(pooled_ready(&serve), pooled, "the pooled VMs stayed pooled and ready (none replaced)");

    // The true faults, under the same load.
    s.waiting_for("a frozen supervisor's VM to be killed and noticed");
    let frozen = pids(&serve, "idle-0");
    let (supervisor, vmm) = (info(frozen.supervisor.pid), info(frozen.vmm.expect("a VMM").pid));
    let start = Instant::now();
    let vmm_gone = exit_after(&vmm, Duration::from_secs(3), || signal(supervisor.pid, SIGSTOP));
    let vmm_gone = vmm_gone.expect("frozen supervisor: the VMM outlived 3 s under load");
    let noticed = wait_until(Duration::from_secs(5), || serve.sandbox_state("idle-0") != "ready");
    let left_ready = start.elapsed();
    let exec = serve.cli("exec", &["idle-0", "--", "true"]);
    // It never says it is stopping, so it is hung: killed (2 s + 0.5 s after its VM), and its readiness
    // listener closed with it.
    let kill_bound = Duration::from_secs(5);
    let killed = gone_within(&supervisor, (vmm_gone + kill_bound).saturating_sub(start.elapsed()));
    let supervisor_gone = start.elapsed();
    if !killed {
        signal(supervisor.pid, SIGCONT);
    }
    assert!(noticed, "the sandbox is still reported ready 5 s after its VM died");
    let why = String::from_utf8_lossy(&exec.stderr);
    assert!(!exec.status.success() && why.contains("not ready"), "an exec into a dead VM: {why}");
    assert!(killed, "the hung supervisor was not killed within 5 s of its VM");
    eprintln!(
        "e2e: under load: supervisor SIGSTOP -> VMM gone in {vmm_gone:?}, sandbox not ready after {left_ready:?}, \
         hung supervisor killed after {supervisor_gone:?}"
    );

    s.waiting_for("a frozen watchdog's VM to be stopped");
    let frozen = pids(&serve, "idle-1");
    let (watchdog, vmm) = (info(frozen.watchdog.expect("a watchdog").pid), info(frozen.vmm.expect("a VMM").pid));
    let gone = exit_after(&vmm, Duration::from_secs(2), || signal(watchdog.pid, SIGSTOP));
    signal(watchdog.pid, SIGCONT);
    let gone = gone.expect("frozen watchdog: the VMM outlived 2 s under load");
    eprintln!("e2e: under load: watchdog SIGSTOP -> VMM gone in {gone:?}");

    s.waiting_for("a launch's VM to end with its driver");
    let own = Scratch::new("load-launch");
    let mut launched = Running::start(Launch::sleeper(&own), &[], CANARY);
    let vmm = launched.procs().vmm;
    let driver = launched.driver_pid();
    let driver_kill = exit_after(&vmm, Duration::from_secs(5), || signal(driver, SIGKILL));
    launched.driver.wait().unwrap();
    let driver_kill = driver_kill.expect("a launch's VM outlived its killed driver by 5 s under load");
    eprintln!("e2e: under load: launch driver SIGKILL -> VMM gone in {driver_kill:?}");
    // The driver's death reaches the VMM in a few milliseconds (the kill switch); the rest is the kernel
    // tearing down QEMU's ~200 MB address space beside 24 busy VMs and the hogs, which on this project's nested
    // TCG machine alone takes 20 to 80 ms (docs/operations.md, the busy-host table).
    assert!(driver_kill <= KILL_BOUND, "a launch's VM outlived its killed driver by over {KILL_BOUND:?}");

    s.waiting_for("every VM to end with the service");
    let vmms: Vec<ProcInfo> = serve.vmms().into_iter().filter(ProcInfo::is_alive).collect();
    let start = Instant::now();
    signal(serve.pid(), SIGKILL);
    for vmm in &vmms {
        assert!(gone_within(vmm, Duration::from_secs(5)), "a VM outlived the killed service under load");
    }
    eprintln!("e2e: under load: service SIGKILL -> all {} VMMs gone in {:?}", vmms.len(), start.elapsed());
    drop(hogs);
}

/// Control: with the VMM's exit not watched, a sandbox whose supervisor froze (and whose VM the watchdog
/// killed) is still reported ready long after.
#[test]
fn control_without_the_vmm_watch_a_dead_vm_stays_ready() {
    let s = Scratch::new("vmm-watch-ctl");
    let serve = Serve::with_controls(&s, &[TestControl::NoVmmWatch]);
    ok(serve.cli("create", &["frozen"]));
    let p = pids(&serve, "frozen");
    let (supervisor, vmm) = (info(p.supervisor.pid), info(p.vmm.expect("a VMM").pid));
    signal(supervisor.pid, SIGSTOP);
    assert!(gone_within(&vmm, Duration::from_secs(3)), "the watchdog kills the VM of a frozen supervisor");
    std::thread::sleep(Duration::from_secs(8));
    let still_ready = serve.sandbox_state("frozen") == "ready";
    signal(supervisor.pid, SIGCONT);
    assert!(still_ready, "control: unwatched, the dead VM's sandbox is still reported ready 8 s later");
    eprintln!("e2e: control confirmed: the VM is gone and the sandbox still reads ready");
}

fn exec_start(sandbox: &str, argv: &[&str]) -> ExecRequest {
    let argv = argv.iter().map(|a| (*a).to_owned()).collect();
    ExecRequest {
        request: Some(exec_request::Request::Start(ExecStart {
            sandbox_id: sandbox.into(),
            argv,
            ..Default::default()
        })),
    }
}

#[test]
fn serve_admits_only_what_fits_and_says_which_limit() {
    let s = Scratch::new("admission");
    // About 1 GiB of memory to hand out, whatever this host has: room for three 128 MiB sandboxes, not for 2 GiB.
    let host_mib = vm_test_support::procs::meminfo_kib("MemTotal").expect("MemTotal") / 1024;
    let overcommit = format!("{:.6}", 1024.0 / host_mib as f64);
    let serve = Serve::with(
        &s,
        &[],
        &[
            "--max-sandboxes",
            "2",
            "--max-exec-per-sandbox",
            "2",
            "--max-exec-streams",
            "3",
            "--memory-overcommit",
            &overcommit,
        ],
    );
    ok(serve.cli("create", &["--memory", "128", "a"]));
    ok(serve.cli("create", &["--memory", "128", "b"]));
    let refused = serve.cli("create", &["--memory", "128", "c"]);
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && why.contains("--max-sandboxes"), "{why}");
    // A stopped sandbox holds nothing: c fits now, and b cannot start again beside a and c.
    ok(serve.cli("stop", &["b"]));
    ok(serve.cli("create", &["--memory", "128", "c"]));
    let why = serve.cli("start", &["b"]);
    assert!(
        String::from_utf8_lossy(&why.stderr).contains("--max-sandboxes"),
        "{}",
        String::from_utf8_lossy(&why.stderr)
    );
    // Memory beyond the host's is refused, naming the limit.
    ok(serve.cli("rm", &["c"]));
    let huge = serve.cli("create", &["--memory", "2048", "huge"]);
    assert!(
        String::from_utf8_lossy(&huge.stderr).contains("--memory-overcommit"),
        "{}",
        String::from_utf8_lossy(&huge.stderr)
    );

    let (rt, mut client) = serve.grpc();
    rt.block_on(async {
        let mut open = Vec::new();
        let mut refusals = Vec::new();
        for sandbox in ["a", "a", "a"] {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(exec_start(sandbox, &["sleep", "100"])).await.unwrap();
            match client.exec(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
                Ok(stream) => open.push((tx, stream)),
                Err(status) => refusals.push(status),
            }
        }
        assert_eq!(open.len(), 2);
        assert_eq!(refusals[0].code(), tonic::Code::ResourceExhausted);
        assert!(refusals[0].message().contains("--max-exec-per-sandbox"), "{}", refusals[0].message());
        let caps = client.get_capabilities(GetCapabilitiesRequest {}).await.unwrap().into_inner();
        let (limits, usage) = (caps.limits.unwrap(), caps.usage.unwrap());
        assert_eq!((limits.sandboxes, limits.exec_per_sandbox, limits.exec_streams), (2, 2, 3));
        assert!((1000..=1024).contains(&limits.memory_mib), "{}", limits.memory_mib);
        assert_eq!((usage.sandboxes, usage.exec_streams), (1, 2), "a runs, b is stopped; two streams open");
        eprintln!("e2e: admission: limits {limits:?}, usage {usage:?}");
    });
}

/// 2,000 Exec streams of `yes` across 10 sandboxes (200 each; one admits at most 248), never read: the
/// driver's memory stays bounded and the API keeps answering. The guests get 512 MiB: 200 processes run a
/// 128 MiB guest out of memory. The ten creates are asked for at once and all boot, taking turns (on two
/// cores, ten boots at once each missed the 60 s boot timeout).
#[test]
fn two_thousand_exec_streams_that_never_read_keep_the_driver_bounded() {
    let _alone = exclusive::alone();
    const STREAMS: usize = 2000;
    const SANDBOXES: usize = 10;
    let s = Scratch::with_deadline("exec-flood", Duration::from_secs(600));
    let serve = Serve::start(&s);
    let creates: Vec<_> = (0..SANDBOXES)
        .map(|i| {
            serve
                // They boot a few at a time (`--max-boots`): the last waits for the nine before it.
                .cli_command("create", &["--memory", "512", "--wait-timeout", "500", &format!("flood-{i}")])
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in creates {
        assert!(c.wait().unwrap().success());
    }
    let driver = serve.pid();
    let idle_rss = vm_test_support::procs::status_kib(driver, "VmRSS").unwrap_or(0);
    let (rt, _) = serve.grpc();
    s.waiting_for("2,000 Exec streams to open");
    let (peak, slowest) = rt.block_on(async {
        let mut held = Vec::new();
        let mut client = None;
        for i in 0..STREAMS {
            // A connection carries at most a few hundred concurrent streams; a gateway would open several.
            if i % 100 == 0 {
                client = Some(vm_driver::service::client::connect(&serve.socket).await.unwrap());
            }
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(exec_start(&format!("flood-{}", i % SANDBOXES), &["yes"])).await.unwrap();
            let stream = client.as_mut().unwrap().exec(tokio_stream::wrappers::ReceiverStream::new(rx)).await;
            held.push((tx, stream.unwrap_or_else(|e| panic!("stream {i}: {e}"))));
        }
        let mut peak = 0;
        let mut slowest = Duration::ZERO;
        let mut caps = vm_driver::service::client::connect(&serve.socket).await.unwrap();
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            peak = peak.max(vm_test_support::procs::status_kib(driver, "VmRSS").unwrap_or(0));
            let start = Instant::now();
            let reply = caps.get_capabilities(GetCapabilitiesRequest {}).await.unwrap().into_inner();
            slowest = slowest.max(start.elapsed());
            assert_eq!(reply.usage.unwrap().exec_streams, u32::try_from(STREAMS).unwrap());
        }
        (peak, slowest)
    });
    eprintln!("e2e: {STREAMS} unread Exec streams of `yes`: driver RSS {idle_rss} KiB idle, peak {peak} KiB; slowest GetCapabilities {slowest:?}");
    assert!(peak <= idle_rss + DRIVER_STREAM_BOUND_KIB, "the driver grew to {peak} KiB");
    assert!(slowest <= Duration::from_secs(1), "GetCapabilities took {slowest:?}");
}

/// What 2,000 unread streams may add to the driver: per stream, at most its output window (256 KiB) is
/// uncredited, in the driver's queue or the supervisor; and what the transport took, up to the client's
/// connection window (hyper's 5 MiB, one connection per 100 streams); RSS also counts what the allocator keeps
/// of freed chunks (measured: up to 1.22 times the live bound, when the guests fill every window), hence
/// half as much again. Without credit the driver would hold everything `yes` wrote: gigabytes in the minute
/// this runs.
const DRIVER_STREAM_BOUND_KIB: u64 = (2000 * 256 + 20 * 5 * 1024) * 3 / 2;

//! QEMU's confinement (`vm-jailer`), on real VMs: the VMM's credentials, root and limits as `/proc` shows
//! them, and a simulated escape (a process with the VMM's uid, gid, namespaces and root, entered with
//! `nsenter`) that is refused everything it tries, where with `--confinement none` (the control) it gets
//! everything. QEMU dies with its jailer by its own parent-death signal (with a control that drops it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use vm_contract::layout::SandboxFile;
use vm_contract::pids::SandboxPids;
use vm_test_support::procs::{self, exit_after, signal, ProcInfo};
use vm_test_support::serve::Serve;
use vm_test_support::{events, gone_within, Launch, Running, Scratch, TestControl, CANARY};

/// `/proc/<pid>/status` fields.
fn status(pid: i32) -> Vec<(String, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.to_owned(), v.trim().to_owned())))
        .collect()
}

fn field(status: &[(String, String)], name: &str) -> String {
    status.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()).unwrap_or_default()
}

/// The first (real) uid or gid of a `Uid:`/`Gid:` line, when all four agree.
fn one_id(line: &str) -> u32 {
    let ids: BTreeSet<&str> = line.split_whitespace().collect();
    assert_eq!(ids.len(), 1, "real, effective, saved and fs ids differ: {line}");
    ids.into_iter().next().unwrap().parse().unwrap()
}

/// QEMU is pid 1 of its own PID namespace (`NSpid`: the host's pid, then 1).
fn assert_init_of_its_pid_namespace(st: &[(String, String)]) {
    let nspid = field(st, "NSpid");
    assert_eq!(nspid.split_whitespace().count(), 2, "NSpid {nspid}: one PID namespace below the host's");
    assert_eq!(nspid.split_whitespace().last(), Some("1"), "NSpid {nspid}: QEMU is its namespace's init");
}

/// Checks everything `/proc` tells about a jailed VMM; returns its uid.
fn assert_jailed(vmm: i32) -> u32 {
    assert_jailed_with(vmm, &[])
}

/// [`assert_jailed`], for a jail whose root also holds `extra` (a template clone's `proc`).
fn assert_jailed_with(vmm: i32, extra: &[&str]) -> u32 {
    let st = status(vmm);
    let (uid, gid) = (one_id(&field(&st, "Uid")), one_id(&field(&st, "Gid")));
    let driver_uid = rustix::process::getuid().as_raw();
    assert!(uid != 0 && uid != driver_uid && gid != 0, "the VMM runs as {uid}:{gid}");
    assert_eq!(field(&st, "CapEff"), "0000000000000000");
    assert_eq!(field(&st, "CapPrm"), "0000000000000000");
    assert_eq!(field(&st, "CapBnd"), "0000000000000000");
    assert_eq!(field(&st, "NoNewPrivs"), "1");
    assert_eq!(field(&st, "Seccomp"), "2", "QEMU's seccomp filter is on");
    for ns in ["mnt", "ipc", "uts", "net", "pid"] {
        let theirs = std::fs::read_link(format!("/proc/{vmm}/ns/{ns}")).unwrap();
        assert_ne!(theirs, std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap(), "{ns} namespace shared");
    }
    assert_init_of_its_pid_namespace(&st);
    let root: BTreeSet<String> = std::fs::read_dir(format!("/proc/{vmm}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut expected: BTreeSet<String> =
        ["chan.sock", "console.sock", "dev", "initrd", "kernel", "lib", "lib64", "usr"].map(String::from).into();
    expected.extend(extra.iter().map(|e| (*e).to_owned()));
    assert!(root.is_subset(&expected) && root.contains("kernel"), "the jail holds {root:?}");
    let usr: BTreeSet<String> = std::fs::read_dir(format!("/proc/{vmm}/root/usr"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!usr.contains("sbin") && !usr.contains("local"), "the jail's /usr holds {usr:?}");
    let limits = std::fs::read_to_string(format!("/proc/{vmm}/limits")).unwrap();
    for (name, value) in
        [("Max file size", "0"), ("Max core file size", "0"), ("Max processes", "256"), ("Max open files", "4096")]
    {
        let line = limits.lines().find(|l| l.starts_with(name)).unwrap();
        assert_eq!(line.split_whitespace().nth(name.split(' ').count()), Some(value), "{line}");
    }
    // Its inherited fds: stdio and what QEMU opened itself (sockets, eventfds), nothing of the supervisor's.
    for fd in std::fs::read_dir(format!("/proc/{vmm}/fd")).unwrap().flatten() {
        let target = std::fs::read_link(fd.path()).unwrap_or_default();
        let target = target.to_string_lossy();
        assert!(!target.ends_with(".log") && !target.ends_with(".jsonl"), "the VMM holds {target}");
    }
    eprintln!("e2e: jailed VMM {vmm}: uid {uid}, gid {gid}, root {root:?}");
    uid
}

/// The paths this host's loader resolves for `object` (`ldd`, run by the test on a host binary: an
/// answer found independently of the jailer's own ELF reading), canonical.
fn loaded_by(object: &Path) -> BTreeSet<PathBuf> {
    let out = Command::new("ldd").arg(object).output().unwrap();
    let mut found = BTreeSet::from([std::fs::canonicalize(object).unwrap()]);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line.split("=>").nth(1).unwrap_or(line).trim().split(' ').next().unwrap_or("");
        if path.starts_with('/') {
            found.insert(std::fs::canonicalize(path).unwrap());
        }
    }
    found
}

/// The regular files of the VMM's root equal QEMU's loader closure, the TCG module's under TCG, the
/// `microvm` firmware, and the sandbox's kernel and initramfs: no other file of the host.
fn assert_jail_holds_only_what_qemu_loads(vmm: &ProcInfo) {
    let root = PathBuf::from(format!("/proc/{}/root", vmm.pid));
    let mut held = BTreeSet::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            // Through the mount, not readdir's type: a mount point's own type is the host's empty file.
            let kind = std::fs::symlink_metadata(entry.path()).unwrap().file_type();
            if kind.is_dir() {
                dirs.push(entry.path());
            } else if kind.is_file() {
                held.insert(Path::new("/").join(entry.path().strip_prefix(&root).unwrap()));
            }
        }
    }
    let qemu = PathBuf::from(&vmm.cmdline[0]);
    let mut expected = loaded_by(&qemu);
    let prefix = qemu.parent().unwrap().parent().unwrap();
    let tcg = vmm.cmdline.iter().skip_while(|a| *a != "-accel").nth(1).unwrap().starts_with("tcg");
    if tcg {
        let module = prefix.join("lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so");
        expected.extend(loaded_by(&module));
    }
    for firmware in ["bios-microvm.bin", "linuxboot_dma.bin"] {
        expected.insert(std::fs::canonicalize(prefix.join("share/qemu").join(firmware)).unwrap());
    }
    expected.extend([PathBuf::from("/kernel"), PathBuf::from("/initrd")]);
    let bytes: u64 =
        held.iter().map(|p| std::fs::metadata(root.join(p.strip_prefix("/").unwrap())).unwrap().len()).sum();
    eprintln!("e2e: the VMM's root holds {} files, {} MiB (TCG module: {tcg})", held.len(), bytes >> 20);
    assert_eq!(held, expected, "the jail holds exactly what QEMU loads");
}

#[test]
fn a_launched_vmm_runs_jailed() {
    let s = Scratch::new("jail-launch");
    let launch = Launch::sleeper(&s).flag("--vmm-cpu-max").flag("50");
    let running = Running::start(launch, &[], CANARY);
    let p = running.procs();
    let uid = assert_jailed(p.vmm.pid);
    assert_jail_holds_only_what_qemu_loads(&p.vmm);
    let guest_mib: u64 =
        p.vmm.cmdline.iter().skip_while(|a| *a != "-m").nth(1).unwrap().trim_end_matches('M').parse().unwrap();
    let limits = cgroup_limits(p.vmm.pid);
    eprintln!("e2e: the VMM's cgroup limits: {limits:?} (guest {guest_mib} MiB)");
    assert_eq!(limits.memory, Some((guest_mib + 512) << 20), "memory: the guest's plus the default 512 MiB");
    assert_eq!(limits.pids, Some(256));
    assert_eq!(limits.cpu_quota_per_100ms_us, Some(50_000), "--vmm-cpu-max 50: half a core");
    let claims = std::fs::read_dir("/run/vm-driver-jail-ids").unwrap();
    assert!(claims.flatten().any(|c| c.file_name().to_string_lossy() == uid.to_string()), "the uid is claimed");
    // QEMU's parent is the jailer, which holds its PID namespace; QEMU dies with it.
    let jailer = parent_of(p.vmm.pid);
    assert_ne!(jailer, p.supervisor.pid, "QEMU is the jailer's child, not the supervisor's");
    assert!(ProcInfo::read(jailer).unwrap().cmdline[0].ends_with("vm-jailer"));
    let gone = exit_after(&p.vmm, Duration::from_secs(10), || signal(jailer, Signal::SIGKILL));
    eprintln!("e2e: jailer SIGKILLed -> QEMU gone after {gone:?}");
    assert!(gone.is_some(), "QEMU outlived its jailer");
}

/// Kills the jailer of a launched VM while its supervisor is frozen (so the supervisor cannot stop QEMU on
/// its jailer's exit): how long QEMU outlives it, within `limit`. The supervisor is let go again after.
fn qemu_after_its_jailer(name: &str, controls: &[TestControl], limit: Duration) -> Option<Duration> {
    let s = Scratch::new(name);
    let running = Running::start(Launch::sleeper(&s).controls(controls), &[], CANARY);
    let p = running.procs();
    let jailer = parent_of(p.vmm.pid);
    assert!(ProcInfo::read(jailer).unwrap().cmdline[0].ends_with("vm-jailer"));
    signal(p.supervisor.pid, Signal::SIGSTOP);
    let gone = exit_after(&p.vmm, limit, || signal(jailer, Signal::SIGKILL));
    signal(p.supervisor.pid, Signal::SIGCONT);
    // Either way the lease ends it: the watchdog heard no pulse while the supervisor was frozen.
    assert!(gone_within(&p.vmm, Duration::from_secs(10)), "QEMU outlived its jailer and its lease");
    gone
}

#[test]
fn a_killed_jailer_takes_qemu_with_it_even_while_the_supervisor_is_frozen() {
    let gone = qemu_after_its_jailer("jail-pdeath", &[], Duration::from_millis(500));
    eprintln!("e2e: supervisor frozen, jailer SIGKILLed -> QEMU gone after {gone:?}");
    assert!(gone.is_some(), "QEMU outlived its jailer by 500 ms: its parent-death signal did not fire");
}

#[test]
fn control_without_the_parent_death_signal_qemu_outlives_its_jailer() {
    let gone =
        qemu_after_its_jailer("jail-pdeath-ctl", &[TestControl::JailerNoDeathSignal], Duration::from_millis(500));
    assert!(gone.is_none(), "control: QEMU died {gone:?} after its jailer without a parent-death signal");
    eprintln!("e2e: control: without the parent-death signal, QEMU outlived its killed jailer by 500 ms");
}

/// A VMM's limits, as the cgroups it is in show them (v1 per controller, or v2).
#[derive(Debug, Default)]
struct CgroupLimits {
    memory: Option<u64>,
    pids: Option<u64>,
    cpu_quota_per_100ms_us: Option<u64>,
}

fn cgroup_limits(pid: i32) -> CgroupLimits {
    let read = |path: PathBuf| std::fs::read_to_string(path).ok().map(|t| t.trim().to_owned());
    let mut limits = CgroupLimits::default();
    for line in std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap().lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        let under = |mount: &str| PathBuf::from(format!("/sys/fs/cgroup/{mount}{path}"));
        let controllers: Vec<&str> = controllers.split(',').collect();
        if controllers.contains(&"memory") {
            limits.memory = read(under("memory").join("memory.limit_in_bytes")).and_then(|v| v.parse().ok());
        }
        if controllers.contains(&"pids") {
            limits.pids = read(under("pids").join("pids.max")).and_then(|v| v.parse().ok());
        }
        if controllers.contains(&"cpu") {
            let period: u64 = read(under("cpu").join("cpu.cfs_period_us")).unwrap().parse().unwrap();
            let quota: u64 = read(under("cpu").join("cpu.cfs_quota_us")).unwrap().parse().unwrap();
            limits.cpu_quota_per_100ms_us = Some(quota * 100_000 / period);
        }
        if controllers == [""] {
            let v2 = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() { "" } else { "unified" };
            let dir = under(v2);
            if let Some(max) = read(dir.join("memory.max")) {
                limits.memory = max.parse().ok();
            }
            if let Some(max) = read(dir.join("pids.max")) {
                limits.pids = max.parse().ok();
            }
            if let Some(max) = read(dir.join("cpu.max")) {
                let (quota, period) = max.split_once(' ').unwrap();
                let (quota, period): (u64, u64) = (quota.parse().unwrap_or(0), period.parse().unwrap());
                limits.cpu_quota_per_100ms_us = Some(quota * 100_000 / period);
            }
        }
    }
    limits
}

fn parent_of(pid: i32) -> i32 {
    procs::parent(pid).expect("a live process")
}

/// Two sandboxes of one `serve`, and the paths and pids an escape from the first would go for.
struct Targets {
    serve: Serve,
    vmm: ProcInfo,
    vmm_dir: PathBuf,
    other: SandboxPids,
    other_dir: PathBuf,
}

fn two_sandboxes(s: &Scratch, args: &[&str]) -> Targets {
    let serve = Serve::with(s, &[], args);
    for id in ["a", "b"] {
        let out = serve.cli("create", &["--memory", "128", id]);
        assert!(out.status.success(), "create {id}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let dir = |id: &str| serve.sandbox(id);
    let mine = SandboxPids::read(&dir("a")).unwrap();
    let other = SandboxPids::read(&dir("b")).unwrap();
    let vmm = ProcInfo::read(mine.vmm.unwrap().pid).unwrap();
    Targets { vmm_dir: dir("a").join(SandboxFile::VmmRoot.name()), other_dir: dir("b"), vmm, other, serve }
}

/// A file placed among the host's libraries for one test, removed after.
struct HostLibraryCanary(PathBuf);

impl HostLibraryCanary {
    fn place() -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let path = PathBuf::from(format!("/usr/lib/vm-e2e-canary-{}-{nanos}", std::process::id()));
        std::fs::write(&path, b"canary").unwrap();
        Self(path)
    }
}

impl Drop for HostLibraryCanary {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs the escape probe as the VMM of `t` (its uid, gid, mount/IPC/UTS namespaces and root).
fn escape(t: &Targets, outside: &Path, jailed: bool) -> String {
    // World-readable, as the host's libraries are: only the jail's file list keeps it out of reach.
    let canary = HostLibraryCanary::place();
    let probe = PathBuf::from(env!("CARGO_BIN_EXE_escape-probe"));
    let placed = t.vmm_dir.join("escape-probe");
    std::fs::copy(&probe, &placed).unwrap();
    let st = status(t.vmm.pid);
    let (uid, gid) = (one_id(&field(&st, "Uid")), one_id(&field(&st, "Gid")));
    let seen_as = if jailed { PathBuf::from("/escape-probe") } else { placed.clone() };
    // A loopback listener of the host's, as the OTLP collector or a readiness endpoint would be.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = Command::new("nsenter")
        .args(["--target", &t.vmm.pid.to_string(), "--mount", "--ipc", "--uts", "--net", "--pid", "--root", "--wd"])
        .args(["--setuid", &uid.to_string(), "--setgid", &gid.to_string()])
        .arg(&seen_as)
        .arg(&t.serve.socket)
        .arg(t.other_dir.join(SandboxFile::Attach.name()))
        .arg(t.serve.child.id().to_string())
        .arg(t.other.supervisor.pid.to_string())
        .arg(t.other.vmm.unwrap().pid.to_string())
        .arg(outside)
        .arg(listener.local_addr().unwrap().to_string())
        .arg(&canary.0)
        .env_clear()
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "e2e: escape attempts as uid {uid} (jailed: {jailed}):\n{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the probe ran");
    assert_eq!(report.lines().count(), 9, "every attempt reported");
    report
}

fn assert_escape_fails(t: &Targets, outside: &Path) {
    let report = escape(t, outside, true);
    for line in report.lines() {
        assert!(line.contains(" denied: "), "an escaped VMM could: {line}");
    }
    assert!(!outside.exists(), "a file was written outside the jail");
}

#[test]
fn an_escape_from_a_jailed_vmm_reaches_nothing() {
    let s = Scratch::new("jail-escape");
    let t = two_sandboxes(&s, &[]);
    let uid = assert_jailed(t.vmm.pid);
    assert_ne!(uid, assert_jailed(t.other.vmm.unwrap().pid), "two sandboxes, two uids");
    assert_escape_fails(&t, &s.dir.join("escaped"));
    let caps = t.serve.cli("get", &["a"]);
    assert!(String::from_utf8_lossy(&caps.stdout).contains(" jail "), "list shows the confinement");
}

/// The same escape from the VMM of a `launch`, with a `serve` sandbox beside it as the target.
#[test]
fn an_escape_from_a_launched_vmm_reaches_nothing() {
    let s = Scratch::new("jail-escape-launch");
    let beside = Scratch::new("jail-escape-serve");
    let t = two_sandboxes(&beside, &[]);
    let launched = Running::start(Launch::sleeper(&s), &[], CANARY);
    let vmm = launched.procs().vmm;
    let uid = assert_jailed(vmm.pid);
    let dir = s.only_sandbox();
    let t = Targets { vmm, vmm_dir: dir.join(SandboxFile::VmmRoot.name()), ..t };
    assert_ne!(uid, assert_jailed(t.other.vmm.unwrap().pid), "a launch and a serve sandbox, two uids");
    assert_escape_fails(&t, &s.dir.join("escaped"));
}

/// Two sandboxes of a `serve` with templates, both restored from the template its first create made: their
/// jails hold a `/proc` (QEMU names its RAM memfd through it).
fn two_clones(s: &Scratch, controls: &[TestControl]) -> Targets {
    let serve = Serve::with_templates(s, controls, &[]);
    assert!(serve.cli("create", &["--memory", "128", "first"]).status.success());
    s.waiting_for("the template the first create makes");
    serve.wait_template(Duration::from_secs(180));
    for id in ["a", "b"] {
        let out = serve.cli("create", &["--memory", "128", id]);
        assert!(String::from_utf8_lossy(&out.stdout).contains(" template"), "{id} was not restored: {out:?}");
    }
    let mine = SandboxPids::read(&serve.sandbox("a")).unwrap();
    let other = SandboxPids::read(&serve.sandbox("b")).unwrap();
    let vmm = ProcInfo::read(mine.vmm.unwrap().pid).unwrap();
    Targets {
        vmm_dir: serve.sandbox("a").join(SandboxFile::VmmRoot.name()),
        other_dir: serve.sandbox("b"),
        vmm,
        other,
        serve,
    }
}

/// A template clone's VMM is jailed as a booted one is, and its `/proc` shows it none of the host's
/// processes: the same escape reaches nothing (`see-driver-process` among the attempts).
#[test]
fn an_escape_from_a_template_clones_vmm_reaches_nothing() {
    let s = Scratch::new("jail-escape-clone");
    let t = two_clones(&s, &[]);
    let uid = assert_jailed_with(t.vmm.pid, &["proc"]);
    assert_ne!(uid, assert_jailed_with(t.other.vmm.unwrap().pid, &["proc"]), "two clones, two uids");
    assert_escape_fails(&t, &s.dir.join("escaped"));
}

/// Control: a clone's `/proc` mounted without `hidepid=invisible,subset=pid` shows the escaped VMM the
/// driver's process (and every other of the host's).
#[test]
fn control_a_clones_proc_without_hidepid_shows_the_hosts_processes() {
    let s = Scratch::new("jail-escape-clone-ctl");
    let t = two_clones(&s, &[TestControl::JailProcShowsAll]);
    let report = escape(&t, &s.dir.join("escaped"), true);
    assert!(report.lines().any(|l| l == "see-driver-process ok"), "control: the driver was hidden: {report}");
}

/// Control: with `--confinement none`, the same probe, as the same VMM, gets everything.
#[test]
fn control_an_escape_from_an_unconfined_vmm_reaches_everything() {
    let s = Scratch::new("jail-escape-ctl");
    let t = two_sandboxes(&s, &["--confinement", "none"]);
    let outside = s.dir.join("escaped");
    let report = escape(&t, &outside, false);
    for line in report.lines() {
        assert!(line.ends_with(" ok"), "even unconfined, the VMM could not: {line}");
    }
    assert!(outside.exists());
    let events = events::text(t.vmm_dir.parent().unwrap());
    assert!(events.contains("VMM confinement: none (UNCONFINED"), "the sandbox's events say it is unconfined");
}

/// Events of every sandbox directory under `state`.
fn all_events(state: &Path) -> String {
    let mut text = String::new();
    for dir in std::fs::read_dir(state.join("sandboxes")).unwrap().flatten() {
        text.push_str(&events::text(&dir.path()));
    }
    text
}

/// A launch of a 256 MiB guest that fills 140 MiB of its memory (two tmpfs, the root and /run, each up to half
/// of it: the guest's pages become QEMU's), with no VMM memory beyond the guest's, and `flags`.
fn fill_guest_memory(s: &Scratch, flags: &[&str]) -> vm_test_support::Outcome {
    let fill = "dd if=/dev/zero of=/tmp/big bs=1M count=120 2>/dev/null; dd if=/dev/zero of=/run/big bs=1M count=40 \
                2>/dev/null; echo survived";
    let launch = Launch::new(s, &["/bin/sh", "-c", fill]);
    ["--memory", "256", "--vmm-memory-overhead", "0"].iter().chain(flags).fold(launch, |l, f| l.flag(f)).run()
}

/// With no room beyond its guest's memory (`--vmm-memory-overhead 0`), a VMM whose guest fills its memory
/// grows past its cgroup limit: it is killed, the launch fails, and the supervisor reports why.
#[test]
fn a_vmm_over_its_memory_limit_is_stopped_and_reported() {
    let s = Scratch::new("jail-memory");
    let out = fill_guest_memory(&s, &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("survived") && out.code != Some(0), "the VMM outgrew its limit unharmed: {stdout}");
    let events = all_events(&s.state());
    assert!(events.contains("vmm_limit") && events.contains("exceeded its memory limit"), "no finding:\n{events}");
    for p in out.seen.iter().filter(|p| p.is_qemu()) {
        assert!(!p.is_alive(), "the VMM outlived its launch");
    }
    eprintln!("e2e: a VMM over its memory limit: launch ended {:?}, finding reported", out.code);
}

/// A VMM refused a thread at its pids limit fails to start, and says why, under `serve`.
#[test]
fn a_vmm_at_its_pids_limit_is_refused_and_reported() {
    let s = Scratch::new("jail-pids");
    let serve = Serve::with(&s, &[], &["--vmm-pids-max", "2"]);
    let out = serve.cli("create", &["--cpus", "2", "--memory", "128", "p"]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "a VMM with 2 vCPUs started within 2 pids: {text}");
    assert!(text.contains("pids limit"), "the failure does not say why: {text}");
    let events = all_events(&serve.state);
    assert!(events.contains("vmm_limit") && events.contains("pids limit"), "no finding:\n{events}");
    eprintln!("e2e: a VMM at its pids limit: {}", text.lines().last().unwrap_or_default());
}

/// Control: with `--confinement none` there are no VMM cgroups, and the same guest fills its memory unharmed.
#[test]
fn control_without_the_jail_a_vmm_outgrows_the_same_limit() {
    let s = Scratch::new("jail-memory-ctl");
    let out = fill_guest_memory(&s, &["--confinement", "none"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("survived") && out.code == Some(0));
    let s = Scratch::new("jail-pids-ctl");
    let serve = Serve::with(&s, &[], &["--vmm-pids-max", "2", "--confinement", "none"]);
    let out = serve.cli("create", &["--cpus", "2", "--memory", "128", "p"]);
    assert!(out.status.success(), "unlimited, the VMM starts: {}", String::from_utf8_lossy(&out.stderr));
}

/// Not root: the driver says so, and each VMM gets a user namespace with the jail root (this host allows
/// unprivileged user namespaces; the test says which mode it saw).
#[test]
fn not_root_the_vmm_runs_in_a_user_namespace_and_the_driver_says_so() {
    use std::io::BufRead;
    let s = Scratch::new("jail-nonroot");
    let state = s.state();
    let mut driver = vm_test_support::launch_as_nobody(&s)
        .args(["--", "/bin/sh", "-c", "echo up; exec sleep 1000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(driver.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "up", "the unprivileged launch ran its workload");
    let vmm = procs::inside(&s.dir).into_iter().find(ProcInfo::is_qemu).expect("a VMM");
    let st = status(vmm.pid);
    let _ = driver.kill();
    let out = driver.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(one_id(&field(&st, "Uid")), vm_test_support::NOBODY, "the VMM runs as the driver's own uid");
    assert_eq!(field(&st, "CapEff"), "0000000000000000");
    assert_eq!(field(&st, "NoNewPrivs"), "1");
    assert_eq!(field(&st, "Seccomp"), "2");
    let events = all_events(&state);
    if stderr.contains("--confinement userns") {
        let theirs = std::fs::read_link(format!("/proc/{}/ns/user", vmm.pid)).ok();
        assert_ne!(theirs, std::fs::read_link("/proc/self/ns/user").ok(), "no user namespace");
        let theirs = std::fs::read_link(format!("/proc/{}/ns/pid", vmm.pid)).ok();
        assert_ne!(theirs, std::fs::read_link("/proc/self/ns/pid").ok(), "no PID namespace");
        assert_init_of_its_pid_namespace(&st);
        assert!(events.contains("VMM confinement: userns"), "{events}");
        eprintln!("e2e: not root: confinement userns (a user namespace and the jail root), said at start");
    } else {
        assert!(stderr.contains("UNCONFINED") && events.contains("VMM confinement: none"), "{stderr}\n{events}");
        eprintln!("e2e: not root and no user namespaces here: confinement none, said at start and in events");
    }
}

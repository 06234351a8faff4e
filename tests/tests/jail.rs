//! QEMU's confinement (`vm-jailer`), on real VMs: the VMM's credentials, root and limits as `/proc` shows
//! them, and a simulated escape (a process with the VMM's uid, gid, namespaces and root, entered with
//! `nsenter`) that is refused everything it tries, where with `--confinement none` (the control) it gets
//! everything.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use vm_contract::layout::SandboxFile;
use vm_contract::pids::SandboxPids;
use vm_e2e::procs::ProcInfo;
use vm_e2e::serve::Serve;
use vm_e2e::{Launch, Running, Scratch};

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

/// Checks everything `/proc` tells about a jailed VMM; returns its uid.
fn assert_jailed(vmm: i32) -> u32 {
    let st = status(vmm);
    let (uid, gid) = (one_id(&field(&st, "Uid")), one_id(&field(&st, "Gid")));
    let driver_uid = rustix::process::getuid().as_raw();
    assert!(uid != 0 && uid != driver_uid && gid != 0, "the VMM runs as {uid}:{gid}");
    assert_eq!(field(&st, "CapEff"), "0000000000000000");
    assert_eq!(field(&st, "CapPrm"), "0000000000000000");
    assert_eq!(field(&st, "CapBnd"), "0000000000000000");
    assert_eq!(field(&st, "NoNewPrivs"), "1");
    assert_eq!(field(&st, "Seccomp"), "2", "QEMU's seccomp filter is on");
    for ns in ["mnt", "ipc", "uts"] {
        let theirs = std::fs::read_link(format!("/proc/{vmm}/ns/{ns}")).unwrap();
        assert_ne!(theirs, std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap(), "{ns} namespace shared");
    }
    let root: BTreeSet<String> = std::fs::read_dir(format!("/proc/{vmm}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let expected: BTreeSet<String> =
        ["chan.sock", "console.sock", "dev", "initrd", "kernel", "lib", "lib64", "usr"].map(String::from).into();
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

#[test]
fn a_launched_vmm_runs_jailed() {
    let s = Scratch::new("jail-launch");
    let running = Running::start(Launch::new(&s, &["/bin/sh", "-c", "echo up; exec sleep 1000"]), &[], "up");
    let p = running.procs();
    let uid = assert_jailed(p.vmm.pid);
    let claims = std::fs::read_dir("/run/vm-driver-jail-ids").unwrap();
    assert!(claims.flatten().any(|c| c.file_name().to_string_lossy() == uid.to_string()), "the uid is claimed");
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
    let dir = |id: &str| serve.state.join("sandboxes").join(id);
    let mine = SandboxPids::read(&dir("a")).unwrap();
    let other = SandboxPids::read(&dir("b")).unwrap();
    let vmm = ProcInfo::read(mine.vmm.unwrap().pid).unwrap();
    Targets { vmm_dir: dir("a").join(SandboxFile::VmmRoot.name()), other_dir: dir("b"), vmm, other, serve }
}

/// Runs the escape probe as the VMM of `t` (its uid, gid, mount/IPC/UTS namespaces and root).
fn escape(t: &Targets, outside: &Path, jailed: bool) -> String {
    let probe = PathBuf::from(env!("CARGO_BIN_EXE_escape-probe"));
    let placed = t.vmm_dir.join("escape-probe");
    std::fs::copy(&probe, &placed).unwrap();
    let st = status(t.vmm.pid);
    let (uid, gid) = (one_id(&field(&st, "Uid")), one_id(&field(&st, "Gid")));
    let seen_as = if jailed { PathBuf::from("/escape-probe") } else { placed.clone() };
    let out = Command::new("nsenter")
        .args(["--target", &t.vmm.pid.to_string(), "--mount", "--ipc", "--uts", "--root", "--wd"])
        .args(["--setuid", &uid.to_string(), "--setgid", &gid.to_string()])
        .arg(&seen_as)
        .arg(&t.serve.socket)
        .arg(t.other_dir.join(SandboxFile::Attach.name()))
        .arg(t.serve.child.id().to_string())
        .arg(t.other.supervisor.pid.to_string())
        .arg(t.other.vmm.unwrap().pid.to_string())
        .arg(outside)
        .env_clear()
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "e2e: escape attempts as uid {uid} (jailed: {jailed}):\n{report}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the probe ran");
    assert_eq!(report.lines().count(), 6, "every attempt reported");
    report
}

#[test]
fn an_escape_from_a_jailed_vmm_reaches_nothing() {
    let s = Scratch::new("jail-escape");
    let t = two_sandboxes(&s, &[]);
    let uid = assert_jailed(t.vmm.pid);
    assert_ne!(uid, assert_jailed(t.other.vmm.unwrap().pid), "two sandboxes, two uids");
    let outside = s.dir.join("escaped");
    let report = escape(&t, &outside, true);
    for line in report.lines() {
        assert!(line.contains(" denied: "), "an escaped VMM could: {line}");
    }
    assert!(!outside.exists(), "a file was written outside the jail");
    let caps = t.serve.cli("get", &["a"]);
    assert!(String::from_utf8_lossy(&caps.stdout).contains(" jail "), "list shows the confinement");
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
    let events = std::fs::read_to_string(t.vmm_dir.parent().unwrap().join(SandboxFile::Events.name())).unwrap();
    assert!(events.contains("VMM confinement: none (UNCONFINED"), "the sandbox's events say it is unconfined");
}

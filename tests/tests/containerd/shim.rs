//! `ctr run --runtime io.containerd.vmdriver.v2` of an image containerd pulled from the tests'
//! `docker-registry`: each task is a real microVM (its kernel is the guest's, not the host's), stdio and exit
//! statuses are exact, a spec that reaches past the VM is refused with nothing left running, `ctr task exec`
//! and `kill` work, a task outlives containerd's restart, and a killed shim takes its VM with it.

use std::process::Command;
use std::time::Duration;

use vm_test_support::containerd::{Containerd, RUNTIME};
use vm_test_support::output::text;
use vm_test_support::procs::{self, ProcInfo};
use vm_test_support::{gone_within, harness, wait_until, Scratch};

/// The VMMs of the shim's sandboxes: children of supervisors working in the shim's state directory.
pub(super) fn vmms(containerd: &Containerd) -> Vec<ProcInfo> {
    procs::inside(&containerd.vm_state).into_iter().filter(ProcInfo::is_qemu).collect()
}

pub(super) fn report_accel(containerd: &Containerd) {
    let accel = vmms(containerd).first().and_then(ProcInfo::accel).unwrap_or_else(|| "none seen".into());
    eprintln!("e2e: accelerator used: {accel} (requested {})", harness().accel);
}

/// The shim's sandboxes that have not ended (no tombstone).
pub(super) fn live_sandboxes(containerd: &Containerd) -> usize {
    let Ok(dirs) = std::fs::read_dir(containerd.vm_state.join("sandboxes")) else { return 0 };
    dirs.flatten().filter(|d| !d.path().join(vm_contract::layout::SandboxFile::Tombstone.name()).exists()).count()
}

/// `vm-driver audit ACTION --state-dir STATE ID`: its exit code and output.
fn audit(containerd: &Containerd, action: &str, id: &str) -> (Option<i32>, String) {
    let out = Command::new(&harness().shipped.driver)
        .args(["audit", action, "--state-dir"])
        .arg(&containerd.vm_state)
        .arg(id)
        .output()
        .unwrap();
    (out.status.code(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The id of the shim's sandbox whose record holds `needle`.
fn sandbox_with(containerd: &Containerd, needle: &str) -> String {
    let dirs = std::fs::read_dir(containerd.vm_state.join("sandboxes")).unwrap();
    let found = dirs.flatten().find(|d| vm_test_support::events::text(&d.path()).contains(needle));
    found.expect("a sandbox whose record names the task's command").file_name().to_string_lossy().into_owned()
}

#[test]
fn ctr_runs_a_registry_image_in_a_microvm_with_exact_stdio_and_exit_status() {
    let s = Scratch::new("ctr-run");
    let containerd = Containerd::start(&s.dir);
    let busybox = containerd.pull_busybox(&s.dir);
    let image = busybox.reference.clone();
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();

    s.waiting_for("ctr run of sh");
    let script = "echo out; echo err >&2; uname -r; pwd; echo \"$GREETING\"; ulimit -Hn; \
                  head -c 2097152 /dev/zero > /scratch/f 2>/dev/null; wc -c < /scratch/f; exit 7";
    let tmpfs = "type=tmpfs,src=tmpfs,dst=/scratch,options=size=1m:nosuid";
    let args = [
        "run",
        "--rm",
        "--runtime",
        RUNTIME,
        "--cwd",
        "/bin",
        "--env",
        "GREETING=hello vm",
        "--mount",
        tmpfs,
        &image,
        "t1",
    ];
    let out = containerd.ctr(&[&args[..], &["/bin/sh", "-c", script]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(out.status.code(), Some(7), "the workload's exit status: {}", text(&out));
    assert_eq!(lines.len(), 6, "{stdout}");
    assert_eq!((lines[0], lines[2], lines[3]), ("out", "/bin", "hello vm"), "{stdout}");
    // containerd's default spec sets RLIMIT_NOFILE to 1024 (the guest's own hard limit is 4096).
    assert_eq!(lines[4], "1024", "the spec's rlimits reach the process: {stdout}");
    assert_eq!(lines[5].trim(), "1048576", "the spec's 1 MiB tmpfs took 1 MiB of the 2 written: {stdout}");
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), "err", "stderr apart from stdout");
    assert_ne!(lines[1], host_kernel.trim(), "the task ran on the host's kernel, not in a VM");
    eprintln!("e2e: the task's kernel {} (the host's {})", lines[1], host_kernel.trim());

    // The task's record outlives it: its OCSF events and a sealed audit chain, in the shim's state directory.
    let id = sandbox_with(&containerd, "echo out; echo err");
    let (code, verified) = audit(&containerd, "verify", &id);
    assert!(code == Some(0) && verified.contains("sealed at entry"), "the chain: {verified}");
    let (_, shown) = audit(&containerd, "show", &id);
    assert!(shown.contains(&format!("process {id}/1 launched: /bin/sh -c echo out")), "{shown}");

    // The image's disk is made once and kept for the next task of it (docs/kubernetes.md).
    let kept_disk = || {
        let dir = containerd.vm_state.join("containerd-roots");
        let disks: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(disks.len(), 1, "one kept disk for busybox: {disks:?}");
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&disks[0]).unwrap())
    };
    let made = kept_disk();

    s.waiting_for("ctr run -t, on a terminal");
    let line = format!(
        "ctr --address {} --namespace e2e run --rm -t --runtime {RUNTIME} {image} tt /bin/sh -c 'tty; exit 5'",
        containerd.socket.display()
    );
    let out = Command::new("script").args(["-qec", &line, "/dev/null"]).output().unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("/dev/pts/"), "on a terminal: {}", text(&out));

    s.waiting_for("ctr run of cat, stdin from ctr");
    let out =
        containerd.ctr_with_stdin(&["run", "--rm", "--runtime", RUNTIME, &image, "t2", "cat"], b"line one\nline two\n");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "line one\nline two\n");
    assert_eq!(kept_disk(), made, "the later tasks booted the disk made for the first");

    s.waiting_for("a task killed by a signal");
    let out = containerd.ctr(&["run", "--rm", "--runtime", RUNTIME, &image, "t3", "/bin/sh", "-c", "kill -TERM $$"]);
    assert_eq!(out.status.code(), Some(128 + 15), "a signal's death as containerd reports it: {}", text(&out));

    s.waiting_for("refused specs");
    for (extra, why) in [(&["--privileged"][..], "privileged"), (&["--net-host"][..], "network namespace")] {
        let out =
            containerd.ctr(&[&["run", "--rm", "--runtime", RUNTIME][..], extra, &[&image, "bad", "true"]].concat());
        assert!(!out.status.success() && text(&out).contains(why), "{extra:?} refused: {}", text(&out));
    }
    let out = containerd.ctr(&["run", "--rm", "--runtime", RUNTIME, &image, "t4", "/no/such/program"]);
    assert!(!out.status.success(), "a missing program fails: {}", text(&out));
    eprintln!("e2e: a missing program: {}", text(&out).trim());

    let tasks = containerd.ctr(&["task", "ls", "-q"]);
    assert_eq!(String::from_utf8_lossy(&tasks.stdout).trim(), "", "no task left");
    assert!(wait_until(Duration::from_secs(30), || vmms(&containerd).is_empty()), "no VM left");
    assert!(wait_until(Duration::from_secs(30), || live_sandboxes(&containerd) == 0), "every sandbox ended");
    let gone = wait_until(Duration::from_secs(30), || containerd.shims().is_empty());
    assert!(gone, "no shim left: {:?}", containerd.shims());
}

#[test]
fn a_task_outlives_containerds_restart_and_its_vm_dies_with_its_shim() {
    let s = Scratch::new("ctr-restart");
    let mut containerd = Containerd::start(&s.dir);
    let busybox = containerd.pull_busybox(&s.dir);
    let image = busybox.reference.clone();

    s.waiting_for("a detached task");
    let out = containerd.ctr(&["run", "-d", "--runtime", RUNTIME, &image, "long", "sleep", "600"]);
    assert!(out.status.success(), "{}", text(&out));
    report_accel(&containerd);
    let out = containerd.ctr(&["task", "exec", "--exec-id", "e1", "long", "/bin/sh", "-c", "echo in-vm; exit 3"]);
    assert_eq!((out.status.code(), String::from_utf8_lossy(&out.stdout).trim()), (Some(3), "in-vm"), "{}", text(&out));

    s.waiting_for("containerd's restart");
    let shims = containerd.shims();
    assert_eq!(shims.len(), 1, "one shim for the task: {shims:?}");
    containerd.restart();
    let listed = containerd.ctr(&["task", "ls"]);
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(listed.lines().any(|l| l.starts_with("long") && l.contains("RUNNING")), "after the restart: {listed}");
    let out = containerd.ctr(&["task", "exec", "--exec-id", "e2", "long", "echo", "reconnected"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "reconnected", "{}", text(&out));
    // Stats: what the VM costs the node, the VMM's memory and CPU time (docs/kubernetes.md).
    let out = containerd.ctr(&["task", "metrics", "long"]);
    let metrics = String::from_utf8_lossy(&out.stdout).into_owned();
    let value = |name: &str| -> u64 {
        let line = metrics.lines().find(|l| l.split_whitespace().next() == Some(name));
        line.and_then(|l| l.split_whitespace().nth(1)?.parse().ok()).unwrap_or(0)
    };
    assert!(value("memory.usage_in_bytes") > 16 << 20, "a booted VM's memory: {}", text(&out));
    assert!(value("cpuacct.usage") > 0, "a booted VM's CPU time: {}", text(&out));

    s.waiting_for("a SIGTERM through ctr task kill");
    let out = containerd.ctr(&["run", "-d", "--runtime", RUNTIME, &image, "killed", "sleep", "600"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(containerd.ctr(&["task", "kill", "killed"]).status.success());
    let stopped = wait_until(Duration::from_secs(60), || {
        String::from_utf8_lossy(&containerd.ctr(&["task", "ls"]).stdout)
            .lines()
            .any(|l| l.starts_with("killed") && l.contains("STOPPED"))
    });
    assert!(stopped, "killed: {}", String::from_utf8_lossy(&containerd.ctr(&["task", "ls"]).stdout));
    assert!(containerd.ctr(&["task", "delete", "killed"]).status.success());

    s.waiting_for("the shim's death");
    let vms = vmms(&containerd);
    assert_eq!(vms.len(), 1, "the long task's VM: {vms:?}");
    let shim = containerd.shims().into_iter().next().expect("the long task's shim");
    procs::signal(shim.pid, nix::sys::signal::Signal::SIGKILL);
    assert!(gone_within(&vms[0], Duration::from_secs(5)), "the VM outlived its shim by 5 s");
    let cleaned = wait_until(Duration::from_secs(60), || {
        !String::from_utf8_lossy(&containerd.ctr(&["task", "ls"]).stdout).lines().any(|l| l.contains("RUNNING"))
    });
    assert!(cleaned, "containerd still shows the task running: {}", containerd.log());
}

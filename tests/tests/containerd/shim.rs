//! `ctr run --runtime io.containerd.vmdriver.v2` of an image containerd pulled from the tests'
//! `docker-registry`: each task is a real microVM (its kernel is the guest's, not the host's), stdio and exit
//! statuses are exact, a spec that reaches past the VM is refused with nothing left running, `ctr task exec`
//! and `kill` work, a task outlives containerd's restart, and a killed shim takes its VM with it.

use std::path::Path;
use std::time::Duration;

use vm_test_support::containerd::{Containerd, RUNTIME};
use vm_test_support::output::text;
use vm_test_support::procs::{self, ProcInfo};
use vm_test_support::registry::{umoci_image, Registry};
use vm_test_support::{gone_within, harness, wait_until, Scratch};

/// The guest image's static busybox (Debian's `busybox-static`, pinned by `images/pins.json`).
fn busybox() -> Vec<u8> {
    let initramfs = std::fs::read(harness().image.join("initramfs.cpio")).unwrap();
    let entries = vm_test_support::image::read_cpio(&initramfs);
    let found = entries.into_iter().find(|e| e.path == "bin/busybox").expect("bin/busybox in the guest image");
    match found.kind {
        vm_image::cpio::Kind::File(bytes) => bytes,
        other => panic!("bin/busybox is not a file: {other:?}"),
    }
}

/// A busybox image (the guest's static busybox and its applets' links), pushed to a registry and pulled
/// by containerd; returns its reference.
fn pulled_image(s: &Scratch, containerd: &Containerd) -> (Registry, String) {
    let registry = Registry::start(&s.dir.join("registry"), None);
    let busybox = busybox();
    let layout = umoci_image(
        &s.dir,
        "busybox",
        &[&|root: &Path| {
            let bin = root.join("bin");
            std::fs::create_dir_all(&bin).unwrap();
            std::fs::write(bin.join("busybox"), &busybox).unwrap();
            std::fs::set_permissions(bin.join("busybox"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
            for applet in ["sh", "echo", "cat", "sleep", "true", "uname", "tty", "env", "pwd"] {
                std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
            }
        }],
        &["--config.env=PATH=/bin", "--config.cmd=/bin/sh"],
    );
    let reference = registry.push(&format!("oci:{}:busybox", layout.display()), "e2e/busybox:1");
    // containerd takes a loopback registry for a plain-HTTP one unless its hosts file says otherwise.
    let host = reference.split('/').next().unwrap();
    let hosts = s.dir.join("certs.d");
    std::fs::create_dir_all(hosts.join(host)).unwrap();
    let toml = format!(
        "server = \"https://{host}\"\n[host.\"https://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"{}\"\n",
        registry.ca.display()
    );
    std::fs::write(hosts.join(host).join("hosts.toml"), toml).unwrap();
    let out = containerd.ctr(&["images", "pull", "--hosts-dir", hosts.to_str().unwrap(), &reference]);
    assert!(out.status.success(), "ctr pull: {}", text(&out));
    (registry, reference)
}

/// The VMMs of the shim's sandboxes: children of supervisors working in the shim's state directory.
fn vmms(containerd: &Containerd) -> Vec<ProcInfo> {
    procs::inside(&containerd.vm_state).into_iter().filter(ProcInfo::is_qemu).collect()
}

fn report_accel(containerd: &Containerd) {
    let accel = vmms(containerd).first().and_then(ProcInfo::accel).unwrap_or_else(|| "none seen".into());
    eprintln!("e2e: accelerator used: {accel} (requested {})", harness().accel);
}

fn sandboxes(containerd: &Containerd) -> usize {
    std::fs::read_dir(containerd.vm_state.join("sandboxes")).map_or(0, |d| d.count())
}

#[test]
fn ctr_runs_a_registry_image_in_a_microvm_with_exact_stdio_and_exit_status() {
    let s = Scratch::new("ctr-run");
    let containerd = Containerd::start(&s.dir);
    let (_registry, image) = pulled_image(&s, &containerd);
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();

    s.waiting_for("ctr run of sh");
    let script = "echo out; echo err >&2; uname -r; pwd; echo \"$GREETING\"; exit 7";
    let args = ["run", "--rm", "--runtime", RUNTIME, "--cwd", "/bin", "--env", "GREETING=hello vm", &image, "t1"];
    let out = containerd.ctr(&[&args[..], &["/bin/sh", "-c", script]].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(out.status.code(), Some(7), "the workload's exit status: {}", text(&out));
    assert_eq!(lines.len(), 4, "{stdout}");
    assert_eq!((lines[0], lines[2], lines[3]), ("out", "/bin", "hello vm"), "{stdout}");
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), "err", "stderr apart from stdout");
    assert_ne!(lines[1], host_kernel.trim(), "the task ran on the host's kernel, not in a VM");
    eprintln!("e2e: the task's kernel {} (the host's {})", lines[1], host_kernel.trim());

    s.waiting_for("ctr run of cat, stdin from ctr");
    let out =
        containerd.ctr_with_stdin(&["run", "--rm", "--runtime", RUNTIME, &image, "t2", "cat"], b"line one\nline two\n");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "line one\nline two\n");

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
    assert!(wait_until(Duration::from_secs(30), || sandboxes(&containerd) == 0), "no sandbox left");
    let gone = wait_until(Duration::from_secs(30), || containerd.shims().is_empty());
    assert!(gone, "no shim left: {:?}", containerd.shims());
}

#[test]
fn a_task_outlives_containerds_restart_and_its_vm_dies_with_its_shim() {
    let s = Scratch::new("ctr-restart");
    let mut containerd = Containerd::start(&s.dir);
    let (_registry, image) = pulled_image(&s, &containerd);

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

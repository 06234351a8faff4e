//! `vm-driver doctor` on this host, against what a real launch gets here; its failures where no sandbox
//! could start; and a launch in a plain chroot (whose `/` is a directory, not a mount point), refused fast
//! with its fix, where the same chroot runs a sandbox without the jail.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use vm_e2e::{harness, Launch, Scratch};

fn doctor(s: &Scratch, args: &[&str], env: &[(&str, &str)]) -> (Output, String) {
    let h = harness();
    let out = Command::new(&h.build(&[]).driver)
        .arg("doctor")
        .arg("--state-dir")
        .arg(s.state())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("e2e: vm-driver doctor {args:?} (exit {:?}):\n{text}", out.status.code());
    (out, text)
}

fn line<'a>(report: &'a str, topic: &str) -> &'a str {
    report.lines().find(|l| l.get(6..).is_some_and(|rest| rest.starts_with(topic))).unwrap_or_default()
}

#[test]
fn the_doctor_names_what_a_launch_here_gets() {
    let s = Scratch::new("doctor");
    let h = harness();
    let (out, report) = doctor(&s, &["--image", h.image.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(0), "a sandbox can start here");
    // The accelerator: what `auto` resolves to in a real launch, with the same reason.
    let launched = Launch::new(&s, &["true"]).accel("auto").run();
    assert_eq!(launched.code, Some(0));
    let stderr = String::from_utf8_lossy(&launched.stderr).into_owned();
    let said = stderr.lines().find_map(|l| l.split_once("using TCG software emulation: ").map(|(_, r)| r.to_owned()));
    let accel = line(&report, "accelerator");
    match said {
        Some(reason) => {
            assert!(accel.starts_with("warn") && accel.contains("TCG") && accel.contains(&reason), "{accel}")
        }
        None => assert!(accel.starts_with("ok") && accel.contains("KVM"), "{accel}"),
    }
    assert!(line(&report, "confinement").contains("jail: root"), "as root, the full jail");
    let cgroups = line(&report, "cgroups");
    assert!(cgroups.contains("cgroup v1") || cgroups.contains("cgroup v2"), "the cgroup mode: {cgroups}");
    assert!(line(&report, "mounts").contains("/ is a mount point"));
    assert!(line(&report, "qemu").contains("QEMU emulator version"));
    for (topic, needs) in [("images", "--image"), ("disks", "--disk"), ("files", "--mount"), ("egress", "resolver")] {
        assert!(line(&report, topic).contains(needs), "{topic} says what it serves");
    }
}

#[test]
fn the_doctor_fails_where_no_sandbox_could_start() {
    let s = Scratch::new("doctor-fails");
    let (out, report) = doctor(&s, &["--image", "/nonexistent"], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(line(&report, "boot image").starts_with("FAIL"));
    assert!(report.contains("fix: build it with scripts/build-image"));
    let (out, report) = doctor(&s, &[], &[("PATH", "/nonexistent")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(line(&report, "qemu").starts_with("FAIL"), "no QEMU on PATH");
}

/// A chroot of the host's whole tree in a private mount namespace: every top-level directory bound in,
/// every top-level symlink copied, the chroot's directory itself not a mount point.
const CHROOT: &str = r#"set -e
dir=$1; shift
mkdir -p "$dir"
for entry in /*; do
    name=${entry#/}
    if [ -L "$entry" ]; then cp -P "$entry" "$dir/$name"
    elif [ -d "$entry" ]; then mkdir -p "$dir/$name"; mount --rbind "$entry" "$dir/$name"
    fi
done
exec chroot "$dir" "$@""#;

fn in_chroot(s: &Scratch, launch: &Command) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", CHROOT, "sh"])
        .arg(s.dir.join("chroot"))
        .arg(launch.get_program())
        .args(launch.get_args())
        .output()
        .unwrap();
    (out, start.elapsed())
}

#[test]
fn in_a_chroot_a_jailed_launch_is_refused_fast_with_its_fix_and_an_unjailed_one_runs() {
    let s = Scratch::new("doctor-chroot");
    let (out, took) = in_chroot(&s, &Launch::new(&s, &["echo", "in-chroot"]).command());
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("e2e: a jailed launch in a chroot, after {took:?}: {stderr}");
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr.contains("/ is not a mount point") && stderr.contains("mount --bind DIR DIR"), "{stderr}");
    assert!(took < Duration::from_secs(5), "refused before a boot: {took:?}");
    let sandboxes = std::fs::read_dir(s.state().join("sandboxes")).map(|d| d.count()).unwrap_or(0);
    assert_eq!(sandboxes, 0, "nothing started");
    // The same chroot runs a sandbox without the jail: the refusal is the mount check's, not a broken root.
    let (out, took) =
        in_chroot(&s, &Launch::new(&s, &["echo", "in-chroot"]).flag("--confinement").flag("none").command());
    eprintln!("e2e: an unjailed launch in the chroot, after {took:?}: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("in-chroot"));
    // The doctor there says so too.
    let h = harness();
    let mut doctor = Command::new(&h.build(&[]).driver);
    doctor.args(["doctor", "--image"]).arg(&h.image).arg("--state-dir").arg(s.state());
    let (out, _) = in_chroot(&s, &doctor);
    let report = String::from_utf8_lossy(&out.stdout);
    eprintln!("e2e: vm-driver doctor in the chroot:\n{report}");
    assert_eq!(out.status.code(), Some(1));
    assert!(line(&report, "mounts").starts_with("FAIL"));
}

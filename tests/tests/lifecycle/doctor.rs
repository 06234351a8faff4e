//! `vm-driver doctor` on this host, against what a real launch gets here; its failures where no sandbox
//! could start; and a jailed launch with a host directory in a chroot of both shapes (a plain directory, and
//! a directory bound onto itself, whose `/` is a mount point and which the kernel counts chrooted all the
//! same), where no mount of the jail may reach the chroot's host (control: `jail-chroot-shared-mounts`).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use vm_contract::chroot::Root;
use vm_test_support::{events, harness, Launch, Scratch, TestControl};

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
    let expected = match Root::of_this_process() {
        Root::Namespace => "the mount namespace's root",
        Root::Directory => "/ is not a mount point (a chroot)",
        Root::Mount { .. } => "but not the mount namespace's root",
        Root::Unknown(_) => "cannot be told",
    };
    assert!(line(&report, "mounts").contains(expected), "the doctor sees this host as it is: {expected}");
    assert!(line(&report, "qemu").contains("QEMU emulator version"));
    assert!(line(&report, "cache directory").starts_with("ok"), "the image cache is ours and not writable by others");
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

/// A chroot of the host's whole tree in a mount namespace of its own: every top-level directory bound in,
/// every top-level symlink copied; the chroot's directory bound onto itself first when the second argument
/// is `bound`. The namespace's mounts are shared among themselves (and slaves of the host's, so nothing
/// reaches the host): a mount the jail let propagate would appear here. Prints `mounts: BEFORE AFTER` on
/// stderr around the command.
const CHROOT: &str = r#"set -e
dir=$1; shape=$2; shift 2
mount --make-rshared /
mkdir -p "$dir"
if [ "$shape" = bound ]; then mount --bind "$dir" "$dir"; fi
for entry in /*; do
    name=${entry#/}
    if [ -L "$entry" ]; then cp -P "$entry" "$dir/$name"
    elif [ -d "$entry" ]; then mkdir -p "$dir/$name"; mount --rbind "$entry" "$dir/$name"
    fi
done
before=$(wc -l < /proc/self/mountinfo)
status=0
chroot "$dir" "$@" || status=$?
echo "mounts: $before $(wc -l < /proc/self/mountinfo)" >&2
exit $status"#;

/// The two shapes of a chroot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// A plain directory: `/` is no mount point.
    Directory,
    /// A directory bound onto itself (schroot-style): `/` is a mount point, and not the namespace's root.
    Bound,
}

/// Whether this test host is itself a plain chroot (`/` not a mount point). There every jailed VM of the
/// suite already takes the chroot path, and no nested chroot can be built safely: its mounts could not be
/// kept from the real host's.
fn host_is_a_chroot() -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    vm_contract::jail::root_mount_line(&info).is_none()
}

/// On a host that is itself a chroot: runs `command` here and counts this namespace's mounts around it.
const HERE: &str = r#"before=$(wc -l < /proc/self/mountinfo)
status=0
"$@" || status=$?
echo "mounts: $before $(wc -l < /proc/self/mountinfo)" >&2
exit $status"#;

/// Runs `command` in the chroot (this host itself, when it is one): its output, how long it took, and
/// the mount counts around it.
fn in_chroot(s: &Scratch, shape: Shape, command: &Command) -> (Output, Duration, (usize, usize)) {
    let start = Instant::now();
    let mut wrapper = Command::new("unshare");
    if host_is_a_chroot() {
        wrapper = Command::new("sh");
        wrapper.args(["-c", HERE, "sh"]);
    } else {
        let shape = if shape == Shape::Bound { "bound" } else { "directory" };
        wrapper
            .args(["--mount", "--propagation", "slave", "sh", "-c", CHROOT, "sh"])
            .arg(s.dir.join("chroot"))
            .arg(shape);
    }
    let out = wrapper
        .arg(command.get_program())
        .args(command.get_args())
        .envs(command.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let counts = stderr.lines().find_map(|l| l.strip_prefix("mounts: ")).unwrap_or_default();
    let counts: Vec<usize> = counts.split(' ').filter_map(|n| n.parse().ok()).collect();
    assert_eq!(counts.len(), 2, "the script counted the mounts: {stderr}");
    (out, start.elapsed(), (counts[0], counts[1]))
}

/// A jailed sandbox in a plain chroot, with a host directory (its file server's jail too): it runs, reads
/// the directory, and no mount of either jail appears in the chroot's host.
#[test]
fn in_a_chroot_a_jailed_sandbox_runs_and_no_mount_of_its_jail_leaks() {
    jailed_launch_in(Shape::Directory);
}

/// The same in a chroot bound onto itself: its `/` is a mount point, and the kernel still refuses the file
/// server's jail a user namespace unless the jail first makes the chroot its namespace's root.
#[test]
fn in_a_chroot_bound_onto_itself_a_jailed_sandbox_with_a_host_directory_runs() {
    if host_is_a_chroot() {
        eprintln!("e2e: this host is itself a plain chroot: the bound shape is run where / is a mount point");
        return;
    }
    jailed_launch_in(Shape::Bound);
}

fn jailed_launch_in(shape: Shape) {
    let s = Scratch::new(if shape == Shape::Bound { "doctor-bound" } else { "doctor-chroot" });
    let shared = s.dir.join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::write(shared.join("hello"), "in-chroot\n").unwrap();
    let mount = format!("type=bind,src={},dst=/data,readonly", shared.display());
    let launch = Launch::new(&s, &["cat", "/data/hello"]).flag("--id").flag("chrooted").flag("--mount").flag(&mount);
    let (out, took, (before, after)) = in_chroot(&s, shape, &launch.command());
    eprintln!(
        "e2e: a jailed launch in a chroot ({shape:?}), after {took:?}, mounts {before} -> {after}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("in-chroot"));
    let events = events::text(&s.sandbox("chrooted"));
    assert!(events.contains("VMM confinement: jail"), "jailed, not unconfined");
    assert_eq!(before, after, "no mount of the jail reached the chroot's host");
    // The doctor there says what it sees.
    let h = harness();
    let mut doctor = Command::new(&h.build(&[]).driver);
    doctor.args(["doctor", "--image"]).arg(&h.image).arg("--state-dir").arg(s.state());
    let (out, _, _) = in_chroot(&s, shape, &doctor);
    let report = String::from_utf8_lossy(&out.stdout);
    eprintln!("e2e: vm-driver doctor in the chroot:\n{report}");
    assert_eq!(out.status.code(), Some(0));
    let mounts = line(&report, "mounts");
    match shape {
        Shape::Directory => assert!(mounts.contains("not a mount point (a chroot)"), "{mounts}"),
        // PID 1 is outside the test's mount namespace, so the doctor cannot tell; the jail checks itself.
        Shape::Bound => assert!(
            mounts.contains("/ is a mount point")
                && (mounts.contains("not the mount namespace's root") || mounts.contains("cannot be told")),
            "{mounts}"
        ),
    }
}

/// Control: without making the mounts private before the chroot is bound onto itself, that bind (with
/// everything mounted in the chroot) propagates to the chroot's host.
#[test]
fn control_in_a_chroot_a_bind_made_before_the_mounts_are_private_leaks() {
    if host_is_a_chroot() {
        // Its leak would be a bind of this whole chroot, onto the real host's tree.
        eprintln!("e2e: CONTROL NOT RUN: this host is itself a chroot; the control runs where / is a mount point");
        return;
    }
    let s = Scratch::new("doctor-chroot-ctl");
    let launch = Launch::new(&s, &["echo", "in-chroot"]).control(TestControl::JailChrootSharedMounts);
    let (out, _, (before, after)) = in_chroot(&s, Shape::Directory, &launch.command());
    eprintln!("e2e: control: mounts {before} -> {after}: {}", String::from_utf8_lossy(&out.stderr));
    assert!(after > before + 10, "the jail's binds appeared in the chroot's host: {before} -> {after}");
}

//! Host directories in real sandboxes (`--mount`, virtiofs through a confined `virtiofsd` per mount): a
//! read-only mount is readable and refuses writes while a read-write one is shared both ways, live; a
//! symlink in the directory never leads the guest out of it, while the same link followed on the host does
//! (the control); the server sees only its directory, as the directory's owner, and dies with the
//! supervisor, which the `share-no-death-signal` control shows it would not; no set-id file reaches the
//! host (the `share-allows-setid` control shows one would); bad mounts are refused before anything starts.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal::{SIGKILL, SIGSTOP};
use vm_test_support::image::with_init_that_never_stops;
use vm_test_support::output::ok;
use vm_test_support::procs::{signal, ProcInfo};
use vm_test_support::serve::{Serve, STATE_WAIT};
use vm_test_support::{events, gone_within, survives, wait_until, Launch, Running, Scratch, TestControl, CANARY};

/// The host owner of the shared directories (no such user needs to exist).
const OWNER: u32 = 4242;

fn root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A directory owned by [`OWNER`] when the tests run as root (a read-write mount of a root-owned one is
/// refused), by the test's own user otherwise.
fn owned_dir(path: &Path) -> PathBuf {
    std::fs::create_dir_all(path).unwrap();
    if root() {
        std::os::unix::fs::chown(path, Some(OWNER), Some(OWNER)).unwrap();
    }
    path.to_owned()
}

fn expected_owner() -> u32 {
    if root() {
        OWNER
    } else {
        rustix::process::geteuid().as_raw()
    }
}

fn mount_flag(src: &Path, dst: &str, readonly: bool) -> String {
    format!("--mount=type=bind,src={},dst={dst}{}", src.display(), if readonly { ",readonly" } else { "" })
}

fn is_server(p: &ProcInfo) -> bool {
    p.comm == "virtiofsd"
}

#[test]
fn a_read_only_mount_refuses_writes_and_a_read_write_one_is_shared_both_ways_while_it_runs() {
    let s = Scratch::new("mounts-rw");
    let ro = owned_dir(&s.dir.join("ro"));
    std::fs::write(ro.join("data.txt"), "from-the-host\n").unwrap();
    let rw = owned_dir(&s.dir.join("rw"));
    let script = "cat /data/data.txt; \
        echo x > /data/data.txt && echo RO-WRITTEN; touch /data/new && echo RO-CREATED; \
        echo from-the-guest > /work/guest.txt && mkdir /work/sub && echo deep > /work/sub/f; \
        i=0; while [ ! -e /work/host.txt ] && [ $i -lt 120 ]; do sleep 1; i=$((i+1)); done; \
        cat /work/host.txt; mount | grep virtiofs";
    // The host answers the guest's file with one of its own while the VM runs: shared, not copied.
    let watched = rw.clone();
    let answer = std::thread::spawn(move || {
        let seen = wait_until(Duration::from_secs(120), || watched.join("guest.txt").exists());
        std::fs::write(watched.join("host.txt"), "live-from-the-host\n").unwrap();
        seen
    });
    let out = Launch::new(&s, &["sh", "-c", script])
        .flag(&mount_flag(&ro, "/data", true))
        .flag(&mount_flag(&rw, "/work", false))
        .run();
    assert!(answer.join().unwrap(), "the guest's file appeared on the host while the VM ran");
    let stdout = out.stdout_text();
    assert_eq!(out.code, Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("from-the-host\n"), "{stdout}");
    assert!(!stdout.contains("RO-WRITTEN") && !stdout.contains("RO-CREATED"), "{stdout}");
    assert!(out.workload_stderr().contains("Read-only file system"), "{}", out.workload_stderr());
    assert!(stdout.contains("live-from-the-host"), "the host's write was seen in the guest: {stdout}");
    assert!(stdout.contains("on /data type virtiofs (ro,nosuid,nodev"), "{stdout}");
    assert!(stdout.contains("on /work type virtiofs (rw,nosuid,nodev"), "{stdout}");

    assert_eq!(std::fs::read_to_string(ro.join("data.txt")).unwrap(), "from-the-host\n");
    assert!(!ro.join("new").exists());
    assert_eq!(std::fs::read_to_string(rw.join("guest.txt")).unwrap(), "from-the-guest\n");
    assert_eq!(std::fs::read_to_string(rw.join("sub/f")).unwrap(), "deep\n");
    for made in ["guest.txt", "sub", "sub/f"] {
        let meta = std::fs::metadata(rw.join(made)).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (expected_owner(), expected_owner()), "{made} belongs to the owner");
    }
    assert_eq!(out.seen.iter().filter(|p| is_server(p)).count(), 2, "one file server per mount");
    out.assert_nothing_left();
}

#[test]
fn a_symlink_in_a_mount_never_leads_the_guest_out_of_it() {
    let s = Scratch::new("mounts-links");
    let outside = s.dir.join("outside");
    std::fs::create_dir(&outside).unwrap();
    let secret = format!("host-secret-{}", std::process::id());
    std::fs::write(outside.join("secret"), &secret).unwrap();
    let shared = owned_dir(&s.dir.join("shared"));
    std::os::unix::fs::symlink(&outside, shared.join("abs")).unwrap();
    std::os::unix::fs::symlink("../outside/secret", shared.join("rel")).unwrap();
    std::os::unix::fs::symlink("/etc", shared.join("etc")).unwrap();
    // Control: on the host, each link leads out.
    assert_eq!(std::fs::read_to_string(shared.join("abs/secret")).unwrap(), secret);
    assert_eq!(std::fs::read_to_string(shared.join("rel")).unwrap(), secret);
    assert!(shared.join("etc/passwd").exists());

    let script = "cat /work/abs/secret; cat /work/rel; cat /work/etc/hostname; \
        echo planted > /work/abs/planted; echo planted > /work/rel; echo planted > /work/etc/planted; \
        cd /work/.. && ls; ls -la /work";
    let out = Launch::new(&s, &["sh", "-c", script]).flag(&mount_flag(&shared, "/work", false)).run();
    let everything = format!("{}{}", out.stdout_text(), String::from_utf8_lossy(&out.stderr));
    assert!(everything.contains("abs -> "), "the links reached the guest as links: {everything}");
    assert!(!everything.contains(&secret), "the host's file was read through a link: {everything}");
    let entries: Vec<_> = std::fs::read_dir(&outside).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(entries, ["secret"], "nothing was written outside the shared directory");
    assert_eq!(std::fs::read_to_string(outside.join("secret")).unwrap(), secret);
    assert!(!Path::new("/etc/planted").exists());
    out.assert_nothing_left();
}

/// The guest's workload owns what it makes in a read-write mount, so it may `chmod u+s` it; the host
/// would then hold a set-uid program of the directory's owner. Returns the host file's mode and the
/// guest's output.
fn set_id_attempt(s: &Scratch, controls: &[TestControl]) -> (u32, String) {
    let shared = owned_dir(&s.dir.join("shared"));
    let script = "echo '#!/bin/sh' > /work/prog; chmod 755 /work/prog; \
        chmod 4755 /work/prog 2>&1; chmod 2755 /work/prog 2>&1; chmod 6755 /work/prog 2>&1; \
        mkfifo /work/fifo && echo FIFO; stat -c %a /work/prog";
    let launch = Launch::new(s, &["sh", "-c", script]).flag(&mount_flag(&shared, "/work", false));
    let out = launch.controls(controls).run();
    assert_eq!(out.code, Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    out.assert_nothing_left();
    (std::fs::metadata(shared.join("prog")).unwrap().mode() & 0o7777, out.stdout_text())
}

#[test]
fn a_guest_cannot_make_a_set_id_file_in_a_shared_directory() {
    let s = Scratch::new("mounts-setid");
    let (mode, guest) = set_id_attempt(&s, &[]);
    assert_eq!(mode, 0o755, "no set-id bit reached the host: {guest}");
    assert!(guest.contains("Operation not permitted"), "{guest}");
    assert!(guest.contains("FIFO"), "what is harmless still works: {guest}");
}

#[test]
fn control_without_the_set_id_filter_the_guest_plants_a_set_uid_program_on_the_host() {
    let s = Scratch::new("mounts-setid-ctl");
    let (mode, guest) = set_id_attempt(&s, &[TestControl::ShareAllowsSetId]);
    assert_eq!(mode, 0o6755, "control: the set-id bits reached the host: {guest}");
    eprintln!("e2e: control confirmed: without the filter the host file is mode {mode:o}");
}

/// A hostile guest (it never powers itself off, as a compromised one would not, so only the host's
/// mechanisms can end it) with one read-write mount, its canary seen on the console, and its file server,
/// connected to QEMU from QEMU's start.
fn hostile_guest_with_a_mount(s: &Scratch, shared: &Path, controls: &[TestControl]) -> (Running, ProcInfo) {
    let launch = Launch::new(s, &["true"])
        .initrd(&with_init_that_never_stops(&s.dir))
        .flag("--boot-timeout")
        .flag("600")
        .flag(&mount_flag(shared, "/work", false))
        .controls(controls);
    let run = Running::start(launch, &[], "");
    let procs = run.procs();
    run.assert_console_shows(CANARY);
    assert!(procs.vmm.is_alive());
    let server = run.watcher.as_ref().unwrap().seen().into_iter().find(|p| is_server(p) && p.is_alive());
    (run, server.expect("a running virtiofsd"))
}

/// Freezes the driver and the watchdog (either would end the VM, and with it the server's connection),
/// then kills the supervisor.
fn kill_the_supervisor_alone(run: &Running) {
    let p = run.procs();
    signal(run.driver_pid(), SIGSTOP);
    signal(p.watchdog.pid, SIGSTOP);
    signal(p.supervisor.pid, SIGKILL);
    assert!(gone_within(&p.supervisor, Duration::from_secs(2)));
}

#[test]
fn the_file_server_sees_only_its_directory_as_its_owner_and_dies_with_the_supervisor() {
    let s = Scratch::new("mounts-server");
    let shared = owned_dir(&s.dir.join("shared"));
    std::fs::write(shared.join("one"), "1").unwrap();
    std::fs::create_dir(shared.join("two")).unwrap();
    let (run, server) = hostile_guest_with_a_mount(&s, &shared, &[]);

    let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid)).unwrap();
    let uids = status.lines().find(|l| l.starts_with("Uid:")).unwrap().to_owned();
    let owner = expected_owner().to_string();
    assert!(uids.split_whitespace().skip(1).all(|u| u == owner), "the server runs as the owner only: {uids}");
    let own_ns = |pid: &str, ns: &str| std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
    for ns in ["user", "mnt", "pid", "net"] {
        assert_ne!(own_ns(&server.pid.to_string(), ns), own_ns("self", ns), "the server has its own {ns} namespace");
    }
    // Its root is the shared directory itself: nothing of the host is there to name.
    let mut seen: Vec<_> = std::fs::read_dir(format!("/proc/{}/root", server.pid))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    seen.sort();
    assert_eq!(seen, ["one", "two"], "the server's root is the directory");
    let mounts = std::fs::read_to_string(format!("/proc/{}/mountinfo", server.pid)).unwrap();
    assert!(mounts.lines().count() <= 8, "the server's namespace holds its jail's mounts only:\n{mounts}");

    kill_the_supervisor_alone(&run);
    assert!(gone_within(&server, Duration::from_secs(5)), "the server outlived the supervisor");
    eprintln!("e2e: supervisor SIGKILL -> file server gone");
}

#[test]
fn control_a_server_jailer_not_armed_to_die_keeps_the_server_after_the_supervisor() {
    let s = Scratch::new("mounts-server-ctl");
    let shared = owned_dir(&s.dir.join("shared"));
    let (run, server) = hostile_guest_with_a_mount(&s, &shared, &[TestControl::ShareNoDeathSignal]);
    kill_the_supervisor_alone(&run);
    assert!(survives(&server, Duration::from_secs(5)), "control: the server outlives the supervisor");
    eprintln!("e2e: control confirmed: file server alive 5 s after the supervisor died");
}

#[test]
fn bad_mounts_are_refused_before_anything_starts() {
    let s = Scratch::new("mounts-bad");
    let file = s.dir.join("file");
    std::fs::write(&file, "x").unwrap();
    let dir = owned_dir(&s.dir.join("dir"));
    let mut cases = vec![
        (mount_flag(&s.dir.join("missing"), "/work", false), "is not a directory"),
        (mount_flag(&file, "/work", false), "is not a directory"),
        (mount_flag(&dir, "/proc/x", false), "must be an absolute guest path"),
        (mount_flag(&dir, "/", false), "must be an absolute guest path"),
        (format!("--mount=type=volume,src={},dst=/work", dir.display()), "only type=bind"),
        (format!("--mount=src={},dst=/work,src=/etc", dir.display()), "given twice"),
        ("--tmpfs=/proc/x".to_owned(), "must be absolute and normal"),
        ("--tmpfs=/x:suid".to_owned(), "is not one of size="),
        ("--tmpfs=/x:size=lots".to_owned(), "malformed value"),
    ];
    if root() {
        let root_owned = s.dir.join("root-owned");
        std::fs::create_dir(&root_owned).unwrap();
        cases.push((mount_flag(&root_owned, "/work", false), "owned by root"));
    }
    for (flag, says) in cases {
        let out = Launch::new(&s, &["true"]).flag(&flag).run();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.code, Some(0), "{flag}");
        assert!(stderr.contains(says), "{flag}: {stderr}");
        assert!(out.elapsed < Duration::from_secs(5), "{flag} refused in {:?}", out.elapsed);
        assert!(out.accel().is_none(), "{flag}: no VM was started");
        out.assert_nothing_left();
    }
    let twice =
        Launch::new(&s, &["true"]).flag(&mount_flag(&dir, "/work", false)).flag(&mount_flag(&dir, "/work", true)).run();
    assert!(String::from_utf8_lossy(&twice.stderr).contains("two mounts at /work"));
    let nested = Launch::new(&s, &["true"])
        .flag(&mount_flag(&dir, "/work", false))
        .flag(&mount_flag(&dir, "/work/in", true))
        .run();
    assert!(String::from_utf8_lossy(&nested.stderr).contains("overlap"));
}

#[test]
fn a_served_sandbox_keeps_its_mounts_across_stop_and_start_and_a_driver_restart() {
    let s = Scratch::with_deadline("mounts-serve", Duration::from_secs(400));
    let shared = owned_dir(&s.dir.join("shared"));
    let mut serve = Serve::start(&s);
    let flag = mount_flag(&shared, "/work", false);
    ok(serve.cli("create", &[&flag, "m"]));
    ok(serve.cli("exec", &["m", "--", "sh", "-c", "echo one > /work/one"]));
    assert_eq!(std::fs::read_to_string(shared.join("one")).unwrap(), "one\n");
    assert!(ok(serve.cli("get", &["m"])).contains("/work"), "the sandbox shows its mount");
    ok(serve.cli("stop", &["m"]));
    std::fs::write(shared.join("two"), "two\n").unwrap();
    // `start` returns once the new generation is ready, as `create` does: an exec right after it runs.
    ok(serve.cli("start", &["m"]));
    assert_eq!(ok(serve.cli("exec", &["m", "--", "cat", "/work/one", "/work/two"])), "one\ntwo\n");
    serve.restart();
    ok(serve.cli("stop", &["m"]));
    ok(serve.cli("start", &["m"]));
    serve.wait_ready("m");
    assert_eq!(ok(serve.cli("exec", &["m", "--", "cat", "/work/two"])), "two\n", "the mount outlived a driver restart");
    let refused = serve.cli("create", &[&mount_flag(&s.dir.join("missing"), "/work", false), "bad"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("is not a directory"));
    // The directory's path turned into a symlink since create: the start is refused, nothing served.
    ok(serve.cli("stop", &["m"]));
    let elsewhere = owned_dir(&s.dir.join("elsewhere"));
    std::fs::rename(&shared, s.dir.join("shared.old")).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &shared).unwrap();
    // A start through a swapped path fails, and `start`, which waits for the generation, says so.
    let started = serve.cli("start", &["m"]);
    assert!(!started.status.success(), "start waited for a generation that failed");
    assert!(String::from_utf8_lossy(&started.stderr).contains("sandbox m failed"), "{started:?}");
    serve.wait_state("m", "failed", STATE_WAIT);
    let sandbox = serve.sandbox("m");
    let log = std::fs::read_to_string(sandbox.join("shares/0.log")).unwrap_or_default();
    assert!(log.contains("without following symlinks"), "the jailer's reason is kept: {log}");
    let events = events::text(&sandbox);
    assert!(events.contains("without following symlinks"), "and reported: {events}");
    std::fs::remove_file(&shared).unwrap();
    std::fs::rename(s.dir.join("shared.old"), &shared).unwrap();
    ok(serve.cli("rm", &["m"]));
    assert!(shared.join("one").exists(), "removing the sandbox leaves the host directory alone");
    let servers: Vec<_> = serve.seen().into_iter().filter(is_server).collect();
    assert_eq!(servers.len(), 3, "one server per successful start: {servers:?}");
    assert!(servers.iter().all(|p| gone_within(p, Duration::from_secs(5))), "every server ended with its VM");
}

/// A tmpfs is the guest's own memory, bounded by its size; the same write to a tmpfs without one is the
/// control. `noexec` and the mode are in force, and the workload's user may write to it.
#[test]
fn a_tmpfs_is_bounded_by_its_size_and_mounted_as_asked() {
    let s = Scratch::new("tmpfs");
    let write =
        |dir: &str| format!("head -c 2097152 /dev/zero > {dir}/f 2>/dev/null; echo {dir} $? $(wc -c < {dir}/f)");
    let run = |dir: &str| {
        format!("rm {dir}/f; printf '#!/bin/sh\\n' > {dir}/x && chmod +x {dir}/x && {dir}/x 2>/dev/null; echo exec $?")
    };
    let script = format!(
        "{}; {}; {}; {}; stat -c %a /scratch /cache",
        write("/scratch"),
        write("/cache"),
        run("/scratch"),
        run("/cache")
    );
    let out = Launch::new(&s, &["/bin/sh", "-c", &script])
        .flag("--tmpfs")
        .flag("/scratch:size=1m,noexec")
        .flag("--tmpfs")
        .flag("/cache:mode=777")
        .run();
    assert_eq!(out.code, Some(0), "{}", out.workload_stderr());
    let stdout = out.stdout_text();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "/scratch 1 1048576", "the 1 MiB tmpfs took 1 MiB of the 2 written: {stdout}");
    assert_eq!(lines[1], "/cache 0 2097152", "control: a tmpfs without a size took the whole 2 MiB: {stdout}");
    assert_eq!(lines[2], "exec 126", "a program on a noexec tmpfs may not run: {stdout}");
    assert_eq!(lines[3], "exec 0", "control: the same program runs from a tmpfs without noexec: {stdout}");
    assert_eq!(&lines[4..], ["1777", "777"], "each root's mode as asked (1777 by default): {stdout}");
    out.assert_nothing_left();
}

/// Not root: the server runs in a user namespace of the driver's own making, the guest's workload mapped to
/// the driver's own uid (there is no other to map to).
#[test]
fn an_unprivileged_driver_shares_a_directory_as_its_own_user() {
    let s = Scratch::new("mounts-nonroot");
    let shared = s.dir.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::write(shared.join("h.txt"), "from-the-host\n").unwrap();
    for path in [&shared, &shared.join("h.txt")] {
        std::os::unix::fs::chown(path, Some(vm_test_support::NOBODY), Some(vm_test_support::NOBODY)).unwrap();
    }
    let out = vm_test_support::launch_as_nobody(&s)
        .arg(mount_flag(&shared, "/work", false))
        .args(["--", "sh", "-c", "cat /work/h.txt; echo from-the-guest > /work/g.txt"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("confinement none") || stderr.contains("UNCONFINED") {
        assert!(stderr.contains("host directories need jail or userns confinement"), "{stderr}");
        eprintln!("e2e: no user namespaces here: the mount was refused, as documented");
        return;
    }
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-the-host\n");
    let meta = std::fs::metadata(shared.join("g.txt")).unwrap();
    assert_eq!(
        (meta.uid(), meta.gid()),
        (vm_test_support::NOBODY, vm_test_support::NOBODY),
        "the guest's file is the driver user's"
    );
    eprintln!("e2e: not root: a userns file server shared the directory as the driver's own user");
}

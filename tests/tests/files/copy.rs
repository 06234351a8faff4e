//! Host paths in and out of real sandboxes: `vm-driver cp` through `serve` and `launch --copy-in/--copy-out`
//! round-trip trees byte for byte; a hostile guest's tar (the rogue agent's `tar-*` modes) is refused by the
//! hardened extractor with a `tar_refused` finding and nothing written outside the destination, while the
//! `unchecked-extract` control shows the write through a symlink that the checks prevent.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use vm_contract::test_control::TestControl;
use vm_test_support::events;
use vm_test_support::image::with_rogue_agent_files;
use vm_test_support::serve::Serve;
use vm_test_support::{wait_until, Launch, Scratch, DRIVER_ERROR};

/// The checksums of every file under `dir`, as `sha256sum` prints them, in order of path, with their modes.
const SUMS: &str =
    "cd \"$0\" && find . -type f | LC_ALL=C sort | xargs sha256sum && find . -type f -perm -u+x | LC_ALL=C sort";

fn sums(dir: &Path) -> String {
    let out = Command::new("sh").args(["-c", SUMS]).arg(dir).output().unwrap();
    assert!(out.status.success() && !out.stdout.is_empty());
    String::from_utf8(out.stdout).unwrap()
}

/// A tree of `files` files in 13 directories (some executable), and one file of `big` bytes.
fn tree(dir: &Path, files: usize, big: usize) {
    for i in 0..files {
        let sub = dir.join(format!("d{}", i % 13));
        std::fs::create_dir_all(&sub).unwrap();
        let path = sub.join(format!("f{i}"));
        std::fs::write(&path, format!("{i}:").repeat(i % 97)).unwrap();
        if i % 10 == 0 {
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        }
    }
    let mut data = vec![0u8; big];
    for (i, b) in data.iter_mut().enumerate() {
        *b = u8::try_from((i * 7 + i / 4096) % 251).unwrap();
    }
    std::fs::write(dir.join("big.bin"), data).unwrap();
}

#[test]
fn cp_of_a_host_tree_into_and_out_of_a_sandbox_round_trips_byte_for_byte() {
    let s = Scratch::with_deadline("copy-cp", Duration::from_secs(600));
    let serve = Serve::start(&s);
    let created = serve.cli("create", &["--memory", "1024", "c"]);
    assert!(created.status.success(), "create: {}", String::from_utf8_lossy(&created.stderr));
    let src = s.dir.join("project");
    tree(&src, 1000, 256 << 20);

    let started = std::time::Instant::now();
    let cp_in = serve.cli("cp", &[src.to_str().unwrap(), "c:/tmp"]);
    assert!(cp_in.status.success(), "cp in: {}", String::from_utf8_lossy(&cp_in.stderr));
    eprintln!("e2e: cp in of 1000 files and 256 MiB: {:?}", started.elapsed());
    let guest = serve.cli("exec", &["c", "--", "sh", "-c", SUMS, "/tmp/project"]);
    assert_eq!(String::from_utf8_lossy(&guest.stdout), sums(&src), "the tree arrived whole, modes kept");
    let owner = serve.cli("exec", &["c", "--", "stat", "-c", "%u:%g", "/tmp/project/d3/f3"]);
    assert_eq!(String::from_utf8_lossy(&owner.stdout).trim(), "1000:1000", "owned by the workload identity");

    // Out: into an existing directory under the source's name, then to a new name.
    let back = s.dir.join("back");
    std::fs::create_dir(&back).unwrap();
    let started = std::time::Instant::now();
    let cp_out = serve.cli("cp", &["c:/tmp/project", back.to_str().unwrap()]);
    assert!(cp_out.status.success(), "cp out: {}", String::from_utf8_lossy(&cp_out.stderr));
    eprintln!("e2e: cp out of 1000 files and 256 MiB: {:?}", started.elapsed());
    assert_eq!(sums(&back.join("project")), sums(&src), "the tree came back whole");
    let renamed = s.dir.join("renamed");
    assert!(serve.cli("cp", &["c:/tmp/project/d3/f3", renamed.to_str().unwrap()]).status.success());
    assert_eq!(std::fs::read(&renamed).unwrap(), std::fs::read(src.join("d3/f3")).unwrap());

    // The same copy again would merge into the first: refused, the first left as it was.
    let again = serve.cli("cp", &["c:/tmp/project", back.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(DRIVER_ERROR));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("does not merge"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(sums(&back.join("project")), sums(&src));
    assert_eq!(std::fs::read_dir(&back).unwrap().count(), 1, "no staging directory left beside it");

    // A guest path that is not there: the agent's message, exit status 1, nothing made.
    let missing = serve.cli("cp", &["c:/tmp/nothing", s.dir.join("none").to_str().unwrap()]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("No such file"));
    assert!(!s.dir.join("none").exists());
    let findings = events::text(&serve.sandbox("c"));
    assert!(!findings.contains("tar_refused"), "a healthy sandbox's copies raise no finding");
}

#[test]
fn launch_copies_in_before_the_command_and_out_after_it() {
    let s = Scratch::new("copy-launch");
    let src = s.dir.join("job");
    tree(&src, 50, 1 << 20);
    let results = s.dir.join("results");
    let copy_in = format!("{}:/tmp", src.display());
    let copy_out = format!("/tmp/job:{}", results.display());
    let out = Launch::new(&s, &["sh", "-c", "cd /tmp/job && sha256sum big.bin > sums && exit 3"])
        .flag("--copy-in")
        .flag(&copy_in)
        .flag("--copy-out")
        .flag(&copy_out)
        .run();
    assert_eq!(out.code, Some(3), "the command's status: {}", String::from_utf8_lossy(&out.stderr));
    let expected = Command::new("sha256sum").arg("big.bin").current_dir(&src).output().unwrap();
    assert_eq!(std::fs::read(results.join("sums")).unwrap(), expected.stdout, "the command's output came out");
    std::fs::remove_file(results.join("sums")).unwrap();
    assert_eq!(sums(&results), sums(&src));
    out.assert_nothing_left();
}

/// A launch whose guest is the rogue agent in `mode`, copying its `/out` to `dest` after a polite command.
fn rogue_copy(
    s: &Scratch,
    mode: &str,
    target: &Path,
    dest: &Path,
    controls: &[TestControl],
) -> vm_test_support::Outcome {
    let initrd = with_rogue_agent_files(&s.dir, mode, &[("etc/rogue-target", target.to_str().unwrap().into())]);
    let copy_out = format!("/out:{}", dest.display());
    let launch = Launch::new(s, &["true"]).initrd(&initrd).controls(controls);
    launch.flag("--id").flag(mode).flag("--copy-out").flag(&copy_out).flag("--timeout").flag("120").run()
}

fn tar_refused(s: &Scratch, id: &str) -> Vec<String> {
    let dir = s.sandbox(id);
    let mut found = Vec::new();
    wait_until(Duration::from_secs(20), || {
        found = events::of_class(&events::read(&dir), 2004)
            .into_iter()
            .filter(|e| e["finding_info"]["types"][0] == "tar_refused")
            .map(|e| {
                e["message"].as_str().unwrap_or_default().to_owned()
                    + " "
                    + e["finding_info"]["desc"].as_str().unwrap_or_default()
            })
            .collect();
        !found.is_empty()
    });
    found
}

#[test]
fn every_malicious_tar_is_refused_with_a_finding_and_nothing_written_outside() {
    let s = Scratch::with_deadline("copy-rogue", Duration::from_secs(900));
    let canary = s.dir.join("canary");
    std::fs::create_dir(&canary).unwrap();
    let secret = canary.join("secret");
    std::fs::write(&secret, b"host secret").unwrap();
    let cases = [
        ("tar-symlink-escape", canary.as_path(), "absolute path"),
        ("tar-symlink-inside", canary.as_path(), "passes through a symlink"),
        ("tar-dotdot", canary.as_path(), "through .."),
        ("tar-hardlink", secret.as_path(), "hard link"),
        ("tar-huge", canary.as_path(), "more bytes"),
        ("tar-sparse", canary.as_path(), "sparse"),
        ("tar-device", canary.as_path(), "device"),
        ("tar-many", canary.as_path(), "too many entries"),
    ];
    for (mode, target, reason) in cases {
        let landing = s.dir.join(format!("landing-{mode}"));
        std::fs::create_dir(&landing).unwrap();
        let out = rogue_copy(&s, mode, target, &landing.join("dest"), &[]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.code, Some(DRIVER_ERROR), "{mode}: {stderr}");
        assert!(stderr.contains("refused the sandbox's tar") && stderr.contains(reason), "{mode}: {stderr}");
        assert_eq!(std::fs::read_dir(&landing).unwrap().count(), 0, "{mode}: nothing landed, no staging left");
        let mut beside: Vec<_> = std::fs::read_dir(&canary).unwrap().map(|e| e.unwrap().file_name()).collect();
        beside.sort();
        assert_eq!(beside, ["secret"], "{mode}: nothing written outside the destination");
        assert_eq!(std::fs::metadata(&secret).unwrap().nlink(), 1, "{mode}: no link to the host's file");
        let findings = tar_refused(&s, mode);
        assert!(findings.iter().any(|f| f.contains(reason)), "{mode}: a tar_refused finding: {findings:?}");
        out.assert_nothing_left();
        eprintln!("e2e: {mode}: refused ({reason}) in {:?}", out.elapsed);
    }
}

#[test]
fn a_served_cp_out_of_a_10_gib_tar_entry_is_refused_fast_with_nothing_landed() {
    let s = Scratch::new("copy-rogue-serve");
    let images = vm_test_support::image::images_with_rogues(&s.dir, &["tar-huge"]);
    let serve = Serve::with(&s, &[], &["--boot-images", images.to_str().unwrap()]);
    let created = serve.cli("create", &["--boot-image", "rogue-tar-huge", "huge"]);
    assert!(created.status.success(), "create: {}", String::from_utf8_lossy(&created.stderr));
    let landing = s.dir.join("landing");
    std::fs::create_dir(&landing).unwrap();
    let started = std::time::Instant::now();
    let out = serve.cli("cp", &["huge:/out", landing.join("dest").to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("refused the sandbox's tar") && stderr.contains("more bytes"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(60), "refused at the cap, not at the end of the guest's stream");
    assert_eq!(std::fs::read_dir(&landing).unwrap().count(), 0, "nothing landed, no staging left");
    assert!(tar_refused(&s, "huge").iter().any(|f| f.contains("more bytes")), "a tar_refused finding");
    eprintln!("e2e: a served cp of a never-ending tar refused in {:?}", started.elapsed());
}

#[test]
fn control_without_the_extractors_checks_a_guest_writes_through_a_symlink_onto_the_host() {
    let s = Scratch::new("copy-rogue-ctl");
    let canary = s.dir.join("canary");
    std::fs::create_dir(&canary).unwrap();
    let landing = s.dir.join("landing");
    std::fs::create_dir(&landing).unwrap();
    let out = rogue_copy(&s, "tar-symlink-escape", &canary, &landing.join("dest"), &[TestControl::UncheckedExtract]);
    assert_eq!(
        std::fs::read(canary.join("pwned")).ok().as_deref(),
        Some(&b"pwned"[..]),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.assert_nothing_left();
}

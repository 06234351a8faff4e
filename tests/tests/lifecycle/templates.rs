//! Templates (`docs/templates.md`) on real VMs: the first launch of a kind boots and saves its template, the
//! next ones restore from it; clones read their own randomness and carry their own identity; a clone's
//! writes reach neither another clone (which maps the same template memory, under `serve`) nor the template;
//! a template changed on disk is refused and made again, and so is one whose restore fails; one made stale
//! by a changed image is not used.

use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use vm_test_support::events;
use vm_test_support::launch::Outcome;
use vm_test_support::leaks;
use vm_test_support::output::ok;
use vm_test_support::serve::Serve;
use vm_test_support::{Launch, Scratch};

/// What a launch says when its VM was restored from a template.
const RESTORED: &str = "restored from a template";

/// The templates in `s`'s state directory, one directory per key.
fn templates(s: &Scratch) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(s.state().join("templates")) else { return Vec::new() };
    let mut dirs: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.len() == 64))
        .collect();
    dirs.sort();
    dirs
}

fn stderr(out: &Outcome) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The `origin: …` of the sandbox's VM start event (Application Lifecycle, the `microvm` app), and that
/// event's sandbox.
fn start_origin(sandbox_dir: &Path) -> (String, String) {
    let all = events::read(sandbox_dir);
    let start = events::of_class(&all, 6002)
        .into_iter()
        .find(|e| e["activity_id"] == 3 && e["app"]["name"] == "microvm")
        .unwrap_or_else(|| panic!("no VM start event in {}", sandbox_dir.display()));
    (start["status_detail"].as_str().unwrap_or("").to_owned(), start["app"]["uid"].as_str().unwrap().to_owned())
}

/// The QEMU command lines a run started.
fn qemu_lines(out: &Outcome) -> Vec<String> {
    out.seen.iter().filter(|p| p.is_qemu()).map(|p| p.cmdline.join(" ")).collect()
}

/// A workload that prints 16 fresh random bytes and its kernel's boot id.
const READ_IDENTITY: &str =
    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; cat /proc/sys/kernel/random/boot_id";

#[test]
fn the_first_launch_makes_a_template_and_the_next_ones_restore_from_it_each_their_own() {
    let s = Scratch::with_deadline("tpl-launch", Duration::from_secs(600));
    let first = Launch::new(&s, &["true"]).templates().flag("--id").flag("first").run();
    first.succeeded();
    assert!(!stderr(&first).contains(RESTORED), "{}", stderr(&first));
    assert_eq!(start_origin(&s.sandbox("first")).0, "origin: cold");
    let [template] = &templates(&s)[..] else { panic!("one template: {:?}", templates(&s)) };
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(template), 0o700);
    assert_eq!(mode(&template.join("ram")), 0o400, "the template's memory is read-only, the driver's only");
    // Its RAM is a file of its own: the stream holds the devices' state only.
    let state = std::fs::metadata(template.join("state")).unwrap().len();
    assert!(state < 4 << 20, "the saved stream holds the RAM ({state} bytes)");

    let mut readings = Vec::new();
    for id in ["clone-a", "clone-b"] {
        let out = Launch::new(&s, &["sh", "-c", READ_IDENTITY]).templates().flag("--id").flag(id).run();
        let text = out.succeeded();
        assert!(stderr(&out).contains(RESTORED), "{id} booted: {}", stderr(&out));
        let qemu = qemu_lines(&out);
        assert!(
            qemu.iter().any(|l| l.contains("-incoming defer") && l.contains("share=off")),
            "{id}'s VMM did not map the template privately: {qemu:?}"
        );
        assert_eq!(start_origin(&s.sandbox(id)), ("origin: template".to_owned(), id.to_owned()));
        eprintln!("e2e: {id}: {} in {:?}", text.replace('\n', " "), out.elapsed);
        readings.push(text);
    }
    let lines: Vec<Vec<&str>> = readings.iter().map(|r| r.lines().collect()).collect();
    assert_eq!(lines[0].len(), 2, "{readings:?}");
    assert_ne!(lines[0][0], lines[1][0], "two clones of one template read the same random bytes");
    assert_ne!(lines[0][1], lines[1][1], "two clones of one template have one boot id");
    assert_eq!(templates(&s).len(), 1, "the clones made no template of their own");

    let cold = Launch::new(&s, &["true"]).templates().flag("--cold").flag("--id").flag("forced").run();
    cold.succeeded();
    assert!(!stderr(&cold).contains(RESTORED));
    assert_eq!(start_origin(&s.sandbox("forced")).0, "origin: cold");
}

/// Flips one byte of `file` (kept read-only) in the middle of its first range of data.
fn tamper(file: &Path) {
    let mut bytes = vec![0u8; 1 << 20];
    let f = std::fs::File::open(file).unwrap();
    let mut at = 0u64;
    let (offset, byte) = loop {
        let n = f.read_at(&mut bytes, at).unwrap();
        assert!(n > 0, "{} holds only zeros", file.display());
        if let Some(i) = bytes[..n].iter().position(|b| *b != 0) {
            break (at + i as u64, bytes[i]);
        }
        at += n as u64;
    };
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::OpenOptions::new().write(true).open(file).unwrap().write_all_at(&[!byte], offset).unwrap();
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o400)).unwrap();
}

#[test]
fn a_template_changed_on_disk_is_refused_and_made_again() {
    let s = Scratch::with_deadline("tpl-tamper", Duration::from_secs(600));
    Launch::new(&s, &["true"]).templates().run().succeeded();
    let [template] = &templates(&s)[..] else { panic!("{:?}", templates(&s)) };
    // Control: untouched, it is used.
    let used = Launch::new(&s, &["true"]).templates().run();
    used.succeeded();
    assert!(stderr(&used).contains(RESTORED), "{}", stderr(&used));
    for file in ["ram", "state"] {
        tamper(&template.join(file));
        let out = Launch::new(&s, &["echo", "booted"]).templates().run();
        assert_eq!(out.succeeded(), "booted\n");
        let said = stderr(&out);
        assert!(said.contains("template refused") && !said.contains(RESTORED), "{file} changed: {said}");
        // Made again by that launch, whole: the next one restores.
        assert!(template.join("digests").is_file(), "the template of the changed {file} was not made again");
        let again = Launch::new(&s, &["true"]).templates().run();
        again.succeeded();
        assert!(stderr(&again).contains(RESTORED), "after the changed {file}: {}", stderr(&again));
    }
}

/// Rewrites `file` of `template` with `edit` and its recorded digest to match, as a writer of the state
/// directory could: what no digest catches.
fn rewrite_consistently(template: &Path, file: &str, edit: impl FnOnce(&Path)) {
    let path = template.join(file);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    edit(&path);
    let digests_file = template.join("digests");
    let mut digests: serde_json::Value = serde_json::from_slice(&std::fs::read(&digests_file).unwrap()).unwrap();
    digests[file] = vm_driver::template::ram::digest(&path).unwrap().into();
    std::fs::set_permissions(&digests_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&digests_file, serde_json::to_vec(&digests).unwrap()).unwrap();
}

#[test]
fn a_template_whose_restore_fails_is_booted_past_and_made_again() {
    let s = Scratch::with_deadline("tpl-broken", Duration::from_secs(600));
    Launch::new(&s, &["true"]).templates().run().succeeded();
    let [template] = &templates(&s)[..] else { panic!("{:?}", templates(&s)) };
    // A stream QEMU refuses, with a digest that matches it.
    rewrite_consistently(template, "state", |state| {
        std::fs::OpenOptions::new().write(true).open(state).unwrap().set_len(4096).unwrap();
    });
    let out = Launch::new(&s, &["echo", "booted"]).templates().flag("--id").flag("past").run();
    assert_eq!(out.succeeded(), "booted\n");
    let said = stderr(&out);
    assert!(said.contains("cannot restore from the template") && !said.contains(RESTORED), "{said}");
    assert_eq!(start_origin(&s.sandbox("past")).0, "origin: cold");
    let again = Launch::new(&s, &["true"]).templates().run();
    again.succeeded();
    assert!(stderr(&again).contains(RESTORED), "the template was not made again: {}", stderr(&again));
}

#[test]
fn a_template_made_stale_by_a_changed_image_or_shape_is_not_used() {
    let s = Scratch::with_deadline("tpl-stale", Duration::from_secs(600));
    let image = s.dir.join("image");
    std::fs::create_dir_all(&image).unwrap();
    let copy_image = || {
        for file in ["vmlinuz", "initramfs.cpio"] {
            let _ = std::fs::remove_file(image.join(file));
            std::fs::copy(vm_test_support::harness().image.join(file), image.join(file)).unwrap();
        }
    };
    copy_image();
    let launch = |extra: &[&str]| {
        let mut l = Launch::new(&s, &["true"]).templates().image(&image);
        for flag in extra {
            l = l.flag(flag);
        }
        let out = l.run();
        out.succeeded();
        stderr(&out).contains(RESTORED)
    };
    assert!(!launch(&[]), "no template yet");
    assert!(launch(&[]), "control: the same image restores");
    // The same bytes written again: the image changed on disk, and its template is another.
    copy_image();
    assert!(!launch(&[]), "a template of the image before it changed was used");
    assert_eq!(templates(&s).len(), 2);
    assert!(launch(&[]));
    assert!(!launch(&["--memory", "192"]), "a template of another shape was used");
    assert_eq!(templates(&s).len(), 3);
}

fn unique_kib(pid: i32) -> u64 {
    vm_test_support::procs::unique_kib(pid).unwrap()
}

/// The VMM of sandbox `id` of `s`.
fn vmm_of(s: &Scratch, id: &str) -> i32 {
    let pids = vm_contract::pids::SandboxPids::read(&s.sandbox(id)).unwrap();
    pids.vmm.unwrap().pid
}

#[test]
fn clones_share_the_templates_memory_and_a_clones_writes_reach_no_other_clone_nor_the_template() {
    let s = Scratch::with_deadline("tpl-serve", Duration::from_secs(600));
    let serve = Serve::with_templates(&s, &[], &[]);
    assert!(ok(serve.cli("create", &["cold"])).contains(" cold"));
    s.waiting_for("the template the first create makes");
    serve.wait_template(Duration::from_secs(180));
    let [template] = &templates(&s)[..] else { panic!("{:?}", templates(&s)) };
    let digests = std::fs::read(template.join("digests")).unwrap();
    for id in ["a", "b"] {
        let created = ok(serve.cli("create", &[id]));
        assert!(created.contains(" template"), "{id}: {created}");
    }
    // Idle clones hold only the pages they wrote; a booted VM holds all it touched.
    std::thread::sleep(Duration::from_secs(5));
    let (cold, a, b) = (unique_kib(vmm_of(&s, "cold")), unique_kib(vmm_of(&s, "a")), unique_kib(vmm_of(&s, "b")));
    eprintln!("e2e: unique memory: booted {cold} KiB, clones {a} and {b} KiB");
    assert!(a * 2 < cold && b * 2 < cold, "the clones do not share the template's memory");

    // A write of clone a's, in its memory (its root is a RAM file system).
    let marker = format!("clone-a-wrote-{}", std::process::id());
    let script = format!("for i in $(seq 4096); do echo {marker}; done > /tmp/m; sync; wc -l < /tmp/m");
    assert_eq!(ok(serve.cli("exec", &["a", "--", "sh", "-c", &script])).trim(), "4096");
    let (found, scanned) = leaks::guest_memory_holds(vmm_of(&s, "a"), marker.as_bytes());
    assert!(found, "control: the marker is not in clone a's own memory ({scanned} bytes read)");
    let (found, scanned) = leaks::guest_memory_holds(vmm_of(&s, "b"), marker.as_bytes());
    assert!(!found, "clone a's write is in clone b's memory ({scanned} bytes read)");
    assert_eq!(ok(serve.cli("exec", &["b", "--", "sh", "-c", "cat /tmp/m 2>/dev/null | wc -l"])).trim(), "0");
    let ram = std::fs::read(template.join("ram")).unwrap();
    assert!(!leaks::contains(&ram, marker.as_bytes()), "clone a's write reached the template's file");
    assert_eq!(std::fs::read(template.join("digests")).unwrap(), digests);
    // The memory every clone maps: the driver's sealed memfd.
    let driver = serve.child.id();
    let memfds: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{driver}/fd"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_link(p).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:vm-template ")))
        .collect();
    assert_eq!(memfds.len(), 1, "one copy of the template's memory for every clone: {memfds:?}");
    let shared = std::fs::read(&memfds[0]).unwrap();
    assert!(!leaks::contains(&shared, marker.as_bytes()), "clone a's write reached the shared template memory");
    assert!(
        std::fs::OpenOptions::new().write(true).open(&memfds[0]).unwrap().write_all_at(b"x", 0).is_err(),
        "the shared template memory takes writes"
    );
}

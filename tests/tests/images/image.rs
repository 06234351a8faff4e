//! The default guest image build: reproducible, and refusing packages that do not match their pins.

use std::process::Command;

use vm_test_support::{repo, Scratch};

fn build_image(args: &[&str]) -> std::process::Output {
    Command::new(repo().join("scripts/build-image")).args(args).output().expect("cannot run scripts/build-image")
}

#[test]
fn two_builds_give_the_same_bytes() {
    let s = Scratch::new("repro");
    let (a, b) = (s.dir.join("a"), s.dir.join("b"));
    for out in [&a, &b] {
        let run = build_image(&["--out", out.to_str().unwrap()]);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    }
    for file in ["vmlinuz", "initramfs.cpio", "manifest.json"] {
        let (x, y) = (std::fs::read(a.join(file)).unwrap(), std::fs::read(b.join(file)).unwrap());
        assert!(x == y, "{file} differs between two builds");
        eprintln!("e2e: {file}: {} bytes, sha256 {}", x.len(), vm_image::debian::sha256(&x));
    }
    let manifest = std::fs::read_to_string(a.join("manifest.json")).unwrap();
    for must in ["linux-image-", "busybox-static", "virtio_console", "\"sha256\""] {
        assert!(manifest.contains(must), "manifest lacks {must}");
    }
}

#[test]
fn a_package_whose_checksum_differs_from_its_pin_is_refused() {
    let s = Scratch::new("badpin");
    let pins = std::fs::read_to_string(repo().join("images/pins.json")).unwrap();
    let good = pins.split("\"busybox\"").nth(1).unwrap().split("\"sha256\": \"").nth(1).unwrap()[..64].to_owned();
    let bad_pins = s.dir.join("pins.json");
    std::fs::write(&bad_pins, pins.replace(&good, &"0".repeat(64))).unwrap();
    let out = s.dir.join("out");
    let run = build_image(&["--out", out.to_str().unwrap(), "--pins", bad_pins.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("sha256 is") && stderr.contains("the pin says 0000"), "{stderr}");
    assert!(!out.exists(), "no image from an unverified package");
}

#[test]
fn a_package_missing_from_the_package_lists_comes_from_a_mirror() {
    // As on Ubuntu: apt knows no such package, so the pool path on a Debian mirror is used, sha256 checked.
    let s = Scratch::new("mirror");
    let pins = std::fs::read_to_string(repo().join("images/pins.json")).unwrap();
    let renamed = s.dir.join("pins.json");
    std::fs::write(&renamed, pins.replace("\"package\": \"busybox-static\"", "\"package\": \"not-in-apt-lists\""))
        .unwrap();
    let out = s.dir.join("out");
    let cache = s.dir.join("cache");
    let run = build_image(&[
        "--out",
        out.to_str().unwrap(),
        "--pins",
        renamed.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let fetched: Vec<_> = std::fs::read_dir(cache.join("debs")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(fetched.iter().any(|n| n.to_string_lossy().starts_with("not-in-apt-lists_")), "{fetched:?}");
    assert!(out.join("initramfs.cpio").is_file());
}

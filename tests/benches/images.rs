//! Image roots (issue 21): `launch --image` of a cached image against `launch` on the built-in root; the
//! first use of an image (pull and disk build, `vm-driver image pull`) against `skopeo copy` then
//! `umoci unpack` of the same image from the same local registry; and what a new sandbox's writable layer
//! costs on the host before it writes. Medians over `BENCH_RUNS` runs (default 10), the two sides of each
//! ratio alternating within each run.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{timed_ms as timed, Report};
use vm_test_support::registry::Registry;
use vm_test_support::{harness, test_image, Scratch};

fn launch(state: &Path, image: Option<(&str, &Path)>) -> Command {
    let mut cmd = Command::new(&harness().shipped.driver);
    // Cold boots: what an image root costs at a boot (templates have their own bench).
    cmd.arg("launch").arg("--state-dir").arg(state).args(["--accel", &harness().accel, "--cold"]);
    if let Some((reference, store)) = image {
        cmd.args(["--image", reference, "--image-cache"]).arg(store);
    }
    cmd
}

fn main() {
    let runs = common::runs();
    // About 25 s a run on 2 cores under TCG, and the setup: past the default deadline at 10 runs.
    let s = Scratch::with_deadline("bench-images", Duration::from_secs(120 + 60 * runs as u64));
    let layout_ref = test_image::layout_ref();
    let registry = Registry::start(&s.dir.join("registry"), None);
    let reference = registry.push(&layout_ref, "bench/py:1");
    let cached = s.dir.join("cached");
    timed(
        Command::new(&harness().shipped.driver)
            .args(["image", "import", "--image-cache"])
            .arg(&cached)
            .arg(&layout_ref),
    );
    let state = s.dir.join("state");
    let mut report = Report::new("images");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        report.sample("launch -- true (ms)", timed(launch(&state, None).args(["--", "true"])));
        let mut with_image = launch(&state, Some((&layout_ref, &cached)));
        report.sample("launch --image -- true, cached (ms)", timed(with_image.args(["--", "true"])));

        let store = s.dir.join(format!("store-{i}"));
        let ours = timed(
            Command::new(&harness().shipped.driver)
                .args(["image", "pull", "--image-cache"])
                .arg(&store)
                .arg("--registry-ca")
                .arg(&registry.ca)
                .arg(&reference),
        );
        report.sample("image pull: pull + disk (ms)", ours);
        let (oci, bundle) = (s.dir.join(format!("skopeo-{i}")), s.dir.join(format!("bundle-{i}")));
        let theirs = timed(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--src-cert-dir"])
                .arg(&registry.cert_dir)
                .arg(format!("docker://{reference}"))
                .arg(format!("oci:{}:py", oci.display())),
        ) + timed(
            Command::new("umoci").args(["unpack", "--image"]).arg(format!("{}:py", oci.display())).arg(&bundle),
        );
        report.sample("skopeo copy + umoci unpack (ms)", theirs);
        for dir in [&store, &oci, &bundle] {
            let _ = std::fs::remove_dir_all(dir);
        }

        // A new sandbox that writes nothing: its writable layer as allocated on the host.
        let kept = s.dir.join(format!("kept-{i}"));
        timed(launch(&kept, Some((&layout_ref, &cached))).args(["--keep", "--", "true"]));
        let dir = std::fs::read_dir(kept.join("sandboxes")).unwrap().flatten().next().unwrap().path();
        let blocks = std::fs::metadata(dir.join("disk.ext4")).unwrap().blocks();
        report.sample("writable layer, allocated before any write (KiB)", (blocks * 512) as f64 / 1024.0);
        let _ = std::fs::remove_dir_all(&kept);
    }
    report.compare(
        "launch --image REF -- true (image cached) vs launch -- true on the built-in root (ms)",
        "launch --image -- true, cached (ms)",
        "launch -- true (ms)",
        0,
        "<= 1.15",
    );
    report.compare(
        "first use of an image: vm-driver image pull (pull + EROFS disk) vs skopeo copy + umoci unpack (ms)",
        "image pull: pull + disk (ms)",
        "skopeo copy + umoci unpack (ms)",
        0,
        "<= 1.5",
    );
    report.single(
        "a new sandbox's writable layer before it writes (KiB allocated of 1024 MiB)",
        "writable layer, allocated before any write (KiB)",
        0,
        "< 1024",
    );
    report.finish("Image roots", runs);
}

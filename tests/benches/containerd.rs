//! The containerd shim (issue 35): `ctr run --rm` of `true` with our runtime against `vm-driver launch
//! --image` of the same image (what the shim adds: containerd, the shim's start, the rootfs made a disk),
//! and against runc (containerd's default runtime, no VM) in the same runs. Medians over `BENCH_RUNS` runs
//! (default 10), the three alternating within each run.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{timed_ms as timed, Report};
use vm_test_support::containerd::{Containerd, RUNTIME};
use vm_test_support::{harness, Scratch};

fn main() {
    let runs = common::runs();
    // About 20 s a run on 2 cores under TCG, and the setup.
    let s = Scratch::with_deadline("bench-ctr", Duration::from_secs(180 + 60 * runs as u64));
    let containerd = Containerd::start(&s.dir);
    let busybox = containerd.pull_busybox(&s.dir);
    let store = s.dir.join("store");
    let layout_ref = format!("oci:{}:busybox", busybox.layout.display());
    timed(
        Command::new(&harness().shipped.driver).args(["image", "import", "--image-cache"]).arg(&store).arg(&layout_ref),
    );
    let state = s.dir.join("launch-state");
    let mut report = Report::new("containerd");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        let runc = timed(containerd.command().args(["run", "--rm", &busybox.reference, &format!("runc-{i}"), "true"]));
        report.sample("ctr run --rm, runc (ms)", runc);
        let ours = timed(containerd.command().args([
            "run",
            "--rm",
            "--runtime",
            RUNTIME,
            &busybox.reference,
            &format!("vm-{i}"),
            "true",
        ]));
        report.sample("ctr run --rm, vmdriver (ms)", ours);
        let launch = timed(
            Command::new(&harness().shipped.driver)
                .args(["launch", "--state-dir"])
                .arg(&state)
                // Cold, as the shim's VM is (templates have their own bench).
                .args(["--accel", &harness().accel, "--cold", "--image", &layout_ref, "--image-cache"])
                .arg(&store)
                .args(["--", "true"]),
        );
        report.sample("vm-driver launch --image (ms)", launch);
    }
    report.compare(
        "ctr run --rm IMAGE true: our runtime vs vm-driver launch --image of the same image (ms)",
        "ctr run --rm, vmdriver (ms)",
        "vm-driver launch --image (ms)",
        0,
        "<= 1.2",
    );
    report.compare(
        "ctr run --rm IMAGE true: our runtime vs runc, no VM (ms)",
        "ctr run --rm, vmdriver (ms)",
        "ctr run --rm, runc (ms)",
        0,
        "- (a VM's boot)",
    );
    report.finish("containerd shim", runs);
}

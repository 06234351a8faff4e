//! Files in and out (issue 23): `vm-driver cp` of a 256 MiB file into and out of a running sandbox (a tar
//! made on the host; out, the hardened extractor) against the same bytes through `vm-driver exec -i ... cat`
//! on stdin and stdout of the same sandbox: the files API's cost over the plain stream both ride. (`launch --
//! cat` would add a boot to one side only.) And a host directory mounted into a second sandbox (virtiofs,
//! read-only): the guest's sequential read of the 256 MiB file from it into a guest file, against `cp` of
//! the same file into that sandbox. Medians over `BENCH_RUNS` runs (default 10), the two sides of each ratio alternating
//! within each run.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::fs::File;
use std::time::{Duration, Instant};

use common::{timed_ms as timed, Report};
use vm_test_support::serve::Serve;
use vm_test_support::Scratch;

const BYTES: usize = 256 << 20;

fn main() {
    let runs = common::runs();
    let s = Scratch::with_deadline("bench-files", Duration::from_secs(120 + 90 * runs as u64));
    let serve = Serve::start(&s);
    let shared = s.dir.join("shared");
    std::fs::create_dir(&shared).unwrap();
    let mount = format!("--mount=type=bind,src={},dst=/host,readonly", shared.display());
    // A sandbox of its own for the mount: mounts put every virtio device in modern mode, which would
    // change the other ratios' both sides.
    for args in [&["--memory", "1024", "f"][..], &["--memory", "1024", &mount, "m"]] {
        let created = serve.cli("create", args);
        assert!(created.status.success(), "{}", String::from_utf8_lossy(&created.stderr));
    }
    let big = shared.join("big.bin");
    let data: Vec<u8> = (0..BYTES).map(|i| u8::try_from((i * 7 + i / 4096) % 251).unwrap()).collect();
    std::fs::write(&big, &data).unwrap();
    let back = s.dir.join("back");
    let mut report = Report::new("files");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        // One 256 MiB file in the guest at a time: its /tmp is RAM, at most half the guest's memory.
        let cp_in = timed(&mut serve.cli_command("cp", &[big.to_str().unwrap(), "f:/tmp"]));
        report.sample("cp HOST f:/tmp, 256 MiB (ms)", cp_in);
        assert!(serve.cli("exec", &["f", "--", "rm", "/tmp/big.bin"]).status.success());
        let cp_in = timed(&mut serve.cli_command("cp", &[big.to_str().unwrap(), "m:/tmp"]));
        report.sample("cp HOST m:/tmp, 256 MiB (ms)", cp_in);
        assert!(serve.cli("exec", &["m", "--", "rm", "/tmp/big.bin"]).status.success());
        let read = timed(&mut serve.cli_command("exec", &["m", "--", "sh", "-c", "cat /host/big.bin > /tmp/big.bin"]));
        report.sample("cat mounted file > guest file, 256 MiB (ms)", read);
        assert!(serve.cli("exec", &["m", "--", "rm", "/tmp/big.bin"]).status.success());
        let read = timed(&mut serve.cli_command("exec", &["m", "--", "sh", "-c", "cat /host/big.bin > /dev/null"]));
        report.sample("cat mounted file > /dev/null, 256 MiB (ms)", read);
        let started = Instant::now();
        let out = serve
            .cli_command("exec", &["-i", "f", "--", "sh", "-c", "cat > /tmp/cat.bin"])
            .stdin(File::open(&big).unwrap())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        report.sample("exec -i cat > guest file, 256 MiB (ms)", started.elapsed().as_secs_f64() * 1e3);

        let _ = std::fs::remove_dir_all(&back);
        std::fs::create_dir(&back).unwrap();
        let cp_out = timed(&mut serve.cli_command("cp", &["f:/tmp/cat.bin", back.to_str().unwrap()]));
        report.sample("cp f:/tmp/cat.bin HOST, 256 MiB (ms)", cp_out);
        let started = Instant::now();
        let out = serve
            .cli_command("exec", &["f", "--", "cat", "/tmp/cat.bin"])
            .stdout(File::create(back.join("exec.bin")).unwrap())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        report.sample("exec cat guest file > host file, 256 MiB (ms)", started.elapsed().as_secs_f64() * 1e3);
        assert_eq!(std::fs::read(back.join("cat.bin")).unwrap(), data);
        assert_eq!(std::fs::metadata(back.join("exec.bin")).unwrap().len(), BYTES as u64);
        assert!(serve.cli("exec", &["f", "--", "rm", "/tmp/cat.bin"]).status.success());
    }
    report.compare(
        "cp of 256 MiB into a sandbox vs exec -i cat of the same bytes into a guest file (ms)",
        "cp HOST f:/tmp, 256 MiB (ms)",
        "exec -i cat > guest file, 256 MiB (ms)",
        0,
        "<= 1.5",
    );
    report.compare(
        "cp of 256 MiB out of a sandbox (hardened extractor) vs exec cat of the same bytes into a host file (ms)",
        "cp f:/tmp/cat.bin HOST, 256 MiB (ms)",
        "exec cat guest file > host file, 256 MiB (ms)",
        0,
        "<= 1.5",
    );
    report.compare(
        "a mounted host directory's sequential read of 256 MiB into a guest file vs cp of the same file in (ms)",
        "cat mounted file > guest file, 256 MiB (ms)",
        "cp HOST m:/tmp, 256 MiB (ms)",
        0,
        "<= 1.0",
    );
    report.single(
        "a mounted host directory's sequential read of 256 MiB to /dev/null (ms)",
        "cat mounted file > /dev/null, 256 MiB (ms)",
        0,
        "-",
    );
    report.finish("Files in and out", runs);
}

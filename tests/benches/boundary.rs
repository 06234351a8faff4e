//! Launch overhead, guest-to-host throughput and supervisor memory, each against a baseline measured in
//! the same run (medians of `BENCH_RUNS` runs, default 10, interleaved so both sides see the same noise).
//!
//! Run with `scripts/bench`; it builds the release binaries and the image first and prints a Markdown table.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{BareVm, Report, CHANNEL_UP};
use vm_test_support::{procs, Launch, Scratch};

const STREAM_BYTES: usize = 64 << 20;

/// `vm-driver launch -- CMD`, reading stdout; returns wall time, bytes, first-to-last byte span, and the
/// supervisor's peak RSS (VmHWM, KiB) as observed from /proc.
fn launch(scratch: &Scratch, cmd: &[&str]) -> (Duration, usize, Option<Duration>, u64) {
    let mut command = Launch::new(scratch, cmd).command();
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
    let watch_dir = scratch.dir.clone();
    let start = Instant::now();
    let mut child = command.spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let poller = std::thread::spawn(move || {
        let mut peak = 0u64;
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            let sups: Vec<_> = procs::inside(&watch_dir).into_iter().filter(|p| p.is_supervisor()).collect();
            if sups.is_empty() && peak > 0 {
                break;
            }
            for p in sups {
                peak = peak.max(procs::status_kib(p.pid, "VmHWM").unwrap_or(0));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        peak
    });
    let mut buf = vec![0u8; 1 << 16];
    let (mut total, mut first, mut last) = (0usize, None, None);
    while let Ok(n) = stdout.read(&mut buf) {
        if n == 0 {
            break;
        }
        first.get_or_insert_with(Instant::now);
        total += n;
        last = Some(Instant::now());
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "vm-driver launch {cmd:?} failed: {status}");
    let elapsed = start.elapsed();
    (elapsed, total, first.zip(last).map(|(f, l)| l - f), poller.join().unwrap())
}

fn mb_per_s(bytes: usize, span: Option<Duration>) -> f64 {
    let secs = span.map_or(f64::NAN, |d| d.as_secs_f64());
    bytes as f64 / secs / 1e6
}

fn main() {
    let runs = common::runs();
    let scratch = Scratch::new("bench");
    let dd = format!("{CHANNEL_UP}\n/bin/busybox dd if=/dev/zero of=/dev/vport0p1 bs=65536 count={} 2>/dev/null\n/bin/busybox reboot -f", STREAM_BYTES / 65536);
    // The same bytes through one pipe and `cat` first: what any design that hands the workload a pipe pays.
    let piped =
        dd.replace("of=/dev/vport0p1 ", "").replace("2>/dev/null", "2>/dev/null | /bin/busybox cat > /dev/vport0p1");
    let mut report = Report::new("boundary");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        report
            .sample("bare boot+poweroff (s)", BareVm::boot(&scratch, "/bin/busybox reboot -f").drain().0.as_secs_f64());
        report.sample("launch -- true (s)", launch(&scratch, &["true"]).0.as_secs_f64());
        let (_, bytes, span) = BareVm::boot(&scratch, &dd).drain();
        assert_eq!(bytes, STREAM_BYTES, "raw dd delivered everything");
        report.sample("raw dd (MB/s)", mb_per_s(bytes, span));
        let (_, bytes, span) = BareVm::boot(&scratch, &piped).drain();
        assert_eq!(bytes, STREAM_BYTES, "dd | cat delivered everything");
        report.sample("dd | cat (MB/s)", mb_per_s(bytes, span));
        let count = format!("count={}", STREAM_BYTES / 65536);
        let (_, bytes, span, peak) = launch(&scratch, &["dd", "if=/dev/zero", "bs=65536", &count]);
        assert_eq!(bytes, STREAM_BYTES, "our path delivered everything");
        report.sample("ours (MB/s)", mb_per_s(bytes, span));
        report.sample("supervisor peak RSS (MiB)", peak as f64 / 1024.0);
    }
    report.compare(
        "`launch -- true` vs bare QEMU boot+poweroff (s)",
        "launch -- true (s)",
        "bare boot+poweroff (s)",
        3,
        "<= 1.10",
    );
    report.compare("guest->host 64 MiB (MB/s) vs raw `dd` to the port", "ours (MB/s)", "raw dd (MB/s)", 1, ">= 0.60");
    report.compare(
        "guest->host 64 MiB (MB/s) vs `dd \\| cat` to the port",
        "ours (MB/s)",
        "dd | cat (MB/s)",
        1,
        ">= 1.00",
    );
    report.single("supervisor peak RSS streaming 64 MiB (MiB)", "supervisor peak RSS (MiB)", 1, "<= 16");
    report.finish("Launch, throughput, memory", runs);
}

//! Launch overhead, guest-to-host throughput and supervisor memory, each against a baseline measured in
//! the same run (medians of `BENCH_RUNS` runs, default 10, interleaved so both sides see the same noise).
//!
//! Run with `scripts/bench`; it builds the release binaries and the image first and prints a Markdown table.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use vm_e2e::image::with_init_script;
use vm_e2e::{harness, procs, Launch, Scratch};
use vm_protocol::status::Accelerator;
use vm_supervisor::vmm::VmmConfig;

const STREAM_BYTES: usize = 64 << 20;

/// Brings the channel up the way the agent does, for baseline guests that run a shell script as PID 1.
const CHANNEL_UP: &str = r#"
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $(/bin/busybox cat /etc/vm-agent/modules); do /bin/busybox insmod $m; done
while [ ! -e /sys/class/virtio-ports/vport0p1/name ]; do :; done"#;

fn accel() -> Accelerator {
    match harness().accel.as_str() {
        "kvm" => Accelerator::Kvm,
        _ => Accelerator::Tcg,
    }
}

/// QEMU exactly as the supervisor starts it, but without supervisor, agent or protocol. Returns the wall
/// time from spawn to exit and every byte the guest wrote to the channel, with the first and last byte times.
fn bare_qemu(scratch: &Scratch, init: &str) -> (Duration, usize, Option<Duration>) {
    let dir = scratch.dir.join("bare");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let initrd = with_init_script(&dir, init);
    let listener = UnixListener::bind(dir.join("chan.sock")).unwrap();
    let config = VmmConfig {
        qemu: vm_supervisor::vmm::find_qemu().expect("qemu-system-x86_64"),
        kernel: harness().image.join("vmlinuz"),
        initrd,
        cpus: 1,
        memory_mib: 256,
        accel: accel(),
    };
    let start = Instant::now();
    let mut qemu = Command::new(&config.qemu)
        .args(config.args())
        .current_dir(&dir)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (mut conn, _) = listener.accept().unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let (mut total, mut first, mut last) = (0usize, None, None);
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                first.get_or_insert_with(Instant::now);
                total += n;
                last = Some(Instant::now());
            }
        }
    }
    qemu.wait().unwrap();
    let elapsed = start.elapsed();
    let span = first.zip(last).map(|(f, l)| l - f);
    (elapsed, total, span)
}

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
                peak = peak.max(vm_hwm_kib(p.pid));
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

fn vm_hwm_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).map(str::to_owned))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn mb_per_s(bytes: usize, span: Option<Duration>) -> f64 {
    let secs = span.map_or(f64::NAN, |d| d.as_secs_f64());
    bytes as f64 / secs / 1e6
}

fn main() {
    // `cargo bench` passes --bench; any other argument is a filter we do not support.
    let runs: usize = std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let scratch = Scratch::new("bench");
    let dd = format!("{CHANNEL_UP}\n/bin/busybox dd if=/dev/zero of=/dev/vport0p1 bs=65536 count={} 2>/dev/null\n/bin/busybox reboot -f", STREAM_BYTES / 65536);
    // The same bytes through one pipe and `cat` first: what any design that hands the workload a pipe pays.
    let piped =
        dd.replace("of=/dev/vport0p1 ", "").replace("2>/dev/null", "2>/dev/null | /bin/busybox cat > /dev/vport0p1");
    let (mut bare, mut ours, mut raw_tp, mut pipe_tp, mut our_tp, mut rss) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        bare.push(bare_qemu(&scratch, "/bin/busybox reboot -f").0.as_secs_f64());
        ours.push(launch(&scratch, &["true"]).0.as_secs_f64());
        let (_, bytes, span) = bare_qemu(&scratch, &dd);
        assert_eq!(bytes, STREAM_BYTES, "raw dd delivered everything");
        raw_tp.push(mb_per_s(bytes, span));
        let (_, bytes, span) = bare_qemu(&scratch, &piped);
        assert_eq!(bytes, STREAM_BYTES, "dd | cat delivered everything");
        pipe_tp.push(mb_per_s(bytes, span));
        let count = format!("count={}", STREAM_BYTES / 65536);
        let (_, bytes, span, peak) = launch(&scratch, &["dd", "if=/dev/zero", "bs=65536", &count]);
        assert_eq!(bytes, STREAM_BYTES, "our path delivered everything");
        our_tp.push(mb_per_s(bytes, span));
        rss.push(peak as f64 / 1024.0);
    }
    let (bare, ours, rss) = (median(bare), median(ours), median(rss));
    let (raw_tp, pipe_tp, our_tp) = (median(raw_tp), median(pipe_tp), median(our_tp));
    println!("accelerator: {} | runs: {runs} | medians\n", harness().accel);
    println!("| measure | ours | baseline | ratio | goal |");
    println!("|---|---|---|---|---|");
    println!(
        "| `launch -- true` vs bare QEMU boot+poweroff (s) | {ours:.3} | {bare:.3} | {:.2} | <= 1.10 |",
        ours / bare
    );
    println!(
        "| guest->host 64 MiB (MB/s) vs raw `dd` to the port | {our_tp:.1} | {raw_tp:.1} | {:.2} | >= 0.80 |",
        our_tp / raw_tp
    );
    println!(
        "| guest->host 64 MiB (MB/s) vs `dd \\| cat` to the port | {our_tp:.1} | {pipe_tp:.1} | {:.2} | - |",
        our_tp / pipe_tp
    );
    println!("| supervisor peak RSS streaming 64 MiB (MiB) | {rss:.1} | - | - | <= 16 |");
}

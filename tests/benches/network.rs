//! Network through the boundary (issue 22): a sandbox has no NIC, so every byte goes through the agent's
//! loopback proxy, the channel and the supervisor's relay. Three measures, each against a baseline measured
//! in the same run: a 256 MiB download from the host's loopback (guest `curl` in the Debian test image
//! against the host's own `curl` to the same server), with the supervisor's CPU per GiB; the time to first
//! byte of a small HTTPS request (through the proxy against direct from the host); and a 64 MiB download
//! from a server in the guest through `vm-driver port-forward` against the same bytes on `launch`'s stdout.
//! The download is also set against the same bytes sent into the guest on `launch`'s stdin (issue 36).
//! Medians over `BENCH_RUNS` runs (default 10).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::served::{mb_per_s, write_file, Removed};
use common::{median, Report};
use vm_test_support::net::{self, rule, server_dir, throwaway_ca, WebServer, HOST_GATEWAY};
use vm_test_support::procs::{self, Killed};
use vm_test_support::serve::Serve;
use vm_test_support::test_image::{import_into, layout_ref};
use vm_test_support::{Launch, Scratch};

const BIG: usize = 256 << 20;
const FORWARDED: usize = 64 << 20;
const TTFB_REQUESTS: usize = 10;
const GUEST_PORT: u16 = 8000;

/// A child killed when dropped, and its stdout, kept open until then (a guest server writing to it must not
/// see EPIPE).
type KeptOpen = (Killed, ChildStdout);

/// The host's `curl` with `args` (never through a proxy of the host's environment): its `-w` output.
fn curl(args: &[&str]) -> String {
    let out = Command::new("curl").args(["-s", "-S", "--noproxy", "*", "-o", "/dev/null"]).args(args).output().unwrap();
    assert!(out.status.success(), "curl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The utime + stime of the one live supervisor under `dir`, in seconds.
fn supervisor_cpu(dir: &Path) -> f64 {
    let sups: Vec<_> = procs::inside(dir).into_iter().filter(|p| p.comm == "vm-supervisor").collect();
    assert_eq!(sups.len(), 1, "one supervisor: {sups:?}");
    procs::cpu_ticks(sups[0].pid).unwrap() as f64 / rustix::param::clock_ticks_per_second() as f64
}

/// A `launch` of the Debian test image from `store`.
fn launch<'a>(s: &'a Scratch, store: &Path, script: &str) -> Launch<'a> {
    Launch::new(s, &["/bin/sh", "-c", script]).root_image(&layout_ref(), store)
}

/// What one launch through the proxy gave: download MB/s, supervisor CPU seconds over the download, and the
/// median time to first byte of the HTTPS requests (ms).
fn through_proxy(s: &Scratch, store: &Path, policy: &Path, ca: &Path, script: &str, run: usize) -> (f64, f64, f64) {
    let err = s.dir.join(format!("launch-{run}.stderr"));
    let mut cmd = launch(s, store, script).policy(policy).command();
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(std::fs::File::create(&err).unwrap());
    s.waiting_for("the download through the proxy");
    let mut child = Killed(cmd.spawn().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    stdin.write_all(&std::fs::read(ca).unwrap()).unwrap();
    drop(stdin);
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines().map_while(Result::ok);
    let failed = |what: &str| format!("{what}; stderr: {}", std::fs::read_to_string(&err).unwrap_or_default());
    assert_eq!(lines.next().as_deref(), Some("go"), "{}", failed("the guest's go line"));
    let before = supervisor_cpu(&s.dir);
    let download = lines.next().unwrap_or_else(|| panic!("{}", failed("the download's line")));
    let cpu = supervisor_cpu(&s.dir) - before;
    let ttfb: Vec<f64> = lines.map(|l| l.trim().parse::<f64>().unwrap() * 1e3).collect();
    let status = child.0.wait().unwrap();
    assert!(status.success() && ttfb.len() == TTFB_REQUESTS, "{}", failed(&format!("{status}, {ttfb:?}")));
    (mb_per_s(&download, BIG), cpu, median(&ttfb))
}

/// `launch -- CMD` of the Debian image: MB/s of its stdout from the first byte to the last.
fn stdout_stream(s: &Scratch, store: &Path, script: &str) -> f64 {
    let mut cmd = launch(s, store, script).command();
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null());
    s.waiting_for("the baseline launch's stdout");
    let mut child = Killed(cmd.spawn().unwrap());
    let mut stdout = child.0.stdout.take().unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let (mut total, mut first, mut last) = (0usize, None, Instant::now());
    while let Ok(n @ 1..) = stdout.read(&mut buf) {
        first.get_or_insert_with(Instant::now);
        total += n;
        last = Instant::now();
    }
    assert!(child.0.wait().unwrap().success(), "the baseline launch failed");
    assert_eq!(total, FORWARDED, "launch delivered everything");
    total as f64 / (last - first.unwrap()).as_secs_f64() / 1e6
}

/// `launch -- wc -c` of the Debian image fed `BIG` bytes on its stdin: MB/s from the first byte written to
/// the guest's count (host to guest over the attach stream, the agent, a pipe: the download's baseline).
fn stdin_stream(s: &Scratch, store: &Path) -> f64 {
    let mut cmd = launch(s, store, "echo ready; wc -c").command();
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
    s.waiting_for("the baseline launch's stdin");
    let mut child = Killed(cmd.spawn().unwrap());
    let mut stdin = child.0.stdin.take().unwrap();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines().map_while(Result::ok);
    assert_eq!(lines.next().as_deref(), Some("ready"), "the baseline launch started");
    let chunk = vec![b'x'; 1 << 20];
    let start = Instant::now();
    for _ in 0..BIG / chunk.len() {
        stdin.write_all(&chunk).unwrap();
    }
    drop(stdin);
    let counted = lines.next().unwrap_or_default();
    let took = start.elapsed();
    assert_eq!(counted.trim(), BIG.to_string(), "the guest counted every byte");
    assert!(child.0.wait().unwrap().success(), "the baseline launch failed");
    BIG as f64 / took.as_secs_f64() / 1e6
}

/// Whether an HTTP HEAD of `path` on the host's `127.0.0.1:port` answers 200.
fn answers(port: u16, path: &str) -> bool {
    let Ok(mut conn) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = conn.write_all(format!("HEAD {path} HTTP/1.0\r\n\r\n").as_bytes());
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer);
    answer.starts_with(b"HTTP/1.0 200") || answer.starts_with(b"HTTP/1.1 200")
}

fn main() {
    let runs = common::runs();
    // About 40 s a run on 2 cores under TCG, and the setup (an image import, a create).
    let s = Scratch::with_deadline("bench-net", Duration::from_secs(300 + 90 * runs as u64));
    let store = s.dir.join("store");
    import_into(&store);

    let (web_dir, ca_dir, tls_dir) =
        (server_dir("bench-net-web"), server_dir("bench-net-ca"), server_dir("bench-net-tls"));
    let _removed = Removed(vec![web_dir.clone(), ca_dir.clone(), tls_dir.clone()]);
    let web = WebServer::start(&web_dir, None);
    write_file(&web.root.join("big"), BIG);
    let (ca, cert, key) = throwaway_ca(&ca_dir, &[HOST_GATEWAY]);
    let tls = WebServer::start(&tls_dir, Some((&cert, &key)));
    std::fs::write(tls.root.join("small"), "a small answer\n").unwrap();
    let (h, t) = (web.port, tls.port);
    let policy = s.dir.join("policy.json");
    std::fs::write(&policy, net::policy(&["exec", "stdin"], &[rule(HOST_GATEWAY, h), rule(HOST_GATEWAY, t)])).unwrap();
    let g = HOST_GATEWAY;
    // The CA first (stdin), then `go`, a pause (so the host samples the supervisor before the curl starts),
    // the download, and the small HTTPS requests one curl each.
    let script = format!(
        "cat > /tmp/ca.pem; echo go; sleep 0.5; \
         curl -sS -o /dev/null -w '%{{time_total}} %{{size_download}}\\n' http://{g}:{h}/big; \
         for i in $(seq {TTFB_REQUESTS}); do \
         curl -sS -o /dev/null --cacert /tmp/ca.pem -w '%{{time_starttransfer}}\\n' https://{g}:{t}/small; done"
    );
    let resolve = format!("{g}:{t}:127.0.0.1");
    let (big_url, small_url) = (format!("http://127.0.0.1:{h}/big"), format!("https://{g}:{t}/small"));

    let mut report = Report::new("network");
    for i in 0..runs {
        eprintln!("bench: proxy run {}/{runs}", i + 1);
        let (mbps, cpu, ttfb) = through_proxy(&s, &store, &policy, &ca, &script, i);
        report.sample("download through the proxy (MB/s)", mbps);
        report.sample("supervisor CPU per GiB downloaded (s)", cpu / (BIG as f64 / f64::from(1u32 << 30)));
        report.sample("https TTFB through the proxy (ms)", ttfb);
        let direct = curl(&["-w", "%{time_total} %{size_download}", &big_url]);
        report.sample("download direct on the host (MB/s)", mb_per_s(&direct, BIG));
        report.sample("launch stdin host->guest (MB/s)", stdin_stream(&s, &store));
        let ca_arg = ca.to_str().unwrap();
        let direct: Vec<f64> = (0..TTFB_REQUESTS)
            .map(|_| {
                let w = curl(&["--cacert", ca_arg, "--resolve", &resolve, "-w", "%{time_starttransfer}", &small_url]);
                w.trim().parse::<f64>().unwrap() * 1e3
            })
            .collect();
        report.sample("https TTFB direct on the host (ms)", median(&direct));
    }
    drop((web, tls));

    // The forward: a server in a sandbox of `serve`, its file made as the baseline makes its own.
    let serve_scratch = Scratch::with_deadline("bench-net-pf", Duration::from_secs(300 + 60 * runs as u64));
    let log = serve_scratch.dir.join("serve.log");
    let serve = Serve::with_env(&serve_scratch, &[], &["--image-cache", store.to_str().unwrap()], &[], Some(&log));
    let pf_policy = serve_scratch.dir.join("pf.policy.json");
    std::fs::write(&pf_policy, r#"{"allow":["exec","port_forward"]}"#).unwrap();
    let out = serve.cli("create", &["--image", &layout_ref(), "--policy", pf_policy.to_str().unwrap(), "pf"]);
    assert!(out.status.success(), "create: {}", String::from_utf8_lossy(&out.stderr));
    let make = format!("head -c {FORWARDED} /dev/urandom > f");
    let httpd =
        format!("mkdir -p /tmp/w && cd /tmp/w && {make} && echo ready && exec python3 -m http.server {GUEST_PORT} --bind 127.0.0.1");
    let mut server = serve.cli_command("exec", &["pf", "--", "sh", "-c", &httpd]);
    let mut server = Killed(server.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap());
    let mut said = BufReader::new(server.0.stdout.take().unwrap());
    let mut line = String::new();
    said.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready", "the guest's server made its file");
    let server: KeptOpen = (server, said.into_inner());
    let mut forward = serve.cli_command("port-forward", &["pf", &format!("0:{GUEST_PORT}")]);
    let mut forward =
        Killed(forward.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap());
    let mut said = BufReader::new(forward.0.stdout.take().unwrap());
    line.clear();
    said.read_line(&mut line).unwrap();
    let forward: KeptOpen = (forward, said.into_inner());
    // "Forwarding from 127.0.0.1:NNNN -> PORT"
    let port: u16 = line
        .split_whitespace()
        .nth(2)
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("port-forward said {line:?}"));
    let up = Instant::now();
    while !answers(port, "/f") {
        assert!(up.elapsed() < Duration::from_secs(60), "the guest's server never answered through the forward");
        std::thread::sleep(Duration::from_millis(200));
    }
    let url = format!("http://127.0.0.1:{port}/f");
    let baseline = format!("head -c {FORWARDED} /dev/urandom > /tmp/f && cat /tmp/f");
    for i in 0..runs {
        eprintln!("bench: forward run {}/{runs}", i + 1);
        let w = curl(&["-w", "%{time_total} %{size_download}", &url]);
        report.sample("port-forward guest->host (MB/s)", mb_per_s(&w, FORWARDED));
        report.sample("launch stdout guest->host (MB/s)", stdout_stream(&s, &store, &baseline));
    }
    drop((forward, server, serve));

    report.compare(
        "256 MiB from the host's loopback: guest `curl` through the HTTP proxy (curl's time_total) vs the host's `curl` to 127.0.0.1 (MB/s)",
        "download through the proxy (MB/s)",
        "download direct on the host (MB/s)",
        1,
        ">= 0.5",
    );
    report.compare(
        "256 MiB host to guest: guest `curl` through the HTTP proxy vs the same bytes on `launch -- wc -c`'s stdin (MB/s)",
        "download through the proxy (MB/s)",
        "launch stdin host->guest (MB/s)",
        2,
        ">= 0.8",
    );
    report.single(
        "supervisor CPU (utime+stime from /proc, sampled when the guest's line before the curl and the curl's result line arrive) per GiB downloaded (s)",
        "supervisor CPU per GiB downloaded (s)",
        2,
        "-",
    );
    report.compare(
        "small HTTPS GET, time to first byte (median of 10 per run): guest `curl` through the proxy vs the host's `curl` direct (ms)",
        "https TTFB through the proxy (ms)",
        "https TTFB direct on the host (ms)",
        1,
        "-",
    );
    report.compare(
        "64 MiB from python3 http.server in the guest to the host's `curl` through `vm-driver port-forward` vs `launch -- cat` of the same-size file to stdout, first to last byte (MB/s)",
        "port-forward guest->host (MB/s)",
        "launch stdout guest->host (MB/s)",
        1,
        "-",
    );
    report.finish("Network through the boundary", runs);
}

//! TLS interception (issue 24): what terminating the workload's TLS in the supervisor, reading each
//! request and making a second TLS connection costs, against the same bytes passed through untouched.
//! Two HTTPS servers on the host's loopback share one throwaway certificate; the policy intercepts one
//! port and passes the other through. Guest `curl` (Debian test image) measures a small GET's total time
//! intercepted, passed through, and the host's own `curl` direct; and a 256 MiB download intercepted
//! against passed through. Medians over `BENCH_RUNS` runs (default 10).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::served::{mb_per_s, write_file, Removed};
use common::{median, Report};
use vm_test_support::net::{self, server_dir, throwaway_ca, WebServer, HOST_GATEWAY};
use vm_test_support::test_image::{import_into, layout_ref};
use vm_test_support::{Launch, Scratch};

const BIG: usize = 256 << 20;
const SMALL_REQUESTS: usize = 10;

fn main() {
    let runs = common::runs();
    let s = Scratch::with_deadline("bench-intercept", Duration::from_secs(300 + 180 * runs as u64));
    let store = s.dir.join("store");
    import_into(&store);

    let dirs = [server_dir("bench-icpt-ca"), server_dir("bench-icpt-a"), server_dir("bench-icpt-b")];
    let _removed = Removed(dirs.to_vec());
    let (ca, cert, key) = throwaway_ca(&dirs[0], &[HOST_GATEWAY]);
    let intercepted = WebServer::start(&dirs[1], Some((&cert, &key)));
    let passed = WebServer::start(&dirs[2], Some((&cert, &key)));
    for server in [&intercepted, &passed] {
        write_file(&server.root.join("big"), BIG);
        std::fs::write(server.root.join("small"), "a small answer\n").unwrap();
    }
    let (g, i, p) = (HOST_GATEWAY, intercepted.port, passed.port);
    let policy = s.dir.join("policy.json");
    let rules = [
        format!(r#"{{"host":"{g}","ports":[{i}],"tls":"intercept"}}"#),
        format!(r#"{{"host":"{g}","ports":[{p}],"tls":"passthrough"}}"#),
    ];
    std::fs::write(&policy, net::policy(&["exec", "stdin"], &rules)).unwrap();
    // Each measured curl trusts one certificate: the sandbox's CA alone, or the server's. A last series uses
    // the environment's bundle (the system's roots and the sandbox's CA), to show what loading it costs.
    let sandbox_ca = vm_protocol::net::TRUST_CA_FILE;
    let script = format!(
        "cat > /tmp/ca.pem; \
         curl -sS -o /dev/null --cacert {sandbox_ca} -w '%{{time_total}} %{{size_download}}\\n' https://{g}:{i}/big; \
         curl -sS -o /dev/null --cacert /tmp/ca.pem -w '%{{time_total}} %{{size_download}}\\n' https://{g}:{p}/big; \
         for n in $(seq {SMALL_REQUESTS}); do curl -sS -o /dev/null --cacert {sandbox_ca} -w '%{{time_total}}\\n' https://{g}:{i}/small; done; \
         for n in $(seq {SMALL_REQUESTS}); do curl -sS -o /dev/null --cacert /tmp/ca.pem -w '%{{time_total}}\\n' https://{g}:{p}/small; done; \
         for n in $(seq {SMALL_REQUESTS}); do curl -sS -o /dev/null -w '%{{time_total}}\\n' https://{g}:{i}/small; done"
    );
    let resolve = format!("{g}:{p}:127.0.0.1");
    let small_url = format!("https://{g}:{p}/small");

    let mut report = Report::new("interception");
    for run in 0..runs {
        eprintln!("bench: interception run {}/{runs}", run + 1);
        s.waiting_for("the intercepted and passed-through requests");
        let out = Launch::new(&s, &["/bin/sh", "-c", &script])
            .policy(&policy)
            .root_image(&layout_ref(), &store)
            .flag("--egress-ca")
            .flag(ca.to_str().unwrap())
            .stdin(std::fs::read(&ca).unwrap())
            .run();
        let text = out.stdout_text();
        let lines: Vec<&str> = text.lines().collect();
        assert!(out.code == Some(0) && lines.len() == 2 + 3 * SMALL_REQUESTS, "{text}\n{}", out.workload_stderr());
        report.sample("256 MiB intercepted (MB/s)", mb_per_s(lines[0], BIG));
        report.sample("256 MiB passed through (MB/s)", mb_per_s(lines[1], BIG));
        let ms = |range: &[&str]| median(&range.iter().map(|l| l.parse::<f64>().unwrap() * 1e3).collect::<Vec<_>>());
        report.sample("small GET intercepted (ms)", ms(&lines[2..2 + SMALL_REQUESTS]));
        report.sample("small GET passed through (ms)", ms(&lines[2 + SMALL_REQUESTS..2 + 2 * SMALL_REQUESTS]));
        report.sample("small GET intercepted, the environment's bundle (ms)", ms(&lines[2 + 2 * SMALL_REQUESTS..]));
        let direct: Vec<f64> = (0..SMALL_REQUESTS)
            .map(|_| {
                let out = Command::new("curl")
                    .args(["-s", "-S", "--noproxy", "*", "-o", "/dev/null", "-w", "%{time_total}"])
                    .args(["--cacert", ca.to_str().unwrap(), "--resolve", &resolve, &small_url])
                    .output()
                    .unwrap();
                assert!(out.status.success(), "host curl: {}", String::from_utf8_lossy(&out.stderr));
                String::from_utf8_lossy(&out.stdout).trim().parse::<f64>().unwrap() * 1e3
            })
            .collect();
        report.sample("small GET direct on the host (ms)", median(&direct));
    }
    report.compare(
        "small HTTPS GET, total time (median of 10 a run): guest `curl` intercepted vs passed through (ms)",
        "small GET intercepted (ms)",
        "small GET passed through (ms)",
        1,
        "-",
    );
    report.compare(
        "small HTTPS GET, total time (median of 10 a run): guest `curl` intercepted vs the host's `curl` direct (ms)",
        "small GET intercepted (ms)",
        "small GET direct on the host (ms)",
        1,
        "-",
    );
    report.compare(
        "small HTTPS GET, total time (median of 10 a run): guest `curl` intercepted, trusting the environment's bundle (the system's roots and the sandbox's CA) vs the sandbox's CA alone (ms)",
        "small GET intercepted, the environment's bundle (ms)",
        "small GET intercepted (ms)",
        1,
        "-",
    );
    report.compare(
        "256 MiB over HTTPS from the host's loopback: guest `curl` intercepted vs passed through (MB/s)",
        "256 MiB intercepted (MB/s)",
        "256 MiB passed through (MB/s)",
        1,
        "-",
    );
    report.finish("TLS interception", runs);
}

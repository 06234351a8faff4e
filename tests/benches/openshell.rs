//! An OpenShell gateway's path against our own API's, on one `vm-driver serve`, in the same runs: create ->
//! Ready (the gateway's ComputeDriver create until our supervisor's session is live, against `CreateSandbox`
//! until ready) and exec `true` (the gateway's exec: a relay, SSH with `none`, one `exec`, its `exit-status`;
//! against one `Exec` stream). The gateway is the suite's stand-in (`vm_test_support::openshell`,
//! `docs/openshell.md`). Medians over `BENCH_RUNS` runs (default 10), each a fresh sandbox of each kind and
//! the median of `EXECS` execs in it.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::time::{Duration, Instant};

use common::api::create_exec_delete;
use common::{median, ms, Report};
use vm_protocol::openshell::compute::v1::{CreateSandboxRequest, DeleteSandboxRequest};
use vm_test_support::openshell::{self, StandIn};
use vm_test_support::serve::Serve;
use vm_test_support::{wait_until, Scratch};

const EXECS: usize = 30;
const IDLE: [&str; 3] = ["/bin/sh", "-c", "exec sleep 100000"];

fn main() {
    let runs = common::runs();
    let scratch = Scratch::new("bench-openshell");
    let gateway = StandIn::start();
    let socket = scratch.state().join("compute.sock");
    let serve = Serve::with(
        &scratch,
        &[],
        &["--openshell-socket", socket.to_str().unwrap(), "--openshell-endpoint", &gateway.url],
    );
    let (rt, mut client) = serve.grpc();
    let mut driver = gateway.driver(&socket);
    let mut report = Report::new("openshell");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        // Ours first in odd runs, the gateway's first in even ones: neither always boots on a warmer host.
        let ours_first = i % 2 == 0;
        for side in [ours_first, !ours_first] {
            if side {
                let id = format!("api-{i}");
                let (created, exec) = rt.block_on(create_exec_delete(&mut client, &id, EXECS));
                report.sample("ours: create -> ready (ms)", created);
                report.sample("ours: exec true (ms)", exec);
            } else {
                let (id, token) = gateway.mint();
                let begun = Instant::now();
                let sandbox = openshell::sandbox(&id, &token, &format!("bench-{i}"), &IDLE, false);
                gateway.rt.block_on(driver.create_sandbox(CreateSandboxRequest { sandbox: Some(sandbox) })).unwrap();
                assert!(wait_until(Duration::from_secs(120), || gateway.connected(&id)), "Ready");
                report.sample("gateway: create -> Ready (ms)", ms(&begun.elapsed()));
                let mut execs = Vec::with_capacity(EXECS);
                for _ in 0..EXECS {
                    let begun = Instant::now();
                    let out = gateway.rt.block_on(openshell::exec(&gateway, &id, &["true"], b"", false)).unwrap();
                    assert_eq!(out.code, Some(0));
                    execs.push(ms(&begun.elapsed()));
                }
                report.sample("gateway: exec true (ms)", median(&execs));
                let delete = DeleteSandboxRequest { sandbox_id: id, sandbox_name: String::new() };
                gateway.rt.block_on(driver.delete_sandbox(delete)).unwrap();
            }
        }
    }
    report.compare(
        "create -> Ready (ms): a gateway's create vs our CreateSandbox",
        "gateway: create -> Ready (ms)",
        "ours: create -> ready (ms)",
        0,
        "<= 1.2",
    );
    report.compare(
        "exec `true` round trip (ms): a gateway's exec (relay + SSH) vs our Exec",
        "gateway: exec true (ms)",
        "ours: exec true (ms)",
        2,
        "<= 2",
    );
    report.finish(&format!("An OpenShell gateway (the stand-in) vs our API (median of {EXECS} execs a run)"), runs);
}

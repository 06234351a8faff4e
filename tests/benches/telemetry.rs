//! Telemetry costs, against a run without telemetry in the same session (medians of `BENCH_RUNS`, default 3:
//! each run drives 5,000 processes, i.e. 10,000 Process Activity events).
//!
//! - supervisor CPU per 1,000 events, with OCSF JSON + JSONL + OTLP on, and with only console shorthand;
//! - stop time with 10,000 records queued for a collector that was refusing and now accepts, against the stop
//!   time with nothing to flush; the difference is the flush, and 10,000 / flush is the sustained export rate;
//! - the audit chain: events per second and supervisor CPU per 1,000 events with the chain, against the same
//!   build with `no-audit-chain` (both on the controls build, both without the rate limit, which would
//!   otherwise cap the rate measured).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::time::{Duration, Instant};

use common::Report;

use vm_test_support::attach::AttachClient;
use vm_test_support::otlp_receiver::{Behavior, Receiver};
use vm_test_support::procs::{self, signal};
use vm_test_support::{Launch, Running, Scratch, TestControl, CANARY};

const PROCESSES: usize = 5_000;

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    procs::cpu_ticks(pid).expect("a live process")
}

/// (supervisor CPU ms per 1,000 events, stop time, events the collector got)
fn run(n: usize, telemetry: bool) -> (f64, Duration, usize) {
    let receiver = Receiver::start(Behavior::Reject("unavailable".into()));
    let s = Scratch::new(&format!("bench-tel-{n}-{telemetry}"));
    let mut launch = Launch::sleeper(&s);
    launch = if telemetry {
        launch.flag("--otlp-ocsf-endpoint").flag(&receiver.grpc_endpoint())
    } else {
        launch.flag("--ocsf-json").flag("off")
    };
    let mut run = Running::start(launch, &[], CANARY);
    let sup = run.procs().supervisor;
    let before = cpu_ticks(sup.pid);
    AttachClient::connect(&run.sandbox_dir).run_many(&["true"], PROCESSES, 32);
    let ticks = cpu_ticks(sup.pid) - before;
    let cpu_ms_per_1000 = ticks as f64 * 10.0 / (2.0 * PROCESSES as f64 / 1000.0);
    receiver.set_behavior(Behavior::Accept);
    let start = Instant::now();
    signal(run.driver_pid(), nix::sys::signal::Signal::SIGTERM);
    run.driver.wait().unwrap();
    (cpu_ms_per_1000, start.elapsed(), receiver.records().len())
}

/// (events per second, supervisor CPU ms per 1,000 events) over 2,000 processes, with or without the chain.
fn run_chain(n: usize, chain: bool) -> (f64, f64) {
    const DRIVEN: usize = 2_000;
    let s = Scratch::new(&format!("bench-chain-{n}-{chain}"));
    let mut launch = Launch::sleeper(&s).control(TestControl::NoTelemetryLimits);
    if !chain {
        launch = launch.control(TestControl::NoAuditChain);
    }
    let run = Running::start(launch, &[], CANARY);
    let sup = run.procs().supervisor;
    let before = cpu_ticks(sup.pid);
    let start = Instant::now();
    AttachClient::connect(&run.sandbox_dir).run_many(&["true"], DRIVEN, 32);
    let elapsed = start.elapsed().as_secs_f64();
    let ticks = cpu_ticks(sup.pid) - before;
    let events = 2.0 * DRIVEN as f64;
    (events / elapsed, ticks as f64 * 10.0 / (events / 1000.0))
}

fn main() {
    let runs = common::runs_or(3).min(5);
    let mut report = Report::new("telemetry");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        let (cpu, stop, received) = run(i, true);
        assert!(received >= 2 * PROCESSES, "every queued event was delivered ({received})");
        report.sample("cpu with sinks", cpu);
        report.sample("stop with 10k queued (s)", stop.as_secs_f64());
        let (cpu, stop, _) = run(i, false);
        report.sample("cpu shorthand only", cpu);
        report.sample("stop with nothing queued (s)", stop.as_secs_f64());
    }
    for i in 0..runs {
        let (rate, cpu) = run_chain(i, true);
        report.sample("events/s with the chain", rate);
        report.sample("cpu with the chain", cpu);
        let (rate, cpu) = run_chain(i, false);
        report.sample("events/s without the chain", rate);
        report.sample("cpu without the chain", cpu);
    }
    report.compare(
        "events per second driving 2,000 processes: audit chain vs no-audit-chain (controls build)",
        "events/s with the chain",
        "events/s without the chain",
        0,
        ">= 0.90",
    );
    report.compare(
        "supervisor CPU per 1,000 events (ms): audit chain vs no-audit-chain (controls build)",
        "cpu with the chain",
        "cpu without the chain",
        1,
        "-",
    );
    report.compare(
        "supervisor CPU per 1,000 events (ms): OCSF JSON + JSONL + OTLP vs console shorthand only",
        "cpu with sinks",
        "cpu shorthand only",
        1,
        "-",
    );
    report.compare(
        "stop (s): 10,000 events queued for the collector vs nothing queued",
        "stop with 10k queued (s)",
        "stop with nothing queued (s)",
        2,
        "-",
    );
    report.finish("Telemetry (each run drives 5,000 processes = 10,000 Process Activity events)", runs);
}

//! Telemetry costs, against a run without telemetry in the same session (medians of `BENCH_RUNS`, default 3:
//! each run drives 5,000 processes, i.e. 10,000 Process Activity events).
//!
//! - supervisor CPU per 1,000 events, with OCSF JSON + JSONL + OTLP on, and with only console shorthand;
//! - stop time with 10,000 records queued for a collector that was refusing and now accepts, against the stop
//!   time with nothing to flush; the difference is the flush, and 10,000 / flush is the sustained export rate.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::time::{Duration, Instant};

use common::median;

use vm_e2e::attach::AttachClient;
use vm_e2e::otlp_receiver::{Behavior, Receiver};
use vm_e2e::procs::signal;
use vm_e2e::{Launch, Running, Scratch};

const PROCESSES: usize = 5_000;

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: i32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = text.rsplit_once(") ").unwrap().1.split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// (supervisor CPU ms per 1,000 events, stop time, events the collector got)
fn run(n: usize, telemetry: bool) -> (f64, Duration, usize) {
    let receiver = Receiver::start(Behavior::Reject("unavailable".into()));
    let s = Scratch::new(&format!("bench-tel-{n}-{telemetry}"));
    let mut launch = Launch::new(&s, &["/bin/sh", "-c", "echo up; exec sleep 1000"]);
    launch = if telemetry {
        launch.flag("--otlp-ocsf-endpoint").flag(&receiver.grpc_endpoint())
    } else {
        launch.flag("--ocsf-json").flag("off")
    };
    let mut run = Running::start(launch, &[], "up");
    let sup = run.procs().supervisor;
    let before = cpu_ticks(sup.pid);
    AttachClient::connect(&run.sandbox_dir).run_many(&["true"], PROCESSES, 32);
    let ticks = cpu_ticks(sup.pid) - before;
    let cpu_ms_per_1000 = ticks as f64 * 10.0 / (2.0 * PROCESSES as f64 / 1000.0);
    receiver.set_behavior(Behavior::Accept);
    let start = Instant::now();
    signal(i32::try_from(run.driver.id()).unwrap(), nix::sys::signal::Signal::SIGTERM);
    run.driver.wait().unwrap();
    (cpu_ms_per_1000, start.elapsed(), receiver.records().len())
}

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3).min(5);
    let (mut cpu_on, mut cpu_off, mut stop_on, mut stop_off) = (vec![], vec![], vec![], vec![]);
    for i in 0..runs {
        let (cpu, stop, received) = run(i, true);
        assert!(received >= 2 * PROCESSES, "every queued event was delivered ({received})");
        cpu_on.push(cpu);
        stop_on.push(stop.as_secs_f64());
        let (cpu, stop, _) = run(i, false);
        cpu_off.push(cpu);
        stop_off.push(stop.as_secs_f64());
    }
    let (cpu_on, cpu_off) = (median(cpu_on), median(cpu_off));
    let (stop_on, stop_off) = (median(stop_on), median(stop_off));
    let flush = (stop_on - stop_off).max(0.001);
    println!("\n| telemetry ({runs} runs, medians) | with OCSF JSON + JSONL + OTLP | shorthand only | ratio |");
    println!("|---|---|---|---|");
    println!("| supervisor CPU per 1,000 events (ms) | {cpu_on:.1} | {cpu_off:.1} | {:.2} |", cpu_on / cpu_off);
    println!("| stop with 10,000 events queued (s) | {stop_on:.2} | {stop_off:.2} (nothing queued) | - |");
    println!("| flush of 10,000 queued events (s) | {flush:.2} | - | - |");
    println!("| events per second sustained to the collector | {:.0} | - | - |", 10_000.0 / flush);
}

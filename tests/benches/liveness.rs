//! Fault to VMM exit, for the three faults the lease and the liveness pipe exist for. `BENCH_RUNS` runs
//! (default 10); each boots a fresh sandbox, waits for its canary, injects the fault and times the VMM's
//! exit through a pidfd opened beforehand.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::time::{Duration, Instant};

use common::Report;
use nix::sys::signal::Signal::{SIGCONT, SIGKILL, SIGSTOP};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, Pid, PidfdFlags};
use vm_test_support::procs::signal;
use vm_test_support::{Launch, Running, Scratch};

#[derive(Clone, Copy)]
enum Fault {
    KillDriver,
    KillSupervisor,
    StopSupervisor,
}

fn once(fault: Fault, n: usize) -> Duration {
    let s = Scratch::new(&format!("bench-live-{n}"));
    let mut run = Running::start(Launch::new(&s, &["/bin/sh", "-c", "echo up; exec sleep 1000"]), &[], "up");
    let p = run.procs();
    let pidfd = pidfd_open(Pid::from_raw(p.vmm.pid).unwrap(), PidfdFlags::empty()).unwrap();
    let start = Instant::now();
    match fault {
        Fault::KillDriver => {
            run.driver.kill().unwrap();
        }
        Fault::KillSupervisor => signal(p.supervisor.pid, SIGKILL),
        Fault::StopSupervisor => signal(p.supervisor.pid, SIGSTOP),
    }
    let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
    let ready = poll(&mut fds, Some(&Timespec { tv_sec: 30, tv_nsec: 0 })).unwrap();
    let elapsed = start.elapsed();
    assert_eq!(ready, 1, "the VMM exited");
    signal(p.supervisor.pid, SIGCONT);
    elapsed
}

fn main() {
    let runs = common::runs();
    let mut report = Report::new("liveness");
    let faults = [
        ("driver SIGKILL -> VMM exit (ms)", Fault::KillDriver, "<= 100"),
        ("supervisor SIGKILL -> VMM exit (ms)", Fault::KillSupervisor, "<= 100"),
        ("supervisor SIGSTOP -> VMM exit (ms)", Fault::StopSupervisor, "<= 3000"),
    ];
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        for (name, fault, _) in faults {
            report.sample(name, once(fault, i).as_secs_f64() * 1e3);
        }
    }
    for (name, _, goal) in faults {
        report.single(name, name, 1, goal);
    }
    report.finish("Liveness: fault to VMM exit", runs);
}

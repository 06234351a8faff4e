//! `vm-driver serve`: the exec round trip of `true` in a running sandbox, and create -> ready, against
//! the raw channel's ping-pong, a bare guest that runs `true` per round trip, and a bare boot, all measured
//! in the same run; and create -> ready against the same service with `--confinement none` (the jail's
//! cost). Medians over `BENCH_RUNS` runs (default 10); each run creates a fresh sandbox and times 100 execs
//! in it, each a new `Exec` stream on one gRPC connection, from the first request to the exit. Where an
//! exec's time goes: the CPU each process used over those execs (QEMU, which runs the guest and its agent;
//! the supervisor; `serve`; this client), per exec, against bare QEMU's per trip.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::api::exec_true;
use common::{channel_up_then_one_byte, median, ms, BareVm, Report, CHANNEL_UP};
use vm_contract::pids::SandboxPids;
use vm_protocol::driver_api::SandboxRef;
use vm_test_support::api::create_ready;
use vm_test_support::procs::{cpu_ticks, thread_cpu_ticks};
use vm_test_support::serve::Serve;
use vm_test_support::Scratch;

const EXECS: usize = 100;

/// What a CPU figure counts.
#[derive(Clone, Copy)]
enum Meter {
    /// A whole process.
    Process(i32),
    /// One thread of a process.
    Thread(i32, i32),
    /// A process but one of its threads.
    Rest(i32, i32),
}

/// QEMU's busiest thread so far: with one vCPU under TCG, the vCPU thread, which ran the guest's whole boot
/// (QEMU names its threads only with `-name debug-threads=on`). The rest is its main loop, which serves the
/// devices (the channel's socket and virtqueues), and helpers.
fn vcpu_thread(qemu: i32) -> i32 {
    std::fs::read_dir(format!("/proc/{qemu}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| t.file_name().to_str()?.parse::<i32>().ok())
        .max_by_key(|tid| thread_cpu_ticks(qemu, *tid).unwrap_or(0))
        .unwrap()
}

impl Meter {
    fn ticks(self) -> u64 {
        match self {
            Self::Process(pid) => cpu_ticks(pid).unwrap(),
            Self::Thread(pid, tid) => thread_cpu_ticks(pid, tid).unwrap(),
            Self::Rest(pid, tid) => {
                // The thread first: the process's total, read after, already holds what it counted.
                let thread = thread_cpu_ticks(pid, tid).unwrap();
                cpu_ticks(pid).unwrap().saturating_sub(thread)
            }
        }
    }

    /// QEMU's vCPU thread and the rest of it.
    fn qemu(pid: i32) -> [Self; 2] {
        let vcpu = vcpu_thread(pid);
        [Self::Thread(pid, vcpu), Self::Rest(pid, vcpu)]
    }
}

/// CPU milliseconds each meter counted while `f` ran, divided by `per`.
fn cpu_ms_per<T>(meters: &[Meter], per: usize, f: impl FnOnce() -> T) -> (Vec<f64>, T) {
    let ticks = || meters.iter().map(|m| m.ticks()).collect::<Vec<_>>();
    let before = ticks();
    let out = f();
    let hz = rustix::param::clock_ticks_per_second() as f64;
    let used = ticks().into_iter().zip(before).map(|(after, before)| (after - before) as f64 / hz * 1e3 / per as f64);
    (used.collect(), out)
}

/// Baselines on a bare guest (a shell script as PID 1, no agent, supervisor or protocol): `EXECS` one-byte
/// round trips in which the guest runs `/bin/busybox true` before answering, and QEMU's CPU per trip; then
/// `EXECS` plain ones echoed by `cat`: the raw channel's ping-pong.
fn bare_round_trips(scratch: &Scratch) -> (Vec<Duration>, Vec<f64>, Vec<Duration>) {
    let init = format!(
        "{CHANNEL_UP}\nexec 3<>/dev/vport0p1\n\
         while read -n 1 c <&3 && [ \"$c\" = e ]; do /bin/busybox true; echo -n e >&3; done\n\
         exec /bin/busybox cat <&3 >&3"
    );
    let mut vm = BareVm::boot(scratch, &init);
    // The first trip of each kind waits for the guest to boot, or for `cat` to start.
    let qemu = i32::try_from(vm.qemu.id()).unwrap();
    let conn = &mut vm.conn;
    trip(conn, b'e');
    let (cpu, spawns) = cpu_ms_per(&Meter::qemu(qemu), EXECS, || (0..EXECS).map(|_| trip(conn, b'e')).collect());
    conn.write_all(b"q").unwrap();
    trip(conn, b'p');
    let pings = (0..EXECS).map(|_| trip(conn, b'p')).collect();
    (spawns, cpu, pings)
}

fn trip(conn: &mut UnixStream, byte: u8) -> Duration {
    let mut back = [0u8; 1];
    let t = Instant::now();
    conn.write_all(&[byte]).unwrap();
    conn.read_exact(&mut back).unwrap();
    assert_eq!(back[0], byte, "the guest answers");
    t.elapsed()
}

fn main() {
    let runs = common::runs();
    let scratch = Scratch::new("bench-svc");
    let serve = Serve::start(&scratch);
    let (rt, mut client) = serve.grpc();
    // The same service without the jail: the jail's cost at create.
    let open_scratch = Scratch::new("bench-svc-open");
    let open = Serve::with(&open_scratch, &[], &["--confinement", "none"]);
    let (open_rt, mut open_client) = open.grpc();
    let mut report = Report::new("service");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        report.sample(
            "bare boot to first channel byte (ms)",
            ms(&BareVm::boot(&scratch, &channel_up_then_one_byte()).first_byte()),
        );
        let (spawn_trips, bare_cpu, ping_trips) = bare_round_trips(&scratch);
        report.sample("bare guest `true` per trip (ms)", median(&spawn_trips.iter().map(ms).collect::<Vec<_>>()));
        report.sample("bare QEMU CPU per trip (ms)", bare_cpu.iter().sum());
        report.sample("bare QEMU vCPU per trip (ms)", bare_cpu[0]);
        report.sample("bare QEMU main loop per trip (ms)", bare_cpu[1]);
        report.sample("raw ping-pong (ms)", median(&ping_trips.iter().map(ms).collect::<Vec<_>>()));
        let id = format!("bench-{i}");
        open_rt.block_on(async {
            report.sample(
                "create -> ready, --confinement none (ms)",
                ms(&create_ready(&mut open_client, &id, None).await.0),
            );
            open_client.delete_sandbox(SandboxRef { sandbox_id: id.clone() }).await.unwrap();
        });
        let created = rt.block_on(create_ready(&mut client, &id, None)).0;
        report.sample("create -> ready (ms)", ms(&created));
        let p = SandboxPids::read(&serve.sandbox(&id)).unwrap();
        let qemu = p.vmm.unwrap().pid;
        let [vcpu, rest] = Meter::qemu(qemu);
        let meters = [
            vcpu,
            rest,
            Meter::Process(p.supervisor.pid),
            Meter::Process(serve.pid()),
            Meter::Process(i32::try_from(std::process::id()).unwrap()),
        ];
        let (cpu, times) = cpu_ms_per(&meters, EXECS, || {
            (0..EXECS).map(|_| ms(&rt.block_on(exec_true(&mut client, &id)))).collect::<Vec<_>>()
        });
        report.sample("exec true (ms)", median(&times));
        report.sample("QEMU CPU per exec (ms)", cpu[0] + cpu[1]);
        for (name, used) in ["QEMU vCPU", "QEMU main loop", "supervisor", "serve", "the client"].iter().zip(cpu) {
            report.sample(&format!("{name} CPU per exec (ms)"), used);
        }
        rt.block_on(client.delete_sandbox(SandboxRef { sandbox_id: id.clone() })).unwrap();
    }
    report.compare(
        "exec `true` round trip (ms) vs raw channel 1-byte ping-pong",
        "exec true (ms)",
        "raw ping-pong (ms)",
        3,
        "-",
    );
    report.compare(
        "exec `true` round trip (ms) vs bare guest running `true` per 1-byte trip",
        "exec true (ms)",
        "bare guest `true` per trip (ms)",
        2,
        "<= 1.30",
    );
    report.compare(
        "QEMU CPU per exec `true` (the guest, its agent included) vs bare QEMU's per `true` trip (ms)",
        "QEMU CPU per exec (ms)",
        "bare QEMU CPU per trip (ms)",
        2,
        "-",
    );
    report.compare(
        "of which QEMU's vCPU thread (the guest's instructions) vs the bare guest's (ms)",
        "QEMU vCPU CPU per exec (ms)",
        "bare QEMU vCPU per trip (ms)",
        2,
        "-",
    );
    report.compare(
        "of which QEMU's other threads (its devices: the channel) vs the bare guest's (ms)",
        "QEMU main loop CPU per exec (ms)",
        "bare QEMU main loop per trip (ms)",
        2,
        "-",
    );
    for name in ["supervisor", "serve", "the client"] {
        report.single(&format!("{name} CPU per exec `true` (ms)"), &format!("{name} CPU per exec (ms)"), 2, "-");
    }
    report.compare(
        "create -> ready (ms), jailed vs --confinement none",
        "create -> ready (ms)",
        "create -> ready, --confinement none (ms)",
        0,
        "-",
    );
    report.compare(
        "create -> ready (ms) vs bare boot to the guest's first channel byte",
        "create -> ready (ms)",
        "bare boot to first channel byte (ms)",
        0,
        "-",
    );
    report.finish(&format!("The service (each run: a fresh sandbox, median of {EXECS} execs in it)"), runs);
}

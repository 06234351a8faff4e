//! `vm-driver serve`: the exec round trip of `true` in a running sandbox, and create -> ready, against
//! the raw channel's ping-pong, a bare guest that runs `true` per round trip, and a bare boot, all measured
//! in the same run; and create -> ready against the same service with `--confinement none` (the jail's
//! cost). Medians over `BENCH_RUNS` runs (default 10); each run creates a fresh sandbox and times 100 execs
//! in it, each a new `Exec` stream on one gRPC connection, from the first request to the exit.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::api::create_exec_delete;
use common::{channel_up_then_one_byte, median, ms, BareVm, Report, CHANNEL_UP};
use vm_protocol::driver_api::SandboxRef;
use vm_test_support::api::create_ready;
use vm_test_support::serve::Serve;
use vm_test_support::Scratch;

const EXECS: usize = 100;

/// Baselines on a bare guest (a shell script as PID 1, no agent, supervisor or protocol): `EXECS` one-byte
/// round trips in which the guest runs `/bin/busybox true` before answering, then `EXECS` plain ones
/// echoed by `cat`: the raw channel's ping-pong.
fn bare_round_trips(scratch: &Scratch) -> (Vec<Duration>, Vec<Duration>) {
    let init = format!(
        "{CHANNEL_UP}\nexec 3<>/dev/vport0p1\n\
         while read -n 1 c <&3 && [ \"$c\" = e ]; do /bin/busybox true; echo -n e >&3; done\n\
         exec /bin/busybox cat <&3 >&3"
    );
    let mut vm = BareVm::boot(scratch, &init);
    // The first trip of each kind waits for the guest to boot, or for `cat` to start.
    let conn = &mut vm.conn;
    trip(conn, b'e');
    let spawns = (0..EXECS).map(|_| trip(conn, b'e')).collect();
    conn.write_all(b"q").unwrap();
    trip(conn, b'p');
    let pings = (0..EXECS).map(|_| trip(conn, b'p')).collect();
    (spawns, pings)
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
        let (spawn_trips, ping_trips) = bare_round_trips(&scratch);
        report.sample("bare guest `true` per trip (ms)", median(&spawn_trips.iter().map(ms).collect::<Vec<_>>()));
        report.sample("raw ping-pong (ms)", median(&ping_trips.iter().map(ms).collect::<Vec<_>>()));
        let id = format!("bench-{i}");
        open_rt.block_on(async {
            report.sample(
                "create -> ready, --confinement none (ms)",
                ms(&create_ready(&mut open_client, &id, None).await.0),
            );
            open_client.delete_sandbox(SandboxRef { sandbox_id: id.clone() }).await.unwrap();
        });
        let (created, exec) = rt.block_on(create_exec_delete(&mut client, &id, EXECS));
        report.sample("create -> ready (ms)", created);
        report.sample("exec true (ms)", exec);
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

//! `vm-driver serve`: the exec round trip of `true` in a running sandbox, and create -> ready, against
//! the raw channel's ping-pong and a bare boot measured in the same run. Medians over `BENCH_RUNS` runs
//! (default 10); each run creates a fresh sandbox and times 100 execs in it.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{median, BareVm, CHANNEL_UP};
use tokio_stream::StreamExt;
use vm_e2e::serve::Serve;
use vm_e2e::{harness, Scratch};
use vm_protocol::driver_api::driver_client::DriverClient;
use vm_protocol::driver_api::{
    exec_request, exec_response, watch_event, CreateSandboxRequest, ExecRequest, ExecStart, SandboxRef, SandboxState,
    StdinEof, WatchRequest,
};

const EXECS: usize = 100;

type Client = DriverClient<tonic::transport::Channel>;

/// CreateSandbox until Watch reports it ready.
async fn create_ready(client: &mut Client, id: &str) -> Duration {
    let mut events = client.watch(WatchRequest { sandbox_id: id.to_owned() }).await.unwrap().into_inner();
    let start = Instant::now();
    client.create_sandbox(CreateSandboxRequest { sandbox_id: id.to_owned(), spec: None }).await.unwrap();
    while let Some(event) = events.next().await {
        if let Some(watch_event::Event::Changed(s)) = event.unwrap().event {
            assert_ne!(s.state, i32::from(SandboxState::Failed), "sandbox failed: {}", s.detail);
            if s.state == i32::from(SandboxState::Ready) {
                return start.elapsed();
            }
        }
    }
    panic!("watch ended before {id} was ready")
}

/// One Exec stream running `true`, from the request to the exit status.
async fn exec_true(client: &mut Client, id: &str) -> Duration {
    let start = ExecStart { sandbox_id: id.to_owned(), argv: vec!["true".into()], ..Default::default() };
    let requests = [
        ExecRequest { request: Some(exec_request::Request::Start(start)) },
        ExecRequest { request: Some(exec_request::Request::StdinEof(StdinEof {})) },
    ];
    let begun = Instant::now();
    let mut stream = client.exec(tokio_stream::iter(requests)).await.unwrap().into_inner();
    while let Some(response) = stream.next().await {
        if let Some(exec_response::Response::Exited(e)) = response.unwrap().response {
            assert_eq!(e.status, 0, "true exits 0");
            return begun.elapsed();
        }
    }
    panic!("exec stream ended without an exit status")
}

/// A bare guest echoes each byte back on the channel: spawn to the first byte (the guest is up and its
/// channel open), then `EXECS` one-byte round trips.
fn bare_ping_pong(scratch: &Scratch) -> (Duration, Vec<Duration>) {
    let init = format!("{CHANNEL_UP}\nexec 3<>/dev/vport0p1\n/bin/busybox echo -n u >&3\n/bin/busybox cat <&3 >&3");
    let mut vm = BareVm::boot(scratch, &init);
    let mut byte = [0u8; 1];
    vm.conn.read_exact(&mut byte).unwrap();
    let up = vm.started.elapsed();
    let trips = (0..EXECS)
        .map(|_| {
            let t = Instant::now();
            vm.conn.write_all(b"p").unwrap();
            vm.conn.read_exact(&mut byte).unwrap();
            assert_eq!(&byte, b"p", "the guest echoes");
            t.elapsed()
        })
        .collect();
    (up, trips)
}

fn ms(d: &Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let runs = common::runs();
    let scratch = Scratch::new("bench-svc");
    let serve = Serve::start(&scratch, &[]);
    let (rt, mut client) = serve.grpc();
    let (mut ready, mut bare_up, mut execs, mut pings) = (vec![], vec![], vec![], vec![]);
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        let (up, trips) = bare_ping_pong(&scratch);
        bare_up.push(ms(&up));
        pings.extend(trips.iter().map(ms));
        let id = format!("bench-{i}");
        rt.block_on(async {
            ready.push(ms(&create_ready(&mut client, &id).await));
            for _ in 0..EXECS {
                execs.push(ms(&exec_true(&mut client, &id).await));
            }
            client.delete_sandbox(SandboxRef { sandbox_id: id.clone() }).await.unwrap();
        });
    }
    let (ready, bare_up, exec, ping) = (median(ready), median(bare_up), median(execs), median(pings));
    println!("accelerator: {} | runs: {runs}, {EXECS} execs and pings each | medians\n", harness().accel);
    println!("| measure | ours | baseline | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| exec `true` round trip (ms) vs raw channel 1-byte ping-pong | {exec:.2} | {ping:.3} | {:.1} |",
        exec / ping
    );
    println!(
        "| create -> ready (ms) vs bare QEMU boot to the channel's first byte | {ready:.0} | {bare_up:.0} | {:.2} |",
        ready / bare_up
    );
}

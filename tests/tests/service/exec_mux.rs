//! `vm-driver serve` runs every Exec stream into a sandbox over one attach connection, on real VMs: many
//! concurrent streams add no connection to the supervisor, and a stream whose client does not read stalls
//! only its own process (with a control: the stall reaches the other streams once the per-process queues
//! are bypassed).

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use tokio_stream::StreamExt;
use vm_protocol::driver_api::{exec_request, exec_response, ExecRequest, ExecStart, StdinEof};
use vm_test_support::output::ok;
use vm_test_support::serve::Serve;
use vm_test_support::{procs, wait_until, Scratch, TestControl};

/// The sandbox's supervisor: the one process of the scratch directory that is one.
fn supervisor(s: &Scratch) -> i32 {
    let found: Vec<i32> =
        procs::inside(&s.dir).into_iter().filter(procs::ProcInfo::is_supervisor).map(|p| p.pid).collect();
    assert_eq!(found.len(), 1, "one sandbox, one supervisor: {found:?}");
    found[0]
}

/// Sockets the process holds open (the attach listener, its clients, the guest channel, ...).
fn sockets(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:")))
        .count()
}

#[test]
fn concurrent_exec_streams_share_one_attach_connection() {
    let s = Scratch::new("mux-one");
    let serve = Serve::start(&s);
    ok(serve.cli("create", &["one"]));
    let sup = supervisor(&s);
    // The first exec makes the sandbox's connection, which stays for the next ones.
    assert_eq!(ok(serve.cli("exec", &["one", "--", "echo", "first"])), "first\n");
    let idle = sockets(sup);
    let (rt, mut client) = serve.grpc();
    const STREAMS: usize = 12;
    rt.block_on(async {
        // Each holds its process open until its stdin ends, so all of them run at once.
        let mut streams = Vec::new();
        let mut inputs = Vec::new();
        for _ in 0..STREAMS {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let start = ExecStart { sandbox_id: "one".into(), argv: vec!["cat".into()], ..Default::default() };
            tx.send(ExecRequest { request: Some(exec_request::Request::Start(start)) }).await.unwrap();
            let mut stream = client.exec(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
            let first = stream.next().await.unwrap().unwrap().response;
            assert!(matches!(first, Some(exec_response::Response::Started(_))), "{first:?}");
            streams.push(stream);
            inputs.push(tx);
        }
        let live = sockets(sup);
        assert_eq!(live, idle, "{STREAMS} running exec streams added {} sockets to the supervisor", live - idle);
        for (i, tx) in inputs.iter().enumerate() {
            tx.send(ExecRequest { request: Some(exec_request::Request::Stdin(format!("s{i}\n").into_bytes())) })
                .await
                .unwrap();
            tx.send(ExecRequest { request: Some(exec_request::Request::StdinEof(StdinEof {})) }).await.unwrap();
        }
        for (i, mut stream) in streams.into_iter().enumerate() {
            let (mut out, mut status) = (Vec::new(), None);
            while let Some(r) = stream.next().await {
                match r.unwrap().response {
                    Some(exec_response::Response::Stdout(b)) => out.extend_from_slice(&b),
                    Some(exec_response::Response::Exited(e)) => status = Some(e.status),
                    _ => {}
                }
            }
            assert_eq!((String::from_utf8_lossy(&out).into_owned(), status), (format!("s{i}\n"), Some(0)));
        }
    });
    eprintln!("e2e: {STREAMS} concurrent exec streams, {idle} supervisor sockets before and during");
}

/// Runs `vm-driver exec -t` into `id` with its stdout never read: a client that stops reading once its
/// buffers (the pipe, the HTTP/2 window) are full. Its process writes 1 KB pieces forever and counts them in
/// `/tmp/pieces`, so a test can see when it is held back. On a pseudo-terminal, whose line discipline hands
/// the agent at most 4 KiB a read, its output leaves the guest as small frames however the host keeps pace:
/// its output window (256 KiB) holds many more of them than the stream's response queue (16) and, under the
/// control, its one-frame queue. (From a pipe, output that waited for credit leaves as a few large frames,
/// which even the control's queues hold without a stall: the control once failed so in CI.)
fn unread_exec(serve: &Serve, id: &str) -> Child {
    let script = "s=$(head -c 1000 /dev/zero | tr '\\0' x); i=0; \
                  while :; do printf %s \"$s\"; i=$((i+1)); echo $i > /tmp/pieces; done";
    serve.cli_command("exec", &["-t", id, "--", "sh", "-c", script]).stdout(Stdio::piped()).spawn().unwrap()
}

/// Whether `vm-driver exec ID -- echo quick` finishes within `limit`.
fn quick_exec_within(serve: &Serve, id: &str, limit: Duration) -> bool {
    let mut quick = serve.cli_command("exec", &[id, "--", "echo", "quick"]).stdout(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    let done = wait_until(limit, || quick.try_wait().unwrap().is_some());
    if !done {
        let _ = quick.kill();
    }
    let out = quick.wait_with_output().unwrap();
    if done {
        assert_eq!(String::from_utf8_lossy(&out.stdout), "quick\n");
        eprintln!("e2e: the quick exec took {:?} beside the unread one", start.elapsed());
    }
    done
}

/// A sandbox with one exec whose client does not read.
fn stalled(controls: &[TestControl], name: &str) -> (Scratch, Serve, Child) {
    let s = Scratch::new(name);
    let serve = Serve::with_controls(&s, controls);
    ok(serve.cli("create", &["stall"]));
    let slow = unread_exec(&serve, "stall");
    (s, serve, slow)
}

#[test]
fn a_stream_whose_client_does_not_read_stalls_only_its_own_process() {
    let (_s, serve, mut slow) = stalled(&[], "mux-stall");
    // Held back: its piece count stops moving once every buffer on its way is full (however slow the host).
    let pieces = || ok(serve.cli("exec", &["stall", "--", "sh", "-c", "cat /tmp/pieces 2>/dev/null || echo 0"]));
    let mut last = String::new();
    let held = wait_until(Duration::from_secs(120), || {
        std::thread::sleep(Duration::from_secs(3));
        let now = pieces();
        let unchanged = now == last && now.trim() != "0";
        last = now;
        unchanged
    });
    assert!(held, "the unread stream was never held back (pieces: {last})");
    assert!(quick_exec_within(&serve, "stall", Duration::from_secs(20)), "the unread stream stalled another");
    assert!(slow.try_wait().unwrap().is_none(), "the unread stream is still open, its process held back");
    let _ = slow.kill();
}

#[test]
fn control_without_per_process_queues_one_unread_stream_stalls_the_sandbox() {
    let (_s, serve, mut slow) = stalled(&[TestControl::ExecMuxHeadOfLine], "mux-stall-ctl");
    // Once the unread stream's buffers are full, a quick exec beside it stalls; on a slow host that takes
    // longer, so it is tried until it stalls.
    let stalls = wait_until(Duration::from_secs(120), || !quick_exec_within(&serve, "stall", Duration::from_secs(15)));
    assert!(stalls, "the control should stall the quick exec");
    let _ = slow.kill();
    eprintln!("e2e: control: with the reader waiting on one process's queue, a quick exec beside it stalls");
}

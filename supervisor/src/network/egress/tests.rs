use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch, Semaphore};
use vm_protocol::link::ToGuest;
use vm_protocol::net::{Listener, NetToGuest, StreamFrame, StreamId, EGRESS_DOWNLOAD_WINDOW_BYTES, NET_WINDOW_BYTES};
use vm_protocol::policy::network::{NetRule, HOST_GATEWAY};

use super::{run, Context, Report, DOWNLOAD_BUDGET_BYTES};
use crate::boot::guest_link::Queued;
use crate::network::intercept::secrets::Secrets;
use crate::network::pipe::Pipe;
use crate::network::resolve::Resolver;
use crate::policy::NetView;

/// A CONNECT tunnel to a local server, run as the event loop runs a stream: the server, the pipe the guest's
/// side fills, what the stream sends the guest and reports, and its task.
struct Tunnel {
    server: std::net::TcpListener,
    pipe: Arc<Pipe>,
    to_guest: mpsc::Receiver<Queued>,
    reported: mpsc::Receiver<Report>,
    task: tokio::task::JoinHandle<()>,
}

/// A [`Tunnel`] whose guest granted `send_window` bytes.
fn tunnel(send_window: u32) -> Tunnel {
    tunnel_within(send_window, DOWNLOAD_BUDGET_BYTES)
}

/// A [`Tunnel`] whose guest granted `send_window` bytes, with a download budget of `budget`.
fn tunnel_within(send_window: u32, budget: usize) -> Tunnel {
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    let rule: NetRule = serde_json::from_str(&format!(r#"{{"host":"{HOST_GATEWAY}","ports":[{port}]}}"#)).unwrap();
    let (guest, to_guest) = mpsc::channel::<Queued>(64);
    let (reports, reported) = mpsc::channel(64);
    let (_rules, view) = watch::channel(NetView { rules: vec![rule], revision: 0, max_connections: 8 });
    let ctx = Context {
        guest,
        download_budget: Arc::new(Semaphore::new(budget)),
        reports,
        view,
        resolver: Resolver::System,
        upstream: None,
        check_addresses: true,
        secrets: Secrets::default(),
        intercept: None,
    };
    let pipe = Arc::new(Pipe::new(NET_WINDOW_BYTES, send_window));
    pipe.push(format!("CONNECT {HOST_GATEWAY}:{port} HTTP/1.1\r\n\r\n").as_bytes()).unwrap();
    let task = tokio::spawn(run(Arc::new(ctx), StreamId(1), Listener::Http, Arc::clone(&pipe)));
    Tunnel { server, pipe, to_guest, reported, task }
}

/// A destination that resets mid-stream, while the workload sends nothing more: without the failed
/// direction ending the other, the upload would wait for the workload until the 300 s idle bound.
#[tokio::test]
async fn a_destination_that_resets_ends_both_directions_at_once() {
    let Tunnel { server, pipe: _pipe, mut to_guest, mut reported, task } = tunnel(NET_WINDOW_BYTES);

    let (conn, _) = tokio::task::spawn_blocking(move || server.accept().unwrap()).await.unwrap();
    // The reset comes once the tunnel is open (the guest got its reply): one that beats the connect's own
    // completion is a failed connect, refused, which is another test's.
    let mut seen = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), to_guest.recv()).await.unwrap().unwrap().msg;
        let reply = matches!(msg, ToGuest::Net(NetToGuest::Stream(StreamFrame::Data { .. })));
        seen.push(msg);
        if reply {
            break;
        }
    }
    // Linger 0: the close is a reset.
    rustix::net::sockopt::set_socket_linger(&conn, Some(Duration::ZERO)).unwrap();
    drop(conn);
    let why = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match reported.recv().await {
                Some(Report::Closed { why, .. }) => return why,
                Some(_) => {}
                None => return None,
            }
        }
    })
    .await
    .expect("the stream ended at the reset, not at the idle bound");
    assert_eq!(why, Some("the destination reset the connection"));
    tokio::time::timeout(Duration::from_secs(5), task).await.unwrap().unwrap();
    let mut closed = false;
    while let Some(msg) = seen.pop().or_else(|| to_guest.try_recv().ok().map(|q| q.msg)) {
        closed |= matches!(msg, ToGuest::Net(NetToGuest::Stream(StreamFrame::Close { .. })));
    }
    assert!(closed, "the guest's side is closed, not half-closed");
}

/// A destination that answers and closes while the workload is still sending (an HTTP server's 431 for an
/// endless head): the upload fails, and the answer still reaches the workload before the stream closes, even
/// when the workload's credit lets only part of it through before the upload failed (the control: an upload's
/// failure that ends the stream loses the rest).
#[tokio::test]
async fn a_last_answer_before_the_destinations_close_reaches_the_workload() {
    // Credit for the tunnel's reply and 5 bytes more: "LAST " passes, "ANSWER" waits for the workload.
    let window = u32::try_from(crate::network::request::ESTABLISHED.len()).unwrap() + 5;
    let Tunnel { server, pipe, mut to_guest, mut reported, task } = tunnel(window);
    // What reaches the workload, until the stream's task is gone.
    let workload = tokio::spawn(async move {
        let mut received = Vec::new();
        while let Some(Queued { msg, .. }) = to_guest.recv().await {
            if let ToGuest::Net(NetToGuest::Stream(StreamFrame::Data { data, .. })) = msg {
                received.extend_from_slice(&data);
            }
        }
        received
    });
    let destination = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let (mut conn, _) = server.accept().unwrap();
        let mut head = [0u8; 1024];
        conn.read_exact(&mut head).unwrap();
        conn.write_all(b"LAST ANSWER").unwrap();
        // Closed with the workload's later bytes unread: a reset follows the answer.
    });
    // The workload sends without end, as long as its credit allows.
    let sender = {
        let pipe = Arc::clone(&pipe);
        tokio::spawn(async move {
            while pipe.ended().is_none() {
                let _ = pipe.push(&[b'x'; 512]);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    destination.await.unwrap();
    // The upload meets the reset while the download waits for credit; then the workload grants more.
    tokio::time::sleep(Duration::from_millis(500)).await;
    pipe.grant(window).unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !matches!(reported.recv().await, Some(Report::Closed { .. }) | None) {}
    })
    .await
    .expect("the stream ended");
    tokio::time::timeout(Duration::from_secs(5), task).await.unwrap().unwrap();
    sender.abort();
    let received = tokio::time::timeout(Duration::from_secs(5), workload).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&received);
    assert!(text.ends_with("LAST ANSWER"), "the destination's answer reached the workload: {text:?}");
}

/// Downloads whose guest grants a large window but whose link is not written (a guest that stops reading its
/// link): what the supervisor holds of them stays within the download budget. The control, a budget as large
/// as the window, holds the whole window: without the budget, the windows alone would bound the supervisor's
/// memory.
#[tokio::test]
async fn a_download_holds_no_more_than_the_budget_whatever_the_window() {
    const BUDGET: usize = 512 * 1024;
    let window = EGRESS_DOWNLOAD_WINDOW_BYTES;
    let window_bytes = usize::try_from(window).unwrap();
    assert!(window_bytes > 2 * BUDGET, "the window alone would let the stream hold more");
    for budget in [BUDGET, window_bytes] {
        let Tunnel { server, pipe: _pipe, mut to_guest, reported: _reported, task } = tunnel_within(window, budget);
        // A destination sending without end until the stream goes.
        std::thread::spawn(move || {
            use std::io::Write;
            let (mut conn, _) = server.accept().unwrap();
            while conn.write_all(&[b'd'; 64 * 1024]).is_ok() {}
        });
        // Frames taken off the queue but kept, as a writer stuck on the guest's socket keeps them.
        let mut held = Vec::new();
        let data = |held: &Vec<Queued>| -> usize {
            held.iter()
                .filter(|q| q.holds_budget())
                .map(|q| match &q.msg {
                    ToGuest::Net(NetToGuest::Stream(StreamFrame::Data { data, .. })) => data.len(),
                    _ => 0,
                })
                .sum()
        };
        // Within 256 KiB of the bound (a read is at most one chunk), then a while longer to overshoot it.
        let reach = budget - 256 * 1024;
        tokio::time::timeout(Duration::from_secs(30), async {
            while data(&held) < reach {
                held.push(to_guest.recv().await.unwrap());
            }
        })
        .await
        .expect("the download moved");
        tokio::time::sleep(Duration::from_millis(300)).await;
        while let Ok(q) = to_guest.try_recv() {
            held.push(q);
        }
        let bytes = data(&held);
        assert!(bytes <= budget, "{bytes} bytes held with a budget of {budget}");
        if budget == window_bytes {
            // The control: what stops it is the window, four times the budget above.
            assert!(bytes > 2 * BUDGET, "the window held only {bytes} bytes");
        }
        task.abort();
    }
}

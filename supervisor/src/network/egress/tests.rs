use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use vm_protocol::link::ToGuest;
use vm_protocol::net::{Listener, NetToGuest, StreamFrame, StreamId, NET_WINDOW_BYTES};
use vm_protocol::policy::network::{NetRule, HOST_GATEWAY};

use super::{run, Context, Report};
use crate::network::intercept::secrets::Secrets;
use crate::network::pipe::Pipe;
use crate::network::resolve::Resolver;
use crate::policy::NetView;

/// A destination that resets mid-stream, while the workload sends nothing more: without the failed
/// direction ending the other, the upload would wait for the workload until the 300 s idle bound.
#[tokio::test]
async fn a_destination_that_resets_ends_both_directions_at_once() {
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = server.local_addr().unwrap().port();
    let rule: NetRule = serde_json::from_str(&format!(r#"{{"host":"{HOST_GATEWAY}","ports":[{port}]}}"#)).unwrap();
    let (guest, mut to_guest) = mpsc::channel::<ToGuest>(64);
    let (reports, mut reported) = mpsc::channel(64);
    let (_rules, view) = watch::channel(NetView { rules: vec![rule], revision: 0, max_connections: 8 });
    let ctx = Context {
        guest,
        reports,
        view,
        resolver: Resolver::System,
        upstream: None,
        check_addresses: true,
        secrets: Secrets::default(),
        intercept: None,
    };
    let pipe = Arc::new(Pipe::new(NET_WINDOW_BYTES, NET_WINDOW_BYTES));
    pipe.push(format!("CONNECT {HOST_GATEWAY}:{port} HTTP/1.1\r\n\r\n").as_bytes()).unwrap();
    let task = tokio::spawn(run(Arc::new(ctx), StreamId(1), Listener::Http, Arc::clone(&pipe)));

    let (conn, _) = tokio::task::spawn_blocking(move || server.accept().unwrap()).await.unwrap();
    // The reset comes once the tunnel is open (the guest got its reply): one that beats the connect's own
    // completion is a failed connect, refused, which is another test's.
    let mut seen = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), to_guest.recv()).await.unwrap().unwrap();
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
    while let Some(msg) = seen.pop().or_else(|| to_guest.try_recv().ok()) {
        closed |= matches!(msg, ToGuest::Net(NetToGuest::Stream(StreamFrame::Close { .. })));
    }
    assert!(closed, "the guest's side is closed, not half-closed");
}

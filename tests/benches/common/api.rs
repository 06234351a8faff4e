//! Our own API's operations, timed as the benchmarks compare them.

use std::time::{Duration, Instant};

use tokio_stream::StreamExt;
use vm_protocol::driver_api::{
    exec_request, exec_response, ExecRequest, ExecStart, ListPoolRequest, SandboxRef, StdinEof,
};
use vm_test_support::api::{create_ready, Client};

use super::{median, ms};

/// Creates sandbox `id` until ready, runs `execs` Execs of `true` in it and deletes it: the create's
/// milliseconds and the execs' median.
pub async fn create_exec_delete(client: &mut Client, id: &str, execs: usize) -> (f64, f64) {
    let created = ms(&create_ready(client, id, None).await.0);
    let mut times = Vec::with_capacity(execs);
    for _ in 0..execs {
        times.push(ms(&exec_true(client, id).await));
    }
    client.delete_sandbox(SandboxRef { sandbox_id: id.to_owned() }).await.unwrap();
    (created, median(&times))
}

/// One Exec stream running `true`, from the request to the exit status.
pub async fn exec_true(client: &mut Client, id: &str) -> Duration {
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

/// Waits until the pool holds `count` ready VMs (polled every 20 ms: refills are timed by it).
pub async fn pool_full(client: &mut Client, count: usize) {
    for _ in 0..6000 {
        let vms = client.list_pool(ListPoolRequest {}).await.unwrap().into_inner().vms;
        if vms.iter().filter(|v| v.state == "ready").count() == count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the pool never filled")
}

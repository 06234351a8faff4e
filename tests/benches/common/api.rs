//! Our own API's operations, timed as the benchmarks compare them.

use std::time::{Duration, Instant};

use tokio_stream::StreamExt;
use vm_protocol::driver_api::{exec_request, exec_response, ExecRequest, ExecStart, StdinEof};
use vm_test_support::api::Client;

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

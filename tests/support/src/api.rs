//! The driver API as the service benchmarks drive it.

use std::time::{Duration, Instant};

use tokio_stream::StreamExt;
use vm_protocol::driver_api::driver_client::DriverClient;
use vm_protocol::driver_api::{watch_event, CreateSandboxRequest, Sandbox, SandboxState, WatchRequest};

pub type Client = DriverClient<tonic::transport::Channel>;

/// CreateSandbox until Watch reports it ready: the time, and the create's answer.
pub async fn create_ready(client: &mut Client, id: &str) -> (Duration, Sandbox) {
    let mut events = client.watch(WatchRequest { sandbox_id: id.to_owned() }).await.unwrap().into_inner();
    let start = Instant::now();
    let created = client
        .create_sandbox(CreateSandboxRequest { sandbox_id: id.to_owned(), spec: None, credentials: Vec::new() })
        .await;
    let created = created.unwrap().into_inner();
    while let Some(event) = events.next().await {
        if let Some(watch_event::Event::Changed(s)) = event.unwrap().event {
            assert_ne!(s.state, i32::from(SandboxState::Failed), "sandbox failed: {}", s.detail);
            if s.state == i32::from(SandboxState::Ready) {
                return (start.elapsed(), created);
            }
        }
    }
    panic!("watch ended before {id} was ready")
}

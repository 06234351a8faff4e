//! The driver's gRPC API as the tests and benchmarks drive it (`docs/driver-api.md`); a client comes from
//! [`Serve::grpc`](crate::serve::Serve::grpc).

use std::time::{Duration, Instant};

use tokio_stream::StreamExt;
use vm_protocol::driver_api::driver_client::DriverClient;
use vm_protocol::driver_api::{watch_event, CreateSandboxRequest, Sandbox, SandboxSpec, SandboxState, WatchRequest};

/// A connected API client.
pub type Client = DriverClient<tonic::transport::Channel>;

/// CreateSandbox of `id` (with `spec`, or the service's defaults) until Watch reports it ready: the time it
/// took from the request, and the sandbox as the ready event showed it (its origin known). The watch starts
/// first, so no change is missed.
///
/// # Panics
///
/// If the sandbox fails, or the watch ends before it is ready.
pub async fn create_ready(client: &mut Client, id: &str, spec: Option<SandboxSpec>) -> (Duration, Sandbox) {
    let mut events = client.watch(WatchRequest { sandbox_id: id.to_owned() }).await.unwrap().into_inner();
    let start = Instant::now();
    let created =
        client.create_sandbox(CreateSandboxRequest { sandbox_id: id.to_owned(), spec, credentials: Vec::new() }).await;
    created.unwrap();
    while let Some(event) = events.next().await {
        if let Some(watch_event::Event::Changed(s)) = event.unwrap().event {
            assert_ne!(s.state, i32::from(SandboxState::Failed), "sandbox failed: {}", s.detail);
            if s.state == i32::from(SandboxState::Ready) {
                return (start.elapsed(), s);
            }
        }
    }
    panic!("watch ended before {id} was ready")
}

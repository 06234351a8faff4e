//! OpenShell's supervisor protocol, spoken by this host supervisor for its sandbox (a sandbox an OpenShell
//! gateway created through `vm-driver serve`'s ComputeDriver service; `docs/openshell.md`).
//!
//! ```text
//! gateway ── ConnectSupervisor (hello, heartbeats, RelayOpen) ──> session
//!         ── RelayStream (init, bytes) ──> relay ──> SSH server ──> attach client ──> boundary core
//!                                                └── TCP target ──> port-forward stream ─┘
//! main process (the gateway's command) ── its end ──> ReportMainProcessExit
//! ```
//!
//! Everything the gateway asks arrives as an attach client of the boundary core (`crate::boundary`), the
//! same one the driver's own clients are: the policy gate, the bounds, the OCSF events and the audit chain
//! apply as for any other. The sandbox token lives in this process's memory only (from the auth bundle);
//! it never reaches the guest, argv or an event.
//!
//! - [`client`]: the gRPC connection and the token on every call.
//! - [`session`]: `ConnectSupervisor`, and a relay for each `RelayOpen` ([`relay`]).
//! - [`ssh`]: the SSH server on a relay's bytes; [`forward`]: a byte stream to a guest port.
//! - [`attach`]: the in-process attach client each relay is.
//! - [`main_process`]: the main process, its replay and its end.

pub mod attach;
pub mod client;
pub mod forward;
pub mod main_process;
pub mod relay;
pub mod session;
pub mod ssh;

use std::sync::Arc;
use std::time::Duration;

use vm_contract::gateway::GatewayBinding;
use vm_protocol::openshell::v1::ReportMainProcessExitRequest;

use self::attach::Attach;
use self::main_process::MainSession;
use crate::inbox::{Notice, Senders};
use crate::serve::attach_server::Connector;

/// The first wait before asking again when the exit report fails, and the longest.
const REPORT_RETRY_FIRST: Duration = Duration::from_millis(250);
const REPORT_RETRY_MAX: Duration = Duration::from_secs(2);

/// What the record hears of the gateway (fixed text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayEvent {
    /// The gateway accepted the supervisor's session: the sandbox is Ready to it.
    SessionUp,
    /// The session broke or was refused.
    SessionDown(&'static str),
    /// A relay was refused.
    RelayRefused(&'static str),
    /// The main process's end was reported, with its code.
    MainExitReported(i32),
}

/// The gateway that created this sandbox, and its token. Its `Debug` never shows the token.
pub struct Gateway {
    binding: GatewayBinding,
    token: String,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("binding", &self.binding).field("token", &"<redacted>").finish()
    }
}

impl Gateway {
    /// From the binding in the sandbox directory and the token in the auth bundle.
    pub fn new(binding: GatewayBinding, token: String) -> Self {
        Self { binding, token }
    }

    /// Where the gateway listens.
    pub fn endpoint_url(&self) -> &str {
        &self.binding.endpoint.url
    }

    /// Starts the main process and the session, for sandbox `sandbox_id`, its clients coming through
    /// `connector`; returns the task to abort when the sandbox stops.
    pub fn start(self, sandbox_id: String, connector: Connector, senders: Senders) -> tokio::task::AbortHandle {
        tokio::spawn(self.run(sandbox_id, connector, senders)).abort_handle()
    }

    async fn run(self, sandbox_id: String, connector: Connector, senders: Senders) {
        let gateway = match client::connect(&self.binding.endpoint, &self.token) {
            Ok(gateway) => gateway,
            Err(e) => {
                tracing::error!(error = %e, "cannot reach the OpenShell gateway");
                let _ = senders
                    .notices
                    .try_send(Notice::Gateway(GatewayEvent::SessionDown("the gateway's settings are not usable")));
                return;
            }
        };
        // The main process first, as upstream's supervisor does: Ready then means it runs.
        let main = match Attach::connect(&connector).await {
            Ok(attach) => MainSession::start(attach, &self.binding.sandbox.main, &self.binding.env).await,
            Err(_) => None,
        };
        let instance_id = random_uuid();
        let shared = Arc::new(ssh::Shared::new(random_seed(), main.clone(), self.binding.env.clone()));
        let end = tokio_util::sync::CancellationToken::new();
        let ctx = session::SessionContext {
            gateway: gateway.clone(),
            sandbox_id: sandbox_id.clone(),
            instance_id: instance_id.clone(),
            connector,
            shared,
            senders: senders.clone(),
            end: end.clone(),
        };
        // Aborted with this task (the sandbox stopping), or when the main process ends.
        let session = AbortOnDrop(tokio::spawn(session::run(ctx)));
        let Some(main) = main else {
            // No main process (the sandbox is going): the session serves until the stop aborts it.
            std::future::pending::<()>().await;
            return;
        };
        let mut ended = main.ended();
        let status = loop {
            if let Some(status) = *ended.borrow_and_update() {
                break status;
            }
            if ended.changed().await.is_err() {
                return;
            }
        };
        // As upstream: the session ends with the main process, and the gateway hears how it ended. The
        // relays open now finish on their own (an attachment gets the status); the stop aborts what is left.
        end.cancel();
        let code = status.shell_code();
        report_exit(gateway, ReportMainProcessExitRequest { sandbox_id, instance_id, exit_code: code }).await;
        let _ = senders.notices.try_send(Notice::Gateway(GatewayEvent::MainExitReported(code)));
        let _ = session.wait().await;
    }
}

/// A task that ends when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl AbortOnDrop {
    /// Waits for the task to end by itself.
    async fn wait(mut self) -> Result<(), tokio::task::JoinError> {
        (&mut self.0).await
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reports the main process's end until the gateway takes it.
async fn report_exit(mut gateway: client::Gateway, request: ReportMainProcessExitRequest) {
    let mut wait = REPORT_RETRY_FIRST;
    while gateway.report_main_process_exit(request.clone()).await.is_err() {
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(REPORT_RETRY_MAX);
    }
}

/// 32 bytes from the system's RNG, or a time-derived fallback that is never used for anything secret (the
/// host key only authenticates a server the relay already reaches).
fn random_seed() -> [u8; 32] {
    let mut seed = [0u8; 32];
    if rustix::rand::getrandom(&mut seed, rustix::rand::GetRandomFlags::empty()).is_err() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        seed[..16].copy_from_slice(&nanos.to_le_bytes());
    }
    seed
}

/// A random (version 4) UUID: the main process's instance id.
fn random_uuid() -> String {
    let mut b = [0u8; 16];
    b.copy_from_slice(&random_seed()[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_ids_are_version_4_uuids_and_differ() {
        let (a, b) = (random_uuid(), random_uuid());
        assert_ne!(a, b);
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"));
    }
}

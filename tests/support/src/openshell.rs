//! A stand-in OpenShell gateway, built from the same vendored protos as `vm-driver` (see
//! `docs/openshell.md` for why the pinned gateway itself is not built by the suite): it drives `vm-driver
//! serve` through the ComputeDriver socket as the gateway does, serves the supervisor's calls
//! (`ConnectSupervisor`, `RelayStream`, `ReportMainProcessExit`, `GetSandboxConfig`) on loopback as the
//! gateway does with `--disable-tls`, and runs commands over a relay exactly as the gateway's
//! `run_exec_with_russh` does: SSH with `none` as `sandbox`, one session channel, an optional `pty-req` of 0x0,
//! one `exec` of the shell-quoted command, stdin then EOF, then everything until `exit-status`.
//!
//! Each sandbox gets a random bearer token at create; a call must carry the token of the sandbox it names.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};
use vm_protocol::openshell::compute::v1::compute_driver_client::ComputeDriverClient;
use vm_protocol::openshell::compute::v1::{DriverSandbox, DriverSandboxSpec, DriverSandboxTemplate};
use vm_protocol::openshell::sandbox::v1::{GetSandboxConfigRequest, GetSandboxConfigResponse};
use vm_protocol::openshell::v1::gateway_message::Payload as ToSupervisor;
use vm_protocol::openshell::v1::open_shell_server::{OpenShell, OpenShellServer};
use vm_protocol::openshell::v1::relay_frame::Payload as Frame;
use vm_protocol::openshell::v1::relay_open::Target;
use vm_protocol::openshell::v1::supervisor_message::Payload as FromSupervisor;
use vm_protocol::openshell::v1::{
    GatewayHeartbeat, GatewayMessage, RelayFrame, RelayOpen, ReportMainProcessExitRequest,
    ReportMainProcessExitResponse, SessionAccepted, SshRelayTarget, SupervisorMessage, TcpRelayTarget,
};

/// How long a relay may take to be claimed (the gateway's own bound).
pub const RELAY_CLAIM: Duration = Duration::from_secs(10);

type Pending = oneshot::Sender<(Streaming<RelayFrame>, mpsc::Sender<Result<RelayFrame, Status>>)>;

/// What the stand-in saw, for the tests to check.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// Accepted hellos: (sandbox id, instance id).
    pub hellos: Vec<(String, String)>,
    /// Heartbeats received.
    pub heartbeats: usize,
    /// Calls refused for their token.
    pub refused: usize,
    /// `RelayOpenResult`s that said no, with their error.
    pub relay_failures: Vec<String>,
    /// Exit reports.
    pub exits: Vec<ReportMainProcessExitRequest>,
    /// Every `authorization` value that reached the gateway (to find the token there, and only there).
    pub authorizations: Vec<String>,
}

#[derive(Default)]
struct State {
    tokens: HashMap<String, String>,
    sessions: HashMap<String, mpsc::Sender<Result<GatewayMessage, Status>>>,
    pending: HashMap<String, Pending>,
    seen: Seen,
    next: u64,
}

/// The gateway side of one service.
#[derive(Clone)]
struct Service(Arc<Mutex<State>>);

impl Service {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The sandbox the call's token is for, if any.
    fn caller<T>(&self, req: &Request<T>) -> Result<String, Status> {
        let auth = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        let mut state = self.lock();
        state.seen.authorizations.push(auth.clone());
        let found = state.tokens.iter().find(|(_, t)| auth == format!("Bearer {t}")).map(|(id, _)| id.clone());
        match found {
            Some(id) => Ok(id),
            None => {
                state.seen.refused += 1;
                Err(Status::unauthenticated("not a sandbox token"))
            }
        }
    }
}

type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl OpenShell for Service {
    async fn connect_supervisor(
        &self,
        req: Request<Streaming<SupervisorMessage>>,
    ) -> Result<Response<Out<GatewayMessage>>, Status> {
        let caller = self.caller(&req)?;
        let mut inbound = req.into_inner();
        let hello = match inbound.next().await {
            Some(Ok(SupervisorMessage { payload: Some(FromSupervisor::Hello(hello)) })) => hello,
            _ => return Err(Status::invalid_argument("expected SupervisorHello")),
        };
        if hello.sandbox_id != caller {
            return Err(Status::permission_denied("cross-sandbox access denied"));
        }
        let (tx, rx) = mpsc::channel(64);
        let accepted = SessionAccepted { session_id: format!("session-{}", caller), heartbeat_interval_secs: 5 };
        let _ = tx.send(Ok(GatewayMessage { payload: Some(ToSupervisor::SessionAccepted(accepted)) })).await;
        {
            let mut state = self.lock();
            state.seen.hellos.push((hello.sandbox_id.clone(), hello.instance_id.clone()));
            state.sessions.insert(caller.clone(), tx.clone());
        }
        let service = self.clone();
        tokio::spawn(async move {
            let beat = tx.clone();
            let heartbeats = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    let msg = GatewayMessage { payload: Some(ToSupervisor::Heartbeat(GatewayHeartbeat {})) };
                    if beat.send(Ok(msg)).await.is_err() {
                        return;
                    }
                }
            });
            while let Some(Ok(msg)) = inbound.next().await {
                let mut state = service.lock();
                match msg.payload {
                    Some(FromSupervisor::Heartbeat(_)) => state.seen.heartbeats += 1,
                    Some(FromSupervisor::RelayOpenResult(r)) if !r.success => {
                        state.seen.relay_failures.push(r.error);
                        state.pending.remove(&r.channel_id);
                    }
                    _ => {}
                }
            }
            heartbeats.abort();
            let mut state = service.lock();
            if state.sessions.get(&caller).is_some_and(|s| s.same_channel(&tx)) {
                state.sessions.remove(&caller);
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn relay_stream(&self, req: Request<Streaming<RelayFrame>>) -> Result<Response<Out<RelayFrame>>, Status> {
        self.caller(&req)?;
        let mut inbound = req.into_inner();
        let channel_id = match inbound.next().await {
            Some(Ok(RelayFrame { payload: Some(Frame::Init(init)) })) if !init.channel_id.is_empty() => init.channel_id,
            _ => return Err(Status::invalid_argument("first RelayFrame must be init with non-empty channel_id")),
        };
        let claim = self.lock().pending.remove(&channel_id);
        let Some(claim) = claim else { return Err(Status::not_found("unknown or expired relay channel")) };
        let (tx, rx) = mpsc::channel(16);
        let _ = claim.send((inbound, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn report_main_process_exit(
        &self,
        req: Request<ReportMainProcessExitRequest>,
    ) -> Result<Response<ReportMainProcessExitResponse>, Status> {
        let caller = self.caller(&req)?;
        let report = req.into_inner();
        if report.sandbox_id != caller {
            return Err(Status::permission_denied("cross-sandbox access denied"));
        }
        self.lock().seen.exits.push(report);
        Ok(Response::new(ReportMainProcessExitResponse {}))
    }

    async fn get_sandbox_config(
        &self,
        req: Request<GetSandboxConfigRequest>,
    ) -> Result<Response<GetSandboxConfigResponse>, Status> {
        self.caller(&req)?;
        Ok(Response::new(GetSandboxConfigResponse::default()))
    }
}

/// The stand-in gateway: its service on loopback, and a runtime to drive everything from blocking tests.
pub struct StandIn {
    /// `http://127.0.0.1:PORT`, for `--openshell-endpoint`.
    pub url: String,
    addr: std::net::SocketAddr,
    service: Service,
    /// The runtime the tests' calls run on.
    pub rt: tokio::runtime::Runtime,
    /// The runtime its server runs on: dropped whole at a restart, every connection with it.
    server: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for StandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StandIn").field("url", &self.url).finish_non_exhaustive()
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown_background();
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

impl StandIn {
    /// Listens on a free loopback port.
    pub fn start() -> Self {
        let service = Service(Arc::default());
        let server = runtime();
        let listener = server.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        serve(&server, listener, &service);
        Self { url: format!("http://{addr}"), addr, service, rt: runtime(), server: Some(server) }
    }

    /// Goes down (every connection, session and relay with it) and comes back on the same address, keeping
    /// what it knows of its sandboxes, as a gateway restarted on its database does.
    pub fn restart(&mut self) {
        if let Some(old) = self.server.take() {
            old.shutdown_background();
        }
        {
            let mut state = self.service.lock();
            state.sessions.clear();
            state.pending.clear();
        }
        let server = runtime();
        let listener = server.block_on(async {
            loop {
                match tokio::net::TcpListener::bind(self.addr).await {
                    Ok(listener) => return listener,
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        });
        serve(&server, listener, &self.service);
        self.server = Some(server);
    }

    /// Forgets sandbox `id`'s token: its supervisor's calls are refused from now on (a token that expired
    /// or was revoked).
    pub fn revoke(&self, id: &str) {
        let mut state = self.service.lock();
        state.tokens.remove(id);
        state.sessions.remove(id);
    }

    /// What it saw so far.
    pub fn seen(&self) -> Seen {
        self.service.lock().seen.clone()
    }

    /// A fresh sandbox id (a UUID, as the gateway's are) and its token, which this gateway will accept.
    pub fn mint(&self) -> (String, String) {
        let mut state = self.service.lock();
        state.next += 1;
        let n = state.next;
        let id = format!("5a1d0b0e-0000-4000-8000-{n:012x}");
        let token = format!("eyJ.standin-token-{n}-{}.sig", std::process::id());
        state.tokens.insert(id.clone(), token.clone());
        (id, token)
    }

    /// Whether sandbox `id`'s supervisor holds a session now.
    pub fn connected(&self, id: &str) -> bool {
        self.service.lock().sessions.get(id).is_some_and(|s| !s.is_closed())
    }

    /// Asks sandbox `id`'s supervisor for a relay to `target` (none: SSH) and returns its bytes, as the
    /// gateway's own consumer of the relay sees them; `Err` with the supervisor's or our reason.
    pub async fn relay(&self, id: &str, tcp: Option<(&str, u32)>) -> Result<DuplexStream, String> {
        let session = self.service.lock().sessions.get(id).cloned().ok_or("no supervisor session")?;
        let channel_id = {
            let mut state = self.service.lock();
            state.next += 1;
            format!("relay-{}", state.next)
        };
        let (claimed, claim) = oneshot::channel();
        self.service.lock().pending.insert(channel_id.clone(), claimed);
        let target = match tcp {
            Some((host, port)) => Target::Tcp(TcpRelayTarget { host: host.into(), port }),
            None => Target::Ssh(SshRelayTarget {}),
        };
        let open = RelayOpen { channel_id: channel_id.clone(), target: Some(target), service_id: String::new() };
        session
            .send(Ok(GatewayMessage { payload: Some(ToSupervisor::RelayOpen(open)) }))
            .await
            .map_err(|_| "the session closed")?;
        let (mut inbound, outbound) = match tokio::time::timeout(RELAY_CLAIM, claim).await {
            Ok(Ok(pair)) => pair,
            Ok(Err(_)) => {
                let why = self.service.lock().seen.relay_failures.last().cloned().unwrap_or_default();
                return Err(format!("relay refused: {why}"));
            }
            Err(_) => {
                self.service.lock().pending.remove(&channel_id);
                return Err("relay open timed out".into());
            }
        };
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let (mut read, mut write) = tokio::io::split(ours);
        tokio::spawn(async move {
            while let Some(Ok(frame)) = inbound.next().await {
                if let Some(Frame::Data(data)) = frame.payload {
                    if write.write_all(&data).await.is_err() {
                        return;
                    }
                }
            }
            let _ = write.shutdown().await;
        });
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n) = read.read(&mut buf).await {
                if n == 0
                    || outbound.send(Ok(RelayFrame { payload: Some(Frame::Data(buf[..n].to_vec())) })).await.is_err()
                {
                    return;
                }
            }
        });
        Ok(theirs)
    }

    /// A ComputeDriver client of `serve`'s socket.
    pub fn driver(&self, socket: &std::path::Path) -> ComputeDriverClient<tonic::transport::Channel> {
        let channel = self.rt.block_on(vm_driver::service::client::channel(socket)).unwrap();
        ComputeDriverClient::new(channel)
    }
}

fn serve(runtime: &tokio::runtime::Runtime, listener: tokio::net::TcpListener, service: &Service) {
    let served = OpenShellServer::new(service.clone());
    runtime.spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let _ = tonic::transport::Server::builder().add_service(served).serve_with_incoming(incoming).await;
    });
}

/// A sandbox as the gateway asks for one.
pub fn sandbox(id: &str, token: &str, name: &str, command: &[&str], tty: bool) -> DriverSandbox {
    DriverSandbox {
        id: id.into(),
        name: name.into(),
        spec: Some(DriverSandboxSpec {
            sandbox_token: token.into(),
            command: command.iter().map(|s| (*s).to_owned()).collect(),
            tty,
            template: Some(DriverSandboxTemplate::default()),
            ..DriverSandboxSpec::default()
        }),
        ..DriverSandbox::default()
    }
}

/// A word as a POSIX shell reads it back: bare when it holds only `[A-Za-z0-9./_-]`, else single-quoted
/// (the gateway's quoting).
pub fn quote(word: &str) -> String {
    if !word.is_empty() && word.bytes().all(|b| b.is_ascii_alphanumeric() || b"./_-".contains(&b)) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r#"'"'"'"#))
    }
}

/// What one exec returned.
#[derive(Debug, Default)]
pub struct ExecOutput {
    /// Its stdout (channel data).
    pub stdout: Vec<u8>,
    /// Its stderr (extended data).
    pub stderr: Vec<u8>,
    /// Its `exit-status`; `None` when the channel closed without one (the gateway's UNAVAILABLE).
    pub code: Option<u32>,
}

impl ExecOutput {
    /// Stdout as text.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    /// Stderr as text.
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// The SSH client's handler: any host key, as the gateway's.
#[derive(Debug)]
pub struct AnyHostKey;

impl russh::client::Handler for AnyHostKey {
    type Error = russh::Error;

    async fn check_server_key(&mut self, _: &russh::keys::PublicKeyOrCertificate) -> Result<bool, Self::Error> {
        Ok(true)
    }
}

/// An SSH connection over `relay`, logged in with `none` as `sandbox`.
///
/// # Errors
/// The handshake or the login failed.
pub async fn ssh(relay: DuplexStream) -> Result<russh::client::Handle<AnyHostKey>, russh::Error> {
    let config = russh::client::Config {
        keepalive_interval: Some(Duration::from_secs(15)),
        keepalive_max: 4,
        ..Default::default()
    };
    let mut handle = russh::client::connect_stream(Arc::new(config), relay, AnyHostKey).await?;
    let auth = handle.authenticate_none("sandbox").await?;
    if !auth.success() {
        return Err(russh::Error::NotAuthenticated);
    }
    Ok(handle)
}

/// Runs `argv` in sandbox `id` as the gateway's exec does; `Err` for a relay or SSH failure.
pub async fn exec(gateway: &StandIn, id: &str, argv: &[&str], stdin: &[u8], tty: bool) -> Result<ExecOutput, String> {
    let relay = gateway.relay(id, None).await?;
    let handle = ssh(relay).await.map_err(|e| format!("ssh: {e}"))?;
    let mut channel = handle.channel_open_session().await.map_err(|e| format!("channel: {e}"))?;
    if tty {
        channel.request_pty(false, "xterm-256color", 0, 0, 0, 0, &[]).await.map_err(|e| e.to_string())?;
    }
    let command: Vec<String> = argv.iter().map(|a| quote(a)).collect();
    channel.exec(true, command.join(" ")).await.map_err(|e| e.to_string())?;
    if !stdin.is_empty() {
        channel.data_bytes(stdin.to_vec()).await.map_err(|e| e.to_string())?;
    }
    channel.eof().await.map_err(|e| e.to_string())?;
    let mut out = ExecOutput::default();
    loop {
        let wait = if out.code.is_some() { Duration::from_millis(500) } else { Duration::from_secs(300) };
        match tokio::time::timeout(wait, channel.wait()).await {
            Ok(Some(russh::ChannelMsg::Data { data })) => out.stdout.extend_from_slice(&data),
            Ok(Some(russh::ChannelMsg::ExtendedData { data, .. })) => out.stderr.extend_from_slice(&data),
            Ok(Some(russh::ChannelMsg::ExitStatus { exit_status })) => out.code = Some(exit_status),
            Ok(Some(russh::ChannelMsg::Close)) | Ok(None) | Err(_) => break,
            Ok(Some(_)) => {}
        }
    }
    let _ = handle.disconnect(russh::Disconnect::ByApplication, "exec complete", "").await;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::quote;

    #[test]
    fn words_quote_as_the_gateway_quotes_them() {
        assert_eq!(quote("ls"), "ls");
        assert_eq!(quote("/usr/bin/env"), "/usr/bin/env");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r#"'it'"'"'s'"#);
    }
}

//! The supervisor's session with the gateway (`ConnectSupervisor`): a hello naming the sandbox and the main
//! process's instance, heartbeats at the interval the gateway sets, and a relay for each `RelayOpen`. The
//! gateway calls the sandbox Ready while this session is live; a session that breaks is opened again,
//! waiting 1 s, then twice as long each time, up to 30 s.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use vm_protocol::openshell::v1::gateway_message::Payload as FromGateway;
use vm_protocol::openshell::v1::supervisor_message::Payload as ToGateway;
use vm_protocol::openshell::v1::{RelayOpen, RelayOpenResult, SupervisorHeartbeat, SupervisorHello, SupervisorMessage};

use super::attach::Attach;
use super::client::Gateway;
use super::relay::{self, MAX_RELAYS};
use super::{ssh, GatewayEvent};
use crate::inbox::{Notice, Senders};
use crate::serve::attach_server::Connector;

/// The shortest heartbeat interval we keep, whatever the gateway asks.
const MIN_HEARTBEAT: Duration = Duration::from_secs(5);
/// The first wait before opening a broken session again, and the longest.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Messages waiting to go to the gateway on the session.
const OUTBOUND_ITEMS: usize = 64;

/// What a session needs, for every time it opens.
#[derive(Debug, Clone)]
pub struct SessionContext {
    /// The gateway.
    pub gateway: Gateway,
    /// The sandbox, as the gateway knows it.
    pub sandbox_id: String,
    /// The main process's instance.
    pub instance_id: String,
    /// Where relays get their attach connections.
    pub connector: Connector,
    /// What relayed SSH connections share.
    pub shared: Arc<ssh::Shared>,
    /// Where the record hears of the session.
    pub senders: Senders,
    /// Ends the session (the main process ended), leaving the relays open to finish.
    pub end: CancellationToken,
}

/// Keeps the session open until `ctx.end`, then waits for its relays; aborting the task ends the relays too.
pub async fn run(ctx: SessionContext) {
    let relays = Arc::new(Semaphore::new(MAX_RELAYS));
    let mut tasks = JoinSet::new();
    let mut backoff = BACKOFF_FIRST;
    while !ctx.end.is_cancelled() {
        let accepted = tokio::select! {
            accepted = once(&ctx, &relays, &mut tasks) => accepted,
            () = ctx.end.cancelled() => break,
        };
        if accepted {
            backoff = BACKOFF_FIRST;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = ctx.end.cancelled() => break,
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    // The session is closed; what was relayed before (an attachment watching the main process end) may
    // finish.
    while tasks.join_next().await.is_some() {}
}

fn event(senders: &Senders, event: GatewayEvent) {
    // A full notice queue drops the record of it, never the session.
    let _ = senders.notices.try_send(Notice::Gateway(event));
}

/// One session, until it breaks; whether the gateway accepted it.
async fn once(ctx: &SessionContext, relays: &Arc<Semaphore>, tasks: &mut JoinSet<()>) -> bool {
    let (tx, rx) = mpsc::channel(OUTBOUND_ITEMS);
    // Queued before the call: the gateway answers nothing until it has read the hello.
    let hello = SupervisorHello { sandbox_id: ctx.sandbox_id.clone(), instance_id: ctx.instance_id.clone() };
    if tx.send(SupervisorMessage { payload: Some(ToGateway::Hello(hello)) }).await.is_err() {
        return false;
    }
    let mut gateway = ctx.gateway.clone();
    let mut inbound = match gateway.connect_supervisor(ReceiverStream::new(rx)).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::warn!(code = ?status.code(), "the gateway refused the supervisor session");
            event(&ctx.senders, GatewayEvent::SessionDown(down_reason(status.code())));
            return false;
        }
    };
    let mut accepted = false;
    let mut heartbeat = tokio::time::interval(Duration::from_secs(3600));
    heartbeat.reset();
    loop {
        tokio::select! {
            message = inbound.next() => {
                let payload = match message {
                    Some(Ok(m)) => m.payload,
                    Some(Err(status)) => {
                        event(&ctx.senders, GatewayEvent::SessionDown(down_reason(status.code())));
                        return accepted;
                    }
                    None => {
                        event(&ctx.senders, GatewayEvent::SessionDown("the gateway ended the session"));
                        return accepted;
                    }
                };
                match payload {
                    Some(FromGateway::SessionAccepted(ok)) if !accepted => {
                        accepted = true;
                        let every = Duration::from_secs(u64::from(ok.heartbeat_interval_secs)).max(MIN_HEARTBEAT);
                        heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                        event(&ctx.senders, GatewayEvent::SessionUp);
                    }
                    Some(FromGateway::SessionRejected(_)) => {
                        event(&ctx.senders, GatewayEvent::SessionDown("the gateway rejected the session"));
                        return false;
                    }
                    Some(FromGateway::RelayOpen(open)) if accepted => {
                        let result = open_relay(ctx, relays, tasks, open).await;
                        if tx.send(SupervisorMessage { payload: Some(ToGateway::RelayOpenResult(result)) }).await.is_err() {
                            return accepted;
                        }
                    }
                    _ => {}
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            _ = heartbeat.tick(), if accepted => {
                let beat = SupervisorMessage { payload: Some(ToGateway::Heartbeat(SupervisorHeartbeat {})) };
                if tx.send(beat).await.is_err() {
                    return accepted;
                }
            }
        }
    }
}

/// Starts a relay for `open`, or says why not.
async fn open_relay(
    ctx: &SessionContext,
    relays: &Arc<Semaphore>,
    tasks: &mut JoinSet<()>,
    open: RelayOpen,
) -> RelayOpenResult {
    let refuse = |channel_id: String, why: &'static str| {
        event(&ctx.senders, GatewayEvent::RelayRefused(why));
        RelayOpenResult { channel_id, success: false, error: why.into() }
    };
    let what = match relay::target(&open) {
        Ok(what) => what,
        Err(why) => return refuse(open.channel_id, why),
    };
    let Ok(place) = Arc::clone(relays).try_acquire_owned() else {
        return refuse(open.channel_id, "too many relays are open into this sandbox");
    };
    let attach = match Attach::connect(&ctx.connector).await {
        Ok(attach) => attach,
        Err(_) => return refuse(open.channel_id, "the sandbox takes no more connections"),
    };
    let (gateway, shared, senders) = (ctx.gateway.clone(), Arc::clone(&ctx.shared), ctx.senders.clone());
    let channel_id = open.channel_id.clone();
    tasks.spawn(relay::run(gateway, channel_id, what, attach, shared, senders, place));
    RelayOpenResult { channel_id: open.channel_id, success: true, error: String::new() }
}

/// Why the session went down, in fixed text.
fn down_reason(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => "the gateway did not accept the sandbox token",
        tonic::Code::NotFound => "the gateway does not know this sandbox",
        tonic::Code::Unavailable => "the gateway is unreachable",
        tonic::Code::InvalidArgument => "the gateway refused the hello",
        _ => "the session with the gateway failed",
    }
}

//! One egress stream's task: read the proxy request from the stream, decide it, resolve the name on the host,
//! check every address, dial exactly those, answer the guest, relay.
//!
//! ```text
//! guest bytes --> request (HTTP CONNECT / absolute-form, SOCKS5)  <= MAX_HEAD_BYTES, REQUEST_TIMEOUT
//!             --> rule for (host, port)?            no: 403 / SOCKS 2, Refuse event, finding
//!             --> addresses (host gateway, literal, or resolved once; never re-resolved)
//!             --> each one public, or listed by the rule?        no: refused the same way
//!             --> the rule still in force (a policy update may have come meanwhile)?
//!             --> dial (directly, or CONNECT through the operator's proxy)  CONNECT_TIMEOUT
//!             --> relay both ways within the windows until both ends close, or IDLE_TIMEOUT
//! ```

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch, Semaphore};
use vm_protocol::net::{Listener, NetToGuest, StreamFrame, StreamId};

use self::relay::{describe, download, upload, Activity, DESTINATION_CLOSED};
use super::dial;
use super::intercept::secrets::{Scanner, Secrets};
use super::intercept::Interceptor;
use super::pipe::{End, Inbound, Pipe};
use super::request::{self, Kind, ProxyRequest};
use super::resolve::Resolver;
use super::socks::{self, Socks, Step};
use super::upstream::Upstream;
use crate::boot::guest_link::Queued;
use crate::policy::NetView;
use vm_protocol::policy::network::TlsMode;

/// How long a workload has to send its whole proxy request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a dial may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection with no byte either way for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a refusal waits for the workload to read it and close, before the stream is closed anyway.
const LINGER: Duration = Duration::from_secs(2);
/// Largest chunk read from a destination at once.
const CHUNK_BYTES: usize = 256 * 1024;
/// What the supervisor holds of all a sandbox's downloads together, read from their destinations and not yet
/// taken by the guest link's writer: the bound on its memory for them, whatever windows the guest grants.
pub const DOWNLOAD_BUDGET_BYTES: usize = 4 * 1024 * 1024;
/// Bytes buffered between an intercepted stream and its TLS server, each way.
const INTERCEPT_BUFFER_BYTES: usize = 64 * 1024;

/// How a sandbox's egress resolves, leaves and checks (from the arguments and the auth bundle).
#[derive(Debug)]
pub struct EgressSettings {
    /// How names are resolved.
    pub resolver: Resolver,
    /// The operator's proxy, when connections must leave through one.
    pub upstream: Option<Upstream>,
    /// When off (the `no-address-check` control), resolved addresses are dialed unchecked.
    pub check_addresses: bool,
    /// When off (the `no-download-budget` control), downloads are held by the guest's windows alone.
    pub download_budget: bool,
    /// The sandbox's credentials.
    pub secrets: Secrets,
    /// TLS interception, when some approved rule asks for it.
    pub intercept: Option<Arc<Interceptor>>,
}

/// Reports from egress tasks waiting for the loop.
pub const REPORT_QUEUE_ITEMS: usize = 256;

impl Context {
    /// What the egress tasks of a sandbox share: `settings`, the guest link's queue, and the rules in force
    /// (`view`, published by the boundary). Returns the loop's end of the reports and of the rules.
    pub fn new(
        settings: EgressSettings,
        guest: mpsc::Sender<Queued>,
        view: NetView,
    ) -> (Arc<Self>, mpsc::Receiver<Report>, watch::Sender<NetView>) {
        let (reports, reports_rx) = mpsc::channel(REPORT_QUEUE_ITEMS);
        let (view_tx, view_rx) = watch::channel(view);
        let ctx = Self {
            guest,
            download_budget: Arc::new(Semaphore::new(if settings.download_budget {
                DOWNLOAD_BUDGET_BYTES
            } else {
                Semaphore::MAX_PERMITS
            })),
            reports,
            view: view_rx,
            resolver: settings.resolver,
            upstream: settings.upstream,
            check_addresses: settings.check_addresses,
            secrets: settings.secrets,
            intercept: settings.intercept,
        };
        (Arc::new(ctx), reports_rx, view_tx)
    }
}

/// What every egress task of a sandbox shares.
#[derive(Debug)]
pub struct Context {
    /// The guest link's queue.
    pub guest: mpsc::Sender<Queued>,
    /// Bytes of [`DOWNLOAD_BUDGET_BYTES`] not held by a download's queued data.
    pub download_budget: Arc<Semaphore>,
    /// Reports to the event loop.
    pub reports: mpsc::Sender<Report>,
    /// The network rules in force.
    pub view: watch::Receiver<NetView>,
    /// How names are resolved.
    pub resolver: Resolver,
    /// The operator's proxy, when connections must leave through one.
    pub upstream: Option<Upstream>,
    /// When off (the `no-address-check` control), resolved addresses are dialed unchecked.
    pub check_addresses: bool,
    /// The sandbox's credentials (their placeholders are refused on streams not intercepted).
    pub secrets: Secrets,
    /// TLS interception, when some approved rule asks for it.
    pub intercept: Option<Arc<Interceptor>>,
}

/// What a stream is, once its request was read and decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decided {
    /// The host as asked for (normalized).
    pub host: String,
    /// The port.
    pub port: u16,
    /// The rule that allowed it (its host pattern).
    pub rule: String,
    /// The address dialed.
    pub ip: Option<IpAddr>,
}

/// What a task tells the loop (which emits the events).
#[derive(Debug)]
pub enum Report {
    /// The stream was refused before any byte reached a destination.
    Refused {
        /// The stream.
        id: StreamId,
        /// Its listener.
        listener: Listener,
        /// What was asked, as far as it was read.
        host: Option<String>,
        /// The port asked for.
        port: Option<u16>,
        /// The address that was refused, if the refusal is about one.
        ip: Option<IpAddr>,
        /// Why (fixed text).
        reason: &'static str,
    },
    /// The destination answered; bytes flow.
    Opened(StreamId, Listener, Decided),
    /// A request the proxy read: a plain-HTTP one that went out, or an intercepted one, answered or refused.
    Http(Box<HttpReport>),
    /// Something a finding must tell about a stream (the detail names no secret).
    Finding {
        /// The stream.
        id: StreamId,
        /// Where it was going.
        decided: Decided,
        /// What happened.
        detail: String,
    },
    /// The task ended: the loop forgets the stream.
    Gone(StreamId),
    /// The stream ended.
    Closed {
        /// The stream.
        id: StreamId,
        /// Its listener.
        listener: Listener,
        /// Where it went.
        decided: Decided,
        /// Bytes to the guest.
        to_guest: u64,
        /// Bytes from the guest.
        from_guest: u64,
        /// How long it was open.
        duration: Duration,
        /// Why it ended, when not in order (fixed text).
        why: Option<&'static str>,
    },
}

/// One request, for its HTTP Activity event: never a header value, a query or a body.
#[derive(Debug)]
pub struct HttpReport {
    /// The stream.
    pub id: StreamId,
    /// Where it went.
    pub decided: Decided,
    /// Its method.
    pub method: String,
    /// Its path, without the query.
    pub path: String,
    /// The answer's status (none for a plain-HTTP forward, which the proxy does not read back).
    pub status: Option<u16>,
    /// Bytes of the answer's body.
    pub bytes: u64,
    /// Intercepted TLS (`https`), or plain HTTP.
    pub tls: bool,
    /// Why the proxy refused or failed it, when it did (the answer is then the proxy's own).
    pub refused: Option<String>,
}

/// Why a request was refused: what the workload is told, and what the event says.
pub(super) struct Refusal {
    pub(super) http: u16,
    /// The SOCKS answer: a reply with a code, a method refusal, or nothing to a client that is no SOCKS5 one.
    pub(super) socks: Vec<u8>,
    pub(super) reason: &'static str,
    pub(super) host: Option<String>,
    pub(super) port: Option<u16>,
    pub(super) ip: Option<IpAddr>,
}

impl Refusal {
    pub(super) fn new(http: u16, socks: u8, reason: &'static str) -> Self {
        Self { http, socks: socks::reply(socks).to_vec(), reason, host: None, port: None, ip: None }
    }
}

/// Runs one stream to its end.
pub async fn run(ctx: Arc<Context>, id: StreamId, listener: Listener, pipe: Arc<Pipe>) {
    let started = Instant::now();
    let (req, socks) = match read_request(&ctx, id, listener, &pipe).await {
        Ok(read) => read,
        Err(None) => return finish(&ctx, id, &pipe, false).await,
        Err(Some(refusal)) => return refuse(&ctx, id, listener, &pipe, refusal).await,
    };
    // A stream that ends meanwhile (the guest closed it, an update) stops its resolution and dials at once.
    let connected = tokio::select! {
        connected = dial::connect(&ctx, &req, &pipe) => connected,
        end = pipe.wait_ended() => match end {
            End::GuestClosed => return finish(&ctx, id, &pipe, false).await,
            End::Aborted(reason) => Err(Refusal::new(403, socks::NOT_ALLOWED, reason)),
        },
    };
    let (upstream, decided) = match connected {
        Ok(open) => open,
        Err(mut refusal) => {
            refusal.host.get_or_insert(req.target.host.clone());
            refusal.port = Some(req.target.port);
            return refuse(&ctx, id, listener, &pipe, refusal).await;
        }
    };
    let _ = ctx.reports.send(Report::Opened(id, listener, decided.clone())).await;
    // A tunnel (CONNECT or SOCKS) whose rule intercepts goes to the TLS server; anything else to the destination.
    let intercept = match (&req.kind, pipe.decided(), ctx.intercept.clone()) {
        (Kind::Connect, Some(rule), Some(intercept)) if rule.tls == TlsMode::Intercept => Some((rule, intercept)),
        _ => None,
    };
    let intercepted = intercept.is_some();
    let (mut up_read, mut up_write): (Box<dyn AsyncRead + Send + Unpin>, Box<dyn AsyncWrite + Send + Unpin>) =
        match intercept {
            Some((rule, intercept)) => {
                let (near, far) = tokio::io::duplex(INTERCEPT_BUFFER_BYTES);
                let stream = (id, decided.clone(), rule);
                tokio::spawn(super::intercept::serve(Arc::clone(&ctx), intercept, stream, far, upstream));
                let (read, write) = tokio::io::split(near);
                (Box::new(read), Box::new(write))
            }
            None => {
                let (read, write) = upstream.into_split();
                (Box::new(read), Box::new(write))
            }
        };
    // Placeholders are only ever swapped on intercepted requests: on any other stream one is a leak.
    let mut scanner = (!intercepted && !ctx.secrets.is_empty()).then(|| ctx.secrets.scanner());
    if let (Some(scanner), Kind::Forward { head, .. }) = (scanner.as_mut(), &req.kind) {
        if let Some(name) = scanner.feed(head) {
            leak(&ctx, id, &decided, &name).await;
            return closed(&ctx, id, listener, &pipe, decided, (0, 0), started, Some(LEAK)).await;
        }
    }
    // The request head is ours to answer or rewrite; what follows it is the workload's own bytes.
    let consumed = pipe.discard(req.head_len);
    credit(&ctx, id, consumed).await;
    let reply: &[u8] = match (&req.kind, socks.is_some()) {
        (_, true) => &socks::reply(socks::SUCCEEDED),
        (Kind::Connect, false) => request::ESTABLISHED,
        (Kind::Forward { head, method, path }, false) => {
            let report = HttpReport {
                id,
                decided: decided.clone(),
                method: method.clone(),
                path: path.clone(),
                status: None,
                bytes: 0,
                tls: false,
                refused: None,
            };
            let _ = ctx.reports.send(Report::Http(Box::new(report))).await;
            if up_write.write_all(head).await.is_err() {
                return closed(&ctx, id, listener, &pipe, decided, (0, 0), started, Some(DESTINATION_CLOSED)).await;
            }
            &[]
        }
    };
    if !reply.is_empty() && !send_data(&ctx, id, &pipe, reply).await {
        return closed(&ctx, id, listener, &pipe, decided, (0, 0), started, Some("the stream ended")).await;
    }
    let activity = Activity::new();
    // A direction that fails (a reset) ends the other too: nothing more can pass in order.
    let failed = |(bytes, why): (u64, Option<&'static str>)| {
        if let Some(why) = why {
            pipe.end(End::Aborted(why));
        }
        (bytes, why)
    };
    let down = async { failed(download(&ctx, id, &pipe, &mut up_read, &activity).await) };
    let up = async {
        let (bytes, why) = upload(&ctx, id, &pipe, &mut up_write, &activity, scanner.as_mut()).await;
        if why == Some(LEAK) {
            leak(&ctx, id, &decided, scanner.as_ref().and_then(Scanner::found).unwrap_or_default()).await;
        }
        if why == Some(DESTINATION_CLOSED) {
            // It took no more, perhaps after a last answer (an HTTP server's 431, then its close: RFC 9112
            // 9.6): what it sent before still reaches the workload, and the download ends the stream.
            return (bytes, why);
        }
        failed((bytes, why))
    };
    // Either direction may wait on the destination for ever: an end from outside, or idleness, ends both.
    let (why, bytes) = tokio::select! {
        (to_guest, from_guest) = async { tokio::join!(down, up) } => {
            let why = to_guest.1.or(from_guest.1);
            (why, (to_guest.0, from_guest.0))
        }
        end = pipe.wait_ended() => (Some(describe(end)), activity.totals()),
        () = activity.idle() => (Some("idle"), activity.totals()),
    };
    closed(&ctx, id, listener, &pipe, decided, bytes, started, why).await;
}

/// Why a stream that carried a placeholder was cut.
const LEAK: &str = "a credential placeholder on a stream the proxy does not intercept";

async fn leak(ctx: &Context, id: StreamId, decided: &Decided, name: &str) {
    let detail = format!("the placeholder of credential {name} was sent on a stream the proxy does not intercept");
    let _ = ctx.reports.send(Report::Finding { id, decided: decided.clone(), detail }).await;
}

/// Reads the proxy request within its bounds. `Err(None)`: the stream ended before one came.
async fn read_request(
    ctx: &Context,
    id: StreamId,
    listener: Listener,
    pipe: &Pipe,
) -> Result<(ProxyRequest, Option<Socks>), Option<Refusal>> {
    let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
    let mut socks = (listener == Listener::Socks).then(Socks::new);
    loop {
        let (buf, eof) = pipe.peek();
        let parsed = match socks.as_mut() {
            None => {
                request::parse(&buf).map_err(|e| Some(Refusal::new(e.status(), socks::GENERAL_FAILURE, e.describe())))
            }
            Some(state) => match state.feed(&buf) {
                Ok(Step::Reply(reply)) => {
                    let sent = tokio::time::timeout_at(deadline, send_data(ctx, id, pipe, &reply)).await;
                    if !sent.unwrap_or(false) {
                        return Err(None);
                    }
                    continue;
                }
                Ok(Step::Connect { target, consumed }) => {
                    Ok(Some(ProxyRequest { target, kind: Kind::Connect, head_len: consumed }))
                }
                Ok(Step::NeedMore) => Ok(None),
                Err(e) => Err(Some(Refusal {
                    socks: e.answer().unwrap_or_default(),
                    ..Refusal::new(400, socks::GENERAL_FAILURE, e.describe())
                })),
            },
        };
        match parsed {
            Ok(Some(req)) => return Ok((req, socks)),
            Err(refusal) => return Err(refusal),
            Ok(None) if eof => return Err(None),
            Ok(None) => {}
        }
        if pipe.ended().is_some() {
            return Err(None);
        }
        if tokio::time::timeout_at(deadline, pipe.wait_change(buf.len())).await.is_err() {
            let mut refusal = Refusal::new(408, socks::GENERAL_FAILURE, "the proxy request did not complete in time");
            // Still in the greeting, a request reply would be out of place: the stream just closes.
            if socks.as_ref().is_some_and(|s| !s.greeted()) {
                refusal.socks.clear();
            }
            return Err(Some(refusal));
        }
    }
}

/// Sends the guest `bytes` within its credit; `false` once the stream ended.
async fn send_data(ctx: &Context, id: StreamId, pipe: &Pipe, bytes: &[u8]) -> bool {
    let mut rest = bytes;
    while !rest.is_empty() {
        let Ok(n) = pipe.reserve(rest.len()).await else { return false };
        let data = rest[..n].to_vec().into();
        if ctx.guest.send(NetToGuest::Stream(StreamFrame::Data { id, data }).into()).await.is_err() {
            return false;
        }
        rest = &rest[n..];
    }
    true
}

async fn credit(ctx: &Context, id: StreamId, bytes: usize) {
    if let Ok(bytes @ 1..) = u32::try_from(bytes) {
        let _ = ctx.guest.send(NetToGuest::Stream(StreamFrame::Credit { id, bytes }).into()).await;
    }
}

/// Answers a refused request, reports it, and ends the stream.
async fn refuse(ctx: &Context, id: StreamId, listener: Listener, pipe: &Pipe, refusal: Refusal) {
    let answer = if listener == Listener::Socks { refusal.socks } else { request::reply(refusal.http, refusal.reason) };
    let report = Report::Refused {
        id,
        listener,
        host: refusal.host,
        port: refusal.port,
        ip: refusal.ip,
        reason: refusal.reason,
    };
    let _ = ctx.reports.send(report).await;
    let mut orderly = false;
    // A guest that grants too small a window, and never credits, does not keep the task.
    if tokio::time::timeout(LINGER, send_data(ctx, id, pipe, &answer)).await.unwrap_or(false) {
        let _ = ctx.guest.send(NetToGuest::Stream(StreamFrame::Eof { id }).into()).await;
        // The workload reads the answer and closes its side: an orderly end. One that does not is cut.
        let closed = tokio::time::timeout(LINGER, async {
            loop {
                match pipe.take(usize::MAX).await {
                    Inbound::Bytes(bytes) => {
                        pipe.credit_back(bytes.len());
                        credit(ctx, id, bytes.len()).await;
                    }
                    Inbound::Eof => return true,
                    Inbound::Ended(_) => return false,
                }
            }
        });
        orderly = closed.await.unwrap_or(false);
    }
    finish(ctx, id, pipe, orderly).await;
}

/// Tells the loop the stream is gone, closing it towards the guest first unless it ended in order (both
/// sides sent `Eof`: a `Close` then could cut bytes the agent has not yet written) or the guest closed it.
async fn finish(ctx: &Context, id: StreamId, pipe: &Pipe, orderly: bool) {
    if !orderly && pipe.ended() != Some(End::GuestClosed) {
        let _ = ctx.guest.send(NetToGuest::Stream(StreamFrame::Close { id }).into()).await;
    }
    let _ = ctx.reports.send(Report::Gone(id)).await;
}

#[allow(clippy::too_many_arguments, reason = "the close event's fields")]
async fn closed(
    ctx: &Context,
    id: StreamId,
    listener: Listener,
    pipe: &Pipe,
    decided: Decided,
    (to_guest, from_guest): (u64, u64),
    started: Instant,
    why: Option<&'static str>,
) {
    let report = Report::Closed { id, listener, decided, to_guest, from_guest, duration: started.elapsed(), why };
    let _ = ctx.reports.send(report).await;
    finish(ctx, id, pipe, why.is_none()).await;
}

mod relay;
#[cfg(test)]
mod tests;

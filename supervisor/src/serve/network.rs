//! The event loop's network half: the link's streams ([`crate::network::streams`]), their egress tasks, the
//! rules they read, and the events and findings of what they report.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, watch};
use vm_ocsf::{Connection, Direction, Finding, NetworkActivity};
use vm_protocol::link::{ToGuest, VmRequest};
use vm_protocol::net::{ForwardRequest, Listener, NetToHost};

use super::Serving;
use crate::mux::ClientId;
use crate::network::egress::{self, Context, Decided, Report};
use crate::network::pipe::End;
use crate::network::resolve::Resolver;
use crate::network::streams::{ForwardNote, Out, Refused, Streams};
use crate::network::upstream::Upstream;
use crate::policy::NetView;

/// Reports from egress tasks waiting for the loop.
const REPORT_QUEUE_ITEMS: usize = 256;
/// At most one refusal finding this often: every refusal has its own Network Activity event (under the
/// telemetry limits), and a workload that opens connections without end must not flood the findings.
const FINDING_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// The loop's network messages waiting for room in the guest's queue, which the egress tasks share. What the
/// loop sends is credit-bound (forwards) or one `Close` per refused stream; only a guest that opens streams
/// without end and never reads its link, or a client that sends its window in 1-byte frames, gets past it.
const BACKLOG_ITEMS: usize = 8192;
/// Refused egress streams a second before the loop stops reading the guest's link for the rest of that
/// second. Refusing costs the host CPU, and a guest can open streams as fast as its vCPU runs: pausing its
/// link passes the cost back to it (QEMU stops taking its writes), where a busy guest's cost already is.
/// A workload that retries at its connection cap is slowed, never stopped.
const REFUSALS_PER_SEC: u32 = 512;
/// Findings about intercepted requests and placeholders: a burst this large, then one a second. Each
/// request also has its own HTTP Activity event (under the telemetry limits); a workload that sends 403s
/// without end must not flood the findings.
const INTERCEPT_FINDINGS_BURST: u32 = 16;
/// Longest method and path a finding repeats.
const FINDING_PATH_CHARS: usize = 256;

/// How this sandbox's egress resolves, leaves and checks (from the arguments and the auth bundle).
#[derive(Debug)]
pub(crate) struct EgressSettings {
    pub(crate) resolver: Resolver,
    pub(crate) upstream: Option<Upstream>,
    pub(crate) check_addresses: bool,
    /// The sandbox's credentials.
    pub(crate) secrets: crate::network::intercept::secrets::Secrets,
    /// TLS interception, when some approved rule asks for it.
    pub(crate) intercept: Option<Arc<crate::network::intercept::Interceptor>>,
    /// Off under the `egress-ignores-updates` control: the rules approved at create stay in force for egress.
    pub(crate) follow_updates: bool,
}

/// The loop's network state.
pub(crate) struct Network {
    streams: Streams,
    ctx: Arc<Context>,
    view: watch::Sender<NetView>,
    /// Whether the agent was told to listen.
    listening: bool,
    /// The sandbox CA's certificate, until the agent was told to trust it.
    trust: Option<String>,
    follow_updates: bool,
    /// When the last refusal finding was emitted, and how many refusals had none since.
    last_finding: Option<tokio::time::Instant>,
    unreported: u64,
    /// Interception's findings: tokens left (refilled one a second up to the burst), when last refilled, and
    /// how many had no finding since.
    intercept_findings: (u32, tokio::time::Instant, u64),
    /// The current second's start and the egress refusals in it; reading the guest's link is paused until
    /// the second ends once they pass [`REFUSALS_PER_SEC`].
    refusals: (tokio::time::Instant, u32),
    /// The loop's messages for the guest waiting for room in its queue, in order.
    backlog: VecDeque<ToGuest>,
    /// Network messages dropped past the backlog (logged once).
    dropped: u64,
}

impl Network {
    /// The state for a sandbox whose rules are `view`; the receiver is the loop's queue of reports.
    pub(crate) fn new(
        settings: EgressSettings,
        guest: mpsc::Sender<ToGuest>,
        view: NetView,
    ) -> (Self, mpsc::Receiver<Report>) {
        let (reports, reports_rx) = mpsc::channel(REPORT_QUEUE_ITEMS);
        let (view_tx, view_rx) = watch::channel(view);
        let ctx = Context {
            guest,
            reports,
            view: view_rx,
            resolver: settings.resolver,
            upstream: settings.upstream,
            check_addresses: settings.check_addresses,
            secrets: settings.secrets,
            intercept: settings.intercept,
        };
        let follow_updates = settings.follow_updates;
        let trust = ctx.intercept.as_ref().map(|i| i.ca.pem().to_owned());
        let net = Self {
            streams: Streams::default(),
            ctx: Arc::new(ctx),
            view: view_tx,
            listening: false,
            trust,
            follow_updates,
            last_finding: None,
            unreported: 0,
            intercept_findings: (INTERCEPT_FINDINGS_BURST, tokio::time::Instant::now(), 0),
            refusals: (tokio::time::Instant::now(), 0),
            backlog: VecDeque::new(),
            dropped: 0,
        };
        (net, reports_rx)
    }
}

fn listener_name(listener: Option<Listener>) -> &'static str {
    match listener {
        Some(Listener::Http) => "http-proxy",
        Some(Listener::Socks) => "socks5",
        None => "port-forward",
    }
}

fn outbound(id: u32, listener: Listener, decided: Option<&Decided>) -> Connection {
    Connection {
        stream: id,
        direction: Direction::Outbound,
        listener: listener_name(Some(listener)),
        guest_port: Some(listener.port()),
        hostname: decided.map(|d| d.host.clone()),
        ip: decided.and_then(|d| d.ip),
        port: decided.map_or(0, |d| d.port),
        rule: decided.map(|d| d.rule.clone()),
        bytes_in: 0,
        bytes_out: 0,
        duration_ms: None,
    }
}

fn inbound(id: u32, port: u16) -> Connection {
    Connection {
        stream: id,
        direction: Direction::Inbound,
        listener: "port-forward",
        guest_port: Some(port),
        hostname: None,
        ip: None,
        port,
        rule: None,
        bytes_in: 0,
        bytes_out: 0,
        duration_ms: None,
    }
}

impl Serving<'_> {
    /// Tells the agent to open its listeners when some rule allows egress, and to close them when none does.
    pub(super) fn publish_network(&mut self) {
        // Before the listeners: no workload connects before its trust is in place.
        if let Some(ca_pem) = self.net.trust.take() {
            self.net_send(VmRequest::Trust { ca_pem }.into());
        }
        if self.net.listening && !self.net.follow_updates {
            return;
        }
        let view = self.mux.gate().network();
        let listen = !view.rules.is_empty();
        self.net.view.send_replace(view.clone());
        if listen != self.net.listening {
            self.net.listening = listen;
            self.net_send(VmRequest::Egress { listen }.into());
        }
        // An update closes what it no longer allows.
        for (_, pipe) in self.net.streams.egress() {
            if pipe.ended().is_none() && !crate::network::dial::still_allowed(pipe, &view) {
                pipe.end(End::Aborted("a policy update no longer allows the destination"));
            }
        }
    }

    pub(super) fn net_from_guest(&mut self, msg: NetToHost) {
        let view = self.net.view.borrow().clone();
        let cap = usize::try_from(view.max_connections).unwrap_or(usize::MAX);
        match self.net.streams.from_guest(msg, cap, !view.rules.is_empty()) {
            Ok(out) => self.net_apply(out),
            Err(violation) => self.guest_violation(violation),
        }
    }

    pub(super) fn net_from_client(&mut self, client: ClientId, msg: ForwardRequest) {
        let cap = usize::try_from(self.net.view.borrow().max_connections).unwrap_or(usize::MAX);
        match self.net.streams.from_client(client, msg, cap) {
            Ok(out) => self.net_apply(out),
            Err(violation) => self.client_violation(client, &violation),
        }
    }

    pub(super) fn net_drop_client(&mut self, client: ClientId) {
        let out = self.net.streams.remove_client(client);
        self.net_apply(out);
    }

    /// The sandbox's credentials, for rotations.
    pub(super) fn secrets(&self) -> &crate::network::intercept::secrets::Secrets {
        &self.net.ctx.secrets
    }

    /// Nothing new opens; every egress stream ends.
    pub(super) fn net_stop(&mut self) {
        self.net.streams.stop_accepting();
        for (_, pipe) in self.net.streams.egress() {
            pipe.end(End::Aborted("the sandbox is stopping"));
        }
    }

    /// Sends the guest a network message in order behind the backlog, which waits when its queue is full.
    fn net_send(&mut self, msg: ToGuest) {
        if self.net.backlog.is_empty() {
            match self.guest.try_send(msg) {
                Err(TrySendError::Full(msg)) => self.net.backlog.push_back(msg),
                Ok(()) | Err(TrySendError::Closed(_)) => {}
            }
        } else if self.net.backlog.len() < BACKLOG_ITEMS {
            self.net.backlog.push_back(msg);
        } else {
            self.net.dropped += 1;
            if self.net.dropped == 1 {
                tracing::warn!("the guest is not reading its link; network messages are dropped");
            }
        }
    }

    /// Until when the loop does not read the guest's link: the rest of a second with too many refusals.
    pub(super) fn guest_paused_until(&self) -> Option<tokio::time::Instant> {
        let (since, count) = self.net.refusals;
        let until = since + std::time::Duration::from_secs(1);
        (count > REFUSALS_PER_SEC && tokio::time::Instant::now() < until).then_some(until)
    }

    /// Whether messages wait for room in the guest's queue.
    pub(super) fn net_waiting(&self) -> bool {
        !self.net.backlog.is_empty()
    }

    /// Room came in the guest's queue: the backlog goes first, as much as fits.
    pub(super) fn net_flush(&mut self, permit: mpsc::Permit<'_, ToGuest>) {
        let Some(first) = self.net.backlog.pop_front() else { return };
        permit.send(first);
        while let Some(msg) = self.net.backlog.pop_front() {
            match self.guest.try_send(msg) {
                Ok(()) => {}
                Err(TrySendError::Full(msg)) => {
                    self.net.backlog.push_front(msg);
                    return;
                }
                Err(TrySendError::Closed(_)) => {
                    self.net.backlog.clear();
                    return;
                }
            }
        }
    }

    fn net_apply(&mut self, out: Vec<Out>) {
        for item in out {
            match item {
                Out::Guest(msg) => self.net_send(msg.into()),
                Out::Client(client, event) => self.send_to_client(client, event.into()),
                Out::Egress(id, listener, pipe) => {
                    tokio::spawn(egress::run(Arc::clone(&self.net.ctx), id, listener, pipe));
                }
                Out::Refused(Refused { id, listener, port, reason }) => {
                    let conn = match (listener, port) {
                        (Some(listener), _) => outbound(id.0, listener, None),
                        (None, port) => inbound(id.0, port.unwrap_or(0)),
                    };
                    self.net_refused(&conn, reason);
                }
                Out::Forward(ForwardNote::Opened { id, port }) => {
                    let event = self.telemetry.source().network(NetworkActivity::Open, &inbound(id.0, port), None);
                    self.telemetry.emit(event);
                }
                Out::Forward(ForwardNote::Closed { id, port, to_guest, from_guest }) => {
                    let conn = Connection { bytes_in: to_guest, bytes_out: from_guest, ..inbound(id.0, port) };
                    let event = self.telemetry.source().network(NetworkActivity::Close, &conn, None);
                    self.telemetry.emit(event);
                }
            }
        }
    }

    /// A refused connection: a Network Activity refuse and a `policy_denied` finding.
    fn net_refused(&mut self, conn: &Connection, reason: &str) {
        if conn.direction == Direction::Outbound {
            let now = tokio::time::Instant::now();
            let (since, count) = &mut self.net.refusals;
            if now >= *since + std::time::Duration::from_secs(1) {
                (*since, *count) = (now, 0);
            }
            *count = count.saturating_add(1);
        }
        let event = self.telemetry.source().network(NetworkActivity::Refuse, conn, Some(reason));
        self.telemetry.emit(event);
        let now = tokio::time::Instant::now();
        if self.net.last_finding.is_some_and(|at| now < at + FINDING_EVERY) {
            self.net.unreported += 1;
            return;
        }
        self.net.last_finding = Some(now);
        let more = std::mem::take(&mut self.net.unreported);
        let what = match (&conn.hostname, conn.ip) {
            (Some(host), _) => format!("{host}:{}", conn.port),
            (None, Some(ip)) => format!("{ip}:{}", conn.port),
            (None, None) => format!("stream {}", conn.stream),
        };
        let also = if more > 0 { format!(" ({more} more refused since the last finding)") } else { String::new() };
        self.finding(Finding::PolicyDenied, &format!("connection to {what} refused: {reason}{also}"));
    }

    /// A finding of interception, within its burst and rate; the next one emitted counts those held back.
    fn intercept_finding(&mut self, detail: &str) {
        let now = tokio::time::Instant::now();
        let (tokens, since, held) = &mut self.net.intercept_findings;
        let refill = u32::try_from(now.duration_since(*since).as_secs()).unwrap_or(u32::MAX);
        if refill > 0 {
            *tokens = tokens.saturating_add(refill).min(INTERCEPT_FINDINGS_BURST);
            *since = now;
        }
        if *tokens == 0 {
            *held += 1;
            return;
        }
        *tokens -= 1;
        let more = std::mem::take(held);
        let also = if more > 0 { format!(" ({more} more held back since the last finding)") } else { String::new() };
        self.finding(Finding::PolicyDenied, &format!("{detail}{also}"));
    }

    pub(super) fn net_report(&mut self, report: Report) {
        match report {
            Report::Refused { id, listener, host, port, ip, reason } => {
                let mut conn = outbound(id.0, listener, None);
                (conn.hostname, conn.port, conn.ip) = (host, port.unwrap_or(0), ip);
                self.net_refused(&conn, reason);
            }
            Report::Opened(id, listener, decided) => {
                let conn = outbound(id.0, listener, Some(&decided));
                let event = self.telemetry.source().network(NetworkActivity::Open, &conn, None);
                self.telemetry.emit(event);
            }
            Report::Http(http) => {
                let conn =
                    Connection { bytes_in: http.bytes, ..outbound(http.id.0, Listener::Http, Some(&http.decided)) };
                let scheme = if http.tls { "https" } else { "http" };
                let denied = http.status == Some(403) && http.refused.is_some();
                let source = self.telemetry.source();
                let event = source.http_scheme(&conn, scheme, &http.method, &http.path, http.status, denied);
                self.telemetry.emit(event);
                if let Some(why) = http.refused {
                    let (host, port) = (&http.decided.host, http.decided.port);
                    let method = vm_contract::logs::printable(&http.method, 16);
                    let path = vm_contract::logs::printable(&http.path, FINDING_PATH_CHARS);
                    self.intercept_finding(&format!("{method} {scheme}://{host}:{port}{path} refused: {why}"));
                }
            }
            Report::Finding { id, decided, detail } => {
                self.intercept_finding(&format!("stream {} to {}: {detail}", id.0, decided.host));
            }
            Report::Closed { id, listener, decided, to_guest, from_guest, duration, why } => {
                let conn = Connection {
                    bytes_in: to_guest,
                    bytes_out: from_guest,
                    duration_ms: Some(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)),
                    ..outbound(id.0, listener, Some(&decided))
                };
                let event = self.telemetry.source().network(NetworkActivity::Close, &conn, why);
                self.telemetry.emit(event);
            }
            Report::Gone(id) => self.net.streams.egress_ended(id),
        }
    }
}

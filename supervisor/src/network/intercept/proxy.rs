//! One intercepted connection: the workload's TLS, its requests, and this supervisor's connection to the
//! destination.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::http::request::Parts;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::ServerName;
use tokio::io::DuplexStream;
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use vm_protocol::net::StreamId;
use vm_protocol::policy::network::{normalize_host, NetRule};

use super::secrets::RequestParts;
use super::{Interceptor, MAX_HEAD_BYTES, MAX_STREAMS};
use crate::network::egress::{Context, Decided, HttpReport, Report, CONNECT_TIMEOUT, REQUEST_TIMEOUT};

/// What the proxy answers a request it refuses or cannot carry (the reason goes to the events only).
const REFUSED_BODY: &str = "refused by the sandbox's network policy\n";
const FAILED_BODY: &str = "the sandbox's proxy could not reach the destination\n";
/// Headers of one hop only, never forwarded (RFC 9110 7.6.1), plus the proxy's own.
const HOP_HEADERS: [&str; 9] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

type ProxyBody = Either<Counted, Full<Bytes>>;

/// Streams the proxy may reset on one HTTP/2 connection for the workload's errors before it ends it.
const MAX_LOCAL_RESETS: usize = 1024;

/// The connection to the destination.
enum Sender {
    Http1(hyper::client::conn::http1::SendRequest<Incoming>),
    Http2(hyper::client::conn::http2::SendRequest<Incoming>),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Self::Http1(sender) => sender.is_closed(),
            Self::Http2(sender) => sender.is_closed(),
        }
    }
}

/// What each request of one connection shares.
struct Conn {
    ctx: Arc<Context>,
    intercept: Arc<Interceptor>,
    id: StreamId,
    decided: Decided,
    /// The rule the stream was decided by: its HTTP rules judge every request, while it is in force.
    rule: NetRule,
    /// The checked dial, until the first request makes it a TLS connection (so a workload that only shakes
    /// hands costs no handshake with the destination); then that connection, made again to the same checked
    /// address when the destination closed it (an HTTP/1.0 server, an idle keep-alive).
    upstream: tokio::sync::Mutex<(Option<TcpStream>, Option<Sender>)>,
}

impl Conn {
    /// Sends `req` (judged) in the form the destination's HTTP version wants. HTTP/1.1 requests take turns:
    /// the next one's `ready` waits until the previous answer was read.
    async fn forward(
        &self,
        mut parts: Parts,
        body: Incoming,
        path_and_query: &str,
    ) -> Result<Response<Incoming>, &'static str> {
        let mut upstream = self.upstream.lock().await;
        if upstream.1.as_ref().is_none_or(Sender::is_closed) {
            let tcp = match upstream.0.take() {
                Some(tcp) => tcp,
                None => self.redial().await?,
            };
            upstream.1 = Some(connect(&self.intercept, &self.decided.host, tcp).await?);
        }
        let unanswered = "the destination did not answer the request";
        match upstream.1.as_mut() {
            Some(Sender::Http1(sender)) => {
                self.adapt(&mut parts, path_and_query, false)?;
                // The destination may close between requests (after `is_closed` said otherwise): once more.
                if sender.ready().await.is_err() {
                    let tcp = self.redial().await?;
                    upstream.1 = Some(connect(&self.intercept, &self.decided.host, tcp).await?);
                    return match upstream.1.as_mut() {
                        Some(Sender::Http1(sender)) => {
                            sender.ready().await.map_err(|_| unanswered)?;
                            sender.send_request(Request::from_parts(parts, body)).await.map_err(|_| unanswered)
                        }
                        _ => Err("the destination changed its HTTP version"),
                    };
                }
                sender.send_request(Request::from_parts(parts, body)).await.map_err(|_| unanswered)
            }
            Some(Sender::Http2(sender)) => {
                let mut sender = sender.clone();
                drop(upstream);
                self.adapt(&mut parts, path_and_query, true)?;
                sender.send_request(Request::from_parts(parts, body)).await.map_err(|_| unanswered)
            }
            None => Err(unanswered),
        }
    }

    /// A new connection to the address the stream was decided for (checked then; never resolved again).
    async fn redial(&self) -> Result<TcpStream, &'static str> {
        let ip = self.decided.ip.ok_or("the destination has no address")?;
        crate::network::dial::dial(&self.ctx, std::net::SocketAddr::new(ip, self.decided.port))
            .await
            .map_err(|_| "the destination refused a new connection")
    }
}

/// Serves one intercepted stream: `guest` carries the workload's TLS, `destination` is the checked dial.
pub async fn serve(
    ctx: Arc<Context>,
    intercept: Arc<Interceptor>,
    (id, decided, rule): (StreamId, Decided, NetRule),
    guest: DuplexStream,
    destination: TcpStream,
) {
    let finding = |detail: String| {
        let ctx = Arc::clone(&ctx);
        let decided = decided.clone();
        async move {
            let _ = ctx.reports.send(Report::Finding { id, decided, detail }).await;
        }
    };
    let config = match intercept.ca.server_config(&decided.host) {
        Ok(config) => config,
        Err(e) => return finding(e.to_string()).await,
    };
    let tls = match tokio::time::timeout(REQUEST_TIMEOUT, TlsAcceptor::from(config).accept(guest)).await {
        Ok(Ok(tls)) => tls,
        _ => return finding("the workload's TLS handshake with the sandbox's CA failed".into()).await,
    };
    let sni = tls.get_ref().1.server_name().map(normalize_host);
    if sni.is_some_and(|name| name.as_deref() != Some(decided.host.as_str())) {
        return finding("the workload's TLS names another host than its CONNECT".into()).await;
    }
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let conn = Arc::new(Conn {
        ctx: Arc::clone(&ctx),
        intercept,
        id,
        decided: decided.clone(),
        rule,
        upstream: tokio::sync::Mutex::new((Some(destination), None)),
    });
    let service = hyper::service::service_fn(move |req| handle(Arc::clone(&conn), req));
    let io = TokioIo::new(tls);
    let served = if h2 {
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(MAX_STREAMS)
            .max_header_list_size(u32::try_from(MAX_HEAD_BYTES).unwrap_or(u32::MAX))
            .max_pending_accept_reset_streams(Some(usize::try_from(MAX_STREAMS).unwrap_or(64)))
            .max_local_error_reset_streams(Some(MAX_LOCAL_RESETS))
            .serve_connection(io, service)
            .await
    } else {
        hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(REQUEST_TIMEOUT)
            .max_buf_size(MAX_HEAD_BYTES)
            .serve_connection(io, service)
            .await
    };
    // A workload that closes mid-request just ends its connection; one that breaks a bound is a finding.
    if let Some(why) = served.err().as_ref().and_then(bound_broken) {
        finding(why.into()).await;
    }
}

/// What a connection's error says of the workload, when it broke a bound or the protocol.
fn bound_broken(e: &hyper::Error) -> Option<&'static str> {
    if e.is_parse_too_large() {
        Some("the workload's request head passed the proxy's 64 KiB bound")
    } else if e.is_timeout() {
        Some("the workload's request head did not complete in time")
    } else if e.is_parse() {
        Some("the workload sent a malformed request")
    } else if e.is_incomplete_message()
        || e.is_canceled()
        || e.is_closed()
        || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
    {
        // The workload went away (a close, a reset, TLS without close_notify).
        None
    } else {
        // HTTP/2: the server sent GOAWAY for a protocol error or too many reset streams.
        Some("the workload's connection broke HTTP's rules or the proxy's bounds")
    }
}

/// This supervisor's TLS connection to the destination, fully checked, and HTTP over it.
async fn connect(intercept: &Interceptor, host: &str, tcp: TcpStream) -> Result<Sender, &'static str> {
    let name = ServerName::try_from(host.to_owned()).map_err(|_| "the destination's name is not a TLS name")?;
    let handshake = TlsConnector::from(Arc::clone(&intercept.client)).connect(name, tcp);
    let tls = match tokio::time::timeout(CONNECT_TIMEOUT, handshake).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            let rustls_error = e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>());
            return Err(match rustls_error {
                Some(rustls::Error::InvalidCertificate(_)) => "the destination's certificate is not trusted",
                _ => "the TLS handshake with the destination failed",
            });
        }
        Err(_) => return Err("the TLS handshake with the destination timed out"),
    };
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let io = TokioIo::new(tls);
    if h2 {
        let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(MAX_HEAD_BYTES).unwrap_or(u32::MAX))
            .handshake(io)
            .await
            .map_err(|_| "the HTTP/2 handshake with the destination failed")?;
        tokio::spawn(conn);
        Ok(Sender::Http2(sender))
    } else {
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .max_buf_size(MAX_HEAD_BYTES)
            .handshake(io)
            .await
            .map_err(|_| "the HTTP/1.1 handshake with the destination failed")?;
        tokio::spawn(conn);
        Ok(Sender::Http1(sender))
    }
}

async fn handle(conn: Arc<Conn>, req: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
    let (mut parts, body) = req.into_parts();
    let mut report = HttpReport {
        id: conn.id,
        decided: conn.decided.clone(),
        method: parts.method.as_str().to_owned(),
        path: parts.uri.path().to_owned(),
        status: None,
        bytes: 0,
        tls: true,
        refused: None,
    };
    let path_and_query = match conn.judge(&mut parts) {
        Ok(path_and_query) => path_and_query,
        Err(why) => return Ok(conn.answer(report, StatusCode::FORBIDDEN, REFUSED_BODY, why).await),
    };
    match conn.forward(parts, body, &path_and_query).await {
        Ok(response) => {
            let (mut parts, body) = response.into_parts();
            strip_hop_headers(&mut parts.headers);
            report.status = Some(parts.status.as_u16());
            let counted = Counted { inner: body, report: Some((conn.ctx.reports.clone(), report)) };
            Ok(Response::from_parts(parts, Either::Left(counted)))
        }
        Err(why) => Ok(conn.answer(report, StatusCode::BAD_GATEWAY, FAILED_BODY, why.into()).await),
    }
}

impl Conn {
    /// Judges the request: its host, the rule in force, the HTTP rules, the placeholders (swapped here).
    /// Returns its path and query, swapped too.
    fn judge(&self, parts: &mut Parts) -> Result<String, String> {
        let decided = &self.decided;
        let authority = parts
            .uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| parts.headers.get(header::HOST).and_then(|h| h.to_str().ok()).map(str::to_owned))
            .ok_or("the request names no host")?;
        let (host, port) = match authority.rsplit_once(':').filter(|(_, p)| !p.contains(']')) {
            Some((host, port)) => (host, port.parse::<u16>().ok()),
            None => (authority.as_str(), Some(decided.port)),
        };
        if normalize_host(host).as_deref() != Some(decided.host.as_str()) || port != Some(decided.port) {
            return Err("the request names another host than its connection".into());
        }
        if !self.ctx.view.borrow().rules.contains(&self.rule) {
            return Err("a policy update no longer allows the destination".into());
        }
        if !self.rule.allows_request(parts.method.as_str(), parts.uri.path()) {
            return Err(format!("no http rule of {} allows the request", self.rule.host));
        }
        let mut path_and_query = parts.uri.path_and_query().map_or_else(|| "/".to_owned(), |pq| pq.as_str().to_owned());
        if self.intercept.swap_placeholders {
            let request = RequestParts { headers: &mut parts.headers, path_and_query: &mut path_and_query };
            self.ctx.secrets.apply(&decided.host, request).map_err(|misplaced| {
                format!(
                    "the placeholder of credential {} was sent to {}, which it is not bound to",
                    misplaced.name, decided.host
                )
            })?;
        }
        Ok(path_and_query)
    }

    /// Puts the request in the form the destination's HTTP version wants.
    fn adapt(&self, parts: &mut Parts, path_and_query: &str, h2: bool) -> Result<(), &'static str> {
        let decided = &self.decided;
        strip_hop_headers(&mut parts.headers);
        let authority =
            if decided.port == 443 { decided.host.clone() } else { format!("{}:{}", decided.host, decided.port) };
        if h2 {
            parts.headers.remove(header::HOST);
            parts.uri =
                Uri::try_from(format!("https://{authority}{path_and_query}")).map_err(|_| "a malformed path")?;
            parts.version = hyper::Version::HTTP_2;
        } else {
            let host = HeaderValue::from_str(&authority).map_err(|_| "a malformed host")?;
            parts.headers.insert(header::HOST, host);
            parts.uri = Uri::try_from(path_and_query).map_err(|_| "a malformed path")?;
            parts.version = hyper::Version::HTTP_11;
        }
        Ok(())
    }

    /// The proxy's own answer, reported with why.
    async fn answer(
        &self,
        mut report: HttpReport,
        status: StatusCode,
        body: &'static str,
        why: String,
    ) -> Response<ProxyBody> {
        report.status = Some(status.as_u16());
        report.refused = Some(why);
        let _ = self.ctx.reports.send(Report::Http(Box::new(report))).await;
        let mut response = Response::new(Either::Right(Full::new(Bytes::from_static(body.as_bytes()))));
        *response.status_mut() = status;
        response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        response
    }
}

/// Drops the headers of one hop, and those `Connection` names; `TE: trailers`, which HTTP/2 and gRPC need
/// end to end, stays.
fn strip_hop_headers(headers: &mut HeaderMap) {
    let trailers = headers.get(header::TE).is_some_and(|te| te.as_bytes().eq_ignore_ascii_case(b"trailers"));
    let listed: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|name| name.trim().to_ascii_lowercase()))
        .collect();
    for name in HOP_HEADERS.iter().copied().chain(listed.iter().map(String::as_str)) {
        headers.remove(name);
    }
    if trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// A response body that counts its bytes and reports the request when hyper drops it: at its end, or when
/// the workload went away (one report task per answer, at most 64 streams on each of the sandbox's connections).
struct Counted {
    inner: Incoming,
    report: Option<(mpsc::Sender<Report>, HttpReport)>,
}

impl Body for Counted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let (Some(data), Some((_, report))) = (frame.data_ref(), self.report.as_mut()) {
                report.bytes += data.len() as u64;
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some((reports, report)) = self.report.take() {
            // The loop may be busy: the report waits its turn rather than being lost.
            tokio::spawn(async move {
                let _ = reports.send(Report::Http(Box::new(report))).await;
            });
        }
    }
}

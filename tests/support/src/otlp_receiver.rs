//! A real OTLP log and trace receiver on loopback sockets: gRPC (tonic, with the official opentelemetry-proto
//! services) and HTTP/protobuf (a small HTTP/1.1 server decoding the same protobuf messages: `/v1/traces`
//! for traces, any other path for logs). It records every request's headers, every log record and every
//! span, and can be slow or reject requests on demand. With [`Receiver::start_tls`] both serve TLS only
//! (rustls), with a certificate the test made.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::{LogsService, LogsServiceServer};
use opentelemetry_proto::tonic::collector::logs::v1::{ExportLogsServiceRequest, ExportLogsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// How the receiver answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Behavior {
    /// Accept every request.
    Accept,
    /// Accept after sleeping this long per request (a slow collector).
    Slow(Duration),
    /// Reject every request with this message (gRPC status or HTTP 400 body).
    Reject(String),
}

/// One log record as received.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub resource: HashMap<String, String>,
    pub attributes: HashMap<String, String>,
    pub severity_number: i32,
    pub body: String,
}

/// One span as received, with its resource.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub protocol: &'static str,
    pub resource: HashMap<String, String>,
    pub attributes: HashMap<String, String>,
    pub name: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    /// Empty for a root span.
    pub parent_span_id: Vec<u8>,
    pub start_time_unix_nano: u64,
    pub end_time_unix_nano: u64,
    /// The status code (0 unset, 1 ok, 2 error).
    pub status_code: i32,
}

/// One export request as received.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub protocol: &'static str,
    pub headers: HashMap<String, String>,
    pub records: usize,
}

impl Request {
    /// Its `authorization` header.
    pub fn authorization(&self) -> Option<&str> {
        self.headers.get("authorization").map(String::as_str)
    }
}

/// The value of `OTEL_EXPORTER_OTLP_HEADERS` (or `..._LOGS_HEADERS`) that sends `token` (`Bearer ...`) as
/// the `authorization` header of every export.
pub fn authorization_headers(token: &str) -> String {
    format!("authorization={}", token.replace(' ', "%20"))
}

#[derive(Debug, Default)]
struct State {
    behavior: Option<Behavior>,
    requests: Vec<Request>,
    records: Vec<Record>,
    rejected: usize,
    trace_requests: Vec<Request>,
    spans: Vec<Span>,
    /// HTTP trace bodies that did not decode as `ExportTraceServiceRequest`.
    undecodable_traces: usize,
}

/// A running receiver. Dropping it stops it.
#[derive(Debug)]
pub struct Receiver {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    scheme: &'static str,
    state: Arc<Mutex<State>>,
    _runtime: tokio::runtime::Runtime,
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn map(attrs: &[KeyValue]) -> HashMap<String, String> {
    attrs.iter().map(|kv| (kv.key.clone(), text(kv.value.as_ref()))).collect()
}

impl State {
    /// Records a request; returns the rejection message if it is to be rejected.
    fn take(
        &mut self,
        protocol: &'static str,
        headers: HashMap<String, String>,
        req: &ExportLogsServiceRequest,
    ) -> Option<String> {
        if let Some(Behavior::Reject(msg)) = &self.behavior {
            self.rejected += 1;
            return Some(msg.clone());
        }
        let mut count = 0;
        for rl in &req.resource_logs {
            let resource = rl.resource.as_ref().map(|r| map(&r.attributes)).unwrap_or_default();
            for sl in &rl.scope_logs {
                for lr in &sl.log_records {
                    count += 1;
                    self.records.push(Record {
                        resource: resource.clone(),
                        attributes: map(&lr.attributes),
                        severity_number: lr.severity_number,
                        body: text(lr.body.as_ref()),
                    });
                }
            }
        }
        self.requests.push(Request { protocol, headers, records: count });
        None
    }

    /// Records a trace export; returns the rejection message if it is to be rejected.
    fn take_traces(
        &mut self,
        protocol: &'static str,
        headers: HashMap<String, String>,
        req: &ExportTraceServiceRequest,
    ) -> Option<String> {
        if let Some(Behavior::Reject(msg)) = &self.behavior {
            self.rejected += 1;
            return Some(msg.clone());
        }
        let mut count = 0;
        for rs in &req.resource_spans {
            let resource = rs.resource.as_ref().map(|r| map(&r.attributes)).unwrap_or_default();
            for ss in &rs.scope_spans {
                for span in &ss.spans {
                    count += 1;
                    self.spans.push(Span {
                        protocol,
                        resource: resource.clone(),
                        attributes: map(&span.attributes),
                        name: span.name.clone(),
                        trace_id: span.trace_id.clone(),
                        span_id: span.span_id.clone(),
                        parent_span_id: span.parent_span_id.clone(),
                        start_time_unix_nano: span.start_time_unix_nano,
                        end_time_unix_nano: span.end_time_unix_nano,
                        status_code: span.status.as_ref().map_or(0, |s| s.code),
                    });
                }
            }
        }
        self.trace_requests.push(Request { protocol, headers, records: count });
        None
    }

    fn delay(&self) -> Option<Duration> {
        match self.behavior {
            Some(Behavior::Slow(d)) => Some(d),
            _ => None,
        }
    }
}

struct Grpc(Arc<Mutex<State>>);

fn grpc_headers(metadata: &tonic::metadata::MetadataMap) -> HashMap<String, String> {
    metadata
        .iter()
        .filter_map(|kv| match kv {
            tonic::metadata::KeyAndValueRef::Ascii(k, v) => Some((k.to_string(), v.to_str().ok()?.to_owned())),
            tonic::metadata::KeyAndValueRef::Binary(..) => None,
        })
        .collect()
}

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let headers = grpc_headers(request.metadata());
        let delay = self.0.lock().unwrap().delay();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        match self.0.lock().unwrap().take_traces("grpc", headers, request.get_ref()) {
            Some(msg) => Err(tonic::Status::permission_denied(msg)),
            None => Ok(tonic::Response::new(ExportTraceServiceResponse::default())),
        }
    }
}

#[tonic::async_trait]
impl LogsService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportLogsServiceRequest>,
    ) -> Result<tonic::Response<ExportLogsServiceResponse>, tonic::Status> {
        let headers = grpc_headers(request.metadata());
        let delay = self.0.lock().unwrap().delay();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        match self.0.lock().unwrap().take("grpc", headers, request.get_ref()) {
            Some(msg) => Err(tonic::Status::permission_denied(msg)),
            None => Ok(tonic::Response::new(ExportLogsServiceResponse::default())),
        }
    }
}

/// A server certificate chain and its key, PEM.
#[derive(Debug, Clone)]
pub struct TlsIdentity {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TlsIdentity {
    /// An identity for 127.0.0.1, signed by a throwaway CA whose certificate is written to `dir/ca_file`
    /// (what the supervisor is told to trust); that file and the identity.
    pub fn issue(dir: &Path, ca_file: &str) -> (PathBuf, Self) {
        let issued = crate::tls::issue(&format!("e2e {ca_file}"), &["127.0.0.1", "localhost"]);
        let path = dir.join(ca_file);
        std::fs::write(&path, issued.ca_pem).unwrap();
        (path, Self { cert_pem: issued.cert_pem, key_pem: issued.key_pem })
    }
}

async fn http_connection<S>(stream: S, state: Arc<Mutex<State>>) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (read, mut write) = tokio::io::split(stream);
    let mut reader = BufReader::new(read);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).await? == 0 {
            return Ok(());
        }
        let mut headers = HashMap::new();
        loop {
            let mut h = String::new();
            reader.read_line(&mut h).await?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
            }
        }
        let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body).await?;
        let delay = state.lock().unwrap().delay();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let traces = line.split_whitespace().nth(1).is_some_and(|path| path.ends_with("/v1/traces"));
        let (verdict, payload) = if traces {
            let mut state = state.lock().unwrap();
            let req = ExportTraceServiceRequest::decode(body.as_slice()).unwrap_or_else(|_| {
                state.undecodable_traces += 1;
                ExportTraceServiceRequest::default()
            });
            (state.take_traces("http", headers, &req), ExportTraceServiceResponse::default().encode_to_vec())
        } else {
            let req = ExportLogsServiceRequest::decode(body.as_slice()).unwrap_or_default();
            (state.lock().unwrap().take("http", headers, &req), ExportLogsServiceResponse::default().encode_to_vec())
        };
        let response = match verdict {
            Some(msg) => format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{msg}",
                msg.len()
            )
            .into_bytes(),
            None => {
                let mut r = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: {}\r\n\r\n",
                    payload.len()
                )
                .into_bytes();
                r.extend_from_slice(&payload);
                r
            }
        };
        write.write_all(&response).await?;
        write.flush().await?;
    }
}

fn tls_acceptor(identity: &TlsIdentity) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(identity.cert_pem.as_bytes()).map(Result::unwrap).collect();
    let key = PrivateKeyDer::from_pem_slice(identity.key_pem.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

impl Receiver {
    /// Starts both servers on loopback.
    pub fn start(behavior: Behavior) -> Self {
        Self::serve(behavior, None)
    }

    /// Starts both servers on loopback, serving TLS only with `identity`.
    pub fn start_tls(behavior: Behavior, identity: &TlsIdentity) -> Self {
        Self::serve(behavior, Some(identity.clone()))
    }

    fn serve(behavior: Behavior, tls: Option<TlsIdentity>) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let state = Arc::new(Mutex::new(State { behavior: Some(behavior), ..State::default() }));
        let (grpc, http) = runtime.block_on(async {
            let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            (grpc_listener, http_listener)
        });
        let (grpc_addr, http_addr) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
        let logs = LogsServiceServer::new(Grpc(Arc::clone(&state)));
        let traces = TraceServiceServer::new(Grpc(Arc::clone(&state)));
        let mut server = tonic::transport::Server::builder();
        if let Some(identity) = &tls {
            let config = tonic::transport::ServerTlsConfig::new()
                .identity(tonic::transport::Identity::from_pem(&identity.cert_pem, &identity.key_pem));
            server = server.tls_config(config).unwrap();
        }
        runtime.spawn(async move {
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(grpc);
            let _ = server.add_service(logs).add_service(traces).serve_with_incoming(incoming).await;
        });
        let http_state = Arc::clone(&state);
        let acceptor = tls.as_ref().map(tls_acceptor);
        runtime.spawn(async move {
            while let Ok((stream, _)) = http.accept().await {
                let state = Arc::clone(&http_state);
                match acceptor.clone() {
                    // A client that does not trust the certificate fails the handshake: nothing is recorded.
                    Some(acceptor) => {
                        tokio::spawn(async move {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let _ = http_connection(stream, state).await;
                            }
                        });
                    }
                    None => {
                        tokio::spawn(http_connection(stream, state));
                    }
                }
            }
        });
        let scheme = if tls.is_some() { "https" } else { "http" };
        Self { grpc: grpc_addr, http: http_addr, scheme, state, _runtime: runtime }
    }

    /// Its endpoint for `protocol`: `grpc`, or `http/protobuf`.
    pub fn endpoint(&self, protocol: &str) -> String {
        if protocol == "grpc" {
            self.grpc_endpoint()
        } else {
            self.http_endpoint()
        }
    }

    pub fn grpc_endpoint(&self) -> String {
        format!("{}://{}", self.scheme, self.grpc)
    }

    pub fn http_endpoint(&self) -> String {
        format!("{}://{}", self.scheme, self.http)
    }

    pub fn records(&self) -> Vec<Record> {
        self.state.lock().unwrap().records.clone()
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().requests.clone()
    }

    /// Every span received, in order.
    pub fn spans(&self) -> Vec<Span> {
        self.state.lock().unwrap().spans.clone()
    }

    /// The trace export requests received (not rejected).
    pub fn trace_requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().trace_requests.clone()
    }

    /// HTTP trace bodies that were not an `ExportTraceServiceRequest`.
    pub fn undecodable_traces(&self) -> usize {
        self.state.lock().unwrap().undecodable_traces
    }

    /// Rejected requests, logs and traces.
    pub fn rejected(&self) -> usize {
        self.state.lock().unwrap().rejected
    }

    pub fn set_behavior(&self, behavior: Behavior) {
        self.state.lock().unwrap().behavior = Some(behavior);
    }

    /// Sends one export over gRPC as an ordinary client and returns the error message, if any: the
    /// positive control that a rejection really carries its message to whoever exports.
    pub fn probe_grpc(&self) -> Option<String> {
        let endpoint = self.grpc_endpoint();
        self._runtime.block_on(async move {
            use opentelemetry_proto::tonic::collector::logs::v1::logs_service_client::LogsServiceClient;
            let mut client = LogsServiceClient::connect(endpoint).await.ok()?;
            client.export(ExportLogsServiceRequest::default()).await.err().map(|s| s.message().to_owned())
        })
    }
}

//! Builds the OTLP exporters (logs and traces alike) from the endpoint, the protocol and the credentials in
//! force: gRPC (tonic) or HTTP/protobuf (reqwest), each over TLS (rustls with ring) when a CA bundle is
//! given. [`Rebuild`] builds a new one whenever the live credentials change, so the next export presents the
//! new token and its next connection trusts the new CA.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use opentelemetry_otlp::tonic_types::metadata::MetadataMap;
use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig};
use opentelemetry_otlp::{
    LogExporter, Protocol as OtlpProtocol, SpanExporter, WithExportConfig, WithHttpConfig, WithTonicConfig,
};
use opentelemetry_sdk::logs::LogExporter as _;
use opentelemetry_sdk::trace::SpanExporter as _;
use opentelemetry_sdk::Resource;

use super::batch::Export;
use super::credentials::{CaBundle, CaError, Credentials, LiveCredentials};
use super::otlp::{OtlpError, Protocol, EXPORT_TIMEOUT};

/// Everything an exporter is built from but the credentials.
#[derive(Debug, Clone)]
pub struct ExporterSpec {
    /// Collector endpoint.
    pub endpoint: String,
    /// Wire protocol.
    pub protocol: Protocol,
    /// The resource every record and span carries.
    pub resource: Resource,
}

/// One OTLP signal the supervisor exports: its exporter, and how one is built.
pub(crate) trait Signal {
    /// The exporter.
    type Exporter: Export;
    /// Names the signal's export in fixed-text diagnostics.
    const NAME: &'static str;

    /// An exporter to `spec`'s collector presenting `credentials`.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    fn build(spec: &ExporterSpec, credentials: &Credentials) -> Result<Self::Exporter, OtlpError>;
}

/// The OCSF events, as OTLP log records.
#[derive(Debug)]
pub(crate) struct Logs;

/// The supervisor's spans, as OTLP traces.
#[derive(Debug)]
pub(crate) struct Traces;

impl Signal for Logs {
    type Exporter = LogExporter;
    const NAME: &'static str = "OCSF OTLP";

    fn build(spec: &ExporterSpec, credentials: &Credentials) -> Result<LogExporter, OtlpError> {
        let built = match spec.protocol {
            Protocol::Grpc => grpc(LogExporter::builder().with_tonic(), &spec.endpoint, credentials)?.build(),
            Protocol::HttpProtobuf => {
                http(LogExporter::builder().with_http(), http_logs_url(&spec.endpoint), credentials)?.build()
            }
        };
        let mut exporter = built.map_err(|_| OtlpError::Build)?;
        exporter.set_resource(&spec.resource);
        Ok(exporter)
    }
}

impl Signal for Traces {
    type Exporter = SpanExporter;
    const NAME: &'static str = "span OTLP";

    fn build(spec: &ExporterSpec, credentials: &Credentials) -> Result<SpanExporter, OtlpError> {
        let built = match spec.protocol {
            Protocol::Grpc => grpc(SpanExporter::builder().with_tonic(), &spec.endpoint, credentials)?.build(),
            Protocol::HttpProtobuf => {
                http(SpanExporter::builder().with_http(), http_traces_url(&spec.endpoint), credentials)?.build()
            }
        };
        let mut exporter = built.map_err(|_| OtlpError::Build)?;
        exporter.set_resource(&spec.resource);
        Ok(exporter)
    }
}

/// Builds a signal's exporter from the credentials in force, and again whenever they change.
#[derive(Debug)]
pub(crate) struct Rebuild<S> {
    spec: ExporterSpec,
    live: LiveCredentials,
    /// The credentials' version the current exporter was built from.
    version: u64,
    signal: PhantomData<S>,
}

impl<S: Signal> Rebuild<S> {
    /// The exporter for the credentials in force now, and what rebuilds it after a rotation.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    pub(crate) fn first(spec: ExporterSpec, live: LiveCredentials) -> Result<(S::Exporter, Self), OtlpError> {
        let (version, credentials) = live.current();
        let exporter = S::build(&spec, &credentials)?;
        Ok((exporter, Self { spec, live, version, signal: PhantomData }))
    }

    /// What the export task calls before it sends: a new exporter once the credentials were rotated.
    /// Requests in flight finish on the old one. A build that fails keeps the old one (the rotation was
    /// validated, so it is not expected).
    pub(crate) fn refresh(&mut self) -> Option<S::Exporter> {
        if self.live.version() == self.version {
            return None;
        }
        let (version, credentials) = self.live.current();
        self.version = version;
        match S::build(&self.spec, &credentials) {
            Ok(exporter) => Some(exporter),
            Err(_) => {
                tracing::warn!("cannot build the {} exporter for rotated credentials; keeping the old", S::NAME);
                None
            }
        }
    }
}

/// The gRPC settings every exporter shares: endpoint, timeout, the headers as metadata, and TLS.
fn grpc<B: WithExportConfig + WithTonicConfig>(
    builder: B,
    endpoint: &str,
    credentials: &Credentials,
) -> Result<B, OtlpError> {
    let builder =
        builder.with_endpoint(endpoint).with_timeout(EXPORT_TIMEOUT).with_metadata(grpc_metadata(credentials)?);
    Ok(match grpc_tls(endpoint, credentials) {
        Some(tls) => builder.with_tls_config(tls),
        None => builder,
    })
}

/// The HTTP settings every exporter shares: our TLS client, the signal's `url`, protobuf, timeout, headers.
fn http<B: WithExportConfig + WithHttpConfig>(
    builder: B,
    url: String,
    credentials: &Credentials,
) -> Result<B, OtlpError> {
    let headers: HashMap<String, String> = credentials.headers.iter().cloned().collect();
    Ok(builder
        .with_http_client(http_client(credentials.ca.as_ref())?)
        .with_endpoint(url)
        .with_protocol(OtlpProtocol::HttpBinary)
        .with_timeout(EXPORT_TIMEOUT)
        .with_headers(headers))
}

/// The collector headers as gRPC metadata.
fn grpc_metadata(credentials: &Credentials) -> Result<MetadataMap, OtlpError> {
    let mut metadata = MetadataMap::new();
    for (name, value) in &credentials.headers {
        let key = tonic::metadata::MetadataKey::from_bytes(name.to_ascii_lowercase().as_bytes())
            .map_err(|_| OtlpError::Header)?;
        let value = tonic::metadata::MetadataValue::try_from(value.as_str()).map_err(|_| OtlpError::Header)?;
        metadata.insert(key, value);
    }
    Ok(metadata)
}

/// TLS trusting the CA bundle, for an `https://` endpoint only (tonic refuses TLS settings on a plain one).
fn grpc_tls(endpoint: &str, credentials: &Credentials) -> Option<ClientTlsConfig> {
    let ca = credentials.ca.as_ref().filter(|_| is_https(endpoint))?;
    Some(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca.pem())))
}

/// A reqwest client that trusts only `ca` (none: no `https://` collector verifies). Always our own rustls
/// configuration: reqwest is built without a default crypto provider.
fn http_client(ca: Option<&CaBundle>) -> Result<reqwest::Client, OtlpError> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(ca) = ca {
        for cert in ca.certificates() {
            roots.add(cert).map_err(|_| OtlpError::Ca(CaError::NoCertificate))?;
        }
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|_| OtlpError::Build)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|_| OtlpError::Build)
}

/// Whether `endpoint` asks for TLS.
pub fn is_https(endpoint: &str) -> bool {
    endpoint.trim_start().get(..8).is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"))
}

/// `http://host:4318` -> `http://host:4318/v1/logs`; a URL with a path is used as given.
pub fn http_logs_url(endpoint: &str) -> String {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    if rest.trim_end_matches('/').contains('/') {
        endpoint.to_owned()
    } else {
        format!("{}/v1/logs", endpoint.trim_end_matches('/'))
    }
}

/// The traces URL beside the logs URL: `http://c:4318` and `http://c:4318/v1/logs` give
/// `http://c:4318/v1/traces`; a custom path ending in `logs` gets `traces` in its place; any other path is
/// replaced by `/v1/traces`.
pub fn http_traces_url(endpoint: &str) -> String {
    let trimmed = endpoint.trim_end_matches('/');
    let (scheme, rest) = trimmed.split_once("://").map_or(("", trimmed), |(s, r)| (s, r));
    let prefix = if scheme.is_empty() { String::new() } else { format!("{scheme}://") };
    match rest.split_once('/') {
        None => format!("{prefix}{rest}/v1/traces"),
        Some((authority, path)) => match path.strip_suffix("logs") {
            Some(base) if base.is_empty() || base.ends_with('/') => format!("{prefix}{authority}/{base}traces"),
            _ => format!("{prefix}{authority}/v1/traces"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_is_asked_for_by_the_scheme() {
        assert!(is_https("https://c:4317") && is_https("HTTPS://c:4317"));
        assert!(!is_https("http://c:4317") && !is_https("c:4317"));
    }

    #[test]
    fn http_endpoints_get_the_logs_path() {
        assert_eq!(http_logs_url("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/logs");
        assert_eq!(http_logs_url("http://127.0.0.1:4318/"), "http://127.0.0.1:4318/v1/logs");
        assert_eq!(http_logs_url("http://c:4318/custom/logs"), "http://c:4318/custom/logs");
    }

    #[test]
    fn traces_go_beside_the_logs() {
        assert_eq!(http_traces_url("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(http_traces_url("http://127.0.0.1:4318/"), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(http_traces_url("http://c:4318/v1/logs"), "http://c:4318/v1/traces");
        assert_eq!(http_traces_url("http://c:4318/custom/logs"), "http://c:4318/custom/traces");
        assert_eq!(http_traces_url("http://c:4318/ingest"), "http://c:4318/v1/traces");
        assert_eq!(http_traces_url("http://c:4318/blogs"), "http://c:4318/v1/traces");
    }
}

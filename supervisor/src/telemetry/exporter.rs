//! Builds the OTLP log exporter from the endpoint, the protocol and the credentials in force: gRPC (tonic)
//! or HTTP/protobuf (reqwest), each over TLS (rustls with ring) when a CA bundle is given. The export task
//! builds a new one whenever the credential slots change, so the next export presents the new token and
//! its next connection trusts the new CA.

use std::collections::HashMap;
use std::sync::Arc;

use opentelemetry_otlp::tonic_types::metadata::MetadataMap;
use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig};
use opentelemetry_otlp::{LogExporter, Protocol as OtlpProtocol, WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::logs::LogExporter as _;
use opentelemetry_sdk::Resource;

use super::credentials::{CaBundle, CaError, Credentials};
use super::otlp::{OtlpError, Protocol, EXPORT_TIMEOUT};

/// Everything an exporter is built from but the credentials.
#[derive(Debug, Clone)]
pub struct ExporterSpec {
    /// Collector endpoint.
    pub endpoint: String,
    /// Wire protocol.
    pub protocol: Protocol,
    /// The resource every record carries.
    pub resource: Resource,
}

impl ExporterSpec {
    /// An exporter presenting `credentials`.
    ///
    /// # Errors
    /// [`OtlpError`] for a bad header, CA bundle or endpoint.
    pub fn build(&self, credentials: &Credentials) -> Result<LogExporter, OtlpError> {
        let mut exporter = match self.protocol {
            Protocol::Grpc => grpc(&self.endpoint, credentials)?,
            Protocol::HttpProtobuf => http(&self.endpoint, credentials)?,
        };
        exporter.set_resource(&self.resource);
        Ok(exporter)
    }
}

fn grpc(endpoint: &str, credentials: &Credentials) -> Result<LogExporter, OtlpError> {
    let mut builder = LogExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(EXPORT_TIMEOUT)
        .with_metadata(grpc_metadata(credentials)?);
    if let Some(tls) = grpc_tls(endpoint, credentials) {
        builder = builder.with_tls_config(tls);
    }
    builder.build().map_err(|_| OtlpError::Build)
}

/// The collector headers as gRPC metadata, for the log and the span exporter alike.
pub(crate) fn grpc_metadata(credentials: &Credentials) -> Result<MetadataMap, OtlpError> {
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
pub(crate) fn grpc_tls(endpoint: &str, credentials: &Credentials) -> Option<ClientTlsConfig> {
    let ca = credentials.ca.as_ref().filter(|_| is_https(endpoint))?;
    Some(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca.pem())))
}

fn http(endpoint: &str, credentials: &Credentials) -> Result<LogExporter, OtlpError> {
    let headers: HashMap<String, String> = credentials.headers.iter().cloned().collect();
    LogExporter::builder()
        .with_http()
        .with_http_client(http_client(credentials.ca.as_ref())?)
        .with_endpoint(http_logs_url(endpoint))
        .with_protocol(OtlpProtocol::HttpBinary)
        .with_timeout(EXPORT_TIMEOUT)
        .with_headers(headers)
        .build()
        .map_err(|_| OtlpError::Build)
}

/// A reqwest client that trusts only `ca` (none: no `https://` collector verifies). Always our own rustls
/// configuration: reqwest is built without a default crypto provider.
pub(crate) fn http_client(ca: Option<&CaBundle>) -> Result<reqwest::Client, OtlpError> {
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
}

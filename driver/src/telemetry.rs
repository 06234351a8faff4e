//! Telemetry settings for supervisors: plain settings go into their environment, collector headers into the
//! sandbox's auth bundle (`vm_contract::auth`). Header values never appear in an argv, an environment, the
//! guest or a log line; every error here is fixed text.

use std::path::PathBuf;

use vm_contract::env::HEADER_VARS;

pub use vm_contract::telemetry::TelemetryConfig;

/// The CA bundle path cannot be used. Fixed text.
#[derive(Debug, thiserror::Error)]
#[error("the OTLP CA bundle cannot be found")]
pub struct CaPathError(#[source] std::io::Error);

/// The absolute, canonical form of a CA bundle path given on this host: supervisors run elsewhere (in the
/// sandbox directory) and read it again at every start and rotation.
///
/// # Errors
/// [`CaPathError`] when it does not exist.
pub fn ca_path(path: &std::path::Path) -> Result<PathBuf, CaPathError> {
    std::fs::canonicalize(path).map_err(CaPathError)
}

/// The collector headers are malformed. Fixed text: the value could be a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var} is not a comma-separated list of key=value pairs")]
pub struct HeaderError {
    var: &'static str,
}

/// Parses `k1=v1,k2=v2` (values percent-decoded) from the first header variable that is set.
///
/// # Errors
/// [`HeaderError`] naming the variable, never its value.
pub fn headers_from_env() -> Result<Vec<(String, String)>, HeaderError> {
    headers_from(|var| std::env::var(var).ok())
}

fn headers_from(lookup: impl Fn(&str) -> Option<String>) -> Result<Vec<(String, String)>, HeaderError> {
    for var in HEADER_VARS {
        if let Some(text) = lookup(var) {
            return parse_headers(&text).ok_or(HeaderError { var });
        }
    }
    Ok(Vec::new())
}

/// Parses collector headers given as text (`k1=v1,k2=v2`, values percent-decoded), as the header variables
/// hold them; `None` when malformed. The caller says where they came from, never what they are.
pub fn parse_headers(text: &str) -> Option<Vec<(String, String)>> {
    text.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=')?;
            let key = k.trim();
            (!key.is_empty()).then(|| Some((key.to_owned(), percent_decode(v.trim())?)))?
        })
        .collect()
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_w3c_style_header_lists() {
        assert_eq!(
            parse_headers("authorization=Bearer%20abc, x-tenant = t1").unwrap(),
            vec![("authorization".into(), "Bearer abc".into()), ("x-tenant".into(), "t1".into())]
        );
        assert_eq!(parse_headers("").unwrap(), vec![]);
        assert!(parse_headers("novalue").is_none());
        assert!(parse_headers("=x").is_none());
        assert!(parse_headers("k=%zz").is_none());
    }

    #[test]
    fn errors_never_show_the_value() {
        // Malformed (the bad escape), and carrying a secret.
        let env = |var: &str| (var == HEADER_VARS[0]).then(|| "authorization=Bearer s3cr3t-%zz".to_owned());
        let e = headers_from(env).unwrap_err();
        let text = format!("{e} {e:?}");
        assert!(text.contains("OTEL_EXPORTER_OTLP_LOGS_HEADERS"), "{text}");
        assert!(!text.contains("s3cr3t") && !text.contains("Bearer"), "{text}");
        // The fallback variable is read only when the first is unset.
        let fallback = |var: &str| (var == HEADER_VARS[1]).then(|| "k=v".to_owned());
        assert_eq!(headers_from(fallback).unwrap(), vec![("k".into(), "v".into())]);
    }
}

//! `vm-driver credentials`: rotate a sandbox's OTLP collector credentials in a running `serve`. Header
//! values are secrets: they are read from a file or stdin (never argv), and no message here shows one.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use vm_protocol::driver_api::{CollectorHeader, CollectorHeaders, RotateCredentialsRequest};

/// Largest headers file read.
const MAX_HEADERS_BYTES: u64 = 64 * 1024;

/// `vm-driver credentials`.
#[derive(Debug, clap::Args)]
pub struct CredentialsArgs {
    #[command(flatten)]
    pub socket: crate::cli::SocketArgs,
    /// The new collector headers: a file, or - for stdin. Replaces every header.
    #[arg(long, value_name = "FILE", value_parser = HeadersFrom::parse)]
    pub headers_file: Option<HeadersFrom>,
    /// A new PEM CA bundle for an https:// collector.
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// New values for the sandbox's secret credentials, by name (a JSON list in a 0600 file, as
    /// --credentials-file of create takes it).
    #[arg(long, value_name = "FILE")]
    pub credentials_file: Option<PathBuf>,
    /// The sandbox id.
    pub id: vm_contract::ids::SandboxId,
}

/// Where the new headers come from.
#[derive(Debug, Clone)]
pub enum HeadersFrom {
    /// `-`: standard input.
    Stdin,
    /// A file.
    File(PathBuf),
}

impl HeadersFrom {
    /// `-` is stdin; anything else a path.
    pub fn parse(text: &str) -> Result<Self, String> {
        Ok(if text == "-" { Self::Stdin } else { Self::File(PathBuf::from(text)) })
    }

    fn describe(&self) -> String {
        match self {
            Self::Stdin => "standard input".to_owned(),
            Self::File(path) => path.display().to_string(),
        }
    }

    /// Reads and parses `k1=v1,k2=v2` (commas or newlines between pairs, values percent-decoded).
    fn read(&self) -> Result<Vec<(String, String)>> {
        let mut text = String::new();
        let read = match self {
            Self::Stdin => std::io::stdin().take(MAX_HEADERS_BYTES).read_to_string(&mut text),
            Self::File(path) => {
                std::fs::File::open(path).and_then(|f| f.take(MAX_HEADERS_BYTES).read_to_string(&mut text))
            }
        };
        read.with_context(|| format!("cannot read the headers from {}", self.describe()))?;
        match vm_driver::telemetry::parse_headers(&text.replace(['\n', '\r'], ",")) {
            Some(headers) if !headers.is_empty() => Ok(headers),
            // Never the text: it holds the token.
            Some(_) => bail!("{}: no headers", self.describe()),
            None => bail!("{}: not a list of key=value pairs", self.describe()),
        }
    }
}

/// What a rotation changes.
#[derive(Debug)]
pub struct Rotation<'a> {
    /// New collector headers.
    pub headers: Option<&'a HeadersFrom>,
    /// A new collector CA bundle.
    pub ca: Option<&'a Path>,
    /// New secret credentials, by name.
    pub credentials: Option<&'a Path>,
}

/// Rotates the credentials of sandbox `id`: new collector headers, a new CA bundle, new secret values.
///
/// # Errors
/// Nothing to rotate, unreadable input, refused, or the driver or sandbox cannot be reached.
pub async fn rotate(socket: &Path, id: &str, rotation: Rotation<'_>) -> Result<()> {
    let Rotation { headers, ca, credentials } = rotation;
    if headers.is_none() && ca.is_none() && credentials.is_none() {
        bail!("nothing to rotate: give --headers-file, --ca, --credentials-file, or several");
    }
    let credentials = match credentials {
        Some(path) => vm_driver::secrets::read_file(path).with_context(|| path.display().to_string())?,
        None => Vec::new(),
    };
    let headers = match headers {
        Some(from) => Some(from.read()?),
        None => None,
    };
    let ca_path = match ca {
        Some(path) => vm_driver::telemetry::ca_path(path)
            .with_context(|| format!("{}", path.display()))?
            .to_string_lossy()
            .into_owned(),
        None => String::new(),
    };
    let request = RotateCredentialsRequest {
        sandbox_id: id.to_owned(),
        headers: headers.map(|h| CollectorHeaders {
            header: h.into_iter().map(|(name, value)| CollectorHeader { name, value }).collect(),
        }),
        ca_path,
        credentials: vm_driver::secrets::to_api(credentials),
    };
    let mut client = crate::client::connect(socket).await?;
    let answer = client.rotate_credentials(request).await?.into_inner();
    println!("{id}: credentials rotation {}", answer.outcome);
    Ok(())
}

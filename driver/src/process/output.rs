//! Where a local process's stdin comes from and its stdout goes: this process's own, or the two ends of a copy
//! (`cp`, `launch --copy-in/--copy-out`): a tar made of a host path, and the hardened extractor.

use std::path::{Path, PathBuf};

use crate::files::{self, CopyOutError, Destination, Limits, Unpacking};
use anyhow::{Context, Result};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use vm_protocol::files::TarRefusal;

/// The extractor's verdict on a tar it ended early.
pub type Verdict = std::pin::Pin<Box<dyn std::future::Future<Output = OutputError>>>;

/// Stdin's chunks; the queue closing is EOF.
pub type Input = mpsc::Receiver<Vec<u8>>;

/// A tar of a host path, made while it is sent.
#[derive(Debug)]
pub struct Packing {
    packer: files::pack::Packer,
    source: PathBuf,
}

/// Starts packing `source`; the chunks are the copy's stdin.
///
/// # Errors
/// The source is missing or has no name.
pub fn pack(source: &Path) -> Result<(Input, Packing)> {
    let (chunks, packer) = files::pack::start(source).with_context(|| format!("cannot copy {}", source.display()))?;
    Ok((chunks, Packing { packer, source: source.to_path_buf() }))
}

impl Packing {
    /// Whether the whole tar was made (a file that vanished or turned unreadable midway breaks it).
    ///
    /// # Errors
    /// The packing failed.
    pub async fn finish(self) -> Result<()> {
        let source = self.source;
        self.packer.finish().await.with_context(|| format!("cannot read {}", source.display()))
    }
}

/// Where a process's stdout goes.
#[derive(Debug)]
pub enum Output {
    /// This process's stdout, byte for byte.
    Stdout(tokio::io::Stdout),
    /// The hardened extractor, into a host path.
    Unpack {
        /// The extractor; `None` once it ended.
        unpacking: Option<Unpacking>,
    },
}

/// Why stdout could not be handed on.
#[derive(Debug)]
pub enum OutputError {
    /// The extractor refused the tar: report it to the sandbox, then fail with the error.
    Refused(TarRefusal, anyhow::Error),
    /// Anything else.
    Failed(anyhow::Error),
}

impl Output {
    /// This process's stdout.
    pub fn stdout() -> Self {
        Self::Stdout(tokio::io::stdout())
    }

    /// The extractor, unpacking the copy of the guest's `source` to the host's `dest`.
    ///
    /// # Errors
    /// The destination cannot take it (checked before any byte).
    pub fn unpack(source: &str, dest: &Path, confined: bool) -> Result<Self> {
        let unpacking = Unpacking::start(Destination::resolve(source, dest)?, Limits::default(), confined)
            .context("cannot start the extractor")?;
        Ok(Self::Unpack { unpacking: Some(unpacking) })
    }

    /// Hands stdout's bytes on.
    ///
    /// # Errors
    /// Writing failed, or the extractor ended early: it refused the tar.
    pub async fn write(&mut self, data: &[u8]) -> Result<(), OutputError> {
        match self {
            Self::Stdout(out) => {
                out.write_all(data).await.context("cannot write stdout").map_err(OutputError::Failed)?;
                out.flush().await.context("cannot write stdout").map_err(OutputError::Failed)
            }
            Self::Unpack { unpacking } => {
                let Some(u) = unpacking else { return Ok(()) };
                if u.chunks.send(data.to_vec()).await.is_ok() {
                    return Ok(());
                }
                match unpacking.take() {
                    Some(u) => Err(verdict(u.finish(false).await)),
                    None => Ok(()),
                }
            }
        }
    }

    /// Resolves once the extractor ended before the tar did (it refused it), so a guest that stops sending
    /// after a bad entry cannot hold the copy open; never for stdout. Then [`Output::verdict`] says why.
    pub async fn ended_early(&self) {
        match self {
            Self::Unpack { unpacking: Some(u) } => u.chunks.closed().await,
            _ => std::future::pending().await,
        }
    }

    /// Takes the extractor, once it ended early, and hands back its verdict to await. Kept by the caller
    /// between polls, so a caller that is cancelled while it waits (a `select!`) loses nothing.
    pub fn verdict(&mut self) -> Option<Verdict> {
        match self {
            Self::Unpack { unpacking } => {
                let u = unpacking.take()?;
                Some(Box::pin(async move { verdict(u.finish(false).await) }))
            }
            Self::Stdout(_) => None,
        }
    }

    /// After the process's exit: the extractor's verdict on the whole tar (`success`: the exit status was 0;
    /// only then does the tar land).
    ///
    /// # Errors
    /// The tar was refused or could not land.
    pub async fn finish(self, success: bool) -> Result<(), OutputError> {
        let Self::Unpack { unpacking: Some(u), .. } = self else { return Ok(()) };
        match u.finish(success).await {
            Ok(_) => Ok(()),
            // A failed operation (its message is on stderr, its status is the copy's) may have cut its tar
            // short: that is no attack, and nothing landed.
            Err(CopyOutError::Refused(TarRefusal::Malformed) | CopyOutError::Abandoned) if !success => Ok(()),
            Err(e) => Err(verdict(Err(e))),
        }
    }
}

fn verdict(ended: Result<files::Unpacked, CopyOutError>) -> OutputError {
    match ended {
        Err(CopyOutError::Refused(reason)) => OutputError::Refused(reason, CopyOutError::Refused(reason).into()),
        Err(e) => OutputError::Failed(e.into()),
        Ok(_) => OutputError::Failed(anyhow::anyhow!("the extractor ended before the tar did")),
    }
}

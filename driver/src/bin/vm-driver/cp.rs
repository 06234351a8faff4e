//! `vm-driver cp`: a tar into or out of a running sandbox, through the files API (docs/files.md).

use anyhow::{bail, Result};
use clap::Args;
use vm_protocol::driver_api::{files_start::Op, FileCopyIn, FilePath};

use crate::cli::SocketArgs;
use crate::exec::{self, Target};

#[derive(Debug, Args)]
pub struct CpArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// `-` (a tar on stdin) or SANDBOX:PATH.
    pub src: String,
    /// SANDBOX:DIR or `-` (a tar on stdout).
    pub dst: String,
}

/// Runs the copy; returns the exit status to exit with.
///
/// # Errors
/// A host path on either side, a bad sandbox id, or the stream's failure.
pub async fn run(args: CpArgs) -> Result<u8> {
    let guest = |arg: &str| arg.split_once(':').map(|(id, path)| (id.to_owned(), path.to_owned()));
    let (id, op, input) = match (args.src.as_str(), args.dst.as_str(), guest(&args.src), guest(&args.dst)) {
        ("-", _, _, Some((id, path))) => (id, Op::CopyIn(FileCopyIn { path, into: true }), true),
        (_, "-", Some((id, path)), _) => (id, Op::CopyOut(FilePath { path }), false),
        _ => bail!(
            "cp takes `- SANDBOX:DIR` or `SANDBOX:PATH -`; copies to and from host paths come with the \
             hardened extractor (docs/files.md)"
        ),
    };
    let id = vm_contract::ids::SandboxId::parse(&id)?;
    exec::exec(&args.socket.path(), id.as_str(), Target::Files(op), input, false).await
}

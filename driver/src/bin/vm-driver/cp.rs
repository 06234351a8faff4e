//! `vm-driver cp`: files into or out of a running sandbox, through the files API (docs/files.md), with
//! docker's syntax: `cp SRC SANDBOX:DST`, `cp SANDBOX:SRC DST`, and `-` for a tar on stdin or stdout.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use vm_contract::ids::SandboxId;
use vm_driver::process::output::{self, Output};
use vm_driver::process::terminal;
use vm_protocol::driver_api::{files_start::Op, FileCopyIn, FilePath};

use crate::cli::SocketArgs;
use crate::exec::{self, Target};

#[derive(Debug, Args)]
pub struct CpArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// A host path, `-` (a tar on stdin), or SANDBOX:PATH.
    pub src: String,
    /// SANDBOX:PATH, a host path, or `-` (a tar on stdout).
    pub dst: String,
}

/// One side of a copy.
#[derive(Debug, PartialEq, Eq)]
enum Side<'a> {
    /// `-`.
    Tar,
    /// SANDBOX:PATH.
    Guest(SandboxId, &'a str),
    /// Anything else, and anything that starts with `/` or `.` (so `./a:b` is a host path, as in docker).
    Host(&'a Path),
}

fn side(arg: &str) -> Result<Side<'_>> {
    if arg == "-" {
        return Ok(Side::Tar);
    }
    if !arg.starts_with(['/', '.']) {
        if let Some((id, path)) = arg.split_once(':') {
            if path.is_empty() {
                bail!("{arg:?} names no path in the sandbox");
            }
            return Ok(Side::Guest(SandboxId::parse(id)?, path));
        }
    }
    Ok(Side::Host(Path::new(arg)))
}

/// Runs the copy; returns the exit status to exit with.
///
/// # Errors
/// A copy between two host paths or two sandboxes, a bad sandbox id, a destination that cannot take the
/// copy, a refused tar, or the stream's failure.
pub async fn run(args: CpArgs, controls: vm_driver::controls::Files) -> Result<u8> {
    let socket = args.socket.path();
    let (id, op, input, output, packing) = match (side(&args.src)?, side(&args.dst)?) {
        (Side::Tar, Side::Guest(id, path)) => {
            let op = Op::CopyIn(FileCopyIn { path: path.to_owned(), into: true });
            (id, op, Some(terminal::stdin_chunks()), Output::stdout(), None)
        }
        (Side::Host(src), Side::Guest(id, path)) => {
            let (chunks, packing) = output::pack(src)?;
            let op = Op::CopyIn(FileCopyIn { path: path.to_owned(), into: false });
            (id, op, Some(chunks), Output::stdout(), Some(packing))
        }
        (Side::Guest(id, path), Side::Tar) => {
            (id, Op::CopyOut(FilePath { path: path.to_owned() }), None, Output::stdout(), None)
        }
        (Side::Guest(id, path), Side::Host(dst)) => {
            let output = Output::unpack(path, dst, !controls.unchecked_extract)?;
            (id, Op::CopyOut(FilePath { path: path.to_owned() }), None, output, None)
        }
        _ => bail!("cp copies between the host and a sandbox: one side is SANDBOX:PATH, the other a host path or -"),
    };
    let status = exec::exec(&socket, id.as_str(), Target::Files(op), input, false, output).await?;
    if let Some(packing) = packing {
        packing.finish().await?;
    }
    Ok(status)
}

/// `--copy-in HOSTPATH:GUESTPATH`, split at the last `:`.
pub fn parse_copy_in(text: &str) -> Result<(PathBuf, String), String> {
    match text.rsplit_once(':') {
        Some((host, guest)) if !host.is_empty() && !guest.is_empty() => Ok((PathBuf::from(host), guest.to_owned())),
        _ => Err(format!("--copy-in wants HOSTPATH:GUESTPATH, got {text:?}")),
    }
}

/// `--copy-out GUESTPATH:HOSTPATH`, split at the first `:`.
pub fn parse_copy_out(text: &str) -> Result<(String, PathBuf), String> {
    match text.split_once(':') {
        Some((guest, host)) if !host.is_empty() && !guest.is_empty() => Ok((guest.to_owned(), PathBuf::from(host))),
        _ => Err(format!("--copy-out wants GUESTPATH:HOSTPATH, got {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_follow_dockers_reading() {
        assert_eq!(side("-").unwrap(), Side::Tar);
        assert!(matches!(side("box-1:/work").unwrap(), Side::Guest(_, "/work")));
        assert_eq!(side("./a:b").unwrap(), Side::Host(Path::new("./a:b")));
        assert_eq!(side("/abs:x").unwrap(), Side::Host(Path::new("/abs:x")));
        assert_eq!(side("plain").unwrap(), Side::Host(Path::new("plain")));
        assert!(side("box-1:").is_err());
        assert!(side("Not An Id:/x").is_err());
    }

    #[test]
    fn launch_copies_split_where_each_side_cannot_hold_a_colon() {
        assert_eq!(parse_copy_in("/h/a:b:/g").unwrap(), (PathBuf::from("/h/a:b"), "/g".to_owned()));
        assert_eq!(parse_copy_out("/g:/h/a:b").unwrap(), ("/g".to_owned(), PathBuf::from("/h/a:b")));
        assert!(parse_copy_in(":/g").is_err());
        assert!(parse_copy_out("/g:").is_err());
    }
}

//! Host directories (`--mount`): one `virtiofsd` per mount, started through `vm-jailer share` before QEMU,
//! and ended with it ([`vm_contract::share`] has the confinement).
//!
//! - The supervisor binds each server's listening socket, `vmm/fsN.sock` (0600, the VMM's ids: only that
//!   QEMU may connect), and hands it over as the jailer's stdin, so no path of the server's is writable.
//! - Whose files: the guest's workload uid and gid are mapped to the directory's owner, or, for a directory
//!   owned by root, to the VMM's own jail id (never to root); under `userns` confinement, to the driver's
//!   own ids. No other guest id exists for the server.
//! - The server's messages go to `shares/N.log`, capped like the VMM's.
//! - On the leash: QEMU's end closes the socket and the server exits with it; [`Shares::kill`] ends each at
//!   the VM's teardown; the jailer dies with the supervisor and the server with its jailer (parent-death
//!   signals, even before QEMU has connected).

use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt};
use tokio::process::{Child, Command};
use vm_contract::jail::{parse_vmm_pid_line, Confinement, JailIds};
use vm_contract::layout::SandboxFile;
use vm_contract::share::{HostMount, ShareJailerArgs, JAIL_SOURCE, SOCKET_FD};
use vm_protocol::identity::WORKLOAD;
use vm_protocol::mounts::GuestMount;

use super::guest_logs;
use super::vmm::VMM_NICE;
use crate::inbox::Senders;
use crate::safeguards::Safeguards;

/// Debian's (and QEMU 7.2's) C `virtiofsd`.
pub const VIRTIOFSD: &str = "/usr/lib/qemu/virtiofsd";
/// The host group a root group is served as.
const NOGROUP: u32 = 65_534;
/// Each server's log cap.
const LOG_CAP_BYTES: u64 = 64 * 1024;
/// How much of a failed jailer's stderr is kept.
const REASON_BYTES: u64 = 4096;
/// How long a jailer has to report its server's pid.
const REPORT_MS: u64 = 5_000;

/// Why a file server could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ShareError {
    /// No `virtiofsd`.
    #[error("host directories need virtiofsd ({VIRTIOFSD}, in Debian's qemu-system-common)")]
    NoVirtiofsd,
    /// `--confinement none`.
    #[error("host directories need jail or userns confinement")]
    NoConfinement,
    /// The shared directory is not a directory.
    #[error("mount source {} is not a directory", .0.display())]
    Source(PathBuf),
    /// A step on the host failed.
    #[error("cannot {0}")]
    Io(&'static str, #[source] std::io::Error),
    /// The server would run as host root (root under `userns` confinement).
    #[error("a file server may not run as root: as root, host directories need jail confinement")]
    AsRoot,
    /// The jailer did not report a pid naming its server.
    #[error("the file server of {} did not start: {}", .0.display(), .1)]
    NoPid(PathBuf, String),
}

/// The running file servers of one VM.
#[derive(Default)]
pub(crate) struct Shares {
    jailers: Vec<Child>,
}

impl Shares {
    /// Ends every server and its jailer.
    pub(crate) async fn kill(&mut self) {
        for jailer in &mut self.jailers {
            // The server is the jailer's child, with SIGKILL as its parent-death signal.
            let _ = jailer.kill().await;
        }
        self.jailers.clear();
    }
}

/// The mounts as the guest is told them.
pub(crate) fn guest_view(mounts: &[HostMount]) -> Vec<GuestMount> {
    mounts
        .iter()
        .enumerate()
        .map(|(index, m)| GuestMount { index, target: m.target.clone(), readonly: m.readonly })
        .collect()
}

/// Starts one confined server per mount; on an error, none is left running.
pub(crate) async fn start(
    jailer: &Path,
    mounts: &[HostMount],
    confinement: Confinement,
    ids: Option<JailIds>,
    cgroups: &[PathBuf],
    safeguards: &Safeguards,
    senders: &Senders,
) -> Result<Shares, ShareError> {
    let mut shares = Shares::default();
    if mounts.is_empty() {
        return Ok(shares);
    }
    if confinement == Confinement::None {
        return Err(ShareError::NoConfinement);
    }
    if !Path::new(VIRTIOFSD).is_file() {
        return Err(ShareError::NoVirtiofsd);
    }
    std::fs::create_dir_all(SandboxFile::Shares.name()).map_err(|e| ShareError::Io("make the shares directory", e))?;
    for (index, mount) in mounts.iter().enumerate() {
        match start_one(jailer, index, mount, confinement, ids, cgroups, safeguards, senders).await {
            Ok(child) => shares.jailers.push(child),
            Err(e) => {
                shares.kill().await;
                return Err(e);
            }
        }
    }
    Ok(shares)
}

#[allow(clippy::too_many_arguments)]
async fn start_one(
    jailer: &Path,
    index: usize,
    mount: &HostMount,
    confinement: Confinement,
    ids: Option<JailIds>,
    cgroups: &[PathBuf],
    safeguards: &Safeguards,
    senders: &Senders,
) -> Result<Child, ShareError> {
    let meta = std::fs::metadata(&mount.source).map_err(|_| ShareError::Source(mount.source.clone()))?;
    if !meta.is_dir() {
        return Err(ShareError::Source(mount.source.clone()));
    }
    let host_ids = match (confinement, ids) {
        // Never root: a root-owned directory (read-only: the driver refuses it read-write) is served as the
        // VMM's own id, and a root group as `nogroup`, which no sandbox reuses.
        (Confinement::Jail, Some(ids)) => {
            (if meta.uid() == 0 { ids.uid } else { meta.uid() }, if meta.gid() == 0 { NOGROUP } else { meta.gid() })
        }
        _ => (rustix::process::getuid().as_raw(), rustix::process::getgid().as_raw()),
    };
    if host_ids.0 == 0 || host_ids.1 == 0 {
        return Err(ShareError::AsRoot);
    }
    let root = std::path::absolute(Path::new(SandboxFile::Shares.name()).join(index.to_string()))
        .map_err(|e| ShareError::Io("make a server's jail", e))?;
    make_jail_dir(&root)?;
    let socket = bind_socket(index, ids)?;
    let args = ShareJailerArgs {
        confinement,
        root,
        source: mount.source.clone(),
        source_owner: meta.uid(),
        readonly: mount.readonly,
        uid_map: (WORKLOAD.uid, host_ids.0),
        gid_map: (WORKLOAD.gid, host_ids.1),
        cgroups: cgroups.to_vec(),
        nice: VMM_NICE,
        exec: server_argv(),
    };
    let log = Path::new(SandboxFile::Shares.name()).join(format!("{index}.log"));
    let mut child = Command::new(jailer)
        .args(args.to_argv())
        .env_clear()
        .envs(safeguards.child_env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::from(socket))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ShareError::Io("start vm-jailer", e))?;
    let stderr = child.stderr.take();
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let mut reader = tokio::io::BufReader::new(stdout.take(24));
        let _ = tokio::time::timeout(Duration::from_millis(REPORT_MS), reader.read_line(&mut line)).await;
    }
    let parent = child.id().and_then(|p| i32::try_from(p).ok());
    let reported = parse_vmm_pid_line(&line).and_then(|p| i32::try_from(p).ok());
    match (reported, parent) {
        (Some(pid), Some(parent)) if vm_contract::pids::ProcessRecord::read_child_of(pid, parent).is_some() => {
            if let Some(stderr) = stderr {
                guest_logs::copy_capped(
                    Box::new(stderr),
                    &log,
                    safeguards.log_cap(LOG_CAP_BYTES),
                    "a file server's log",
                    senders.notices.clone(),
                )
                .map_err(|e| ShareError::Io("open a file server's log", e))?;
            }
            Ok(child)
        }
        _ => {
            let _ = child.kill().await;
            // The jailer's own reason (fixed text and an errno), for the log and the error.
            let mut reason = String::new();
            if let Some(stderr) = stderr {
                let mut limited = stderr.take(REASON_BYTES);
                let _ =
                    tokio::time::timeout(Duration::from_millis(REPORT_MS), limited.read_to_string(&mut reason)).await;
            }
            let _ = std::fs::write(&log, &reason);
            let reason = reason.lines().last().unwrap_or("no reason given").to_owned();
            Err(ShareError::NoPid(mount.source.clone(), reason))
        }
    }
}

/// `virtiofsd`'s command line: the socket it is handed, the directory at its jail path, its own `chroot`
/// sandbox, no capability of its list kept (it runs as one mapped id and needs none), its open-file limit
/// as the jailer set it, and errors only in its log.
fn server_argv() -> Vec<OsString> {
    [
        VIRTIOFSD.to_owned(),
        format!("--fd={SOCKET_FD}"),
        "-o".into(),
        format!("source={JAIL_SOURCE}"),
        "-o".into(),
        "sandbox=chroot".into(),
        "-o".into(),
        "modcaps=-chown:-dac_override:-fowner:-fsetid:-setgid:-setuid:-mknod:-setfcap".into(),
        "-o".into(),
        "log_level=err".into(),
        "--rlimit-nofile=0".into(),
    ]
    .into_iter()
    .map(OsString::from)
    .collect()
}

/// The server's jail root (0755, empty on the host).
fn make_jail_dir(root: &Path) -> Result<(), ShareError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(root).map_err(|e| ShareError::Io("make a server's jail", e))?;
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| ShareError::Io("make a server's jail", e))
}

/// Binds `vmm/fsN.sock` for QEMU (0600, the VMM's ids), replacing one a previous start left behind.
fn bind_socket(index: usize, ids: Option<JailIds>) -> Result<OwnedFd, ShareError> {
    use std::os::unix::fs::PermissionsExt;
    let path = Path::new(SandboxFile::VmmRoot.name()).join(vm_contract::share::socket_name(index));
    let _ = std::fs::remove_file(&path);
    let listener =
        std::os::unix::net::UnixListener::bind(&path).map_err(|e| ShareError::Io("bind a file server's socket", e))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| ShareError::Io("bind a file server's socket", e))?;
    if let Some(ids) = ids {
        std::os::unix::fs::chown(&path, Some(ids.uid), Some(ids.gid))
            .map_err(|e| ShareError::Io("bind a file server's socket", e))?;
    }
    Ok(listener.into())
}

//! A sandbox that an OpenShell gateway created through `vm-driver serve`'s ComputeDriver service: what its
//! supervisor needs to speak the gateway's supervisor protocol for it (`ConnectSupervisor`, `RelayStream`,
//! `ReportMainProcessExit`, `GetSandboxConfig`).
//!
//! The driver writes [`GatewayBinding`] into the sandbox directory ([`SandboxFile::Gateway`], 0600) at every
//! start; the supervisor reads it after admission. Nothing in it is a secret: the sandbox token, which the
//! gateway minted for this sandbox, reaches the supervisor only in the auth bundle
//! ([`crate::auth::AuthBundle::gateway_token`]), and the guest never holds it.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::layout::SandboxFile;

/// Longest main-process command, in arguments.
pub const MAX_COMMAND_ARGS: usize = 256;
/// Longest main-process command, in bytes of all its arguments.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// The command a sandbox with no command of its own runs as its main process (OpenShell's default).
pub const DEFAULT_MAIN: [&str; 2] = ["/bin/sh", "-l"];

/// How the supervisor reaches the gateway.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayEndpoint {
    /// `http://HOST:PORT` (plaintext HTTP/2) or `https://HOST:PORT`.
    pub url: String,
    /// The CA bundle (PEM) that the gateway's certificate must chain to, for `https://`; the system's
    /// roots are never used.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// A client certificate and key (PEM files) for a gateway that asks for one (mutual TLS).
    #[serde(default)]
    pub client_identity: Option<(PathBuf, PathBuf)>,
}

impl GatewayEndpoint {
    /// Whether it is reached over TLS.
    pub fn is_tls(&self) -> bool {
        self.url.get(..8).is_some_and(|s| s.eq_ignore_ascii_case("https://"))
    }
}

/// The sandbox's main process: the gateway's canonical command, started once the boundary is attached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MainProcess {
    /// Its argv (never run through a shell); [`DEFAULT_MAIN`] when the gateway gave none.
    pub command: Vec<String>,
    /// Whether it runs on a terminal.
    pub tty: bool,
}

/// Why a main process cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MainProcessError {
    /// Too many arguments, or too many bytes.
    #[error("the command is longer than {MAX_COMMAND_ARGS} arguments or {MAX_COMMAND_BYTES} bytes")]
    TooLong,
    /// An argument holds a NUL byte.
    #[error("a command argument holds a NUL byte")]
    Nul,
    /// The first argument is empty.
    #[error("the command's program is empty")]
    EmptyProgram,
}

impl MainProcess {
    /// The gateway's command and terminal, checked; an empty command is [`DEFAULT_MAIN`].
    ///
    /// # Errors
    /// [`MainProcessError`].
    pub fn new(command: Vec<String>, tty: bool) -> Result<Self, MainProcessError> {
        if command.is_empty() {
            return Ok(Self { command: DEFAULT_MAIN.iter().map(|s| (*s).to_owned()).collect(), tty });
        }
        let bytes: usize = command.iter().map(String::len).sum();
        if command.len() > MAX_COMMAND_ARGS || bytes > MAX_COMMAND_BYTES {
            return Err(MainProcessError::TooLong);
        }
        if command.iter().any(|a| a.contains('\0')) {
            return Err(MainProcessError::Nul);
        }
        if command[0].is_empty() {
            return Err(MainProcessError::EmptyProgram);
        }
        Ok(Self { command, tty })
    }
}

/// What the gateway asked of one sandbox, kept with its spec for every start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySandbox {
    /// The gateway's name for the sandbox (its id is the sandbox id).
    pub sandbox_name: String,
    /// The main process.
    pub main: MainProcess,
}

/// What binds a sandbox to the gateway that created it, for one start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayBinding {
    /// Where the gateway listens (`serve`'s setting at this start).
    pub endpoint: GatewayEndpoint,
    /// What the gateway asked of the sandbox.
    pub sandbox: GatewaySandbox,
    /// The sandbox's environment, for every process the gateway runs in it (as the driver's `Exec` adds it).
    #[serde(default)]
    pub env: Vec<(String, String)>,
}

/// The binding could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum BindingError {
    /// Writing failed.
    #[error("cannot write {}", SandboxFile::Gateway.name())]
    Write(#[source] std::io::Error),
    /// It exists but cannot be read or parsed.
    #[error("{} is unreadable", SandboxFile::Gateway.name())]
    Unreadable,
}

impl GatewayBinding {
    /// Writes the binding into the sandbox directory `dir`, mode 0600, replacing an older one.
    ///
    /// # Errors
    /// [`BindingError::Write`].
    pub fn write(&self, dir: &Path) -> Result<(), BindingError> {
        let json = serde_json::to_vec(self).map_err(|e| BindingError::Write(e.into()))?;
        let path = dir.join(SandboxFile::Gateway.name());
        let _ = std::fs::remove_file(&path);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(BindingError::Write)?;
        file.write_all(&json).map_err(BindingError::Write)
    }

    /// Reads the binding in `dir`; `None` for a sandbox no gateway created.
    ///
    /// # Errors
    /// [`BindingError::Unreadable`].
    pub fn read(dir: &Path) -> Result<Option<Self>, BindingError> {
        match std::fs::read(dir.join(SandboxFile::Gateway.name())) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|_| BindingError::Unreadable),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(_) => Err(BindingError::Unreadable),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_main_process_is_checked_and_an_empty_one_is_the_default() {
        assert_eq!(MainProcess::new(vec![], true).unwrap().command, DEFAULT_MAIN);
        assert_eq!(MainProcess::new(vec!["".into()], false), Err(MainProcessError::EmptyProgram));
        assert_eq!(MainProcess::new(vec!["a\0b".into()], false), Err(MainProcessError::Nul));
        assert_eq!(MainProcess::new(vec!["x".into(); MAX_COMMAND_ARGS + 1], false), Err(MainProcessError::TooLong));
        assert_eq!(MainProcess::new(vec!["x".repeat(MAX_COMMAND_BYTES + 1)], false), Err(MainProcessError::TooLong));
        let ok = MainProcess::new(vec!["python3".into(), "-c".into(), "print(1)".into()], false).unwrap();
        assert_eq!(ok.command.len(), 3);
    }

    #[test]
    fn a_binding_round_trips_through_its_file_and_is_private() {
        let dir = std::env::temp_dir().join(format!("gateway-binding-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(GatewayBinding::read(&dir).unwrap().is_none(), "no gateway: no binding");
        let binding = GatewayBinding {
            endpoint: GatewayEndpoint {
                url: "HTTPS://gw:8080".into(),
                ca: Some("/ca.pem".into()),
                client_identity: None,
            },
            sandbox: GatewaySandbox { sandbox_name: "box".into(), main: MainProcess::new(vec![], true).unwrap() },
            env: vec![("A".into(), "1".into())],
        };
        assert!(binding.endpoint.is_tls());
        binding.write(&dir).unwrap();
        binding.write(&dir).unwrap();
        assert_eq!(GatewayBinding::read(&dir).unwrap(), Some(binding));
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir.join(SandboxFile::Gateway.name())).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(dir.join(SandboxFile::Gateway.name()), b"{").unwrap();
        assert!(matches!(GatewayBinding::read(&dir), Err(BindingError::Unreadable)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

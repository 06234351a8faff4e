//! `vm-supervisor`: runs one microVM for `vm-driver`.
//!
//! Exit status: 0 after an orderly stop (SIGTERM); 1 when the VM never became ready; 2 for a bad command
//! line; 3 when the VM stopped on its own or broke the protocol; 4 when the driver went away (liveness EOF);
//! 5 when the lease with the watchdog was lost. In every case the VMM has exited.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use vm_supervisor::config::SupervisorConfig;
use vm_supervisor::supervisor::{self, chain};

fn main() -> ExitCode {
    let config = SupervisorConfig::parse();
    // Everything the supervisor and QEMU create is private to this user.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vm-supervisor: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(supervisor::run(config)) {
        Ok(reason) => {
            if reason != supervisor::StopReason::Terminated {
                tracing::warn!(?reason, "the sandbox ended without an orderly stop");
            }
            ExitCode::from(reason.exit_code())
        }
        Err(e) => {
            tracing::error!(error = %chain(&e), "start-up failed");
            ExitCode::from(1)
        }
    }
}

//! The supervisor's command line. Every argument is a trusted input from the driver; nothing here comes
//! from a sandbox descriptor or from the guest.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use vm_protocol::SandboxId;

use crate::accel::AccelChoice;

/// `vm-supervisor` arguments.
#[derive(Debug, Clone, Parser)]
#[command(version, about = "Runs one microVM for vm-driver; not meant to be started by hand")]
pub struct SupervisorConfig {
    /// The sandbox this VM belongs to.
    #[arg(long)]
    pub sandbox_id: SandboxId,
    /// The sandbox's private directory (0700); the supervisor works inside it.
    #[arg(long)]
    pub sandbox_dir: PathBuf,
    /// Guest kernel.
    #[arg(long)]
    pub kernel: PathBuf,
    /// Guest initramfs.
    #[arg(long)]
    pub initrd: PathBuf,
    /// vCPUs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=64))]
    pub cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(64..=65536))]
    pub memory_mib: u32,
    /// Accelerator.
    #[arg(long, value_enum, default_value_t = AccelChoice::Auto)]
    pub accel: AccelChoice,
    /// How long the guest agent may take to answer the handshake after QEMU starts.
    #[arg(long, default_value_t = 60_000)]
    pub boot_timeout_ms: u64,
    /// On stop: time between SIGTERM and SIGKILL for workload processes.
    #[arg(long, default_value_t = 3_000)]
    pub stop_grace_ms: u32,
    /// The QEMU binary (default: qemu-system-x86_64 on PATH).
    #[arg(long)]
    pub qemu: Option<PathBuf>,
    /// The driver's session socket (`vm-driver serve`); without it there is no session and no readiness
    /// listener (`vm-driver launch`).
    #[arg(long)]
    pub session_socket: Option<PathBuf>,
    /// This start's generation, presented in the session.
    #[arg(long, default_value_t = 0)]
    pub generation: u64,
    /// A cgroup v2 directory to join before starting anything (the driver's final sweep kills it).
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// Stdin is the driver's liveness pipe: EOF means the driver is gone.
    #[arg(long)]
    pub parent_liveness_stdin: bool,
}

impl SupervisorConfig {
    /// The boot timeout.
    pub fn boot_timeout(&self) -> Duration {
        Duration::from_millis(self.boot_timeout_ms)
    }
}

//! `vm-driver`: run commands in sandboxed microVMs.
//!
//! Exit status of `launch`: the workload's (its code, or 128 + the signal that killed it); 124 when
//! `--timeout` expired; 130/143/129 when interrupted, terminated or hung up; 125 when the driver failed
//! before the workload produced a status (bad input, missing image, unusable accelerator, boot failure).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use vm_driver::launch::{self, LaunchConfig};
use vm_driver::telemetry::TelemetryConfig;
use vm_driver::EXIT_DRIVER_ERROR;
use vm_protocol::SandboxId;

#[derive(Debug, Parser)]
#[command(version, about = "Run commands in sandboxed microVMs", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Boot a microVM, run CMD inside it, and stop the VM when CMD exits.
    ///
    /// CMD's stdin, stdout and stderr are yours, and its exit status becomes vm-driver's. Ctrl-C is sent
    /// to CMD as SIGINT (press it three times to stop the sandbox instead).
    ///
    /// Example: vm-driver launch -- /bin/sh -c 'uname -a; echo hello'
    #[command(after_help = "The guest image comes from scripts/build-image unless --image, --kernel or --initrd say \
                            otherwise.\nLogs of a failed start (console.log, vmm.log, supervisor.log) are kept in \
                            the sandbox directory, whose path is printed.")]
    Launch(Box<LaunchArgs>),
    /// Kill the VMs of sandboxes whose supervisor is gone, and mark them terminated.
    ///
    /// Every `launch` does this first; run it by hand after a crash.
    Reap {
        /// State directory (as for launch).
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Accel {
    /// KVM where it can boot the guest, otherwise TCG (says why once).
    Auto,
    /// KVM, or fail: never falls back.
    Kvm,
    /// QEMU's software emulation.
    Tcg,
}

#[derive(Debug, clap::Args)]
struct LaunchArgs {
    /// vCPUs for the VM.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=64))]
    cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(64..=65536))]
    memory: u32,
    /// Set an environment variable for CMD (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = launch::parse_env)]
    env: Vec<(String, String)>,
    /// Working directory for CMD inside the guest.
    #[arg(long, short = 'w', value_name = "DIR")]
    workdir: Option<String>,
    /// Guest image directory (vmlinuz + initramfs.cpio). Default: the image scripts/build-image made.
    #[arg(long, value_name = "DIR")]
    image: Option<PathBuf>,
    /// Guest kernel (overrides the image's).
    #[arg(long, value_name = "FILE")]
    kernel: Option<PathBuf>,
    /// Guest initramfs (overrides the image's).
    #[arg(long, value_name = "FILE")]
    initrd: Option<PathBuf>,
    /// Accelerator.
    #[arg(long, value_enum, default_value_t = Accel::Auto)]
    accel: Accel,
    /// Stop the sandbox after this many seconds (exit 124).
    #[arg(long, value_name = "SECS")]
    timeout: Option<u64>,
    /// How long the guest may take to boot, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    boot_timeout: u64,
    /// On stop, how long to wait for the supervisor after SIGTERM before SIGKILL, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10)]
    stop_timeout: u64,
    /// State directory (default: $VM_DRIVER_STATE_DIR, else $XDG_RUNTIME_DIR/vm-driver, else /run/vm-driver for root).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Sandbox id ([A-Za-z0-9._-], at most 128); random by default.
    #[arg(long)]
    id: Option<SandboxId>,
    /// Keep the sandbox directory (logs) after a clean stop.
    #[arg(long)]
    keep: bool,
    /// Export OCSF events as OTLP logs to this collector (headers come from OTEL_EXPORTER_OTLP_LOGS_HEADERS or
    /// OTEL_EXPORTER_OTLP_HEADERS).
    #[arg(long, value_name = "URL", env = "OPENSHELL_OTLP_OCSF_ENDPOINT")]
    otlp_ocsf_endpoint: Option<String>,
    /// OTLP protocol: grpc (default) or http/protobuf.
    #[arg(long, value_name = "PROTO", env = "OPENSHELL_OTLP_OCSF_PROTOCOL")]
    otlp_ocsf_protocol: Option<String>,
    /// OCSF schema version of the events (default 1.8.0).
    #[arg(long, value_name = "VERSION", env = "OPENSHELL_OTLP_OCSF_SCHEMA_VERSION")]
    otlp_ocsf_schema_version: Option<String>,
    /// Gateway name, for the openshell.gateway.name resource attribute.
    #[arg(long, value_name = "NAME", env = "OPENSHELL_GATEWAY_NAME")]
    gateway_name: Option<String>,
    /// OCSF JSON lines on the supervisor's console and in events.jsonl: on (default) or off.
    #[arg(long, value_name = "on|off", env = "OPENSHELL_OCSF_JSON")]
    ocsf_json: Option<String>,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    cmd: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Sandbox directories hold logs and secrets: everything the driver creates is private to this user.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vm-driver: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_DRIVER_ERROR);
        }
    };
    let args = match cli.command {
        Command::Launch(args) => args,
        Command::Reap { state_dir } => return reap(state_dir),
    };
    let config = LaunchConfig {
        argv: args.cmd,
        env: args.env,
        workdir: args.workdir,
        image: args.image,
        kernel: args.kernel,
        initrd: args.initrd,
        cpus: args.cpus,
        memory_mib: args.memory,
        accel: format!("{:?}", args.accel).to_lowercase(),
        timeout: args.timeout.map(Duration::from_secs),
        boot_timeout: Duration::from_secs(args.boot_timeout),
        stop_timeout: Duration::from_secs(args.stop_timeout),
        state_dir: args.state_dir,
        id: args.id,
        keep: args.keep,
        telemetry: TelemetryConfig {
            otlp_endpoint: args.otlp_ocsf_endpoint,
            otlp_protocol: args.otlp_ocsf_protocol,
            schema_version: args.otlp_ocsf_schema_version,
            gateway_name: args.gateway_name,
            ocsf_json: args.ocsf_json,
        },
    };
    let code = match runtime.block_on(launch::run(config)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vm-driver: {e:#}");
            EXIT_DRIVER_ERROR
        }
    };
    // The stdin thread may be blocked in read(); it must not hold the process open.
    runtime.shutdown_background();
    ExitCode::from(code)
}

fn reap(state_dir: Option<PathBuf>) -> ExitCode {
    let root = state_dir.unwrap_or_else(vm_driver::state::default_root);
    let state = match vm_driver::state::StateDir::open(&root) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vm-driver: {:#}", anyhow::Error::new(e));
            return ExitCode::from(EXIT_DRIVER_ERROR);
        }
    };
    for reaped in vm_driver::reap::reap_all(&state.sandboxes_dir()) {
        let what = if reaped.killed { "killed its VM" } else { "nothing left running" };
        println!("{}: supervisor gone; {what}; marked terminated", reaped.sandbox);
    }
    ExitCode::SUCCESS
}

//! `vm-driver`: run commands in sandboxed microVMs. The binary's edge: the command line, the commands that
//! drive the library, and `anyhow` errors turned into exit statuses.
//!
//! Exit status of `launch` and `exec`: the workload's (its code, or 128 + the signal that killed it), else
//! one of `vm_contract::exit::driver`: 124 when `--timeout` expired; 130/143/129 when interrupted, terminated
//! or hung up; 125 when the driver failed before the workload produced a status (bad input, missing image,
//! unusable accelerator, boot failure); 2 for a bad command line. Other commands: 0 or 125.

mod audit;
mod cli;
mod client;
mod cp;
mod credentials;
mod doctor;
mod egress;
mod exec;
mod image;
mod launch;
mod openshell;
mod port_forward;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use cli::{Cli, Command, VmArgs};
use client::{Boot, Lifecycle};
use exec::Target;
use launch::LaunchConfig;
use vm_contract::exit::driver::DRIVER_ERROR;
use vm_driver::controls::Controls;
use vm_driver::service::{self, ServeConfig};
use vm_protocol::driver_api::{CreateSandboxRequest, SandboxSpec};
use vm_protocol::identity::{IdSelector, RunAs};

vm_contract::test_controls!();

fn main() -> ExitCode {
    let cli = Cli::parse();
    #[cfg(feature = "test-controls")]
    eprintln!("{}", vm_contract::test_control::announcement("vm-driver"));
    // Sandbox directories hold logs and secrets: everything the driver creates is private to this user.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    init_diagnostics();
    let multi = matches!(cli.command, Command::Serve(_));
    let runtime = if multi {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()
    } else {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vm-driver: cannot start the runtime: {e}");
            return ExitCode::from(DRIVER_ERROR);
        }
    };
    // The one read of the test controls: the library takes them as plain values.
    let controls = Controls::from_switches(control);
    let code = match runtime.block_on(run(cli.command, controls)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vm-driver: {e:#}");
            DRIVER_ERROR
        }
    };
    // A stdin thread may be blocked in read(); it must not hold the process open.
    runtime.shutdown_background();
    ExitCode::from(code)
}

async fn run(command: Command, controls: Controls) -> Result<u8> {
    match command {
        Command::Launch(args) => {
            let args = *args;
            let shape = args.shape.shape();
            let retention = args.vm.retention.retention();
            vm_protocol::rlimit::check(&args.ulimit).context("--ulimit")?;
            vm_protocol::tmpfs::check(&args.tmpfs).context("--tmpfs")?;
            launch::run(LaunchConfig {
                argv: args.cmd,
                env: args.env,
                workdir: args.workdir,
                rlimits: args.ulimit,
                tmpfs: args.tmpfs,
                root: match args.image.as_deref() {
                    Some(reference) => {
                        let state = args.vm.state_dir.clone().unwrap_or_else(vm_driver::state::default_root);
                        Some(image::root(&args.store.roots(args.registry.options(), &state)?, reference, args.disk)?)
                    }
                    None => None,
                },
                boot_image: args.vm.boot_image,
                kernel: args.vm.kernel,
                initrd: args.vm.initrd,
                shape,
                accel: args.vm.accel,
                jail: args.vm.jail.request(),
                policy: args.policy,
                timeout: args.timeout.map(Duration::from_secs),
                boot_timeout: Duration::from_secs(args.vm.boot_timeout),
                stop_timeout: Duration::from_secs(args.vm.stop_timeout),
                retention,
                state_dir: args.vm.state_dir,
                id: args.id,
                keep: args.keep,
                cold: args.cold,
                telemetry: args.telemetry.config()?,
                egress: args.vm.egress.egress()?,
                controls,
                copy_in: args.copy_in,
                copy_out: args.copy_out,
                mounts: args.mounts,
                secrets: match &args.credentials_file {
                    Some(path) => vm_driver::secrets::read_file(path).with_context(|| path.display().to_string())?,
                    None => Vec::new(),
                },
                tty: args.tty,
            })
            .await
        }
        Command::Serve(args) => {
            let args = *args;
            let (admission, retention) = (args.admission.config(), args.vm.retention.retention());
            let state_dir = state_dir(&args.vm);
            let default = vm_driver::image::resolve(
                args.vm.boot_image.as_deref(),
                args.vm.kernel.as_deref(),
                args.vm.initrd.as_deref(),
            )?;
            // Named images live beside the default one unless told otherwise.
            let root = args.boot_images.or_else(|| default.kernel.parent().and_then(|d| d.parent()).map(PathBuf::from));
            let images = vm_driver::image::ImageSet { default, root };
            let oci = args.store.roots(args.registry.options(), &state_dir)?;
            service::serve(ServeConfig {
                socket: args.socket.unwrap_or_else(|| state_dir.join("driver.sock")),
                state_dir,
                gateway_pid: args.gateway_pid,
                images,
                oci,
                accel: args.vm.accel,
                jail: args.vm.jail.request(),
                telemetry: args.telemetry.config()?,
                boot_timeout: Duration::from_secs(args.vm.boot_timeout),
                stop_timeout: Duration::from_secs(args.vm.stop_timeout),
                admission,
                retention,
                pool: args.pool,
                pool_snapshots: args.pool_snapshots,
                cold: args.cold,
                egress: args.vm.egress.egress()?,
                controls,
                openshell: args.openshell.config()?,
            })
            .await?;
            Ok(0)
        }
        Command::Create(args) => {
            let shape = args.shape.shape();
            let spec = SandboxSpec {
                cpus: u32::from(shape.cpus()),
                memory_mib: shape.memory_mib(),
                env: args.env.into_iter().collect(),
                readiness: 0,
                boot_image: args.boot_image.unwrap_or_default(),
                image: args.image.unwrap_or_default(),
                disk_mib: args.disk,
                policy: args.policy.map(|p| p.to_json()).unwrap_or_default(),
                mounts: args
                    .mounts
                    .into_iter()
                    .map(|m| vm_protocol::driver_api::Mount {
                        // serve resolves it on its side; a relative path is made absolute here, where it was meant.
                        source: std::path::absolute(&m.source).unwrap_or(m.source).display().to_string(),
                        target: m.target,
                        readonly: m.readonly,
                    })
                    .collect(),
            };
            let credentials = match &args.credentials_file {
                Some(path) => vm_driver::secrets::read_file(path).with_context(|| path.display().to_string())?,
                None => Vec::new(),
            };
            let request = CreateSandboxRequest {
                sandbox_id: args.id.to_string(),
                spec: Some(spec),
                credentials: vm_driver::secrets::to_api(credentials),
            };
            client::boot(&args.socket.path(), Boot::Create(request), &args.wait).await?;
            Ok(0)
        }
        Command::Get(args) => client::show(&args.socket.path(), Some(args.id.as_str())).await.map(|()| 0),
        Command::List(args) => client::show(&args.path(), None).await.map(|()| 0),
        Command::Pool(args) => client::show_pool(&args.path()).await.map(|()| 0),
        Command::Stop(args) => {
            client::lifecycle(&args.socket.path(), args.id.as_str(), Lifecycle::Stop).await.map(|()| 0)
        }
        Command::Start(args) => {
            let (socket, id) = (args.sandbox.socket.path(), args.sandbox.id.to_string());
            client::boot(&socket, Boot::Start(id), &args.wait).await.map(|()| 0)
        }
        Command::Rm(args) => {
            client::lifecycle(&args.socket.path(), args.id.as_str(), Lifecycle::Delete).await.map(|()| 0)
        }
        Command::Ps(args) => client::ps(&args.socket.path(), args.id.as_str()).await.map(|()| 0),
        Command::Policy(args) => {
            let run_as = RunAs { user: args.run_as_user.map(IdSelector), group: args.run_as_group.map(IdSelector) };
            let (socket, id) = (args.socket.path(), args.id.as_str());
            client::update_policy(&socket, id, args.revision, &args.allow.0, run_as, args.network).await.map(|()| 0)
        }
        Command::Credentials(args) => {
            let (socket, id) = (args.socket.path(), args.id.as_str());
            let rotation = credentials::Rotation {
                headers: args.headers_file.as_ref(),
                ca: args.ca.as_deref(),
                credentials: args.credentials_file.as_deref(),
            };
            credentials::rotate(&socket, id, rotation).await.map(|()| 0)
        }
        Command::Exec(args) => {
            let target = match (args.attach, args.cmd.is_empty()) {
                (Some(pid), _) => Target::Reattach(pid),
                (None, false) => Target::Start { argv: args.cmd, env: args.env, cwd: args.workdir },
                (None, true) => bail!("exec needs -- CMD or --attach PID"),
            };
            let input = args.interactive.then(vm_driver::process::terminal::stdin_chunks);
            exec::exec(
                &args.socket.path(),
                args.id.as_str(),
                target,
                input,
                args.tty,
                vm_driver::process::output::Output::stdout(),
            )
            .await
        }
        Command::Cp(args) => cp::run(args, controls.files).await,
        Command::PortForward(args) => port_forward::run(args).await.map(|()| 0),
        Command::Reap { state_dir, retention } => reap(state_dir, &retention, controls).map(|()| 0),
        // Registry I/O and disk builds block: off the runtime's thread.
        Command::Audit(args) => tokio::task::spawn_blocking(move || audit::run(args)).await?,
        Command::Doctor(args) => Ok(tokio::task::spawn_blocking(move || doctor::run(args)).await?),
        Command::Image(args) => tokio::task::spawn_blocking(move || image::run(args)).await?,
    }
}

/// Diagnostics on stderr, filtered by `RUST_LOG` (default `warn`); the HTTP, gRPC and OpenTelemetry libraries
/// never reach it, whatever `RUST_LOG` says (`vm_contract::logs`).
fn init_diagnostics() {
    use tracing_subscriber::filter::{filter_fn, FilterExt};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let env = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let quiet = filter_fn(|meta| !vm_contract::logs::is_silenced(meta.target()));
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(false);
    let _ = tracing_subscriber::registry().with(layer.with_filter(env.and(quiet))).try_init();
}

fn state_dir(vm: &VmArgs) -> PathBuf {
    vm.state_dir.clone().unwrap_or_else(vm_driver::state::default_root)
}

fn reap(state_dir: Option<PathBuf>, retention: &cli::RetentionArgs, controls: Controls) -> Result<()> {
    let root = state_dir.unwrap_or_else(vm_driver::state::default_root);
    let state = vm_driver::state::StateDir::open(&root)?;
    for reaped in vm_driver::reap::reap_all(&state.sandboxes_dir(), controls.reaper) {
        let what = if reaped.killed() { "killed its VM" } else { "nothing left running" };
        println!("{}: supervisor gone; {what}; marked terminated", reaped.sandbox);
    }
    vm_driver::gc::collect(&state.sandboxes_dir(), retention.retention());
    Ok(())
}

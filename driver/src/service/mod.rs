//! `vm-driver serve`: the gateway-facing service.
//!
//! - [`socket`]: the API socket and who may connect.
//! - [`api`]: the gRPC service (`vmdriver.v1.Driver`, with server reflection).
//! - [`hub`]: the façade between the API and the sandboxes, over the service's parts: the [`registry`]
//!   (which sandboxes exist), the [`ledger`] (their shares of the host), [`events`] (what `Watch` follows),
//!   [`tokens`] (the session each supervisor must open) and the credential rotations ([`credentials`]).
//! - [`actor`]: the task that runs each sandbox, over its [`record`].
//! - [`pool`]: the warm pool, VMs booted ahead of demand and claimed by `CreateSandbox`.
//! - [`sessions`]: supervisors' sessions, which gate readiness.
//! - [`exec`]: process streams relayed to the sandboxes' attach sockets.
//! - [`store`]: what a sandbox directory remembers across restarts.
//! - [`client`]: how a client reaches the socket (the CLI's commands, tests).
//! - [`openshell`]: OpenShell's ComputeDriver service, a second façade on the same sandboxes, on a socket of
//!   its own (`--openshell-socket`).
//!
//! On start the driver reaps orphans, then restores its sandboxes: running-intent ones boot again (a new
//! generation), stopped ones stay stopped, failed ones are reported failed. On SIGTERM or SIGINT every
//! sandbox is stopped in order, in parallel, keeping its intent, and the driver exits.

mod actor;
pub mod admission;
mod api;
pub mod client;
mod context;
mod credentials;
mod events;
mod exec;
mod hub;
mod ledger;
pub mod openshell;
pub mod pool;
mod record;
mod registry;
mod sessions;
mod socket;
mod store;
mod templates;
mod tokens;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{oneshot, watch};
use vm_contract::accel::AccelChoice;
use vm_contract::args::PROBE_ACCEL;
use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxLayout;
use vm_contract::status::SupervisorStatus;
use vm_contract::tombstone::{EndReason, Tombstone};
use vm_protocol::driver_api::driver_server::DriverServer;
use vm_protocol::driver_api::FILE_DESCRIPTOR_SET;

use self::actor::{Command, Initial};
use self::context::Context;
use self::hub::Hub;
use self::ledger::Ledger;
use self::socket::PeerPolicy;
use crate::image::ImageSet;
use crate::reap;
use crate::sandbox::supervisor::{self, SupervisorError};
use crate::state::{StateDir, StateError};
use crate::telemetry::{self, HeaderError, TelemetryConfig};

/// What `serve` is started with.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// How egress connections resolve and leave.
    pub egress: crate::sandbox::Egress,
    /// The API socket.
    pub socket: PathBuf,
    /// The state directory.
    pub state_dir: PathBuf,
    /// Only this pid may use the API, when set.
    pub gateway_pid: Option<i32>,
    /// The boot images.
    pub images: ImageSet,
    /// The OCI images sandboxes' roots come from.
    pub oci: crate::oci::ImageRoots,
    /// The accelerator asked for.
    pub accel: AccelChoice,
    /// How VMMs are to be confined.
    pub jail: crate::jail::JailRequest,
    /// Telemetry settings for supervisors.
    pub telemetry: TelemetryConfig,
    /// Boot timeout per sandbox.
    pub boot_timeout: Duration,
    /// Stop bound per sandbox.
    pub stop_timeout: Duration,
    /// How long ended launch sandboxes in the same state directory are kept.
    pub retention: crate::gc::Retention,
    /// What may be admitted.
    pub admission: admission::AdmissionConfig,
    /// The warm pool's targets; empty: no pool.
    pub pool: Vec<pool::PoolTarget>,
    /// Pooled VMs are restored from a snapshot saved at start (`--pool-snapshots`).
    pub pool_snapshots: bool,
    /// Boot every sandbox: no templates (`--cold`).
    pub cold: bool,
    /// The test controls (all off but in the causal tests).
    pub controls: crate::controls::Controls,
    /// OpenShell's ComputeDriver service, when a gateway is to drive this driver.
    pub openshell: Option<OpenShellConfig>,
}

/// Where an OpenShell gateway reaches this driver, and where its supervisors reach the gateway.
#[derive(Debug, Clone)]
pub struct OpenShellConfig {
    /// The ComputeDriver socket.
    pub socket: PathBuf,
    /// Only this pid may use it, when set (the gateway's).
    pub gateway_pid: Option<i32>,
    /// The gateway's endpoint, for the supervisors.
    pub endpoint: vm_contract::gateway::GatewayEndpoint,
}

/// Why `serve` could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The confinement asked for is not available.
    #[error(transparent)]
    Jail(#[from] crate::jail::JailSetupError),
    /// Admission needs the host's memory.
    #[error("cannot read MemTotal from /proc/meminfo, which admission needs")]
    HostMemory,
    /// The state directory is unusable.
    #[error(transparent)]
    State(#[from] StateError),
    /// Another `serve` uses the state directory.
    #[error("another vm-driver serve is using the state directory {}", .0.display())]
    Locked(PathBuf),
    /// The lock file cannot be opened.
    #[error("cannot open {}", .0.display())]
    Lock(PathBuf, #[source] std::io::Error),
    /// No supervisor binary.
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    /// The session socket's path would not fit in `sockaddr_un`.
    #[error("the state directory path is too long for a Unix socket; choose a shorter --state-dir")]
    PathTooLong,
    /// A signal handler could not be installed.
    #[error("cannot watch SIGTERM and SIGINT")]
    Signals(#[source] std::io::Error),
    /// The API socket cannot be served.
    #[error(transparent)]
    Socket(#[from] socket::SocketError),
    /// The session socket cannot be bound.
    #[error("cannot bind the session socket")]
    Sessions(#[source] std::io::Error),
    /// The collector headers are malformed.
    #[error(transparent)]
    Headers(#[from] HeaderError),
    /// The reflection service cannot be built.
    #[error("cannot build the reflection service")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// A pool target cannot be served.
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
}

/// Runs the service until SIGTERM or SIGINT.
///
/// # Errors
/// Start-up failures: sockets, state directory, supervisor binary.
pub async fn serve(config: ServeConfig) -> Result<(), ServeError> {
    let fds = raise_fd_limit();
    let state = StateDir::open(&config.state_dir)?;
    // One server per state directory: a second would reap, restore and boot the same sandboxes again.
    let _lock = lock_state_dir(&config.state_dir)?;
    let controls = config.controls;
    clean_up(&state, &config);
    let binary = supervisor::locate()?;
    let accelerator = probe_accelerator(&binary, config.accel).await;
    let jail = config.jail.resolve(&binary)?;
    let sessions_path = config.state_dir.join("sessions.sock");
    if sessions_path.as_os_str().len() > crate::unix::MAX_SUN_PATH {
        return Err(ServeError::PathTooLong);
    }
    let mut terminate = signal(SignalKind::terminate()).map_err(ServeError::Signals)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(ServeError::Signals)?;
    let api_listener = socket::bind(&config.socket).await?;
    let openshell_listener = match &config.openshell {
        Some(o) => Some(socket::bind(&o.socket).await?),
        None => None,
    };
    let sessions_listener = sessions::bind(&sessions_path).map_err(ServeError::Sessions)?;
    let ctx = Arc::new(Context {
        state: state.clone(),
        sessions_socket: sessions_path.clone(),
        supervisor: binary,
        images: config.images.clone(),
        oci: config.oci.clone(),
        accel: config.accel,
        jail,
        telemetry: config.telemetry.clone(),
        otlp_headers: telemetry::headers_from_env()?,
        boot_timeout: config.boot_timeout,
        stop_timeout: config.stop_timeout,
        limits: admission::Limits::of_this_host(&config.admission).ok_or(ServeError::HostMemory)?,
        pool: !config.pool.is_empty(),
        egress: config.egress.clone(),
        controls,
        gateway: config.openshell.as_ref().map(|o| o.endpoint.clone()),
        templates: (!config.cold).then(|| crate::template::Templates::shared(&state)),
    });
    let limits = ctx.limits;
    say_limits(&limits, fds);
    let ledger = Ledger::new(limits);
    let pool = pool::Pool::new(Arc::clone(&ctx), Arc::clone(&ledger), config.pool.clone(), config.pool_snapshots)?;
    let hub = Hub::new(ctx, ledger, Arc::clone(&pool));
    // Before the refill: the restored sandboxes hold their shares first.
    restore(&hub, &state);
    pool.start();
    say_pool(&config);

    let (gate, gate_rx) = watch::channel(sessions::Gate::default());
    // Held until the end of `serve`: dropping it would end every session.
    let gate = Arc::new(gate);
    tokio::spawn(sessions::serve(sessions_listener, Arc::clone(&hub), gate_rx));
    if controls.service.session_gate_signals {
        session_controls(&gate);
    }

    let any_peer = controls.service.api_no_peer_check;
    let policy = PeerPolicy { uid: rustix::process::getuid().as_raw(), pid: config.gateway_pid, any_peer };
    if controls.service.api_socket_world_reachable {
        loosen_for_tests(&config.socket);
    }
    let server = api_server(api::Api::new(Arc::clone(&hub), accelerator), api_listener, policy)?;
    eprintln!("vm-driver: serving on {}", config.socket.display());
    let openshell = match (&config.openshell, openshell_listener) {
        (Some(o), Some(listener)) => {
            let policy = PeerPolicy { pid: o.gateway_pid, ..policy };
            let service = openshell::OpenShellDriver::new(Arc::clone(&hub));
            let server = tonic::transport::Server::builder()
                .add_service(vm_protocol::openshell::compute::v1::compute_driver_server::ComputeDriverServer::new(
                    service,
                ))
                .serve_with_incoming(socket::incoming(listener, policy));
            eprintln!(
                "vm-driver: serving OpenShell's ComputeDriver on {}; supervisors dial the gateway at {}",
                o.socket.display(),
                o.endpoint.url
            );
            Some(tokio::spawn(server))
        }
        _ => None,
    };
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    eprintln!("vm-driver: stopping every sandbox");
    shut_down(&hub, &pool).await;
    server.abort();
    if let Some(openshell) = openshell {
        openshell.abort();
    }
    if let Some(o) = &config.openshell {
        let _ = std::fs::remove_file(&o.socket);
    }
    drop(gate);
    let _ = std::fs::remove_file(&config.socket);
    let _ = std::fs::remove_file(&sessions_path);
    Ok(())
}

/// Reaps what an earlier driver left running and collects ended launch sandboxes.
fn clean_up(state: &StateDir, config: &ServeConfig) {
    for reaped in reap::reap_all(&state.sandboxes_dir(), config.controls.reaper) {
        if reaped.killed() {
            eprintln!("vm-driver: reaped orphaned sandbox {} (its supervisor was gone)", reaped.sandbox);
        }
    }
    crate::gc::collect(&state.sandboxes_dir(), config.retention);
}

/// Says what may be admitted.
fn say_limits(limits: &admission::Limits, fds: u64) {
    eprintln!(
        "vm-driver: admitting up to {} sandboxes, {} vCPUs, {} MiB, {} Exec streams ({} per sandbox); {fds} descriptors; {} boots at once",
        limits.sandboxes, limits.vcpus, limits.memory_mib, limits.exec_streams, limits.exec_per_sandbox, limits.boots
    );
}

/// Says what the warm pool keeps booted.
fn say_pool(config: &ServeConfig) {
    let how = if config.pool_snapshots { "restored from a snapshot" } else { "booted" };
    for t in &config.pool {
        let image = t.image.as_deref().unwrap_or("the built-in root");
        eprintln!(
            "vm-driver: warm pool: {} VMs of {} vCPU, {} MiB, on {image}, {how} ahead and counted in admission",
            t.count,
            t.shape.cpus(),
            t.shape.memory_mib()
        );
    }
}

/// Serves `api` (with server reflection) on the connections `policy` admits, in a task of its own.
fn api_server(
    api: api::Api,
    listener: tokio::net::UnixListener,
    policy: PeerPolicy,
) -> Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>, ServeError> {
    // Both reflection versions: v1, and v1alpha, which many clients (grpcurl, Python's grpcio-reflection) use.
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(ServeError::Reflection)?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(ServeError::Reflection)?;
    let server = tonic::transport::Server::builder()
        .add_service(DriverServer::new(api))
        .add_service(reflection)
        .add_service(reflection_alpha)
        .serve_with_incoming(socket::incoming(listener, policy));
    Ok(tokio::spawn(server))
}

/// Refuses new sandboxes, then gives each known one its orderly stop (keeping its intent) and stops the
/// pool, all in parallel.
async fn shut_down(hub: &Hub, pool: &pool::Pool) {
    let stops = hub.close().into_iter().map(|inbox| async move {
        let (tx, rx) = oneshot::channel();
        if inbox.send(Command::Shutdown(tx)).await.is_ok() {
            let _ = rx.await;
        }
    });
    futures_util::future::join(futures_util::future::join_all(stops), pool.close()).await;
}

/// Holds an exclusive lock on `STATE/serve.lock` for as long as the returned descriptor lives.
fn lock_state_dir(dir: &Path) -> Result<std::fs::File, ServeError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("serve.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| ServeError::Lock(path.clone(), e))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(|_| ServeError::Locked(dir.to_owned()))?;
    Ok(file)
}

/// Brings back what the state directory holds.
fn restore(hub: &Arc<Hub>, state: &StateDir) {
    let Ok(entries) = std::fs::read_dir(state.sandboxes_dir()) else { return };
    for entry in entries.flatten() {
        let layout = SandboxLayout::new(entry.path());
        let Some(id) = entry.file_name().to_str().and_then(|n| SandboxId::parse(n).ok()) else { continue };
        let Some(spec) = store::load_spec(&layout) else { continue };
        let initial = if store::is_stopped(&layout) {
            Initial::Stopped
        } else if Tombstone::read(layout.dir()).is_some_and(|t| t.reason == EndReason::Failed) {
            Initial::Failed("it had failed before the driver restarted; start it to try again".into())
        } else {
            Initial::Start
        };
        hub.restore(id, layout, spec, initial);
    }
}

/// What `auto` resolves to on this host, and why, as the supervisor decides it.
async fn probe_accelerator(binary: &Path, accel: AccelChoice) -> (String, String) {
    let out = tokio::process::Command::new(binary).args([PROBE_ACCEL, accel.as_str()]).env_clear().output().await;
    let line = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    match SupervisorStatus::from_line(&line) {
        Ok(SupervisorStatus::Accelerator { accel, fallback }) => (accel.as_str().into(), fallback.unwrap_or_default()),
        _ => ("unknown".into(), "the accelerator probe failed".into()),
    }
}

/// Fault injection (`session-gate-signals`): SIGUSR1 drops every supervisor session and holds new ones;
/// SIGUSR2 lets them in again. Tests use it to watch readiness close on session loss and reopen.
fn session_controls(gate: &Arc<watch::Sender<sessions::Gate>>) {
    let gate = Arc::clone(gate);
    let (Ok(mut usr1), Ok(mut usr2)) = (signal(SignalKind::user_defined1()), signal(SignalKind::user_defined2()))
    else {
        return;
    };
    tokio::spawn(async move {
        loop {
            tokio::select! {
                Some(()) = usr1.recv() => gate.send_modify(|g| {
                    g.epoch += 1;
                    g.paused = true;
                }),
                Some(()) = usr2.recv() => gate.send_modify(|g| g.paused = false),
                else => return,
            }
        }
    });
}

/// Fault injection (`api-socket-world-reachable`): other users reach the socket, so the peer-credential check
/// is what refuses them.
fn loosen_for_tests(socket: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o666));
    if let Some(dir) = socket.parent() {
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711));
    }
}

/// Raises the soft limit on open descriptors to the hard one (every sandbox and Exec stream costs a few) and
/// returns it.
fn raise_fd_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
    }
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

//! The command line: what each subcommand takes. `main.rs` dispatches.

use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand};
use vm_contract::accel::AccelChoice;
use vm_contract::ids::SandboxId;
use vm_contract::jail::{Confinement, IdRange};
use vm_contract::shape::{SandboxShape, DEFAULT_CPUS, DEFAULT_MEMORY_MIB};
use vm_driver::gc::Retention;
use vm_driver::telemetry::TelemetryConfig;
use vm_protocol::policy::{Operation, SandboxPolicy};

#[derive(Debug, Parser)]
#[command(version, about = "Run commands in sandboxed microVMs", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Boot a microVM, run CMD inside it, and stop the VM when CMD exits.
    ///
    /// CMD's stdin, stdout and stderr are yours, and its exit status becomes vm-driver's. Ctrl-C is sent
    /// to CMD as SIGINT (press it three times to stop the sandbox instead).
    ///
    /// Example: vm-driver launch -- /bin/sh -c 'uname -a; echo hello'
    #[command(after_help = "The root filesystem is the OCI image --image names (pulled on first use), else the \
                            built-in one. The kernel and the agent come from scripts/build-image unless --boot-image, \
                            --kernel or --initrd say otherwise.\nLogs of a failed start (console.log, vmm.log, supervisor.log) are kept in \
                            the sandbox directory, whose path is printed.")]
    Launch(Box<LaunchArgs>),
    /// Serve the driver API (gRPC) on a Unix socket, for a gateway and for the commands below.
    Serve(Box<ServeArgs>),
    /// Create a sandbox in a running `serve` and wait until it is ready.
    Create(CreateArgs),
    /// Show one sandbox.
    Get(IdArgs),
    /// List the sandboxes.
    #[command(visible_alias = "ls")]
    List(SocketArgs),
    /// List the warm pool's VMs (`serve --pool`), apart from the sandboxes.
    Pool(SocketArgs),
    /// Stop a sandbox (it stays, stopped, until started or removed).
    Stop(IdArgs),
    /// Start a stopped sandbox again and wait until it is ready.
    Start(crate::client::StartArgs),
    /// Remove a sandbox (stopping it first).
    #[command(visible_alias = "delete")]
    Rm(IdArgs),
    /// List the processes started with exec that still run in a sandbox.
    Ps(IdArgs),
    /// Run CMD in a running sandbox, or attach to one of its processes again.
    Exec(crate::exec::ExecArgs),
    /// Copy files into or out of a running sandbox (docker's syntax).
    ///
    /// `cp SRC SANDBOX:DST` copies a host file or tree in (DST/NAME when DST is a directory, DST otherwise);
    /// `cp SANDBOX:SRC DST` copies one out, through the hardened extractor (a refused tar writes nothing);
    /// `-` is a tar on stdin (unpacked into the guest directory) or stdout. Modes are kept; guest files are
    /// owned by the workload identity, host files by you. Needs files_write or files_read in the policy.
    ///
    /// Example: vm-driver cp ./project box-1:/home/sandbox && vm-driver cp box-1:/home/sandbox/project/out .
    Cp(crate::cp::CpArgs),
    /// Forward a host port to a port on a running sandbox's loopback (kubectl's syntax).
    ///
    /// Listens on 127.0.0.1 unless an address is given; each connection becomes a stream to the guest's
    /// 127.0.0.1:GUEST_PORT (the sandbox's policy must allow port_forward). Runs until interrupted.
    ///
    /// Example: vm-driver port-forward box-1 8080:80
    PortForward(crate::port_forward::PortForwardArgs),
    /// Restrict or restore a running sandbox's operations, within the policy approved at create.
    ///
    /// Example: vm-driver policy box-1 --revision 2 --allow exec,list_processes
    Policy(PolicyArgs),
    /// Rotate a running sandbox's OTLP collector credentials: the next export uses them.
    ///
    /// Headers are read from a file or stdin (`-`), never from the command line, as k1=v1,k2=v2 (commas or
    /// newlines between pairs, values percent-encoded as in OTEL_EXPORTER_OTLP_HEADERS).
    ///
    /// Example: vm-driver credentials box-1 --headers-file - --ca /etc/otel/ca.pem <<< 'authorization=Bearer%20t2'
    Credentials(crate::credentials::CredentialsArgs),
    /// Pull, import, list and remove OCI images in the local store (docs/images.md).
    ///
    /// Example: vm-driver image pull python:3.12-slim
    Image(crate::image::ImageArgs),
    /// Kill the VMs of sandboxes whose supervisor is gone, and mark them terminated.
    ///
    /// `launch` and `serve` do this first; run it by hand after a crash.
    Reap {
        /// State directory.
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
        #[command(flatten)]
        retention: RetentionArgs,
    },
    /// Verify or show a sandbox's audit chain (every event, hash-chained, sealed at each orderly stop).
    ///
    /// Example: vm-driver audit verify box-1
    Audit(crate::audit::AuditArgs),
    /// Check this host: the accelerator and confinement a sandbox would get and why, QEMU, cgroups, mounts,
    /// the state directory, the boot image, the fd limit and each optional feature's tools.
    ///
    /// Each shortfall is printed with its fix. Exits 1 when no sandbox could start here.
    Doctor(crate::doctor::DoctorArgs),
}

/// vCPUs and memory of a sandbox (launch and create).
#[derive(Debug, Args)]
pub struct ShapeArgs {
    /// vCPUs for the VM (1 to 64).
    #[arg(long, default_value_t = DEFAULT_CPUS)]
    pub cpus: u32,
    /// Guest memory in MiB (64 to 65536).
    #[arg(long, default_value_t = DEFAULT_MEMORY_MIB)]
    pub memory: u32,
}

impl ShapeArgs {
    /// The validated shape; a shape out of range is a usage error (exit 2), like any bad argument.
    pub fn shape(&self) -> SandboxShape {
        SandboxShape::new(self.cpus, self.memory)
            .unwrap_or_else(|e| Cli::command().error(clap::error::ErrorKind::ValueValidation, e).exit())
    }
}

/// How VMs are booted (launch and serve).
#[derive(Debug, Args)]
pub struct VmArgs {
    /// Boot image directory (vmlinuz + initramfs.cpio with the agent). Default: the one scripts/build-image made.
    #[arg(long, value_name = "DIR")]
    pub boot_image: Option<PathBuf>,
    /// Guest kernel (overrides the image's).
    #[arg(long, value_name = "FILE")]
    pub kernel: Option<PathBuf>,
    /// Guest initramfs (overrides the image's).
    #[arg(long, value_name = "FILE")]
    pub initrd: Option<PathBuf>,
    /// Accelerator.
    #[arg(long, value_enum, default_value_t = AccelChoice::Auto)]
    pub accel: AccelChoice,
    /// How long the guest may take to boot, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub boot_timeout: u64,
    /// On stop, how long to wait for the supervisor after SIGTERM before SIGKILL, in seconds. The default is
    /// the stop budget (the guest's grace, its power-off, the VMM's exit and the telemetry flush); a shorter one
    /// can cut the flush.
    #[arg(long, value_name = "SECS", default_value_t = vm_contract::stop::driver_deadline().as_secs())]
    pub stop_timeout: u64,
    #[command(flatten)]
    pub jail: JailArgs,
    /// State directory (default: $VM_DRIVER_STATE_DIR, else $XDG_RUNTIME_DIR/vm-driver, else /run/vm-driver for root).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    #[command(flatten)]
    pub retention: RetentionArgs,
    #[command(flatten)]
    pub egress: crate::egress::EgressArgs,
}

/// How each VMM is confined (docs/operations.md, "Confinement").
#[derive(Debug, Args)]
pub struct JailArgs {
    /// How QEMU is confined: `jail` (root: its own uid, namespaces, jail root, cgroup limits), `userns` (not
    /// root), or `none`. Default: the strongest this host gives, said at start when it is not `jail`.
    #[arg(long, value_enum, value_name = "MODE")]
    pub confinement: Option<Confinement>,
    /// The uids and gids given to jailed VMMs, one per sandbox.
    #[arg(long, value_name = "START:COUNT", default_value_t = IdRange::DEFAULT)]
    pub jail_ids: IdRange,
    /// A jailed VMM's memory limit beyond its guest's memory, MiB (QEMU itself, TCG's translation cache).
    #[arg(long, value_name = "MIB", default_value_t = vm_driver::jail::DEFAULT_MEMORY_OVERHEAD_MIB)]
    pub vmm_memory_overhead: u64,
    /// A jailed VMM's limit on processes and threads.
    #[arg(long, value_name = "N", default_value_t = vm_driver::jail::DEFAULT_PIDS, value_parser = clap::value_parser!(u32).range(1..))]
    pub vmm_pids_max: u32,
    /// A jailed VMM's CPU limit, percent of one core (default: none).
    #[arg(long, value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(1..=6400))]
    pub vmm_cpu_max: Option<u32>,
}

impl JailArgs {
    /// The request these flags make.
    pub fn request(&self) -> vm_driver::jail::JailRequest {
        vm_driver::jail::JailRequest {
            asked: self.confinement,
            ids: self.jail_ids,
            memory_overhead_mib: self.vmm_memory_overhead,
            pids: self.vmm_pids_max,
            cpu_percent: self.vmm_cpu_max,
        }
    }
}

/// How long the directories of ended `launch` sandboxes are kept (launch, serve and reap collect them).
#[derive(Debug, Args)]
pub struct RetentionArgs {
    /// Directories of ended `launch` sandboxes kept for diagnosis: the newest N; older ones are removed when
    /// a driver starts.
    #[arg(long, value_name = "N", default_value_t = Retention::default().keep)]
    pub keep_ended: usize,
    /// ... and none older than this many days.
    #[arg(long, value_name = "DAYS", default_value_t = Retention::default().max_age.as_secs() / 86_400)]
    pub keep_ended_days: u64,
}

impl RetentionArgs {
    /// How long ended launch sandboxes are kept.
    pub fn retention(&self) -> Retention {
        Retention {
            keep: self.keep_ended,
            max_age: std::time::Duration::from_secs(self.keep_ended_days.saturating_mul(86_400)),
        }
    }
}

/// Where OCSF events go (launch and serve).
#[derive(Debug, Args)]
pub struct TelemetryArgs {
    /// Export OCSF events as OTLP logs to this collector (headers come from OTEL_EXPORTER_OTLP_LOGS_HEADERS or
    /// OTEL_EXPORTER_OTLP_HEADERS).
    #[arg(long, value_name = "URL", env = "OPENSHELL_OTLP_OCSF_ENDPOINT")]
    pub otlp_ocsf_endpoint: Option<String>,
    /// OTLP protocol: grpc (default) or http/protobuf.
    #[arg(long, value_name = "PROTO", env = "OPENSHELL_OTLP_OCSF_PROTOCOL")]
    pub otlp_ocsf_protocol: Option<String>,
    /// OCSF schema version of the events (default 1.8.0).
    #[arg(long, value_name = "VERSION", env = "OPENSHELL_OTLP_OCSF_SCHEMA_VERSION")]
    pub otlp_ocsf_schema_version: Option<String>,
    /// Gateway name, for the openshell.gateway.name resource attribute.
    #[arg(long, value_name = "NAME", env = "OPENSHELL_GATEWAY_NAME")]
    pub gateway_name: Option<String>,
    /// OCSF JSON lines on the supervisor's console and in events.jsonl: on (default) or off.
    #[arg(long, value_name = "on|off", env = "OPENSHELL_OCSF_JSON")]
    pub ocsf_json: Option<String>,
    /// PEM CA bundle trusted for an https:// collector (no other roots are); rotate it with `credentials`.
    #[arg(long, alias = "otlp-ca", value_name = "FILE", env = "OPENSHELL_OTLP_OCSF_CA")]
    pub otlp_ocsf_ca: Option<PathBuf>,
}

impl TelemetryArgs {
    /// The settings, with the CA bundle's path made absolute.
    ///
    /// # Errors
    /// The CA bundle does not exist.
    pub fn config(self) -> anyhow::Result<TelemetryConfig> {
        let otlp_ca = match &self.otlp_ocsf_ca {
            Some(path) => Some(
                vm_driver::telemetry::ca_path(path)
                    .map_err(|e| anyhow::Error::new(e).context(format!("--otlp-ocsf-ca {}", path.display())))?,
            ),
            None => None,
        };
        Ok(TelemetryConfig {
            otlp_endpoint: self.otlp_ocsf_endpoint,
            otlp_protocol: self.otlp_ocsf_protocol,
            schema_version: self.otlp_ocsf_schema_version,
            gateway_name: self.gateway_name,
            ocsf_json: self.ocsf_json,
            otlp_ca,
        })
    }
}

#[derive(Debug, Args)]
pub struct LaunchArgs {
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Set an environment variable for CMD (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = crate::launch::parse_env)]
    pub env: Vec<(String, String)>,
    /// Working directory for CMD inside the guest.
    #[arg(long, short = 'w', value_name = "DIR")]
    pub workdir: Option<String>,
    /// A resource limit for CMD, as Docker's: `nofile=1024:2048`; `-1` or `unlimited` for none; one value
    /// for both (repeatable).
    #[arg(long, value_name = "NAME=SOFT[:HARD]", value_parser = vm_protocol::rlimit::parse_ulimit)]
    pub ulimit: Vec<vm_protocol::rlimit::Rlimit>,
    /// Stop the sandbox after this many seconds (exit 124).
    #[arg(long, value_name = "SECS")]
    pub timeout: Option<u64>,
    /// Keep stdin open (docker's -i). launch always streams its stdin to CMD, EOF included, so this is the
    /// default; it is accepted for `launch -it`.
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Run CMD on a pseudo-terminal of this terminal's size, following its resizes; this terminal is raw
    /// while CMD runs (Ctrl-C reaches CMD's terminal as a byte) and restored after.
    #[arg(short = 't', long)]
    pub tty: bool,
    /// Sandbox id ([A-Za-z0-9._-], at most 128); random by default.
    #[arg(long)]
    pub id: Option<SandboxId>,
    /// Keep the sandbox directory (logs) after a clean stop, until `--keep-ended` collects it.
    #[arg(long)]
    pub keep: bool,
    /// Boot the VM, even where a template (a saved boot of the same image and shape) could restore it, and
    /// make no template (docs/templates.md).
    #[arg(long)]
    pub cold: bool,
    /// The sandbox policy (JSON, docs/policy.md); every operation when not given.
    #[arg(long, value_name = "FILE", value_parser = read_policy)]
    pub policy: Option<SandboxPolicy>,
    /// Copy a host file or tree into the sandbox before CMD, as `cp HOSTPATH SANDBOX:GUESTPATH` does
    /// (repeatable; the guest path holds no `:`).
    #[arg(long, value_name = "HOSTPATH:GUESTPATH", value_parser = crate::cp::parse_copy_in)]
    pub copy_in: Vec<(PathBuf, String)>,
    /// Copy a guest file or tree out after CMD, whatever its status, as `cp SANDBOX:GUESTPATH HOSTPATH`
    /// does, through the hardened extractor (repeatable; the guest path holds no `:`).
    #[arg(long, value_name = "GUESTPATH:HOSTPATH", value_parser = crate::cp::parse_copy_out)]
    pub copy_out: Vec<(String, PathBuf)>,
    /// Share a host directory into the sandbox through virtiofs, docker's syntax (repeatable, at most 8;
    /// docs/files.md): the guest's workload writes as the directory's owner, never as root.
    #[arg(long = "mount", value_name = "type=bind,src=HOSTDIR,dst=GUESTDIR[,readonly]")]
    pub mounts: Vec<vm_contract::share::HostMount>,
    /// Mount a tmpfs in the guest, docker's syntax: `/scratch:size=64m,mode=1777,noexec` (repeatable, at most
    /// 8; docs/files.md). It is the guest's own memory, gone with the sandbox; always nosuid and nodev.
    #[arg(long, value_name = "GUESTDIR[:OPTIONS]", value_parser = vm_protocol::tmpfs::GuestTmpfs::parse_flag)]
    pub tmpfs: Vec<vm_protocol::tmpfs::GuestTmpfs>,
    /// Secret credentials the workload sees only as placeholders (a JSON list in a 0600 file,
    /// docs/network.md); the supervisor's proxy swaps them in for their hosts.
    #[arg(long, value_name = "FILE")]
    pub credentials_file: Option<PathBuf>,
    /// The root filesystem: an OCI image (REGISTRY/NAME[:TAG|@sha256:DIGEST], oci:DIR[:TAG],
    /// docker-archive:FILE), pulled on first use (docs/images.md). Default: the built-in root.
    #[arg(long, value_name = "REF")]
    pub image: Option<String>,
    /// The writable layer's size in MiB, with --image (a sparse file: unwritten space costs nothing).
    #[arg(long, value_name = "MIB", default_value_t = vm_contract::root::DEFAULT_DISK_MIB,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(vm_contract::root::MAX_DISK_MIB)))]
    pub disk: u32,
    #[command(flatten)]
    pub store: crate::image::StoreArgs,
    #[command(flatten)]
    pub registry: crate::image::RegistryArgs,
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    /// The command and its arguments (with --image, the image's entrypoint and command when not given).
    #[arg(last = true, required_unless_present = "image", value_name = "CMD")]
    pub cmd: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The API socket (its directory must be private to this user; default: driver.sock in the state directory).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Only this process (the gateway) may use the API.
    #[arg(long, value_name = "PID")]
    pub gateway_pid: Option<i32>,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    /// Keep COUNT VMs booted ahead of demand, of CPUS vCPUs and MIB MiB (default 1:256) on the OCI image
    /// IMAGE as their root (default: the built-in root); a create of exactly that shape and image (with the
    /// default --disk) claims one instead of booting.
    /// Repeatable. Pooled VMs count against the limits above.
    #[arg(long = "pool", value_name = "COUNT[:CPUS:MIB[:IMAGE]]")]
    pub pool: Vec<vm_driver::service::pool::PoolTarget>,
    /// Pooled VMs start from a snapshot instead of booting: one VM per --pool target is booted and saved
    /// at start (into the state directory), and every pooled VM is restored from it and reseeded with fresh
    /// host entropy and the wall clock before it is claimed.
    #[arg(long, requires = "pool")]
    pub pool_snapshots: bool,
    /// Boot every sandbox: no template (a saved boot of the same image and shape) restores one, and none is
    /// made (docs/templates.md).
    #[arg(long)]
    pub cold: bool,
    /// Named boot images, one per subdirectory (vmlinuz + initramfs.cpio), that a sandbox may ask for
    /// (default: the directory holding the default one, so `default` is one of them).
    #[arg(long, value_name = "DIR")]
    pub boot_images: Option<PathBuf>,
    #[command(flatten)]
    pub store: crate::image::StoreArgs,
    #[command(flatten)]
    pub registry: crate::image::RegistryArgs,
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub openshell: crate::openshell::OpenShellArgs,
}

#[derive(Debug, Args)]
pub struct SocketArgs {
    /// The API socket of `vm-driver serve` (default: $VM_DRIVER_SOCKET, else driver.sock in the state directory).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
}

impl SocketArgs {
    pub fn path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(vm_driver::service::client::default_socket)
    }
}

#[derive(Debug, Args)]
pub struct IdArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// The sandbox.
    pub id: SandboxId,
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// Environment for every process in the sandbox (repeatable).
    #[arg(long = "env", short = 'e', value_name = "KEY=VALUE", value_parser = crate::launch::parse_env)]
    pub env: Vec<(String, String)>,
    #[command(flatten)]
    pub wait: crate::client::WaitArgs,
    /// The boot image, by name (a directory under `serve --boot-images`); the default one when not given.
    #[arg(long, value_name = "NAME")]
    pub boot_image: Option<String>,
    /// The root filesystem: an OCI image (a registry reference, oci:DIR[:TAG], docker-archive:FILE), which
    /// serve pulls on first use (docs/images.md). Default: the built-in root.
    #[arg(long, value_name = "REF")]
    pub image: Option<String>,
    /// The writable layer's size in MiB, with --image.
    #[arg(long, value_name = "MIB", default_value_t = vm_contract::root::DEFAULT_DISK_MIB)]
    pub disk: u32,
    /// Share a host directory (of serve's host) into the sandbox through virtiofs, docker's syntax (repeatable, at most 8;
    /// docs/files.md): the guest's workload writes as the directory's owner, never as root.
    #[arg(long = "mount", value_name = "type=bind,src=HOSTDIR,dst=GUESTDIR[,readonly]")]
    pub mounts: Vec<vm_contract::share::HostMount>,
    /// The sandbox policy (JSON, docs/policy.md); every operation when not given.
    #[arg(long, value_name = "FILE", value_parser = read_policy)]
    pub policy: Option<SandboxPolicy>,
    /// Secret credentials the workload sees only as placeholders (a JSON list in a 0600 file,
    /// docs/network.md); the supervisor's proxy swaps them in for their hosts.
    #[arg(long, value_name = "FILE")]
    pub credentials_file: Option<PathBuf>,
    /// The sandbox id ([A-Za-z0-9._-], at most 128).
    pub id: SandboxId,
}

#[derive(Debug, Args)]
pub struct PolicyArgs {
    #[command(flatten)]
    pub socket: SocketArgs,
    /// Above every revision applied to the sandbox's current start.
    #[arg(long)]
    pub revision: u64,
    /// The operations allowed from now on, comma-separated (exec, stdin, signal, resize, reattach,
    /// list_processes, port_forward, files_read, files_write); empty for none.
    #[arg(long, value_name = "OPS", value_parser = parse_operations)]
    pub allow: Operations,
    /// The user workloads run as, by name or uid: it may only select the fixed workload identity (sandbox).
    #[arg(long, value_name = "USER")]
    pub run_as_user: Option<String>,
    /// The group workloads run as, by name or gid: it may only select the fixed workload identity (sandbox).
    #[arg(long, value_name = "GROUP")]
    pub run_as_group: Option<String>,
    /// The network rules allowed from now on: a JSON list of rules from the approved policy, `[]` for none.
    /// Default: every approved rule.
    #[arg(long, value_name = "JSON")]
    pub network: Option<String>,
    /// The sandbox id.
    pub id: SandboxId,
}

/// A list of operations, as `--allow` takes it.
#[derive(Debug, Clone)]
pub struct Operations(pub Vec<Operation>);

fn parse_operations(text: &str) -> Result<Operations, String> {
    let ops = text.split(',').filter(|s| !s.is_empty()).map(|s| s.trim().parse::<Operation>());
    ops.collect::<Result<Vec<_>, _>>().map(Operations).map_err(|e| e.to_string())
}

/// Reads and validates a policy file, so a bad one fails before anything starts.
pub fn read_policy(path: &str) -> Result<SandboxPolicy, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    SandboxPolicy::parse(&text, &vm_protocol::identity::WORKLOAD).map_err(|e| format!("{path}: {e}"))
}

mod admission;
#[cfg(test)]
mod tests;

pub use self::admission::AdmissionArgs;

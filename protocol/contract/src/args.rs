//! The command lines the driver gives the supervisor, and the supervisor gives the watchdog: one type each,
//! turned into argv by the parent and parsed by the child, so the two cannot disagree.

use std::ffi::OsString;
use std::path::PathBuf;

use crate::accel::AccelChoice;
use crate::descriptor::Backend;
use crate::ids::SandboxId;
use crate::jail::Confinement;
use crate::pids::ProcessRecord;
use crate::session::{Generation, SessionId};
use crate::shape::SandboxShape;

/// `vm-supervisor --probe-accel CHOICE`: print the accelerator status line this host gives `CHOICE` and exit,
/// so the driver reports the same choice the supervisor would make.
pub const PROBE_ACCEL: &str = "--probe-accel";

/// Boot timeout when none is given.
pub const DEFAULT_BOOT_TIMEOUT_MS: u64 = 60_000;
/// Grace between SIGTERM and SIGKILL for workload processes at a stop, when none is given.
pub const DEFAULT_STOP_GRACE_MS: u32 = 3_000;

/// `vm-supervisor`'s arguments. Every one is a trusted input from the driver; nothing here comes from a
/// sandbox descriptor or from the guest. Two parts: who the sandbox is ([`IdentityArgs`]) and what its VM is
/// ([`VmArgs`]). A pooled VM's identity is its slot's until its claim brings the sandbox's
/// ([`crate::claim::Claim::identity`]); booting sees only the VM's part.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Parser))]
#[cfg_attr(
    feature = "clap",
    command(
        name = "vm-supervisor",
        version,
        about = "Runs one microVM for vm-driver; not meant to be started by hand"
    )
)]
pub struct SupervisorArgs {
    /// Who the sandbox is.
    #[cfg_attr(feature = "clap", command(flatten))]
    pub identity: IdentityArgs,
    /// What its VM is.
    #[cfg_attr(feature = "clap", command(flatten))]
    pub vm: VmArgs,
}

/// Who a sandbox is: its id, and the session this start opens with `vm-driver serve` (none for `launch`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct IdentityArgs {
    /// The sandbox this VM belongs to.
    #[cfg_attr(feature = "clap", arg(long))]
    pub sandbox_id: SandboxId,
    /// This start's session id.
    #[cfg_attr(feature = "clap", arg(long))]
    pub session_id: Option<SessionId>,
    /// This start's generation, presented in the session.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = Generation(0)))]
    pub generation: Generation,
    /// The driver's session socket (`vm-driver serve`); without it there is no session and no readiness
    /// listener (`vm-driver launch`).
    #[cfg_attr(feature = "clap", arg(long))]
    pub session_socket: Option<PathBuf>,
}

/// What a VM is: what it boots, how it is confined and leashed, how its egress leaves. A pooled VM is booted
/// from these alone.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct VmArgs {
    /// The sandbox's private directory (0700); the supervisor works inside it.
    #[cfg_attr(feature = "clap", arg(long))]
    pub sandbox_dir: PathBuf,
    /// Guest kernel.
    #[cfg_attr(feature = "clap", arg(long))]
    pub kernel: PathBuf,
    /// Guest initramfs.
    #[cfg_attr(feature = "clap", arg(long))]
    pub initrd: PathBuf,
    /// vCPUs and guest memory in MiB, as `CPUS:MIB`.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = SandboxShape::default()))]
    pub shape: SandboxShape,
    /// Accelerator.
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value_t = AccelChoice::Auto))]
    pub accel: AccelChoice,
    /// How long the guest agent may take to answer the handshake after QEMU starts.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_BOOT_TIMEOUT_MS))]
    pub boot_timeout_ms: u64,
    /// On stop: time between SIGTERM and SIGKILL for workload processes.
    #[cfg_attr(feature = "clap", arg(long, default_value_t = DEFAULT_STOP_GRACE_MS))]
    pub stop_grace_ms: u32,
    /// The host's TSC rate in kHz, told to a guest under TCG (whose TSC runs at the host's rate); without
    /// it the guest is told 2 GHz and keeps time off by the ratio.
    #[cfg_attr(feature = "clap", arg(long))]
    pub tsc_khz: Option<u32>,
    /// The QEMU binary (default: qemu-system-x86_64 on PATH).
    #[cfg_attr(feature = "clap", arg(long))]
    pub qemu: Option<PathBuf>,
    /// A cgroup v2 directory to join before starting anything (the driver's final sweep kills it).
    #[cfg_attr(feature = "clap", arg(long))]
    pub cgroup: Option<PathBuf>,
    /// How QEMU is confined (through `vm-jailer`).
    #[cfg_attr(feature = "clap", arg(long, value_enum))]
    pub confinement: Confinement,
    /// `jail` confinement: the uid and gid (the same number) claimed for this sandbox's VMM.
    #[cfg_attr(feature = "clap", arg(long))]
    pub jail_id: Option<u32>,
    /// The VMM's own cgroups, with its limits (repeatable); `vm-jailer` joins them.
    #[cfg_attr(feature = "clap", arg(long = "vmm-cgroup"))]
    pub vmm_cgroups: Vec<PathBuf>,
    /// Stdin is the driver's liveness pipe: EOF means the driver is gone.
    #[cfg_attr(feature = "clap", arg(long))]
    pub parent_liveness_stdin: bool,
    /// Boot without an identity and wait for a claim on stdin ([`crate::claim`]); needs
    /// `--parent-liveness-stdin`. The sandbox id is then the pool slot's until the claim.
    #[cfg_attr(feature = "clap", arg(long, requires = "parent_liveness_stdin"))]
    pub pooled: bool,
    /// Boot (as `--pooled`, with no identity), save the idle VM into this directory ([`crate::snapshot`]) and
    /// exit, saying [`crate::status::SupervisorStatus::Saved`]; the VM serves nothing.
    #[cfg_attr(feature = "clap", arg(long, requires = "pooled", conflicts_with = "restore_snapshot"))]
    pub save_snapshot: Option<PathBuf>,
    /// Start the VM (`--pooled`) from the snapshot in this directory instead of booting it.
    #[cfg_attr(feature = "clap", arg(long, requires = "pooled"))]
    pub restore_snapshot: Option<PathBuf>,
    /// The guest's RAM is the memfd the driver holds at this descriptor ([`crate::guest_ram`]): written
    /// through when saving (`--save-snapshot`), mapped private from a sealed template when restoring.
    #[cfg_attr(feature = "clap", arg(long, requires = "pooled"))]
    pub guest_ram_fd: Option<u32>,
    /// The backend: picks the launch descriptor's decoder (never the descriptor itself).
    #[cfg_attr(feature = "clap", arg(long, value_enum, default_value_t = Backend::Microvm))]
    pub backend: Backend,
    /// A DNS server (`IP:PORT`) that resolves the names of egress connections, instead of the system resolver.
    #[cfg_attr(feature = "clap", arg(long))]
    pub egress_resolver: Option<std::net::SocketAddr>,
    /// The operator's HTTP proxy (`HOST:PORT`) every egress connection leaves through (CONNECT); its
    /// credentials, if any, are in the auth bundle.
    #[cfg_attr(feature = "clap", arg(long))]
    pub egress_proxy: Option<String>,
    /// Certificates (PEM) trusted for intercepted connections' destinations, beside the system's roots.
    #[cfg_attr(feature = "clap", arg(long))]
    pub egress_ca: Option<PathBuf>,
    /// Host directories to share into the guest (repeatable), each served by its own confined `virtiofsd`.
    #[cfg_attr(feature = "clap", arg(long = "mount", value_name = "type=bind,src=HOSTDIR,dst=GUESTDIR[,readonly]"))]
    pub mounts: Vec<crate::share::HostMount>,
    /// Memory file systems the guest mounts (repeatable), Docker's `--tmpfs` form.
    #[cfg_attr(feature = "clap", arg(long = "tmpfs", value_name = "GUESTDIR[:OPTIONS]",
        value_parser = vm_protocol::tmpfs::GuestTmpfs::parse_flag))]
    pub tmpfs: Vec<vm_protocol::tmpfs::GuestTmpfs>,
}

impl SupervisorArgs {
    /// The argv (without the program name) that parses back into `self`.
    pub fn to_argv(&self) -> Vec<OsString> {
        let mut argv = self.identity.to_argv();
        argv.extend(self.vm.to_argv());
        argv
    }
}

impl IdentityArgs {
    /// The identity's flags.
    pub fn to_argv(&self) -> Vec<OsString> {
        let mut argv: Vec<OsString> = vec!["--sandbox-id".into(), self.sandbox_id.as_str().into()];
        if let Some(session) = &self.session_id {
            argv.extend(["--session-id".into(), session.as_str().into()]);
        }
        argv.extend(["--generation".into(), self.generation.to_string().into()]);
        if let Some(socket) = &self.session_socket {
            argv.extend(["--session-socket".into(), socket.clone().into()]);
        }
        argv
    }
}

impl VmArgs {
    /// The VM's flags.
    pub fn to_argv(&self) -> Vec<OsString> {
        let mut argv: Vec<OsString> = Vec::new();
        let mut flag = |name: &str, value: OsString| {
            argv.push(name.into());
            argv.push(value);
        };
        flag("--sandbox-dir", self.sandbox_dir.clone().into());
        flag("--kernel", self.kernel.clone().into());
        flag("--initrd", self.initrd.clone().into());
        flag("--shape", self.shape.to_string().into());
        flag("--accel", self.accel.as_str().into());
        flag("--boot-timeout-ms", self.boot_timeout_ms.to_string().into());
        flag("--stop-grace-ms", self.stop_grace_ms.to_string().into());
        if let Some(khz) = self.tsc_khz {
            flag("--tsc-khz", khz.to_string().into());
        }
        if let Some(qemu) = &self.qemu {
            flag("--qemu", qemu.clone().into());
        }
        if let Some(cgroup) = &self.cgroup {
            flag("--cgroup", cgroup.clone().into());
        }
        flag("--confinement", self.confinement.as_str().into());
        if let Some(id) = self.jail_id {
            flag("--jail-id", id.to_string().into());
        }
        for cgroup in &self.vmm_cgroups {
            flag("--vmm-cgroup", cgroup.clone().into());
        }
        if self.parent_liveness_stdin {
            argv.push("--parent-liveness-stdin".into());
        }
        if self.pooled {
            argv.push("--pooled".into());
        }
        for (name, dir) in [("--save-snapshot", &self.save_snapshot), ("--restore-snapshot", &self.restore_snapshot)] {
            if let Some(dir) = dir {
                argv.push(name.into());
                argv.push(dir.clone().into());
            }
        }
        if let Some(fd) = self.guest_ram_fd {
            argv.push("--guest-ram-fd".into());
            argv.push(fd.to_string().into());
        }
        argv.push("--backend".into());
        argv.push(self.backend.as_str().into());
        if let Some(resolver) = self.egress_resolver {
            argv.push("--egress-resolver".into());
            argv.push(resolver.to_string().into());
        }
        if let Some(proxy) = &self.egress_proxy {
            argv.push("--egress-proxy".into());
            argv.push(proxy.into());
        }
        if let Some(ca) = &self.egress_ca {
            argv.push("--egress-ca".into());
            argv.push(ca.into());
        }
        for mount in &self.mounts {
            argv.push("--mount".into());
            argv.push(mount.to_string().into());
        }
        for tmpfs in &self.tmpfs {
            argv.push("--tmpfs".into());
            argv.push(format!("{}:{}", tmpfs.target, tmpfs.options()).into());
        }
        argv
    }
}

/// `vm-watchdog`'s arguments: the VMM to watch. Parsed by hand, so the watchdog stays free of a parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchdogArgs {
    /// The VMM, by pid and start time.
    pub vmm: ProcessRecord,
}

impl WatchdogArgs {
    /// The argv (without the program name).
    pub fn to_argv(&self) -> Vec<String> {
        vec!["--vmm-pid".into(), self.vmm.pid.to_string(), "--vmm-start-time".into(), self.vmm.start_time.to_string()]
    }

    /// Parses what [`WatchdogArgs::to_argv`] made; `None` for anything else.
    pub fn parse(args: &[String]) -> Option<Self> {
        match args {
            [p, pid, s, start] if p == "--vmm-pid" && s == "--vmm-start-time" => {
                Some(Self { vmm: ProcessRecord { pid: pid.parse().ok()?, start_time: start.parse().ok()? } })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watchdog_args_round_trip() {
        let args = WatchdogArgs { vmm: ProcessRecord { pid: 42, start_time: 9_000 } };
        assert_eq!(WatchdogArgs::parse(&args.to_argv()), Some(args));
        assert_eq!(WatchdogArgs::parse(&["--vmm-pid".into(), "x".into()]), None);
    }

    #[cfg(feature = "clap")]
    #[test]
    fn supervisor_args_round_trip_through_argv() {
        use clap::Parser;
        let identity = IdentityArgs {
            sandbox_id: SandboxId::parse("box-1").unwrap(),
            session_id: Some(SessionId::from_bytes([7; 16])),
            generation: Generation(9),
            session_socket: Some("/run/vm-driver/sessions.sock".into()),
        };
        let full = VmArgs {
            sandbox_dir: "/run/vm-driver/sandboxes/box-1".into(),
            kernel: "/img/vmlinuz".into(),
            initrd: "/img/initramfs.cpio".into(),
            shape: SandboxShape::new(2, 512).unwrap(),
            accel: AccelChoice::Tcg,
            boot_timeout_ms: 5_000,
            stop_grace_ms: 1_000,
            tsc_khz: Some(2_600_000),
            qemu: Some("/opt/qemu".into()),
            cgroup: Some("/sys/fs/cgroup/vm-driver/box-1-abcd".into()),
            confinement: Confinement::Jail,
            jail_id: Some(2_000_000_007),
            vmm_cgroups: vec!["/sys/fs/cgroup/memory/vm-driver/box-1-abcd-vmm".into(), "/p/vm-driver/b-vmm".into()],
            parent_liveness_stdin: true,
            pooled: true,
            save_snapshot: None,
            restore_snapshot: Some("/run/vm-driver/snapshots/pool-1".into()),
            guest_ram_fd: Some(7),
            backend: Backend::Microvm,
            egress_resolver: Some("127.0.0.1:5353".parse().unwrap()),
            egress_proxy: Some("proxy.corp.example:3128".into()),
            egress_ca: Some("/etc/corp-ca.pem".into()),
            mounts: vec!["src=/home/me/p,dst=/work,readonly".parse().unwrap(), "src=/d,dst=/data".parse().unwrap()],
            tmpfs: vec![
                vm_protocol::tmpfs::GuestTmpfs::parse_flag("/scratch:size=1m,noexec").unwrap(),
                vm_protocol::tmpfs::GuestTmpfs::parse_flag("/cache").unwrap(),
            ],
        };
        let saving = VmArgs {
            save_snapshot: Some("/run/vm-driver/snapshots/pool-2".into()),
            restore_snapshot: None,
            ..full.clone()
        };
        let minimal = VmArgs {
            tsc_khz: None,
            qemu: None,
            cgroup: None,
            confinement: Confinement::None,
            jail_id: None,
            vmm_cgroups: Vec::new(),
            parent_liveness_stdin: false,
            pooled: false,
            restore_snapshot: None,
            guest_ram_fd: None,
            backend: Backend::Microvm,
            egress_resolver: None,
            egress_proxy: None,
            egress_ca: None,
            mounts: Vec::new(),
            tmpfs: Vec::new(),
            ..full.clone()
        };
        let launch =
            IdentityArgs { session_id: None, session_socket: None, generation: Generation(0), ..identity.clone() };
        let cases =
            [(identity.clone(), full), (launch.clone(), saving), (identity, minimal.clone()), (launch, minimal)];
        for (identity, vm) in cases {
            let args = SupervisorArgs { identity, vm };
            let argv = std::iter::once(OsString::from("vm-supervisor")).chain(args.to_argv());
            assert_eq!(SupervisorArgs::try_parse_from(argv).unwrap(), args);
        }
    }
}

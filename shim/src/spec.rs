//! What a containerd bundle's OCI runtime spec (`config.json`) asks, and what of it a microVM honours
//! (docs/kubernetes.md, "The OCI spec"): the process's args, env, cwd, terminal and rlimits; bind mounts of
//! host directories (our confined shares); tmpfs mounts (the guest's own memory); the kernel file systems every
//! guest has anyway. What would reach past
//! the VM (host namespaces, privileged, host devices) or what we cannot honour yet is refused by name,
//! before anything is made.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{Capability, LinuxNamespaceType, Mount, Process, Spec};
use vm_contract::share::HostMount;
use vm_protocol::rlimit::{self, Resource, Rlimit};
use vm_protocol::tmpfs::{self, GuestTmpfs, TmpfsError};

/// The most bytes of `config.json` read: containerd's specs are a few KiB.
const MAX_SPEC_BYTES: u64 = 1 << 20;

/// The kernel file systems the guest mounts itself, where a container expects them: accepted and left to
/// the guest.
const GUEST_MOUNTS: &[(&str, &str)] = &[
    ("/proc", "proc"),
    ("/dev", "tmpfs"),
    ("/dev/pts", "devpts"),
    ("/dev/shm", "tmpfs"),
    ("/dev/mqueue", "mqueue"),
    ("/sys", "sysfs"),
    ("/sys/fs/cgroup", "cgroup"),
    ("/run", "tmpfs"),
];

/// The namespaces a container must have of its own; in a VM every one is the guest's.
const OWN_NAMESPACES: [LinuxNamespaceType; 5] = [
    LinuxNamespaceType::Pid,
    LinuxNamespaceType::Network,
    LinuxNamespaceType::Ipc,
    LinuxNamespaceType::Uts,
    LinuxNamespaceType::Mount,
];

/// The annotations containerd's CRI plugin puts on every spec it makes.
const CRI_TYPE: &str = "io.kubernetes.cri.container-type";
const CRI_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// Most files one pod container has copied in (CRI binds three or four).
const MAX_FILES: usize = vm_protocol::container::MAX_FILES;

/// What the task is to its pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// A task of its own (`ctr run`): a VM for it alone.
    Alone,
    /// A pod's sandbox (its pause container): the pod's VM, named by the CRI's sandbox id.
    Sandbox(String),
    /// A container of the pod with this sandbox id: a root of its own in the pod's VM.
    Member(String),
}

impl Role {
    /// The role `spec`'s annotations give (`None`: they are inconsistent).
    pub fn of(spec: &Spec) -> Option<Self> {
        let annotations = spec.annotations().clone().unwrap_or_default();
        let sandbox = annotations.get(CRI_SANDBOX_ID).filter(|id| !id.is_empty()).cloned();
        match (annotations.get(CRI_TYPE).map(String::as_str), sandbox) {
            (None, _) => Some(Self::Alone),
            (Some("sandbox"), Some(id)) => Some(Self::Sandbox(id)),
            (Some("container"), Some(id)) => Some(Self::Member(id)),
            _ => None,
        }
    }

    /// The pod's sandbox id, for a task of a pod.
    pub fn pod(&self) -> Option<&str> {
        match self {
            Self::Alone => None,
            Self::Sandbox(id) | Self::Member(id) => Some(id),
        }
    }
}

/// A host file copied into a pod container's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileCopy {
    /// The host's file.
    pub source: PathBuf,
    /// Its absolute path in the root.
    pub target: String,
}

/// Why a spec is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpecError {
    /// `config.json` is missing, too large or not a runtime spec.
    #[error("the bundle's config.json cannot be read as an OCI runtime spec")]
    Unreadable,
    /// No process, or no args.
    #[error("the spec names no process to run (process.args is empty)")]
    NoArgs,
    /// A namespace the host's, or joined by path.
    #[error("the spec shares the host's {0} namespace: a microVM has only its own")]
    HostNamespace(&'static str),
    /// `CAP_SYS_ADMIN` in the bounding set: a privileged container.
    #[error("privileged containers are refused: CAP_SYS_ADMIN would reach the VM's kernel, not a container")]
    Privileged,
    /// Host devices.
    #[error("host devices are refused ({0}): nothing of the host's is passed to the VM")]
    Device(String),
    /// A resource limit the guest cannot set.
    #[error("the spec's rlimits are refused: {0}")]
    Rlimit(#[from] rlimit::RlimitError),
    /// A resource limit of a kind the guest does not know.
    #[error("the spec's rlimit {0} names an unknown resource")]
    UnknownRlimit(String),
    /// A tmpfs the guest cannot mount as asked.
    #[error("tmpfs at {0} is refused: {1}")]
    Tmpfs(String, #[source] TmpfsError),
    /// CRI's annotations name no pod, or a kind of container it does not make.
    #[error("the spec's CRI annotations ({CRI_TYPE}, {CRI_SANDBOX_ID}) are inconsistent")]
    Annotations,
    /// A mount we cannot honour.
    #[error("mount at {destination} is refused: {why}")]
    Mount {
        /// Where the spec wanted it.
        destination: String,
        /// Why.
        why: &'static str,
    },
}

/// A process as the guest will run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// `KEY=VALUE` pairs, the spec's whole environment.
    pub env: Vec<(String, String)>,
    /// Working directory (`None`: the image's).
    pub cwd: Option<String>,
    /// On a terminal.
    pub terminal: bool,
    /// Resource limits (`process.rlimits`), set before the program runs.
    pub rlimits: Vec<Rlimit>,
}

/// The container: its first process and the host directories it shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    /// What it is to its pod.
    pub role: Role,
    /// The init process.
    pub init: Workload,
    /// Bind mounts of host directories.
    pub mounts: Vec<HostMount>,
    /// tmpfs mounts.
    pub tmpfs: Vec<GuestTmpfs>,
    /// Host files copied into its root (a pod's container only).
    pub files: Vec<FileCopy>,
}

/// Reads and checks `bundle/config.json`.
///
/// # Errors
/// [`SpecError`].
pub fn read(bundle: &Path) -> Result<Container, SpecError> {
    accept(&load(bundle)?)
}

fn load(bundle: &Path) -> Result<Spec, SpecError> {
    use std::io::Read;
    let file = std::fs::File::open(bundle.join("config.json")).map_err(|_| SpecError::Unreadable)?;
    let mut bytes = Vec::new();
    file.take(MAX_SPEC_BYTES + 1).read_to_end(&mut bytes).map_err(|_| SpecError::Unreadable)?;
    if bytes.len() as u64 > MAX_SPEC_BYTES {
        return Err(SpecError::Unreadable);
    }
    serde_json::from_slice(&bytes).map_err(|_| SpecError::Unreadable)
}

/// The CRI pod `bundle`'s task belongs to, if any (its own id for a pod's sandbox).
pub fn pod_of(bundle: &Path) -> Option<String> {
    let spec = load(bundle).ok()?;
    Role::of(&spec)?.pod().map(str::to_owned)
}

/// Checks a whole spec.
///
/// # Errors
/// [`SpecError`], the first thing refused.
pub fn accept(spec: &Spec) -> Result<Container, SpecError> {
    let role = Role::of(spec).ok_or(SpecError::Annotations)?;
    let linux = spec.linux().clone().unwrap_or_default();
    let namespaces = linux.namespaces().clone().unwrap_or_default();
    for wanted in OWN_NAMESPACES {
        // In a pod, a namespace joined by path is the pod's: the VM's own. The mount namespace never is.
        let pods = role != Role::Alone && wanted != LinuxNamespaceType::Mount;
        let own = namespaces.iter().any(|n| n.typ() == wanted && (n.path().is_none() || pods));
        if !own {
            return Err(SpecError::HostNamespace(namespace_name(wanted)));
        }
    }
    // Before the devices: a privileged spec lists every host device too, and privileged is what it asked.
    let process = spec.process().as_ref().ok_or(SpecError::NoArgs)?;
    let init = workload(process)?;
    if let Some(device) = linux.devices().as_ref().and_then(|d| d.first()) {
        return Err(SpecError::Device(device.path().display().to_string()));
    }
    let (mut mounts, mut tmpfs, mut files) = (Vec::new(), Vec::new(), Vec::new());
    for mount in spec.mounts().as_deref().unwrap_or_default() {
        match wanted(mount, &role)? {
            Some(Wanted::Share(share)) => mounts.push(share),
            Some(Wanted::Tmpfs(t)) => tmpfs.push(t),
            Some(Wanted::Copy(file)) if files.len() < MAX_FILES => files.push(file),
            Some(Wanted::Copy(file)) => {
                let why = "a pod's container takes at most 16 files bound in";
                return Err(SpecError::Mount { destination: file.target, why });
            }
            None => {}
        }
    }
    tmpfs::check(&tmpfs)
        .map_err(|e| SpecError::Tmpfs(tmpfs.last().map(|t| t.target.clone()).unwrap_or_default(), e))?;
    Ok(Container { role, init, mounts, tmpfs, files })
}

/// Checks one process (the init's, or an exec's from `ExecProcessRequest.spec`).
///
/// # Errors
/// [`SpecError::NoArgs`], [`SpecError::Privileged`], [`SpecError::Rlimit`], [`SpecError::UnknownRlimit`].
pub fn workload(process: &Process) -> Result<Workload, SpecError> {
    let privileged = process
        .capabilities()
        .as_ref()
        .and_then(|c| c.bounding().as_ref())
        .is_some_and(|bounding| bounding.contains(&Capability::SysAdmin));
    if privileged {
        return Err(SpecError::Privileged);
    }
    let argv = process.args().clone().unwrap_or_default();
    if argv.is_empty() {
        return Err(SpecError::NoArgs);
    }
    let env = process
        .env()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|e| e.split_once('=').map_or((e.clone(), String::new()), |(k, v)| (k.to_owned(), v.to_owned())))
        .collect();
    let cwd = process.cwd().to_str().filter(|c| !c.is_empty() && *c != "/").map(str::to_owned);
    let rlimits = process
        .rlimits()
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|l| {
            let name = l.typ().to_string();
            let resource = Resource::from_name(&name).ok_or(SpecError::UnknownRlimit(name))?;
            Ok(Rlimit { resource, soft: l.soft(), hard: l.hard() })
        })
        .collect::<Result<Vec<_>, SpecError>>()?;
    rlimit::check(&rlimits)?;
    Ok(Workload { argv, env, cwd, terminal: process.terminal().unwrap_or(false), rlimits })
}

/// What one of the spec's mounts becomes in the VM.
enum Wanted {
    /// A host directory, shared.
    Share(HostMount),
    /// A tmpfs of the guest's own.
    Tmpfs(GuestTmpfs),
    /// A host file, copied into a pod container's root.
    Copy(FileCopy),
}

/// A bind mount as a share, a tmpfs as the guest's, a kernel file system the guest has anyway as nothing;
/// in a pod, CRI's `/dev/shm` as the guest's and a bound file as a copy; anything else refused.
fn wanted(mount: &Mount, role: &Role) -> Result<Option<Wanted>, SpecError> {
    let destination = mount.destination().display().to_string();
    let typ = mount.typ().as_deref().unwrap_or_default();
    let options = mount.options().as_deref().unwrap_or_default();
    let refuse = |why| Err(SpecError::Mount { destination: destination.clone(), why });
    if GUEST_MOUNTS.iter().any(|(d, t)| *d == destination && *t == typ) {
        return Ok(None);
    }
    let bind = typ == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
    if typ == "tmpfs" && !bind {
        let t = GuestTmpfs::new(&destination, options.iter().map(String::as_str));
        return t.map(|t| Some(Wanted::Tmpfs(t))).map_err(|e| SpecError::Tmpfs(destination.clone(), e));
    }
    if !bind {
        return refuse(
            "only bind mounts of host directories, tmpfs mounts and the guest's own kernel file systems are honoured",
        );
    }
    let Some(source) = mount.source().as_ref().filter(|s| s.is_absolute()) else {
        return refuse("a bind mount needs an absolute source");
    };
    if *role != Role::Alone && destination == "/dev/shm" {
        // CRI's host tmpfs for the pod: the guest's own /dev/shm, which the pod's containers share.
        return Ok(None);
    }
    if let Role::Sandbox(_) = role {
        if source.is_file() {
            // CRI's `/etc/resolv.conf` and its kind for the pause process, which reads none of them.
            return Ok(None);
        }
    }
    if let Role::Member(_) = role {
        if source.is_file() && vm_protocol::mounts::target_ok(&destination) {
            return Ok(Some(Wanted::Copy(FileCopy { source: source.clone(), target: destination })));
        }
        // The pod's VM shares its directories when it boots, before any of its containers exists.
        return refuse("a pod's container takes only files bound in (a directory volume is not done yet)");
    }
    if !source.is_dir() {
        return refuse("only directories are shared with a VM");
    }
    let readonly = options.iter().any(|o| o == "ro");
    Ok(Some(Wanted::Share(HostMount { source: source.clone(), target: destination, readonly })))
}

fn namespace_name(kind: LinuxNamespaceType) -> &'static str {
    match kind {
        LinuxNamespaceType::Pid => "pid",
        LinuxNamespaceType::Network => "network",
        LinuxNamespaceType::Ipc => "ipc",
        LinuxNamespaceType::Uts => "uts",
        LinuxNamespaceType::Mount => "mount",
        LinuxNamespaceType::Cgroup => "cgroup",
        LinuxNamespaceType::User => "user",
        LinuxNamespaceType::Time => "time",
    }
}

#[cfg(test)]
mod tests;

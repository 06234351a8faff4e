//! The VMM's own cgroups, with its limits: memory (guest memory plus an overhead), pids, and optionally CPU.
//!
//! Where the host's cgroup v2 has the `memory` and `pids` controllers, one v2 cgroup
//! `<v2>/vm-driver/<name>-vmm` (a sibling of the sandbox's cgroup, which holds the supervisor: v2 allows no
//! processes in a cgroup whose controllers are delegated). Otherwise, on a hybrid hierarchy, one cgroup per v1
//! controller: `<v1 memory>/vm-driver/<name>-vmm`, and the same under `pids` and `cpu`. `vm-jailer` moves
//! itself in before it drops privileges, so QEMU starts inside. The paths are recorded in the sandbox
//! directory ([`SandboxFile::VmmCgroups`]) for the supervisor's report and the final sweep.

use std::fs;
use std::path::{Path, PathBuf};

use vm_contract::layout::SandboxFile;

/// What the VMM may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmLimits {
    /// Memory, MiB: the guest's plus the overhead.
    pub memory_mib: u64,
    /// Processes and threads.
    pub pids: u32,
    /// CPU, percent of one core (`None`: unlimited).
    pub cpu_percent: Option<u32>,
}

/// The CFS period the CPU quota is expressed in, µs.
const CPU_PERIOD_US: u64 = 100_000;

/// Creates the VMM's cgroups with `limits`, records them in `sandbox_dir` and returns them. None where the host
/// has no memory and pids controllers we may use (the driver says so once, at start).
///
/// # Errors
/// The host has them but they could not be set up: the caller fails the start rather than run a VMM without
/// the limits its events would claim.
pub fn create(name: &str, sandbox_dir: &Path, limits: VmmLimits) -> std::io::Result<Vec<PathBuf>> {
    let made = match available() {
        Err(_) => return Ok(Vec::new()),
        Ok(Kind::V2(mount)) => vec![v2_create(&mount, name, limits)?],
        Ok(Kind::V1) => v1_create(name, limits)?,
    };
    let text: Vec<String> = made.iter().map(|p| p.display().to_string()).collect();
    if let Err(e) = fs::write(sandbox_dir.join(SandboxFile::VmmCgroups.name()), text.join("\n")) {
        remove(&made);
        return Err(e);
    }
    Ok(made)
}

/// Which hierarchy holds the limits.
#[derive(Debug)]
pub enum Kind {
    /// cgroup v2, mounted here, with the `memory` and `pids` controllers.
    V2(PathBuf),
    /// cgroup v1 `memory` and `pids` hierarchies (a hybrid host).
    V1,
}

impl Kind {
    /// For the start-up line.
    pub fn name(&self) -> &'static str {
        match self {
            Self::V2(_) => "cgroup v2",
            Self::V1 => "cgroup v1",
        }
    }
}

/// Whether VMM limits can be set here, and in which hierarchy, or why not.
///
/// # Errors
/// Fixed text: neither hierarchy has the controllers.
pub fn available() -> Result<Kind, &'static str> {
    match super::mount_point().filter(|m| v2_has_controllers(m)) {
        Some(mount) => Ok(Kind::V2(mount)),
        None if v1_mount("memory").is_some() && v1_mount("pids").is_some() => Ok(Kind::V1),
        None => Err("no cgroup memory and pids controllers"),
    }
}

fn v2_has_controllers(mount: &Path) -> bool {
    let controllers = fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
    let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
    has("memory") && has("pids")
}

fn v2_create(mount: &Path, name: &str, limits: VmmLimits) -> std::io::Result<PathBuf> {
    let parent = mount.join("vm-driver");
    fs::create_dir_all(&parent)?;
    let cpu = if limits.cpu_percent.is_some() { " +cpu" } else { "" };
    fs::write(parent.join("cgroup.subtree_control"), format!("+memory +pids{cpu}"))?;
    let dir = parent.join(format!("{name}-vmm"));
    fs::create_dir(&dir)?;
    let mut writes = vec![("memory.max", bytes(limits.memory_mib)), ("pids.max", limits.pids.to_string())];
    if let Some(percent) = limits.cpu_percent {
        writes.push(("cpu.max", format!("{} {CPU_PERIOD_US}", CPU_PERIOD_US * u64::from(percent) / 100)));
    }
    let set = writes.iter().try_for_each(|(file, value)| fs::write(dir.join(file), value));
    if let Err(e) = set {
        let _ = fs::remove_dir(&dir);
        return Err(e);
    }
    // No swap: a VMM over its memory is stopped, not slowed to a crawl. Missing without swap accounting.
    let _ = fs::write(dir.join("memory.swap.max"), "0");
    Ok(dir)
}

fn v1_create(name: &str, limits: VmmLimits) -> std::io::Result<Vec<PathBuf>> {
    let mut wanted = vec![
        ("memory", vec![("memory.limit_in_bytes", bytes(limits.memory_mib))]),
        ("pids", vec![("pids.max", limits.pids.to_string())]),
    ];
    if let Some(percent) = limits.cpu_percent {
        let quota = CPU_PERIOD_US * u64::from(percent) / 100;
        wanted.push((
            "cpu",
            vec![("cpu.cfs_period_us", CPU_PERIOD_US.to_string()), ("cpu.cfs_quota_us", quota.to_string())],
        ));
    }
    let mut made = Vec::new();
    for (controller, writes) in wanted {
        let Some(mount) = v1_mount(controller) else {
            remove(&made);
            return Err(std::io::ErrorKind::NotFound.into());
        };
        let dir = mount.join("vm-driver").join(format!("{name}-vmm"));
        let set = fs::create_dir_all(&dir)
            .and_then(|()| writes.iter().try_for_each(|(file, value)| fs::write(dir.join(file), value)));
        // Recorded before its writes are checked, so a failure removes it too.
        made.push(dir);
        if let Err(e) = set {
            remove(&made);
            return Err(e);
        }
    }
    Ok(made)
}

/// MiB as a byte count, saturating.
fn bytes(mib: u64) -> String {
    mib.saturating_mul(1 << 20).to_string()
}

/// The mount point of the cgroup v1 hierarchy that has `controller`.
fn v1_mount(controller: &str) -> Option<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut fields = right.split(' ');
        let (fstype, options) = (fields.next()?, fields.nth(1)?);
        let mount = left.split(' ').nth(4)?;
        (fstype == "cgroup" && options.split(',').any(|o| o == controller)).then(|| PathBuf::from(mount))
    })
}

/// The VMM cgroups recorded in `sandbox_dir`, only those this driver made (under a `vm-driver` directory,
/// named `*-vmm`).
pub fn recorded(sandbox_dir: &Path) -> Vec<PathBuf> {
    let text = fs::read_to_string(sandbox_dir.join(SandboxFile::VmmCgroups.name())).unwrap_or_default();
    text.lines()
        .map(PathBuf::from)
        .filter(|p| {
            p.parent().and_then(Path::file_name).is_some_and(|n| n == "vm-driver")
                && p.file_name().is_some_and(|n| n.to_string_lossy().ends_with("-vmm"))
        })
        .collect()
}

/// Kills whatever is left in `cgroups` and removes them. Returns whether anything was still running.
pub fn remove(cgroups: &[PathBuf]) -> bool {
    let mut found = false;
    for cgroup in cgroups {
        for _ in 0..200 {
            let procs = fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
            if procs.trim().is_empty() {
                break;
            }
            found = true;
            super::kill_listed(cgroup);
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = fs::remove_dir(cgroup);
    }
    found
}

//! What `vm-driver serve` admits: sandboxes, their vCPUs and guest memory against the host, and Exec
//! streams, per sandbox and in all. A request past a limit is refused with `RESOURCE_EXHAUSTED` naming the
//! limit; nothing is queued.
//!
//! A sandbox holds its share from the moment it is created (or started again) until it is stopped or
//! deleted, whatever its state in between, so a burst of creates cannot all pass before the first boots.
//! Memory is the guest's plus [`OVERHEAD_MIB`] for the VMM and the control plane; the host's share is its
//! `MemTotal` times the memory overcommit, and its vCPU share is its cores times the CPU overcommit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use vm_contract::ids::SandboxId;
use vm_contract::shape::SandboxShape;

/// Host memory a sandbox costs beyond its guest's: QEMU (with its translation cache capped), the supervisor
/// and the watchdog.
pub const OVERHEAD_MIB: u64 = 96;

/// Attach clients of a sandbox kept for what is not an Exec stream: `ListProcesses`, and streams whose client
/// has gone but whose connection the supervisor has not closed yet.
const ATTACH_RESERVE: usize = 8;
/// The most Exec streams into one sandbox: each is one client of its supervisor's attach socket.
#[allow(clippy::cast_possible_truncation, reason = "a small constant")]
const MAX_PER_SANDBOX: u32 = (vm_contract::attach::MAX_CLIENTS - ATTACH_RESERVE) as u32;

/// How much of the host `serve` may hand out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionConfig {
    /// Most sandboxes holding resources at once.
    pub max_sandboxes: u32,
    /// vCPUs per host core.
    pub cpu_overcommit: f64,
    /// Guest memory (plus overhead) per byte of host memory.
    pub memory_overcommit: f64,
    /// Most Exec streams open at once, in all.
    pub max_exec_streams: u32,
    /// Most Exec streams open at once into one sandbox (at most `vm_contract::attach::MAX_CLIENTS` less a
    /// reserve).
    pub max_exec_per_sandbox: u32,
    /// Most VMs booting at once (0: two per host core).
    pub max_boots: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_sandboxes: 128,
            cpu_overcommit: 32.0,
            memory_overcommit: 1.0,
            max_exec_streams: 4096,
            max_exec_per_sandbox: MAX_PER_SANDBOX,
            max_boots: 0,
        }
    }
}

/// The limits, resolved against this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most sandboxes.
    pub sandboxes: u32,
    /// Most vCPUs in all.
    pub vcpus: u64,
    /// Most memory in all, MiB (guest plus overhead).
    pub memory_mib: u64,
    /// Most Exec streams in all.
    pub exec_streams: u32,
    /// Most Exec streams into one sandbox.
    pub exec_per_sandbox: u32,
    /// Most VMs booting at once; the others wait their turn.
    pub boots: u32,
}

impl Limits {
    /// The limits `config` gives on a host of `cores` and `memory_mib`.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss, reason = "bounded")]
    pub fn new(config: &AdmissionConfig, cores: u64, memory_mib: u64) -> Self {
        Self {
            sandboxes: config.max_sandboxes,
            vcpus: (cores as f64 * config.cpu_overcommit) as u64,
            memory_mib: (memory_mib as f64 * config.memory_overcommit) as u64,
            exec_streams: config.max_exec_streams,
            exec_per_sandbox: config.max_exec_per_sandbox.min(MAX_PER_SANDBOX),
            boots: match config.max_boots {
                0 => u32::try_from(cores.saturating_mul(2)).unwrap_or(u32::MAX).max(1),
                n => n,
            },
        }
    }

    /// The limits `config` gives on this host; `None` when its memory cannot be read.
    pub fn of_this_host(config: &AdmissionConfig) -> Option<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        Some(Self::new(config, cores, host_memory_mib()?))
    }
}

/// `MemTotal` from `/proc/meminfo`, in MiB.
fn host_memory_mib() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? / 1024)
}

/// What the admitted sandboxes hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Sandboxes.
    pub sandboxes: u32,
    /// vCPUs.
    pub vcpus: u64,
    /// Memory, MiB (guest plus overhead).
    pub memory_mib: u64,
    /// Of `sandboxes`, the pooled VMs.
    pub pooled: u32,
}

impl Usage {
    /// Adds a sandbox of `shape`.
    pub fn add(&mut self, shape: SandboxShape) {
        self.sandboxes += 1;
        self.vcpus += u64::from(shape.cpus());
        self.memory_mib += cost_mib(shape);
    }

    /// Takes a sandbox of `shape` away again.
    pub fn remove(&mut self, shape: SandboxShape) {
        self.sandboxes = self.sandboxes.saturating_sub(1);
        self.vcpus = self.vcpus.saturating_sub(u64::from(shape.cpus()));
        self.memory_mib = self.memory_mib.saturating_sub(cost_mib(shape));
    }
}

fn cost_mib(shape: SandboxShape) -> u64 {
    u64::from(shape.memory_mib()) + OVERHEAD_MIB
}

/// Which limit refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// Too many sandboxes.
    #[error("admission: {limit} sandboxes and pooled VMs already hold resources (--max-sandboxes)")]
    Sandboxes {
        /// The limit.
        limit: u32,
    },
    /// Not enough vCPUs left.
    #[error("admission: {asked} vCPUs asked, {used} of {limit} in use (host cores x --cpu-overcommit)")]
    Vcpus {
        /// Asked for.
        asked: u64,
        /// In use.
        used: u64,
        /// The limit.
        limit: u64,
    },
    /// Not enough memory left.
    #[error(
        "admission: {asked} MiB asked (guest plus {OVERHEAD_MIB} MiB overhead), {used} of {limit} MiB in use \
         (host memory x --memory-overcommit)"
    )]
    Memory {
        /// Asked for.
        asked: u64,
        /// In use.
        used: u64,
        /// The limit.
        limit: u64,
    },
    /// Too many Exec streams in all.
    #[error("admission: {limit} Exec streams are open (--max-exec-streams)")]
    ExecStreams {
        /// The limit.
        limit: u32,
    },
    /// Too many Exec streams into this sandbox.
    #[error("admission: {limit} Exec streams are open into this sandbox (--max-exec-per-sandbox)")]
    ExecPerSandbox {
        /// The limit.
        limit: u32,
    },
}

/// Whether a sandbox of `shape` fits beside `used`.
///
/// # Errors
/// The first limit it would pass.
pub fn admit(used: Usage, limits: &Limits, shape: SandboxShape) -> Result<(), Refused> {
    if used.sandboxes >= limits.sandboxes {
        return Err(Refused::Sandboxes { limit: limits.sandboxes });
    }
    let asked = u64::from(shape.cpus());
    if used.vcpus + asked > limits.vcpus {
        return Err(Refused::Vcpus { asked, used: used.vcpus, limit: limits.vcpus });
    }
    let asked = cost_mib(shape);
    if used.memory_mib + asked > limits.memory_mib {
        return Err(Refused::Memory { asked, used: used.memory_mib, limit: limits.memory_mib });
    }
    Ok(())
}

/// The Exec streams open, per sandbox and in all.
#[derive(Debug)]
pub struct ExecStreams {
    limits: Limits,
    open: Mutex<(u32, HashMap<SandboxId, u32>)>,
}

/// One open Exec stream; dropping it closes its share.
#[derive(Debug)]
pub struct ExecPermit {
    streams: Arc<ExecStreams>,
    id: SandboxId,
}

impl ExecStreams {
    /// No stream open yet.
    pub fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Self { limits, open: Mutex::new((0, HashMap::new())) })
    }

    /// Streams open in all.
    pub fn open(&self) -> u32 {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// Opens one more stream into `id`.
    ///
    /// # Errors
    /// [`Refused::ExecStreams`] or [`Refused::ExecPerSandbox`].
    pub fn acquire(self: &Arc<Self>, id: &SandboxId) -> Result<ExecPermit, Refused> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.0 >= self.limits.exec_streams {
            return Err(Refused::ExecStreams { limit: self.limits.exec_streams });
        }
        let here = open.1.entry(id.clone()).or_insert(0);
        if *here >= self.limits.exec_per_sandbox {
            return Err(Refused::ExecPerSandbox { limit: self.limits.exec_per_sandbox });
        }
        *here += 1;
        open.0 += 1;
        Ok(ExecPermit { streams: Arc::clone(self), id: id.clone() })
    }
}

impl Drop for ExecPermit {
    fn drop(&mut self) {
        let mut open = self.streams.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.0 = open.0.saturating_sub(1);
        if let Some(here) = open.1.get_mut(&self.id) {
            *here = here.saturating_sub(1);
            if *here == 0 {
                open.1.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(cpus: u32, mib: u32) -> SandboxShape {
        SandboxShape::new(cpus, mib).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn each_limit_refuses_by_name() {
        let config =
            AdmissionConfig { max_sandboxes: 3, cpu_overcommit: 2.0, memory_overcommit: 0.5, ..Default::default() };
        let limits = Limits::new(&config, 2, 2048);
        assert_eq!(limits.vcpus, 4);
        assert_eq!(limits.memory_mib, 1024);
        let mut used = Usage::default();
        assert_eq!(admit(used, &limits, shape(1, 128)), Ok(()));
        used.add(shape(1, 512));
        assert!(matches!(
            admit(used, &limits, shape(1, 512)),
            Err(Refused::Memory { asked: 608, used: 608, limit: 1024 })
        ));
        assert!(matches!(admit(used, &limits, shape(4, 128)), Err(Refused::Vcpus { asked: 4, used: 1, limit: 4 })));
        used.add(shape(1, 64));
        used.add(shape(1, 64));
        assert!(matches!(admit(used, &limits, shape(1, 64)), Err(Refused::Sandboxes { limit: 3 })));
    }

    #[test]
    fn exec_permits_count_per_sandbox_and_in_all_and_give_back_on_drop() {
        let config = AdmissionConfig { max_exec_streams: 3, max_exec_per_sandbox: 2, ..Default::default() };
        let streams = ExecStreams::new(Limits::new(&config, 1, 1024));
        let (a, b) = (
            SandboxId::parse("a").unwrap_or_else(|e| panic!("{e}")),
            SandboxId::parse("b").unwrap_or_else(|e| panic!("{e}")),
        );
        let first = streams.acquire(&a);
        let _second = streams.acquire(&a);
        assert!(matches!(streams.acquire(&a), Err(Refused::ExecPerSandbox { limit: 2 })));
        let _third = streams.acquire(&b);
        assert!(matches!(streams.acquire(&b), Err(Refused::ExecStreams { limit: 3 })));
        drop(first);
        assert_eq!(streams.open(), 2);
        assert!(streams.acquire(&b).is_ok());
    }
}

//! What a task's VM costs its host, as containerd's `Stats` reports it: cgroup v1 `Metrics` (what `ctr task
//! metrics` and the CRI's container stats read) holding the VMM's CPU time (every thread, user and kernel)
//! and resident memory. The VMM is the whole VM to the node: the guest's own accounting of its processes is
//! the guest's, and nothing the guest says is read here.

use std::path::Path;

use containerd_shim::protos::cgroups::metrics::{CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics};
use vm_contract::pids::{ProcessRecord, SandboxPids};

/// The metrics of the VMM recorded in `sandbox_dir`, or `None` when it is not running.
pub fn vmm_metrics(sandbox_dir: &Path) -> Option<Metrics> {
    let vmm = SandboxPids::read(sandbox_dir)?.vmm?;
    let usage = Usage::of(&vmm)?;
    let mut cpu = CPUUsage::new();
    cpu.set_user(usage.user_ns);
    cpu.set_kernel(usage.kernel_ns);
    cpu.set_total(usage.user_ns.saturating_add(usage.kernel_ns));
    let mut cpu_stat = CPUStat::new();
    cpu_stat.set_usage(cpu);
    let mut memory = MemoryEntry::new();
    memory.set_usage(usage.rss_bytes);
    let mut memory_stat = MemoryStat::new();
    memory_stat.set_usage(memory);
    memory_stat.set_rss(usage.rss_bytes);
    let mut metrics = Metrics::new();
    metrics.set_cpu(cpu_stat);
    metrics.set_memory(memory_stat);
    Some(metrics)
}

/// One process's use, from `/proc`.
#[derive(Debug, PartialEq, Eq)]
struct Usage {
    user_ns: u64,
    kernel_ns: u64,
    rss_bytes: u64,
}

impl Usage {
    /// `record`'s use, `None` when it is gone (or its pid now names another process).
    fn of(record: &ProcessRecord) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", record.pid)).ok()?;
        let status = std::fs::read_to_string(format!("/proc/{}/status", record.pid)).ok()?;
        // Checked after the reads: what was read is of that very process.
        if !record.is_alive() {
            return None;
        }
        let (user, kernel) = cpu_ticks(&stat)?;
        let ns_per_tick = 1_000_000_000 / rustix::param::clock_ticks_per_second().max(1);
        Some(Self {
            user_ns: user.saturating_mul(ns_per_tick),
            kernel_ns: kernel.saturating_mul(ns_per_tick),
            rss_bytes: rss_bytes(&status)?,
        })
    }
}

/// `utime` and `stime` (fields 14 and 15 of `/proc/PID/stat`), in clock ticks. The name (field 2) may hold
/// spaces and parentheses: the fields are counted from its last `)`.
fn cpu_ticks(stat: &str) -> Option<(u64, u64)> {
    let mut after_name = stat.rsplit_once(')')?.1.split_whitespace();
    // After the name come the state (field 3) and ten more before utime.
    let user = after_name.nth(11)?.parse().ok()?;
    let kernel = after_name.next()?.parse().ok()?;
    Some((user, kernel))
}

/// `VmRSS` of `/proc/PID/status`, in bytes.
fn rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use super::*;

    #[test]
    fn fields_are_counted_from_the_names_last_parenthesis() {
        let stat = "42 (a ) b (c)) S 1 42 42 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 3 0 1000 1 1";
        assert_eq!(cpu_ticks(stat), Some((250, 75)));
        assert_eq!(cpu_ticks("42 (x) S 1"), None);
        assert_eq!(cpu_ticks("no parenthesis"), None);
        assert_eq!(rss_bytes("Name:\tx\nVmRSS:\t  2048 kB\nThreads:\t3\n"), Some(2 << 20));
        assert_eq!(rss_bytes("Name:\tx\n"), None);
    }

    #[test]
    fn a_running_vmm_is_measured_and_a_gone_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let me = ProcessRecord::current().unwrap();
        // Some CPU time of our own to be measured.
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(30) {}
        SandboxPids { supervisor: me, vmm: Some(me), watchdog: None }.write(dir.path()).unwrap();
        let metrics = vmm_metrics(dir.path()).unwrap();
        assert!(metrics.cpu.usage.total > 0 && metrics.memory.usage.usage > 0, "{metrics:?}");
        // The same pid with another start time is another process: not measured.
        let other = ProcessRecord { start_time: me.start_time + 1, ..me };
        SandboxPids { supervisor: me, vmm: Some(other), watchdog: None }.write(dir.path()).unwrap();
        assert!(vmm_metrics(dir.path()).is_none());
        assert!(vmm_metrics(&dir.path().join("none")).is_none(), "no pids file");
    }
}

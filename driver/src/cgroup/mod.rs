//! One cgroup v2 per sandbox, where the host allows it, with `cgroup.kill` as the final sweep.
//!
//! The driver creates `<cgroup2 mount>/vm-driver/<sandbox id>-<random>` and tells the supervisor, which
//! moves itself in before it starts anything: QEMU and the watchdog inherit it. After a stop, or when
//! reaping an orphan, the driver writes `1` to `cgroup.kill`, waits for `populated 0` and removes it.
//! The mount point is read from `/proc/self/mountinfo` (`/sys/fs/cgroup` on pure cgroup v2 hosts,
//! `/sys/fs/cgroup/unified` on hybrid ones).

pub mod limits;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::{Duration, Instant};

use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxFile;

/// How long the sweep waits for the cgroup to empty.
const SWEEP_WAIT_MS: u64 = 2_000;

/// The cgroup v2 mount point, if any.
pub fn mount_point() -> Option<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        // ... mount-point ... - fstype source options
        let (left, right) = line.split_once(" - ")?;
        let mount = left.split(' ').nth(4)?;
        (right.split(' ').next()? == "cgroup2").then(|| PathBuf::from(mount))
    })
}

/// Creates the sandbox's cgroup, or says once why there is none and returns `None`.
pub fn create(id: &SandboxId, sandbox_dir: &Path) -> Option<PathBuf> {
    let result = (|| {
        let mount = mount_point().ok_or("no cgroup v2 mount")?;
        let parent = mount.join("vm-driver");
        fs::create_dir_all(&parent).map_err(|_| "cgroup v2 is not writable")?;
        let suffix = crate::state::random_hex::<4>().map_err(|_| "no randomness")?;
        let cgroup = parent.join(format!("{id}-{suffix}"));
        fs::create_dir(&cgroup).map_err(|_| "cgroup v2 is not writable")?;
        fs::write(sandbox_dir.join(SandboxFile::Cgroup.name()), cgroup.as_os_str().as_encoded_bytes())
            .map_err(|_| "cannot record the cgroup")?;
        Ok::<_, &str>(cgroup)
    })();
    match result {
        Ok(cgroup) => Some(cgroup),
        Err(why) => {
            static SAID: Once = Once::new();
            SAID.call_once(|| eprintln!("vm-driver: {why}; sandboxes run without a cgroup sweep"));
            None
        }
    }
}

/// The cgroup recorded in a sandbox directory.
pub fn recorded(sandbox_dir: &Path) -> Option<PathBuf> {
    let text = fs::read_to_string(sandbox_dir.join(SandboxFile::Cgroup.name())).ok()?;
    let path = PathBuf::from(text.trim());
    // Only ever sweep what this driver created.
    (path.parent()?.file_name()? == "vm-driver").then_some(path)
}

/// Kills everything left in `cgroup`, waits for it to empty and removes it (but under the `no-cgroup-sweep`
/// control). Returns whether anything was still running.
pub fn sweep(cgroup: &Path, controls: crate::controls::Reaper) -> bool {
    if controls.no_cgroup_sweep {
        return false;
    }
    let populated = || fs::read_to_string(cgroup.join("cgroup.events")).is_ok_and(|e| e.contains("populated 1"));
    let found = populated();
    if found {
        // Before Linux 5.14 there is no `cgroup.kill`: then kill each process it lists, until it is empty.
        let killer = fs::write(cgroup.join("cgroup.kill"), b"1").is_ok();
        let deadline = Instant::now() + Duration::from_millis(SWEEP_WAIT_MS);
        while populated() && Instant::now() < deadline {
            if !killer {
                kill_listed(cgroup);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let _ = fs::remove_dir(cgroup);
    found
}

fn kill_listed(cgroup: &Path) {
    let procs = fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|l| l.trim().parse().ok()).filter_map(rustix::process::Pid::from_raw) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_cgroup2_mount_or_none() {
        // Every Linux host here has one; the point is that parsing never panics and names a directory.
        if let Some(mount) = mount_point() {
            assert!(mount.is_dir(), "{}", mount.display());
        }
    }

    #[test]
    fn only_sweeps_cgroups_it_created() {
        let dir = std::env::temp_dir().join(format!("cg-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(SandboxFile::Cgroup.name()), "/sys/fs/cgroup/user.slice").unwrap();
        assert_eq!(recorded(&dir), None);
        fs::write(dir.join(SandboxFile::Cgroup.name()), "/sys/fs/cgroup/vm-driver/x-1234").unwrap();
        assert_eq!(recorded(&dir), Some(PathBuf::from("/sys/fs/cgroup/vm-driver/x-1234")));
        fs::remove_dir_all(&dir).unwrap();
    }
}

//! Observing processes from the outside, through `/proc` only.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::wait_until;

/// A process seen by the watcher. `(pid, start_time)` names it even after the pid is reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`, in clock ticks since boot.
    pub start_time: u64,
    pub comm: String,
    pub cmdline: Vec<String>,
}

impl ProcInfo {
    /// Reads a live process.
    pub fn read(pid: i32) -> Option<Self> {
        let (comm, start_time) = stat(pid)?;
        let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmdline =
            raw.split(|b| *b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect();
        Some(Self { pid, start_time, comm, cmdline })
    }

    /// Whether this very process (same pid and start time) still exists and is not a zombie.
    pub fn is_alive(&self) -> bool {
        let Ok(text) = fs::read_to_string(format!("/proc/{}/stat", self.pid)) else {
            return false;
        };
        let Some((_, rest)) = text.rsplit_once(") ") else {
            return false;
        };
        let fields: Vec<&str> = rest.split(' ').collect();
        let same = fields.get(19).and_then(|s| s.parse::<u64>().ok()) == Some(self.start_time);
        same && fields.first() != Some(&"Z")
    }

    pub fn is_qemu(&self) -> bool {
        self.comm.starts_with("qemu-system")
    }

    pub fn is_watchdog(&self) -> bool {
        self.cmdline.first().is_some_and(|a| a.ends_with("vm-watchdog"))
    }

    pub fn is_supervisor(&self) -> bool {
        self.cmdline.first().is_some_and(|a| a.ends_with("vm-supervisor"))
    }

    /// The accelerator after `-accel` on a QEMU command line (`tcg` of `tcg,tb-size=32`).
    pub fn accel(&self) -> Option<String> {
        let at = self.cmdline.iter().position(|a| a == "-accel")?;
        self.cmdline.get(at + 1).and_then(|a| a.split(',').next()).map(str::to_owned)
    }
}

/// Whether `p` exits within `limit` (polled from /proc).
pub fn gone_within(p: &ProcInfo, limit: Duration) -> bool {
    wait_until(limit, || !p.is_alive())
}

/// Whether `p` stays alive for all of `span`.
pub fn survives(p: &ProcInfo, span: Duration) -> bool {
    !wait_until(span, || !p.is_alive())
}

/// `(comm, start_time)` from `/proc/<pid>/stat`.
pub fn stat(pid: i32) -> Option<(String, u64)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = text.find('(')?;
    let (head, rest) = text.rsplit_once(") ")?;
    let comm = head.get(open + 1..)?.to_owned();
    let fields: Vec<&str> = rest.split(' ').collect();
    Some((comm, fields.get(19)?.parse().ok()?))
}

/// Every pid whose working directory or command line is inside `dir`, and their children (a jailed VMM
/// shows neither: its root and working directory are its jail).
pub fn inside(dir: &Path) -> Vec<ProcInfo> {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let all: Vec<(ProcInfo, Option<i32>, bool)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != std::process::id() as i32)
        .filter_map(|pid| {
            let cwd: Option<PathBuf> = fs::read_link(format!("/proc/{pid}/cwd")).ok();
            let info = ProcInfo::read(pid)?;
            let by_cwd = cwd.is_some_and(|c| c.starts_with(dir));
            let by_args = info.cmdline.iter().any(|a| a.contains(&needle));
            Some((info, parent(pid), by_cwd || by_args))
        })
        .collect();
    let matched: Vec<i32> = all.iter().filter(|(_, _, m)| *m).map(|(p, _, _)| p.pid).collect();
    all.into_iter()
        .filter(|(_, ppid, m)| *m || ppid.is_some_and(|pp| matched.contains(&pp)))
        .map(|(p, _, _)| p)
        .collect()
}

/// The parent pid, from `/proc/<pid>/stat`; `None` once it is gone.
pub fn parent(pid: i32) -> Option<i32> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    text.rsplit_once(") ")?.1.split(' ').nth(1)?.parse().ok()
}

/// Polls `/proc` and remembers every process found inside a directory: every 10 ms for the first
/// seconds, where the short-lived helpers of a start come and go, then every 100 ms, so that a long test's
/// watcher does not take a core of the machine whose load it measures. Stopping takes one last look.
#[derive(Debug)]
pub struct Watcher {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<ProcInfo>>>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    pub fn start(dir: &Path) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::<ProcInfo>::new()));
        let (dir, stop2, seen2) = (dir.to_owned(), Arc::clone(&stop), Arc::clone(&seen));
        let thread = thread::spawn(move || {
            let started = std::time::Instant::now();
            loop {
                let last = stop2.load(Ordering::Acquire);
                let found = inside(&dir);
                let mut seen = seen2.lock().unwrap_or_else(|e| e.into_inner());
                for p in found {
                    // exec keeps pid and start time: a fork caught before its exec is updated, not duplicated.
                    // A zombie's cmdline reads empty: keep what was seen while it ran.
                    match seen.iter_mut().find(|s| s.pid == p.pid && s.start_time == p.start_time) {
                        Some(known) if !p.cmdline.is_empty() => *known = p,
                        Some(_) => {}
                        None => seen.push(p),
                    }
                }
                drop(seen);
                if last {
                    return;
                }
                let fast = started.elapsed() < Duration::from_secs(5);
                thread::sleep(Duration::from_millis(if fast { 10 } else { 100 }));
            }
        });
        Self { stop, seen, thread: Some(thread) }
    }

    /// What has been seen so far.
    pub fn seen(&self) -> Vec<ProcInfo> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn stop(mut self) -> Vec<ProcInfo> {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.seen()
    }

    /// Stops watching and SIGKILLs whatever it saw that still runs: a test's cleanup, pass or fail.
    pub fn kill_survivors(self) {
        for p in self.stop() {
            if p.is_alive() {
                signal(p.pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

/// The CPU time `pid` used, user and system, in clock ticks (`rustix::param::clock_ticks_per_second`);
/// `None` once it is gone.
pub fn cpu_ticks(pid: i32) -> Option<u64> {
    stat_ticks(&format!("/proc/{pid}/stat"))
}

/// The same for thread `tid` of `pid` alone.
pub fn thread_cpu_ticks(pid: i32, tid: i32) -> Option<u64> {
    stat_ticks(&format!("/proc/{pid}/task/{tid}/stat"))
}

fn stat_ticks(path: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    let fields: Vec<&str> = text.rsplit_once(") ")?.1.split(' ').collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// A memory figure of a process from `/proc/<pid>/status` (`VmRSS`, `VmHWM`), in KiB; `None` once it is gone.
pub fn status_kib(pid: i32, field: &str) -> Option<u64> {
    kib_field(&format!("/proc/{pid}/status"), field)
}

/// What `pid` holds that no other process does, in KiB: `Private_Clean + Private_Dirty` of its
/// `smaps_rollup` (a clone's clean pages of a template it shares are not in it, as they are in RSS).
pub fn unique_kib(pid: i32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    Some(
        text.lines()
            .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum(),
    )
}

/// A figure of the host's from `/proc/meminfo` (`MemTotal`), in KiB.
pub fn meminfo_kib(field: &str) -> Option<u64> {
    kib_field("/proc/meminfo", field)
}

fn kib_field(path: &str, field: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The peak resident memory of the supervisors inside a scratch directory whose command line contains a
/// needle: the largest `VmHWM` (the kernel's own high-water mark, so no peak falls between two samples but
/// the last), sampled every 100 ms until stopped.
#[derive(Debug)]
pub struct PeakRss {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<u64>>,
}

impl PeakRss {
    pub fn supervisors(dir: &Path, needle: &str) -> Self {
        let (dir, needle) = (dir.to_owned(), needle.to_owned());
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = thread::spawn(move || {
            let mut peak = 0;
            loop {
                let done = flag.load(Ordering::Acquire);
                for p in inside(&dir) {
                    if p.is_supervisor() && p.cmdline.iter().any(|a| a.contains(&needle)) {
                        peak = status_kib(p.pid, "VmHWM").map_or(peak, |kib| peak.max(kib));
                    }
                }
                if done {
                    return peak;
                }
                thread::sleep(Duration::from_millis(100));
            }
        });
        Self { stop, thread: Some(thread) }
    }

    /// The peak so far, in KiB.
    pub fn peak(mut self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.thread.take().map_or(0, |t| t.join().unwrap_or(0))
    }
}

impl Drop for PeakRss {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// A child process killed (and reaped) when dropped: a server or client a test starts beside its sandbox.
#[derive(Debug)]
pub struct Killed(pub std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends `signal` to `pid`, ignoring a process that is already gone.
pub fn signal(pid: i32, signal: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
}

/// `(inode, flags)` of every pipe descriptor `pid` holds, from `/proc/<pid>/fd` and `fdinfo`.
pub fn pipe_fds(pid: i32) -> Vec<(u64, u32)> {
    let Ok(entries) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let target = fs::read_link(e.path()).ok()?.to_string_lossy().into_owned();
            let inode = target.strip_prefix("pipe:[")?.strip_suffix(']')?.parse().ok()?;
            let info = fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", e.file_name().to_string_lossy())).ok()?;
            let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?.trim();
            Some((inode, u32::from_str_radix(flags, 8).ok()?))
        })
        .collect()
}

/// The pipe inode behind `pid`'s stdin.
pub fn stdin_pipe(pid: i32) -> Option<u64> {
    let target = fs::read_link(format!("/proc/{pid}/fd/0")).ok()?.to_string_lossy().into_owned();
    target.strip_prefix("pipe:[")?.strip_suffix(']')?.parse().ok()
}

/// Times how long a process outlives a fault, from the kernel's exit notice rather than a `/proc` poll.
///
/// The pidfd is opened before the fault, so the pid cannot be reused under it, and the wait runs on a
/// thread raised to nice −10 (when the test may), so that on a loaded host the figure is the sandbox's
/// delay and not the observer's own scheduling gap. Returns `None` if `p` is still alive after `limit`.
pub fn exit_after(p: &ProcInfo, limit: Duration, fault: impl FnOnce() + Send) -> Option<Duration> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    use rustix::process::{pidfd_open, Pid, PidfdFlags};
    thread::scope(|scope| {
        scope
            .spawn(|| {
                let raised = rustix::process::setpriority_process(None, -10).is_ok();
                let pidfd = Pid::from_raw(p.pid).and_then(|pid| pidfd_open(pid, PidfdFlags::empty()).ok());
                let pidfd = pidfd.filter(|_| p.is_alive()).expect("the process to time is running");
                let start = std::time::Instant::now();
                fault();
                loop {
                    let left = limit.checked_sub(start.elapsed())?;
                    let timeout = Timespec::try_from(left).ok()?;
                    let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
                    if poll(&mut fds, Some(&timeout)).is_ok_and(|n| n > 0) {
                        let took = start.elapsed();
                        if !raised {
                            eprintln!("e2e: (the exit clock ran at normal priority: not allowed to raise it)");
                        }
                        return Some(took);
                    }
                }
            })
            .join()
            .unwrap_or(None)
    })
}

//! A test's scratch directory and its deadline.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use crate::exclusive::{self, Share};
use crate::procs;

/// A per-test scratch directory, removed when the test passes and kept (and printed) when it fails; the
/// test's deadline; and its share of the machine ([`exclusive`]).
///
/// No end-to-end test may hang the suite: when the deadline passes, the test's processes (everything whose
/// working directory or command line is inside the scratch directory: driver, supervisor, watchdog, VMM)
/// are killed, which ends whatever the test waits on, and the test fails saying what it was waiting for. A
/// test still stuck a minute later ends the test binary, and with it the other tests of its area.
///
/// The directory is `$TMPDIR/e2e-NAME-PID`: the tests of one binary share the pid, so two of them never use
/// the same name at once (the second panics).
#[derive(Debug)]
pub struct Scratch {
    pub dir: PathBuf,
    name: String,
    deadline: Arc<(Mutex<Progress>, Condvar)>,
    _share: Share,
}

#[derive(Debug)]
struct Progress {
    done: bool,
    expired: bool,
    waiting_for: String,
}

/// The deadline of a test that does not choose its own.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(240);

/// The names of the scratch directories alive in this process.
static IN_USE: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl Scratch {
    pub fn new(name: &str) -> Self {
        Self::with_deadline(name, DEFAULT_DEADLINE)
    }

    /// # Panics
    ///
    /// If another test of this process holds a scratch directory of the same name.
    pub fn with_deadline(name: &str, limit: Duration) -> Self {
        // Before the deadline starts: waiting for a test that runs alone is not this test's time.
        let share = exclusive::share();
        {
            let mut in_use = IN_USE.lock().unwrap_or_else(PoisonError::into_inner);
            assert!(!in_use.iter().any(|n| n == name), "two tests of this binary use the scratch name {name:?}");
            in_use.push(name.to_owned());
        }
        // Short, so socket paths stay well inside sun_path.
        let dir = std::env::temp_dir().join(format!("e2e-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let progress = Progress { done: false, expired: false, waiting_for: "the test to start".into() };
        let deadline = Arc::new((Mutex::new(progress), Condvar::new()));
        let (watched, test, scratch) = (Arc::clone(&deadline), name.to_owned(), dir.clone());
        std::thread::spawn(move || enforce(&watched, &test, &scratch, limit));
        Self { dir, name: name.to_owned(), deadline, _share: share }
    }

    /// The state directory to pass to the driver.
    pub fn state(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The directory of sandbox `id` in [`Self::state`].
    pub fn sandbox(&self, id: &str) -> PathBuf {
        self.state().join("sandboxes").join(id)
    }

    /// The one sandbox directory the driver kept in [`Self::state`].
    ///
    /// # Panics
    ///
    /// If there is none, or more than one.
    pub fn only_sandbox(&self) -> PathBuf {
        let sandboxes = self.state().join("sandboxes");
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(&sandboxes)
            .unwrap_or_else(|e| panic!("{}: {e}", sandboxes.display()))
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(dirs.len(), 1, "one sandbox directory: {dirs:?}");
        dirs.remove(0)
    }

    /// Records what the test waits for now, for the deadline's report.
    pub fn waiting_for(&self, what: &str) {
        let mut p = self.deadline.0.lock().unwrap_or_else(PoisonError::into_inner);
        what.clone_into(&mut p.waiting_for);
    }

    /// Whether the deadline passed (its processes were killed).
    pub fn expired(&self) -> bool {
        self.deadline.0.lock().unwrap_or_else(PoisonError::into_inner).expired
    }
}

fn enforce(deadline: &(Mutex<Progress>, Condvar), test: &str, dir: &Path, limit: Duration) {
    let (lock, cvar) = deadline;
    let guard = lock.lock().unwrap_or_else(PoisonError::into_inner);
    let (mut progress, timeout) =
        cvar.wait_timeout_while(guard, limit, |p| !p.done).unwrap_or_else(PoisonError::into_inner);
    if !timeout.timed_out() {
        return;
    }
    progress.expired = true;
    eprintln!(
        "e2e: DEADLINE: {test} did not finish within {} s; it was waiting for {}; killing its processes",
        limit.as_secs(),
        progress.waiting_for
    );
    drop(progress);
    for _ in 0..50 {
        for p in procs::inside(dir) {
            procs::signal(p.pid, nix::sys::signal::Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let guard = lock.lock().unwrap_or_else(PoisonError::into_inner);
    let (guard, stuck) =
        cvar.wait_timeout_while(guard, Duration::from_secs(60), |p| !p.done).unwrap_or_else(PoisonError::into_inner);
    drop(guard);
    if stuck.timed_out() {
        eprintln!("e2e: DEADLINE: {test} is still stuck a minute after its processes were killed; ending the run");
        std::process::exit(101);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let expired = {
            let mut p = self.deadline.0.lock().unwrap_or_else(PoisonError::into_inner);
            p.done = true;
            p.expired
        };
        self.deadline.1.notify_all();
        IN_USE.lock().unwrap_or_else(PoisonError::into_inner).retain(|n| *n != self.name);
        if std::thread::panicking() || expired {
            eprintln!("e2e: kept {} for inspection (console.log, vmm.log, supervisor.log)", self.dir.display());
            assert!(!expired || std::thread::panicking(), "the test passed its deadline");
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

//! A `vm-supervisor` started by the test itself, without a driver.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use vm_contract::descriptor::{LaunchDescriptor, MicrovmPayload};

use crate::procs::{self, Watcher};
use crate::{harness, Scratch};

/// A `vm-supervisor` started by the test itself (no driver), with `stderr` as given: for testing the
/// supervisor's own behaviour, such as its console writer against a stderr nobody reads.
#[derive(Debug)]
pub struct DirectSupervisor {
    pub child: std::process::Child,
    pub status: std::io::BufReader<std::process::ChildStdout>,
    pub sandbox_dir: PathBuf,
    watcher: Option<Watcher>,
}

impl DirectSupervisor {
    /// Starts it in a fresh 0700 sandbox directory under `scratch` and waits for its `ready` line.
    pub fn start(scratch: &Scratch, stderr: Stdio) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let h = harness();
        let dir = scratch.dir.join("direct");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        // What the driver writes at every start, for the supervisor's startup admission.
        let payload = MicrovmPayload { sandbox_id: "direct".into(), session_id: None, generation: 0 };
        LaunchDescriptor::microvm(&payload).write(&dir).unwrap();
        let watcher = Watcher::start(&scratch.dir);
        let mut child = Command::new(&h.shipped.supervisor)
            .args(["--sandbox-id", "direct", "--sandbox-dir"])
            .arg(&dir)
            .arg("--kernel")
            .arg(h.image.join("vmlinuz"))
            .arg("--initrd")
            .arg(h.image.join("initramfs.cpio"))
            .args(["--accel", &h.accel])
            // No driver claims a uid here: the VMM runs unconfined (the supervisor's events say so).
            .args(["--confinement", "none"])
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("cannot start vm-supervisor");
        let mut status = std::io::BufReader::new(child.stdout.take().unwrap());
        scratch.waiting_for("the directly started supervisor to report ready");
        loop {
            let mut line = String::new();
            assert!(std::io::BufRead::read_line(&mut status, &mut line).unwrap() > 0, "supervisor exited before ready");
            if line.contains("\"status\":\"ready\"") {
                break;
            }
            assert!(!line.contains("\"status\":\"failed\""), "{line}");
        }
        Self { child, status, sandbox_dir: dir, watcher: Some(watcher) }
    }

    /// SIGTERM, then its remaining status lines (the last is `stopped`) and its exit status.
    pub fn stop(&mut self) -> (Vec<String>, std::process::ExitStatus) {
        procs::signal(i32::try_from(self.child.id()).unwrap(), nix::sys::signal::Signal::SIGTERM);
        let lines: Vec<String> = std::io::BufRead::lines(&mut self.status).map_while(Result::ok).collect();
        (lines, self.child.wait().unwrap())
    }
}

impl Drop for DirectSupervisor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(w) = self.watcher.take() {
            w.kill_survivors();
        }
    }
}

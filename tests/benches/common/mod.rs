//! Baselines shared by the benchmarks: QEMU booting the same kernel and image exactly as the supervisor
//! starts it, but with a shell script as PID 1 instead of the agent, and no supervisor or protocol.
#![allow(dead_code, reason = "each benchmark uses part of this module")]

pub mod api;
mod report;
pub mod served;
#[allow(unused_imports, reason = "each benchmark uses part of this module")]
pub use report::{median, percentile, Report};
#[allow(unused_imports, reason = "each benchmark uses part of this module")]
pub use vm_test_support::image::CHANNEL_UP;

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vm_contract::jail::Confinement;
use vm_contract::layout::SandboxFile;

use vm_contract::accel::Accelerator;
use vm_contract::args::PROBE_ACCEL;
use vm_contract::shape::SandboxShape;
use vm_contract::status::SupervisorStatus;
use vm_supervisor::boot::vmm::VmmConfig;
use vm_test_support::image::with_init_script;
use vm_test_support::{harness, Scratch};

/// A guest that brings the channel up, writes one byte on it and powers off: a bare boot timed to the point
/// where our agent says hello.
pub fn channel_up_then_one_byte() -> String {
    format!("{CHANNEL_UP}\n/bin/busybox printf r > /dev/vport0p1\n/bin/busybox reboot -f")
}

/// A bare QEMU and the host end of its channel.
pub struct BareVm {
    pub qemu: Child,
    pub conn: UnixStream,
    pub started: Instant,
}

impl BareVm {
    /// Boots a guest whose PID 1 is `init` (a busybox shell script) in `scratch/bare`.
    pub fn boot(scratch: &Scratch, init: &str) -> Self {
        Self::boot_with(scratch, init, |args| args)
    }

    /// As [`Self::boot`], with QEMU's arguments passed through `edit` first.
    pub fn boot_with(scratch: &Scratch, init: &str, edit: impl FnOnce(Vec<OsString>) -> Vec<OsString>) -> Self {
        let dir = scratch.dir.join("bare");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let initrd = with_init_script(&dir, init);
        let listener = UnixListener::bind(dir.join(SandboxFile::Channel.name())).unwrap();
        // QEMU connects to the console socket as the supervisor's would be: take it and drain it.
        let console = UnixListener::bind(dir.join(SandboxFile::ConsoleSocket.name())).unwrap();
        std::thread::spawn(move || {
            if let Ok((mut conn, _)) = console.accept() {
                let _ = std::io::copy(&mut conn, &mut std::io::sink());
            }
        });
        // What ours resolves to, so both sides of every ratio run on the same accelerator.
        let accel = match resolved_accel().as_str() {
            "kvm" => Accelerator::Kvm,
            _ => Accelerator::Tcg,
        };
        // Bare: QEMU started directly, unconfined, with host paths.
        let config = VmmConfig {
            jailer: std::path::PathBuf::new(),
            confinement: Confinement::None,
            ids: None,
            root: dir.clone(),
            cgroups: Vec::new(),
            qemu: vm_supervisor::boot::vmm::find_on_path("qemu-system-x86_64").expect("qemu-system-x86_64"),
            kernel: harness().image.join("vmlinuz"),
            initrd,
            shape: SandboxShape::default(),
            accel,
            monitor: false,
            incoming: None,
            defer_incoming: false,
            tsc_khz: vm_driver::tsc::khz(),
            disks: None,
            mounts: Vec::new(),
            tmpfs: Vec::new(),
            ram: None,
        };
        let started = Instant::now();
        let qemu = Command::new(&config.qemu)
            .args(edit(config.args()))
            .current_dir(&dir)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let (conn, _) = listener.accept().unwrap();
        Self { qemu, conn, started }
    }

    /// The time from QEMU's spawn to the first byte the guest writes on the channel: the point at which the
    /// agent would say hello. Then QEMU is killed.
    pub fn first_byte(mut self) -> Duration {
        self.wait_first_byte()
    }

    /// Waits for the first byte the guest writes on the channel, and leaves the VM running.
    pub fn wait_first_byte(&mut self) -> Duration {
        let mut byte = [0u8; 1];
        self.conn.read_exact(&mut byte).unwrap();
        self.started.elapsed()
    }

    /// Reads the channel to its end and waits for QEMU. Returns the wall time from spawn to exit, the bytes
    /// the guest wrote, and the span from the first byte to the last.
    pub fn drain(mut self) -> (Duration, usize, Option<Duration>) {
        let mut buf = vec![0u8; 1 << 16];
        let (mut total, mut first, mut last) = (0usize, None, None);
        loop {
            match self.conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    first.get_or_insert_with(Instant::now);
                    total += n;
                    last = Some(Instant::now());
                }
            }
        }
        self.qemu.wait().unwrap();
        (self.started.elapsed(), total, first.zip(last).map(|(f, l)| l - f))
    }
}

impl Drop for BareVm {
    fn drop(&mut self) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
    }
}

/// The accelerator the harness's setting resolves to on this host, as the supervisor decides it (asked
/// once).
pub fn resolved_accel() -> String {
    static ACCEL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ACCEL.get_or_init(probe_accel).clone()
}

fn probe_accel() -> String {
    let out =
        Command::new(&harness().shipped.supervisor).args([PROBE_ACCEL, &harness().accel]).env_clear().output().unwrap();
    match SupervisorStatus::from_line(&String::from_utf8_lossy(&out.stdout)) {
        Ok(SupervisorStatus::Accelerator { accel, .. }) => accel.as_str().to_owned(),
        _ => panic!("the accelerator probe failed"),
    }
}

/// `BENCH_RUNS`, default 10.
pub fn runs() -> usize {
    runs_or(10)
}

/// `BENCH_RUNS`, default `default`.
pub fn runs_or(default: usize) -> usize {
    std::env::var("BENCH_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Runs `cmd` (no stdin, stdout discarded), which must succeed: the time it took, in ms.
pub fn timed_ms(cmd: &mut Command) -> f64 {
    let started = Instant::now();
    let out = cmd.stdin(Stdio::null()).stdout(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    started.elapsed().as_secs_f64() * 1e3
}

/// `d` in ms.
pub fn ms(d: &Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

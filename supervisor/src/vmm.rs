//! The VMM: QEMU's `microvm` machine, started hardened.
//!
//! - A cleared environment; no network device; `-nodefaults -no-user-config`.
//! - `-sandbox on,...` (seccomp): no obsolete syscalls, no privilege changes, no `fork`/`exec`, no
//!   resource-control syscalls.
//! - The guest console goes to a socket and QEMU's own messages to a pipe, both read by the supervisor, which
//!   keeps them in `console.log` and `vmm.log` up to a cap (`crate::guest_logs`); neither reaches the user's
//!   terminal, and neither is a file QEMU could grow.
//! - The boundary channel is a virtio-serial port whose host side connects, as a client, to the
//!   supervisor's listening socket, so no guest byte can be written before we are attached.
//! - The VMM runs at a lower CPU priority (nice [`VMM_NICE`]) than the control plane (driver, supervisor,
//!   watchdog), through the `nice` utility so that every QEMU thread inherits it from the first instruction:
//!   on a busy host the leash is scheduled before the emulation it guards.
//! - Paths are relative to the sandbox directory (QEMU's working directory), which keeps Unix socket paths
//!   short whatever the state directory is.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::process::{Child, Command};
use vm_contract::accel::Accelerator;
use vm_contract::layout::SandboxFile;
use vm_contract::shape::SandboxShape;
use vm_protocol::CHANNEL_PORT_NAME;

/// QEMU's TCG translation cache, MiB: the largest part of an emulated VM's host memory beyond its guest's.
/// Measured in `docs/benchmarks.md` (density).
pub const TCG_TB_SIZE_MIB: u32 = 32;

/// The VMM's niceness: the data plane yields to the control plane.
pub const VMM_NICE: u8 = 10;

/// Kernel arguments for every boot: serial console, reboot (not hang) on panic or request, and no probing
/// of hardware microvm does not have.
const KERNEL_ARGS: &str = "console=ttyS0 reboot=t panic=-1 quiet 8250.nr_uarts=1 pci=off \
                           random.trust_cpu=on cryptomgr.notests";

/// Extra kernel arguments under TCG: without a TSC frequency and with timer checks on, the boot stalls at
/// "tsc: Marking TSC unstable"; mitigations only slow emulation down and protect nothing there.
const TCG_KERNEL_ARGS: &str = "tsc_early_khz=2000000 no_timer_check mitigations=off";

/// The seccomp policy QEMU runs under.
pub const SANDBOX_POLICY: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// Everything needed to start one VM.
#[derive(Debug, Clone)]
pub struct VmmConfig {
    /// The QEMU binary.
    pub qemu: PathBuf,
    /// The `nice` utility that starts it at [`VMM_NICE`], when the host has one.
    pub nice: Option<PathBuf>,
    /// Guest kernel.
    pub kernel: PathBuf,
    /// Guest initramfs.
    pub initrd: PathBuf,
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// Accelerator.
    pub accel: Accelerator,
}

impl VmmConfig {
    /// QEMU's argument vector.
    pub fn args(&self) -> Vec<OsString> {
        let mut kernel_args = String::from(KERNEL_ARGS);
        if self.accel == Accelerator::Tcg {
            kernel_args.push(' ');
            kernel_args.push_str(TCG_KERNEL_ARGS);
        }
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |items: &[&str]| args.extend(items.iter().map(OsString::from));
        push(&["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]);
        push(&["-M", "microvm,pit=on,pic=on,rtc=on"]);
        match self.accel {
            Accelerator::Kvm => push(&["-accel", "kvm", "-cpu", "host"]),
            // QEMU's default translation cache is 1 GiB, and a guest that runs long enough fills it.
            Accelerator::Tcg => push(&["-accel", &format!("tcg,tb-size={TCG_TB_SIZE_MIB}")]),
        }
        push(&["-smp", &self.shape.cpus().to_string(), "-m", &format!("{}M", self.shape.memory_mib())]);
        push(&["-sandbox", SANDBOX_POLICY]);
        push(&[
            "-chardev",
            &format!("socket,id=console,path={},server=off", SandboxFile::ConsoleSocket.name()),
            "-serial",
            "chardev:console",
        ]);
        push(&["-device", "virtio-serial-device"]);
        push(&["-chardev", &format!("socket,id=boundary,path={},server=off", SandboxFile::Channel.name())]);
        push(&["-device", &format!("virtserialport,chardev=boundary,name={CHANNEL_PORT_NAME}")]);
        push(&["-append", &kernel_args]);
        args.extend([OsString::from("-kernel"), self.kernel.clone().into_os_string()]);
        args.extend([OsString::from("-initrd"), self.initrd.clone().into_os_string()]);
        args
    }

    /// Starts QEMU in the current directory (the sandbox directory), with a cleared environment, stdin
    /// from /dev/null, stdout discarded and stderr on a pipe (the caller copies it into `vmm.log`).
    ///
    /// # Errors
    /// QEMU cannot be executed.
    pub fn spawn(&self) -> std::io::Result<Child> {
        if self.accel == Accelerator::Tcg {
            // Under TCG huge pages buy nothing, and cost a whole 2 MiB of host memory for every guest page
            // touched in it. The setting is this process's, and QEMU inherits it.
            let _ = rustix::thread::disable_transparent_huge_pages(true);
        }
        let mut command = match &self.nice {
            Some(nice) => {
                let mut c = Command::new(nice);
                c.arg("-n").arg(VMM_NICE.to_string()).arg(&self.qemu);
                c
            }
            None => Command::new(&self.qemu),
        };
        command
            .args(self.args())
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
    }
}

/// Finds `name` (`qemu-system-x86_64`, `nice`) on `PATH`.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(accel: Accelerator) -> VmmConfig {
        VmmConfig {
            qemu: "qemu".into(),
            nice: None,
            kernel: "/img/vmlinuz".into(),
            initrd: "/img/initramfs.cpio".into(),
            shape: SandboxShape::new(2, 512).unwrap(),
            accel,
        }
    }

    fn joined(accel: Accelerator) -> String {
        config(accel).args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn command_line_is_hardened() {
        let line = joined(Accelerator::Tcg);
        assert!(line.starts_with("-nodefaults -no-user-config"));
        assert!(line.contains(&format!("-sandbox {SANDBOX_POLICY}")));
        assert!(line.contains("-no-reboot"));
        assert!(!line.contains("-netdev") && !line.contains("-nic"), "no network device");
        assert!(line.contains("server=off"), "QEMU connects to our listening socket");
        assert!(line.contains("-smp 2 -m 512M"));
    }

    #[test]
    fn tcg_gets_its_boot_arguments_and_kvm_does_not() {
        assert!(joined(Accelerator::Tcg).contains("tsc_early_khz=2000000 no_timer_check"));
        assert!(joined(Accelerator::Tcg).contains(&format!("-accel tcg,tb-size={TCG_TB_SIZE_MIB}")));
        let kvm = joined(Accelerator::Kvm);
        assert!(kvm.contains("-accel kvm -cpu host"));
        assert!(!kvm.contains("mitigations=off"));
    }
}

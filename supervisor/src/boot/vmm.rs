//! The VMM: QEMU's `microvm` machine, started hardened.
//!
//! - A cleared environment; no network device; `-nodefaults -no-user-config`.
//! - `-sandbox on,...` (seccomp): no obsolete syscalls, no privilege changes, no `fork`/`exec`, no
//!   resource-control syscalls.
//! - The guest console goes to a socket and QEMU's own messages to a pipe, both read by the supervisor, which
//!   keeps them in `console.log` and `vmm.log` up to a cap (`super::guest_logs`); neither reaches the user's
//!   terminal, and neither is a file QEMU could grow.
//! - The boundary channel is a virtio-serial port whose host side connects, as a client, to the
//!   supervisor's listening socket, so no guest byte can be written before we are attached.
//! - QEMU is started by `vm-jailer` ([`vm_contract::jail`]), which confines itself (ids, namespaces, jail
//!   root, rlimits, no capabilities, no new privileges) and then forks it, staying as its parent.
//! - The VMM runs at a lower CPU priority (nice [`VMM_NICE`]) than the control plane (driver, supervisor,
//!   watchdog), set by the jailer so that every QEMU thread inherits it from the first instruction: on a
//!   busy host the leash is scheduled before the emulation it guards.
//! - An image root is two virtio-blk disks told apart by serial ([`vm_protocol::root`]): the image's,
//!   read-only, and the sandbox's writable layer, the only file QEMU may write (up to its size).
//! - Socket paths are relative to the VMM directory (QEMU's working directory, and its root when jailed),
//!   which keeps them short whatever the state directory is.

use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::Stdio;

use tokio::process::{Child, Command};
use vm_contract::accel::Accelerator;
use vm_contract::guest_ram::RamUse;
use vm_contract::jail::{
    Confinement, JailIds, JailerArgs, JAIL_IMAGE_DISK, JAIL_INITRD, JAIL_KERNEL, JAIL_WRITABLE_DISK,
};
use vm_contract::layout::SandboxFile;
use vm_contract::shape::SandboxShape;
use vm_protocol::mounts::{self, GuestMount};
use vm_protocol::root::{IMAGE_DISK_SERIAL, KERNEL_ARG as IMAGE_ROOT_ARG, WRITABLE_DISK_SERIAL};
use vm_protocol::tmpfs::{self, GuestTmpfs};
use vm_protocol::CHANNEL_PORT_NAME;

use super::disks::Disks;

/// QEMU's TCG translation cache, MiB: the largest part of an emulated VM's host memory beyond its guest's.
/// Measured in `docs/benchmarks.md` (density).
pub const TCG_TB_SIZE_MIB: u32 = 32;

/// The VMM's niceness: the data plane yields to the control plane.
pub const VMM_NICE: u8 = 10;

/// Kernel arguments for every boot: serial console, reboot (not hang) on panic or request, and no probing
/// of hardware microvm does not have.
const KERNEL_ARGS: &str = "console=ttyS0 reboot=t panic=-1 quiet 8250.nr_uarts=1 pci=off \
                           random.trust_cpu=on cryptomgr.notests";

/// Extra kernel arguments under TCG: without a TSC frequency (`tsc_early_khz`, [`VmmConfig::tsc_khz`]) and
/// with timer checks on, the boot stalls at "tsc: Marking TSC unstable"; mitigations only slow emulation
/// down and protect nothing there. QEMU's TSC follows the host's clock, so it is reliable: without saying
/// so, the clocksource watchdog on a loaded host compares it with the ticks the starved vCPU missed, marks
/// it unstable and falls back to jiffies, and the guest's clock then loses time.
const TCG_KERNEL_ARGS: &str = "no_timer_check tsc=reliable mitigations=off";

/// The TSC rate a TCG guest is told when the host's is not known.
pub const DEFAULT_TSC_KHZ: u32 = 2_000_000;

/// The seccomp policy QEMU runs under.
pub const SANDBOX_POLICY: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// Everything needed to start one VM.
#[derive(Debug, Clone)]
pub struct VmmConfig {
    /// The QEMU binary (absolute: the jail binds it at its own path).
    pub qemu: PathBuf,
    /// `vm-jailer`.
    pub jailer: PathBuf,
    /// How QEMU is confined.
    pub confinement: Confinement,
    /// `jail` confinement: its uid and gid.
    pub ids: Option<JailIds>,
    /// The VMM directory (absolute): QEMU's working directory and, when jailed, its root.
    pub root: PathBuf,
    /// The VMM's own cgroups (its limits), which the jailer joins.
    pub cgroups: Vec<PathBuf>,
    /// Guest kernel.
    pub kernel: PathBuf,
    /// Guest initramfs.
    pub initrd: PathBuf,
    /// vCPUs and memory.
    pub shape: SandboxShape,
    /// Accelerator.
    pub accel: Accelerator,
    /// Connect QEMU's monitor to [`SandboxFile::Monitor`]: only a VM that is to be saved, or restored from a
    /// template, has one.
    pub monitor: bool,
    /// Start from this migration stream instead of booting (the jailer opens it for QEMU).
    pub incoming: Option<PathBuf>,
    /// Start from a migration stream the monitor hands over (a template's clone, [`super::snapshot::restore_deferred`]).
    pub defer_incoming: bool,
    /// The host's TSC rate in kHz (TCG only), when known.
    pub tsc_khz: Option<u32>,
    /// An image root's disks; without them the guest keeps the initramfs as its root.
    pub disks: Option<Disks>,
    /// Host directories, one vhost-user-fs device each ([`super::shares`] serves them).
    pub mounts: Vec<GuestMount>,
    /// Memory file systems of the guest's own: only a kernel argument.
    pub tmpfs: Vec<GuestTmpfs>,
    /// The guest's RAM as the driver's memfd (a template saved or restored): the jailer reopens it from here.
    pub ram: Option<GuestRam>,
}

/// A guest RAM memfd this supervisor holds for its jailer to reopen ([`vm_contract::guest_ram`]).
#[derive(Debug, Clone)]
pub struct GuestRam {
    /// Open until the boot ends; the jailer reopens it through `/proc/<this process>/fd/N`.
    pub file: std::sync::Arc<std::fs::File>,
    /// Written through (saved) or mapped private (restored).
    pub usage: RamUse,
}

impl VmmConfig {
    /// QEMU's argument vector.
    pub fn args(&self) -> Vec<OsString> {
        let mut kernel_args = String::from(KERNEL_ARGS);
        if self.accel == Accelerator::Tcg {
            // TCG's TSC runs at the host's rate: told another, the guest's clock runs off by the ratio.
            let khz = self.tsc_khz.unwrap_or(DEFAULT_TSC_KHZ);
            kernel_args.push_str(&format!(" tsc_early_khz={khz} {TCG_KERNEL_ARGS}"));
        }
        if self.disks.is_some() {
            kernel_args.push(' ');
            kernel_args.push_str(IMAGE_ROOT_ARG);
        }
        for arg in [mounts::kernel_arg(&self.mounts), tmpfs::kernel_arg(&self.tmpfs)].into_iter().flatten() {
            kernel_args.push(' ');
            kernel_args.push_str(&arg);
        }
        let jailed = self.confinement.has_jail_root();
        let mut args: Vec<OsString> = Vec::new();
        let mut push = |items: &[&str]| args.extend(items.iter().map(OsString::from));
        push(&["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"]);
        if self.ram.is_some() {
            // The jailer adds the `mem` backend (the memfd's descriptor is its own).
            push(&["-M", "microvm,pit=on,pic=on,rtc=on,memory-backend=mem"]);
        } else if self.mounts.is_empty() {
            push(&["-M", "microvm,pit=on,pic=on,rtc=on"]);
        } else {
            // vhost-user needs guest memory the file servers can map, and virtio-mmio devices in modern
            // (version 2) mode: libvhost-user refuses legacy ones.
            push(&["-M", "microvm,pit=on,pic=on,rtc=on,memory-backend=mem"]);
            let size = format!("memory-backend-memfd,id=mem,size={}M,share=on", self.shape.memory_mib());
            push(&["-object", &size, "-global", "virtio-mmio.force-legacy=false"]);
        }
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
        if self.monitor {
            push(&["-chardev", &format!("socket,id=monitor,path={},server=off", SandboxFile::Monitor.name())]);
            push(&["-mon", "chardev=monitor,mode=control"]);
            // The stream then leaves out the run state (the VM is saved stopped), and a restore runs at once.
            push(&["-global", "migration.store-global-state=off"]);
        }
        if self.defer_incoming {
            // A template's clone: the monitor turns on `x-ignore-shared`, then hands over the saved state.
            push(&["-incoming", "defer"]);
        }
        if let Some(disks) = &self.disks {
            let (image, writable) = if jailed {
                (JAIL_IMAGE_DISK.to_owned(), JAIL_WRITABLE_DISK.to_owned())
            } else {
                (disks.image.display().to_string(), disks.writable.display().to_string())
            };
            // QEMU's drive syntax takes a comma as a separator: a path with one is doubled (escaped).
            let drive = |id: &str, file: &str, extra: &str| {
                format!("id={id},file={},if=none,format=raw{extra}", file.replace(',', ",,"))
            };
            push(&["-drive", &drive("image", &image, ",readonly=on")]);
            push(&["-device", &format!("virtio-blk-device,drive=image,serial={IMAGE_DISK_SERIAL}")]);
            push(&["-drive", &drive("writable", &writable, ",discard=unmap")]);
            push(&["-device", &format!("virtio-blk-device,drive=writable,serial={WRITABLE_DISK_SERIAL}")]);
        }
        for m in &self.mounts {
            let (chardev, socket) = (format!("fs{}", m.index), vm_contract::share::socket_name(m.index));
            push(&["-chardev", &format!("socket,id={chardev},path={socket}")]);
            push(&["-device", &format!("vhost-user-fs-device,chardev={chardev},tag={}", mounts::tag(m.index))]);
        }
        push(&["-append", &kernel_args]);
        let (kernel, initrd) = if jailed {
            (JAIL_KERNEL.into(), JAIL_INITRD.into())
        } else {
            (self.kernel.clone().into_os_string(), self.initrd.clone().into_os_string())
        };
        args.extend([OsString::from("-kernel"), kernel, OsString::from("-initrd"), initrd]);
        args
    }

    /// `vm-jailer`'s arguments, QEMU's command line last.
    pub fn jailer_args(&self) -> JailerArgs {
        let mut exec = vec![self.qemu.clone().into_os_string()];
        exec.extend(self.args());
        JailerArgs {
            confinement: self.confinement,
            root: self.root.clone(),
            uid: self.ids.map(|i| i.uid),
            gid: self.ids.map(|i| i.gid),
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            kvm: self.accel == Accelerator::Kvm,
            nice: VMM_NICE,
            cgroups: self.cgroups.clone(),
            incoming: self.incoming.clone(),
            image_disk: self.disks.as_ref().map(|d| d.image.clone()),
            writable_disk: self.disks.as_ref().map(|d| d.writable.clone()),
            shared_memory_mib: (!self.mounts.is_empty()).then(|| self.shape.memory_mib()),
            guest_ram_fd: self.ram.as_ref().and_then(|r| u32::try_from(r.file.as_raw_fd()).ok()),
            guest_ram_mib: self.ram.as_ref().map(|_| self.shape.memory_mib()),
            guest_ram_private: self.ram.as_ref().is_some_and(|r| r.usage == RamUse::Private),
            exec,
        }
    }

    /// Starts QEMU through the jailer, with a cleared environment (the jailer's holds only a test build's
    /// switches, and it execs QEMU with none), stdin from /dev/null, stdout on a pipe (the
    /// jailer reports QEMU's pid there, then points it at /dev/null) and stderr on a pipe (the caller copies
    /// it into `vmm.log`; the jailer's own failure lands there too).
    ///
    /// `env` is the jailer's environment.
    ///
    /// # Errors
    /// QEMU cannot be executed.
    pub fn spawn(&self, env: &[(&str, String)]) -> std::io::Result<Child> {
        if self.accel == Accelerator::Tcg {
            // Under TCG huge pages buy nothing, and cost a whole 2 MiB of host memory for every guest page
            // touched in it. The setting is this process's, and QEMU inherits it.
            let _ = rustix::thread::disable_transparent_huge_pages(true);
        }
        Command::new(&self.jailer)
            .args(self.jailer_args().to_argv())
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
    }
}

/// Finds `name` (`qemu-system-x86_64`) on `PATH`.
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
            jailer: "vm-jailer".into(),
            confinement: Confinement::Jail,
            ids: Some(JailIds { uid: 2_000_000_001, gid: 2_000_000_001 }),
            root: "/s/box/vmm".into(),
            cgroups: Vec::new(),
            kernel: "/img/vmlinuz".into(),
            initrd: "/img/initramfs.cpio".into(),
            shape: SandboxShape::new(2, 512).unwrap(),
            accel,
            monitor: false,
            incoming: None,
            defer_incoming: false,
            tsc_khz: None,
            disks: None,
            mounts: Vec::new(),
            tmpfs: Vec::new(),
            ram: None,
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
        assert!(joined(Accelerator::Tcg).contains("tsc_early_khz=2000000 no_timer_check tsc=reliable"));
        let measured = VmmConfig { tsc_khz: Some(2_600_000), ..config(Accelerator::Tcg) };
        let line = measured.args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(line.contains("tsc_early_khz=2600000 "), "{line}");
        assert!(joined(Accelerator::Tcg).contains(&format!("-accel tcg,tb-size={TCG_TB_SIZE_MIB}")));
        let kvm = joined(Accelerator::Kvm);
        assert!(kvm.contains("-accel kvm -cpu host"));
        assert!(!kvm.contains("mitigations=off"));
    }

    #[test]
    fn a_jailed_qemu_names_its_files_inside_the_jail_and_an_unconfined_one_by_host_path() {
        assert!(joined(Accelerator::Tcg).contains(&format!("-kernel {JAIL_KERNEL} -initrd {JAIL_INITRD}")));
        let open = VmmConfig { confinement: Confinement::None, ids: None, ..config(Accelerator::Tcg) };
        let line = open.args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(line.contains("-kernel /img/vmlinuz -initrd /img/initramfs.cpio"));
        let jailer = config(Accelerator::Kvm).jailer_args();
        assert!(jailer.kvm && jailer.nice == VMM_NICE && jailer.exec.first() == Some(&"qemu".into()));
    }

    #[test]
    fn an_image_root_adds_two_disks_by_serial_and_the_kernel_argument() {
        let disks = Disks { image: "/c/disks/a,b/rootfs.erofs".into(), writable: "/s/box/disk.ext4".into() };
        let with = VmmConfig { disks: Some(disks.clone()), ..config(Accelerator::Tcg) };
        let line = with.args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(line.contains(&format!("file={JAIL_IMAGE_DISK},if=none,format=raw,readonly=on")), "{line}");
        assert!(line.contains(&format!("serial={IMAGE_DISK_SERIAL}")) && line.contains(WRITABLE_DISK_SERIAL));
        assert!(line.contains(IMAGE_ROOT_ARG));
        assert!(!joined(Accelerator::Tcg).contains(IMAGE_ROOT_ARG) && !joined(Accelerator::Tcg).contains("-drive"));
        let open = VmmConfig { confinement: Confinement::None, ids: None, ..with.clone() };
        let line = open.args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(line.contains("file=/c/disks/a,,b/rootfs.erofs,"), "a comma in a path is escaped: {line}");
        let jailer = with.jailer_args();
        assert_eq!((jailer.image_disk, jailer.writable_disk), (Some(disks.image), Some(disks.writable)));
    }

    #[test]
    fn mounts_add_shared_memory_a_device_each_and_the_kernel_argument() {
        let mounts = vec![
            GuestMount { index: 0, target: "/work".into(), readonly: false },
            GuestMount { index: 1, target: "/data".into(), readonly: true },
        ];
        let with = VmmConfig { mounts: mounts.clone(), ..config(Accelerator::Tcg) };
        let line = with.args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(line.contains("memory-backend=mem") && line.contains("memory-backend-memfd,id=mem,size=512M,share=on"));
        assert!(line.contains("-global virtio-mmio.force-legacy=false"), "{line}");
        assert!(line.contains("vhost-user-fs-device,chardev=fs1,tag=vmfs1") && line.contains("path=fs0.sock"));
        assert!(line.contains(&mounts::kernel_arg(&mounts).unwrap()));
        assert_eq!(with.jailer_args().shared_memory_mib, Some(512));
        let plain = joined(Accelerator::Tcg);
        assert!(!plain.contains("memory-backend") && !plain.contains("vhost-user") && !plain.contains("force-legacy"));
        assert_eq!(config(Accelerator::Tcg).jailer_args().shared_memory_mib, None);
    }

    #[test]
    fn a_tmpfs_is_only_a_kernel_argument() {
        let tmpfs = vec![GuestTmpfs::parse_flag("/scratch:size=1m").unwrap()];
        let with = VmmConfig { tmpfs: tmpfs.clone(), ..config(Accelerator::Tcg) };
        let line = with.args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(line.contains(&tmpfs::kernel_arg(&tmpfs).unwrap()), "{line}");
        assert_eq!(line.replace(&format!(" {}", tmpfs::kernel_arg(&tmpfs).unwrap()), ""), joined(Accelerator::Tcg));
    }

    #[test]
    fn a_templates_clone_names_the_jailers_memory_backend_and_waits_for_its_state() {
        let ram =
            GuestRam { file: std::sync::Arc::new(std::fs::File::open("/dev/null").unwrap()), usage: RamUse::Private };
        let clone = VmmConfig { ram: Some(ram), defer_incoming: true, monitor: true, ..config(Accelerator::Tcg) };
        let line = clone.args().iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        assert!(line.contains("-M microvm,pit=on,pic=on,rtc=on,memory-backend=mem"), "{line}");
        assert!(line.contains("-incoming defer") && line.contains("chardev=monitor,mode=control"), "{line}");
        assert!(!line.contains("memory-backend-memfd"), "the jailer adds the backend: {line}");
        let jailer = clone.jailer_args();
        assert_eq!((jailer.guest_ram_mib, jailer.guest_ram_private, jailer.incoming), (Some(512), true, None));
        assert!(jailer.guest_ram_fd.is_some());
        let plain = config(Accelerator::Tcg).jailer_args();
        assert_eq!((plain.guest_ram_fd, plain.guest_ram_mib, plain.guest_ram_private), (None, None, false));
        assert!(!joined(Accelerator::Tcg).contains("-incoming"));
    }
}

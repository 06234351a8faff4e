//! A real containerd (Debian's `containerd` and `ctr`) for the shim's tests: started with a private root,
//! state and socket under a test's directory, its CRI plugin off (or on, with a CNI bridge network of the
//! test's own: [`Containerd::start_cri`]), our shim on its `PATH` with settings that put the shim's sandboxes
//! in the test's state directory. Dropping it kills containerd and every shim it
//! started (they name its socket in their arguments).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::registry::{umoci_image, Registry};
use crate::{harness, wait_until};

/// The runtime's name.
pub const RUNTIME: &str = "io.containerd.vmdriver.v2";
/// The containerd namespace the tests use.
const NAMESPACE: &str = "e2e";

/// The CRI tests' bridge (a name of at most 15 bytes) and its addresses.
const CRI_BRIDGE: &str = "vmde2e0";
const CRI_SUBNET: &str = "10.233.7.0/24";

/// A busybox image in a registry, for containerd to pull.
#[derive(Debug)]
pub struct Busybox {
    /// The registry (it stops when this is dropped).
    pub registry: Registry,
    /// The reference containerd knows it by.
    pub reference: String,
    /// The same image tagged as a pod's pause image: its command sleeps.
    pub pause: String,
    /// The same image as an OCI layout (tag `busybox`), for `vm-driver launch --image`.
    pub layout: PathBuf,
    /// containerd's registry hosts directory (`hosts.toml` with the registry's CA).
    pub hosts: PathBuf,
}

/// Puts the guest's busybox and its applets' links in `root`.
fn add_busybox(root: &Path) {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("busybox"), guest_busybox()).unwrap();
    std::fs::set_permissions(bin.join("busybox"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    for applet in ["sh", "echo", "cat", "sleep", "true", "uname", "tty", "stty", "env", "pwd", "kill", "ls"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
}

impl Busybox {
    /// A busybox image (the guest's static busybox and its applets' links), built by umoci under `dir`,
    /// pushed to a new registry there (with a pause tag).
    pub fn push(dir: &Path) -> Self {
        let registry = Registry::start(&dir.join("registry"), None);
        let layout = umoci_image(dir, "busybox", &[&add_busybox], &["--config.env=PATH=/bin", "--config.cmd=/bin/sh"]);
        let image = format!("{}:busybox", layout.display());
        let pause_config = ["--tag=pause", "--config.cmd=/bin/sleep", "--config.cmd=2147483647"];
        let made = Command::new("umoci").arg("config").arg("--image").arg(&image).args(pause_config).status();
        assert!(made.unwrap().success(), "umoci config of the pause tag");
        let reference = registry.push(&format!("oci:{image}"), "e2e/busybox:1");
        let pause = registry.push(&format!("oci:{}:pause", layout.display()), "e2e/pause:1");
        // containerd takes a loopback registry for a plain-HTTP one unless its hosts file says otherwise.
        let host = reference.split('/').next().unwrap();
        let hosts = dir.join("certs.d");
        std::fs::create_dir_all(hosts.join(host)).unwrap();
        let toml = format!(
            "server = \"https://{host}\"\n[host.\"https://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"{}\"\n",
            registry.ca.display()
        );
        std::fs::write(hosts.join(host).join("hosts.toml"), toml).unwrap();
        Self { registry, reference, pause, layout, hosts }
    }

    /// The same busybox, crafted as a hostile image would be: its `/proc` is a symlink to `/`. Pushed to the
    /// same registry; its reference.
    pub fn push_crafted(&self, dir: &Path) -> String {
        let crafted = |root: &Path| {
            add_busybox(root);
            std::os::unix::fs::symlink("/", root.join("proc")).unwrap();
        };
        let layout = umoci_image(dir, "crafted", &[&crafted], &["--config.env=PATH=/bin", "--config.cmd=/bin/sh"]);
        self.registry.push(&format!("oci:{}:crafted", layout.display()), "e2e/crafted:1")
    }
}

/// A running containerd.
#[derive(Debug)]
pub struct Containerd {
    dir: PathBuf,
    child: Child,
    /// Its gRPC socket.
    pub socket: PathBuf,
    /// The shim's sandboxes' state directory.
    pub vm_state: PathBuf,
    /// Whether its CRI plugin is on.
    cri: bool,
}

impl Containerd {
    /// Starts containerd under `dir`, its CRI plugin off.
    pub fn start(dir: &Path) -> Self {
        Self::start_with(dir, None)
    }

    /// Starts containerd under `dir` with its CRI plugin on (the socket is then a CRI endpoint too): pods of
    /// the `vmdriver` runtime handler, the pause image `images.pause`, images pulled with `images.hosts`, and
    /// a CNI bridge network of the test's own (Debian's `containernetworking-plugins`), which the CRI
    /// needs to make any pod; its network namespaces under containerd's private state.
    pub fn start_cri(dir: &Path, images: &Busybox) -> Self {
        let cni = dir.join("cni");
        std::fs::create_dir_all(&cni).unwrap();
        let network = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "vmdriver-e2e",
            "plugins": [
                {"type": "bridge", "bridge": CRI_BRIDGE, "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": CRI_SUBNET}]],
                          "dataDir": dir.join("cni-ipam")}},
                {"type": "loopback"}
            ]
        });
        std::fs::write(cni.join("10-vmdriver-e2e.conflist"), network.to_string()).unwrap();
        let cri = format!(
            "[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"{pause}\"\n  \
             netns_mounts_under_state_dir = true\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"vmdriver\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.vmdriver]\n  runtime_type = \"{RUNTIME}\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"/usr/lib/cni\"\n  conf_dir = \"{cni}\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"{hosts}\"\n",
            pause = images.pause,
            cni = cni.display(),
            hosts = images.hosts.display(),
        );
        Self::start_with(dir, Some(cri))
    }

    fn start_with(dir: &Path, cri: Option<String>) -> Self {
        let vm_state = dir.join("vm-state");
        let settings = serde_json::json!({
            "state_dir": vm_state,
            "boot_image": harness().image,
            "accel": harness().accel,
            "boot_timeout_secs": 300,
        });
        std::fs::write(dir.join("shim.json"), settings.to_string()).unwrap();
        let socket = dir.join("containerd.sock");
        let config = format!(
            "version = 2\nroot = \"{root}\"\nstate = \"{state}\"\n\
             disabled_plugins = [{cri_off}\"io.containerd.internal.v1.opt\", \
             \"io.containerd.snapshotter.v1.btrfs\", \"io.containerd.snapshotter.v1.zfs\", \
             \"io.containerd.snapshotter.v1.devmapper\", \"io.containerd.snapshotter.v1.aufs\"]\n\
             [grpc]\n  address = \"{socket}\"\n[ttrpc]\n  address = \"{socket}.ttrpc\"\n{cri_on}",
            root = dir.join("root").display(),
            state = dir.join("state").display(),
            socket = socket.display(),
            cri_off = if cri.is_some() { "" } else { "\"io.containerd.grpc.v1.cri\", " },
            cri_on = cri.as_deref().unwrap_or_default(),
        );
        std::fs::write(dir.join("config.toml"), config).unwrap();
        let child = Self::spawn(dir);
        let me = Self { dir: dir.to_owned(), child, socket, vm_state, cri: cri.is_some() };
        me.wait_up();
        me
    }

    fn spawn(dir: &Path) -> Child {
        let bin = harness().shipped.driver.parent().unwrap().to_owned();
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("containerd.log")).unwrap();
        Command::new("containerd")
            .arg("--config")
            .arg(dir.join("config.toml"))
            .env("PATH", path)
            .env("VM_DRIVER_SHIM_CONFIG", dir.join("shim.json"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("containerd (scripts/deps installs it)")
    }

    fn wait_up(&self) {
        let up = wait_until(Duration::from_secs(60), || self.ctr(&["version"]).status.success());
        assert!(up, "containerd did not start: {}", self.log());
    }

    /// `ctr` against this containerd, stdin empty.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.ctr_with_stdin(args, b"")
    }

    /// `ctr --address SOCKET --namespace e2e`, for more arguments.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(&self.socket).arg("--namespace").arg(NAMESPACE);
        cmd
    }

    /// The busybox image of [`Busybox::push`], pulled by this containerd.
    pub fn pull_busybox(&self, dir: &Path) -> Busybox {
        let busybox = Busybox::push(dir);
        let hosts = busybox.hosts.to_str().unwrap();
        let out = self.ctr(&["images", "pull", "--hosts-dir", hosts, &busybox.reference]);
        assert!(out.status.success(), "ctr pull: {}", String::from_utf8_lossy(&out.stderr));
        busybox
    }

    /// `ctr` with `stdin` written to it.
    pub fn ctr_with_stdin(&self, args: &[&str], stdin: &[u8]) -> Output {
        crate::output::with_stdin(self.command().args(args), stdin)
    }

    /// Stops containerd (SIGTERM, as a service manager would) and starts it again on the same root.
    pub fn restart(&mut self) {
        crate::procs::signal(self.child.id() as i32, nix::sys::signal::Signal::SIGTERM);
        let _ = self.child.wait();
        self.child = Self::spawn(&self.dir);
        self.wait_up();
    }

    /// The shims this containerd started.
    pub fn shims(&self) -> Vec<crate::procs::ProcInfo> {
        let needle = self.socket.to_string_lossy().into_owned();
        all_processes()
            .into_iter()
            .filter(|p| p.comm.starts_with("containerd-shim") && p.cmdline.iter().any(|a| a.contains(&needle)))
            .collect()
    }

    /// containerd's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }
}

/// The guest image's static busybox (Debian's `busybox-static`, pinned by `images/pins.json`).
fn guest_busybox() -> Vec<u8> {
    let initramfs = std::fs::read(harness().image.join("initramfs.cpio")).unwrap();
    let found = crate::image::read_cpio(&initramfs).into_iter().find(|e| e.path == "bin/busybox");
    match found.map(|e| e.kind) {
        Some(vm_image::cpio::Kind::File(bytes)) => bytes,
        other => panic!("no bin/busybox file in the guest image: {other:?}"),
    }
}

fn all_processes() -> Vec<crate::procs::ProcInfo> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(crate::procs::ProcInfo::read)
        .collect()
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for shim in self.shims() {
            crate::procs::signal(shim.pid, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.cri {
            // The CNI bridge outlives the pods on it (its veths went with them).
            let _ = Command::new("ip").args(["link", "delete", CRI_BRIDGE]).status();
        }
        // The shims' VMs follow their supervisors' liveness pipes; the mounts of a killed Create go here.
        for line in std::fs::read_to_string("/proc/self/mounts").unwrap_or_default().lines() {
            if let Some(target) = line.split(' ').nth(1).filter(|t| t.starts_with(self.dir.to_str().unwrap_or("-"))) {
                let _ = Command::new("umount").arg("-l").arg(target).status();
            }
        }
    }
}

//! `containerd-shim-vmdriver-v2`: vm-driver as a containerd runtime (`io.containerd.vmdriver.v2`), one
//! microVM per task (or per CRI pod) under its own supervisor, jailer and watchdog (docs/kubernetes.md).
//!
//! - [`shim`]: the shim's own commands (`start` spawns the daemon, `delete` cleans up after one that died).
//! - [`task`]: containerd's task service on the task's VM; [`pod`]: the VM, through the driver library.
//! - [`spec`]: what of the bundle's OCI spec a VM honours; [`rootfs`]: the snapshot made the guest's root
//!   disk; [`poddir`]: a pod's directory, through which its containers' roots reach its VM; [`fifo`]:
//!   containerd's stdio FIFOs as a process's client; [`settings`]: the node's settings.

mod fifo;
mod pod;
mod poddir;
mod rootfs;
mod settings;
mod shim;
mod spec;
mod stats;
mod task;

/// The runtime's name in containerd (`ctr run --runtime`, a RuntimeClass's handler config).
const RUNTIME_ID: &str = "io.containerd.vmdriver.v2";

#[tokio::main]
async fn main() {
    let config = containerd_shim::Config {
        // The driver library waits for its own children (the supervisor); a reaper would take their statuses.
        no_reaper: true,
        no_sub_reaper: true,
        ..Default::default()
    };
    containerd_shim::asynchronous::run::<shim::VmShim>(RUNTIME_ID, Some(config)).await;
    // Now, not when the runtime is dropped: that would wait on a blocking open of a stdin FIFO whose writer
    // never came.
    std::process::exit(0);
}

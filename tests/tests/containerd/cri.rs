//! The same runtime under containerd's CRI plugin, as kubelet drives it (a CRI client of the tests' own on
//! containerd's socket): a pod is one microVM, booted at its pause container, and each of its containers a
//! root of its own in that VM, from an image the CRI pulled from the tests' registry; the files CRI binds
//! (`/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf`) are in each root; exec, exit codes and a stopped
//! container leave the pod running; a container the VM cannot take is refused with the reason (at its
//! start, where the CRI makes the task) and the pod keeps going, as it does when a crafted image's `/proc`
//! is a symlink out of its root; a removed container's root is released in the guest; removing the pod leaves no VM, shim or sandbox.

use std::collections::HashMap;
use std::time::Duration;

use vm_test_support::containerd::{Busybox, Containerd};
use vm_test_support::cri::api::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ExecSyncRequest, ImageSpec, Mount, PodSandboxConfig,
    PodSandboxMetadata, RemoveContainerRequest, RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest,
    StopContainerRequest, StopPodSandboxRequest,
};
use vm_test_support::cri::Cri;
use vm_test_support::{harness, wait_until, Scratch};

use super::shim::{live_sandboxes, report_accel, vmms};

/// The runtime handler the CRI plugin's configuration names.
const HANDLER: &str = "vmdriver";
/// Long enough for a boot under emulation on a busy host.
const CRI_TIMEOUT: Duration = Duration::from_secs(300);

fn request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(CRI_TIMEOUT);
    request
}

/// `ExecSync` of `sh -c script` in `container`: its exit code and stdout.
async fn exec(cri: &mut Cri, container: &str, script: &str) -> (i32, String) {
    let cmd = vec!["/bin/sh".to_owned(), "-c".to_owned(), script.to_owned()];
    let exec = ExecSyncRequest { container_id: container.to_owned(), cmd, timeout: 120 };
    let out = cri.runtime.exec_sync(request(exec)).await.expect("ExecSync").into_inner();
    (out.exit_code, String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_cri_pod_is_one_microvm_and_each_container_has_its_own_root_in_it() {
    let s = Scratch::new("cri-pod");
    let images = Busybox::push(&s.dir);
    let containerd = Containerd::start_cri(&s.dir, &images);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    rt.block_on(async {
        let mut cri = Cri::connect(&containerd).await;
        cri.pull(&images.reference).await;

        s.waiting_for("the pod's VM (RunPodSandbox)");
        let logs = s.dir.join("pod-logs");
        std::fs::create_dir_all(&logs).unwrap();
        let pod = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: "web".into(),
                namespace: "e2e".into(),
                uid: "u1".into(),
                attempt: 0,
            }),
            hostname: "web-pod".into(),
            log_directory: logs.display().to_string(),
            ..Default::default()
        };
        let run = RunPodSandboxRequest { config: Some(pod.clone()), runtime_handler: HANDLER.into() };
        let sandbox = cri.runtime.run_pod_sandbox(request(run)).await;
        let sandbox = sandbox.unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", containerd.log())).into_inner();
        let sandbox = sandbox.pod_sandbox_id;
        report_accel(&containerd);

        s.waiting_for("two containers in the pod");
        let container = |name: &str, mounts: Vec<Mount>| CreateContainerRequest {
            pod_sandbox_id: sandbox.clone(),
            config: Some(ContainerConfig {
                metadata: Some(ContainerMetadata { name: name.into(), attempt: 0 }),
                image: Some(ImageSpec { image: images.reference.clone(), ..Default::default() }),
                // Each writes its name at one path: in roots of their own, each reads back its own.
                command: vec!["/bin/sh".into(), "-c".into(), format!("echo {name} > /tmp/mine; exec sleep 100000")],
                mounts,
                log_path: format!("{name}.log"),
                ..Default::default()
            }),
            sandbox_config: Some(pod.clone()),
        };
        let mut ids = HashMap::new();
        for name in ["a", "b"] {
            let created = cri.runtime.create_container(request(container(name, Vec::new()))).await;
            let id = created.unwrap_or_else(|e| panic!("CreateContainer {name}: {e}")).into_inner().container_id;
            let started =
                cri.runtime.start_container(request(StartContainerRequest { container_id: id.clone() })).await;
            started.unwrap_or_else(|e| panic!("StartContainer {name}: {e}"));
            ids.insert(name, id);
        }
        assert_eq!(vmms(&containerd).len(), 1, "one VM for the pod and both its containers");
        assert_eq!(containerd.shims().len(), 1, "one shim for the pod: {:?}", containerd.shims());

        let script = "while [ ! -s /tmp/mine ]; do sleep 0.1; done; cat /tmp/mine; uname -r; \
                      cat /proc/sys/kernel/random/boot_id; cat /etc/hostname; grep -c . /etc/hosts; ls /bin/busybox";
        let (code_a, a) = exec(&mut cri, &ids["a"], script).await;
        let (code_b, b) = exec(&mut cri, &ids["b"], script).await;
        assert_eq!((code_a, code_b), (0, 0), "a: {a}\nb: {b}");
        let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
        assert_eq!((a[0], b[0]), ("a", "b"), "each container's write is in its own root: {a:?} {b:?}");
        assert_ne!(a[1], host_kernel.trim(), "the containers ran on the host's kernel, not in a VM");
        assert_eq!(a[2], b[2], "one kernel (one boot) for both containers");
        assert_eq!((a[3], b[3]), ("web-pod", "web-pod"), "CRI's /etc/hostname is in each root");
        assert!(a[4].parse::<u32>().unwrap() > 0, "CRI's /etc/hosts is in the root: {a:?}");
        eprintln!("e2e: the pod's kernel {} (the host's {}), boot {}", a[1], host_kernel.trim(), a[2]);
        let (code, _) = exec(&mut cri, &ids["a"], "exit 3").await;
        assert_eq!(code, 3, "an exec's exit code");

        s.waiting_for("a container the pod's VM cannot take");
        let volume = s.dir.join("volume");
        std::fs::create_dir_all(&volume).unwrap();
        let dir_mount =
            Mount { container_path: "/data".into(), host_path: volume.display().to_string(), ..Default::default() };
        // The CRI makes the task (our Create) at StartContainer.
        let created = cri.runtime.create_container(request(container("c", vec![dir_mount]))).await;
        let id = created.expect("CreateContainer c").into_inner().container_id;
        let refused = cri.runtime.start_container(request(StartContainerRequest { container_id: id.clone() })).await;
        let why = refused.expect_err("a directory volume in a pod's container is refused").message().to_owned();
        assert!(why.contains("directory volume"), "the reason: {why}");
        let remove = RemoveContainerRequest { container_id: id };
        cri.runtime.remove_container(request(remove)).await.expect("RemoveContainer of the refused one");
        assert_eq!(vmms(&containerd).len(), 1, "the refusal left the pod's one VM as it was");

        s.waiting_for("a crafted image whose /proc is a symlink out of its root");
        let crafted = images.push_crafted(&s.dir);
        cri.pull(&crafted).await;
        let mut bad = container("crafted", Vec::new());
        if let Some(config) = bad.config.as_mut() {
            config.image = Some(ImageSpec { image: crafted.clone(), ..Default::default() });
        }
        let id = cri.runtime.create_container(request(bad)).await.expect("CreateContainer crafted").into_inner();
        let start = StartContainerRequest { container_id: id.container_id.clone() };
        let refused = cri.runtime.start_container(request(start)).await;
        let why = refused.expect_err("a root whose /proc leads out of it is refused").message().to_owned();
        assert!(why.contains("/proc"), "the reason names the step: {why}");
        let remove = RemoveContainerRequest { container_id: id.container_id };
        cri.runtime.remove_container(request(remove)).await.expect("RemoveContainer of the crafted one");
        let (code, out) = exec(&mut cri, &ids["b"], "cat /tmp/mine").await;
        assert_eq!((code, out.trim()), (0, "b"), "the pod runs on after the crafted container");

        s.waiting_for("a stopped container, the pod still running");
        let stop = StopContainerRequest { container_id: ids["a"].clone(), timeout: 10 };
        cri.runtime.stop_container(request(stop)).await.expect("StopContainer");
        let (code, out) = exec(&mut cri, &ids["b"], "cat /tmp/mine").await;
        assert_eq!((code, out.trim()), (0, "b"), "the pod's other container runs on");

        s.waiting_for("a removed container's root released at the next container's start");
        let remove = RemoveContainerRequest { container_id: ids["a"].clone() };
        cri.runtime.remove_container(request(remove)).await.expect("RemoveContainer a");
        let created = cri.runtime.create_container(request(container("d", Vec::new()))).await;
        let d = created.expect("CreateContainer d").into_inner().container_id;
        let started = cri.runtime.start_container(request(StartContainerRequest { container_id: d.clone() })).await;
        started.expect("StartContainer d");
        // The guest's loop devices, each naming the disk it is on.
        let (_, disks) = exec(&mut cri, &d, "cat /sys/block/loop*/loop/backing_file").await;
        assert!(disks.contains(&d) && disks.contains(&ids["b"]), "d's and b's disks attached: {disks}");
        assert!(!disks.contains(&ids["a"]), "the removed container's loop device was freed: {disks}");

        s.waiting_for("the pod's removal");
        let stop = StopPodSandboxRequest { pod_sandbox_id: sandbox.clone() };
        cri.runtime.stop_pod_sandbox(request(stop)).await.expect("StopPodSandbox");
        let remove = RemovePodSandboxRequest { pod_sandbox_id: sandbox.clone() };
        cri.runtime.remove_pod_sandbox(request(remove)).await.expect("RemovePodSandbox");
    });
    assert!(wait_until(Duration::from_secs(60), || vmms(&containerd).is_empty()), "no VM left");
    assert!(wait_until(Duration::from_secs(60), || live_sandboxes(&containerd) == 0), "every sandbox ended");
    let gone = wait_until(Duration::from_secs(60), || containerd.shims().is_empty());
    assert!(gone, "no shim left: {:?}", containerd.shims());
    eprintln!("e2e: accelerator requested {}", harness().accel);
}

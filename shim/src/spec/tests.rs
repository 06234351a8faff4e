use serde_json::{json, Value};

use super::*;

/// What `ctr run` writes, trimmed to the parts the checks read.
fn ctr_spec() -> Value {
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", "echo hi"],
            "env": ["PATH=/usr/bin:/bin", "EMPTY=", "BARE"],
            "cwd": "/work",
            "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL"]},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
        },
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]}
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]
        }
    })
}

fn check(spec: &Value) -> Result<Container, SpecError> {
    accept(&serde_json::from_value(spec.clone()).unwrap())
}

#[test]
fn ctrs_spec_is_accepted_as_written() {
    let container = check(&ctr_spec()).unwrap();
    assert_eq!(container.init.argv, ["/bin/sh", "-c", "echo hi"]);
    let env: Vec<(&str, &str)> = container.init.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    assert_eq!(env, [("PATH", "/usr/bin:/bin"), ("EMPTY", ""), ("BARE", "")]);
    assert_eq!(container.init.cwd.as_deref(), Some("/work"));
    assert!(!container.init.terminal);
    assert_eq!(container.init.rlimits, [Rlimit { resource: Resource::Nofile, soft: 1024, hard: 1024 }]);
    assert!(container.mounts.is_empty(), "the kernel file systems are the guest's own");
}

#[test]
fn rlimits_the_guest_cannot_set_are_refused() {
    let mut spec = ctr_spec();
    spec["process"]["rlimits"] = json!([{"type": "RLIMIT_CORE", "hard": 1, "soft": 2}]);
    assert_eq!(check(&spec), Err(SpecError::Rlimit(rlimit::RlimitError::SoftAboveHard("core"))));
    let twice = json!({"type": "RLIMIT_NOFILE", "hard": 1, "soft": 1});
    spec["process"]["rlimits"] = json!([twice, twice]);
    assert_eq!(check(&spec), Err(SpecError::Rlimit(rlimit::RlimitError::Twice("nofile"))));
    spec["process"]["rlimits"] = json!([{"type": "RLIMIT_NOPE", "hard": 1, "soft": 1}]);
    // Not a resource oci-spec knows: the whole spec is unreadable (read() says SpecError::Unreadable).
    assert!(serde_json::from_value::<Spec>(spec).is_err());
}

#[test]
fn a_missing_or_joined_namespace_is_the_hosts_and_refused() {
    for (kind, name) in [("network", "network"), ("pid", "pid"), ("ipc", "ipc")] {
        let mut spec = ctr_spec();
        let namespaces = spec["linux"]["namespaces"].as_array_mut().unwrap();
        namespaces.retain(|n| n["type"] != kind);
        assert_eq!(check(&spec), Err(SpecError::HostNamespace(name)), "{kind} left out");
        let mut spec = ctr_spec();
        for n in spec["linux"]["namespaces"].as_array_mut().unwrap() {
            if n["type"] == kind {
                n["path"] = json!("/proc/1/ns/net");
            }
        }
        assert_eq!(check(&spec), Err(SpecError::HostNamespace(name)), "{kind} joined by path");
    }
}

/// `spec` as the CRI plugin marks a task of pod `pod`: its sandbox (`sandbox`) or a container, with the
/// pod's namespaces joined by path.
fn in_pod(mut spec: Value, kind: &str) -> Value {
    spec["annotations"] = json!({"io.kubernetes.cri.container-type": kind, "io.kubernetes.cri.sandbox-id": "pod1"});
    for n in spec["linux"]["namespaces"].as_array_mut().unwrap() {
        if ["network", "ipc", "uts"].contains(&n["type"].as_str().unwrap()) {
            n["path"] = json!("/proc/42/ns/net");
        }
    }
    spec
}

#[test]
fn in_a_cri_pod_joined_namespaces_are_the_vms_own_and_bound_files_are_copied() {
    let sandbox = check(&in_pod(ctr_spec(), "sandbox")).unwrap();
    assert_eq!(sandbox.role, Role::Sandbox("pod1".into()));
    // Control: the same namespaces outside a pod are the host's.
    let mut alone = in_pod(ctr_spec(), "sandbox");
    alone.as_object_mut().unwrap().remove("annotations");
    assert_eq!(check(&alone), Err(SpecError::HostNamespace("network")));

    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "127.0.0.1 localhost\n").unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let mut member = in_pod(ctr_spec(), "container");
    let mounts = member["mounts"].as_array_mut().unwrap();
    mounts.push(json!({"destination": "/etc/hosts", "type": "bind", "source": hosts, "options": ["rbind"]}));
    mounts.push(json!({"destination": "/dev/shm", "type": "bind", "source": shm, "options": ["rbind"]}));
    let container = check(&member).unwrap();
    assert_eq!(container.role, Role::Member("pod1".into()));
    assert_eq!(container.files, [FileCopy { source: hosts, target: "/etc/hosts".into() }]);
    assert!(container.mounts.is_empty(), "CRI's /dev/shm is the guest's own");

    let mut volume = in_pod(ctr_spec(), "container");
    let src = dir.path().display().to_string();
    volume["mounts"].as_array_mut().unwrap().push(json!({"destination": "/data", "type": "bind", "source": src}));
    let err = check(&volume).unwrap_err();
    assert!(err.to_string().contains("directory volume"), "{err}");

    let mut own_mount_ns = in_pod(ctr_spec(), "container");
    for n in own_mount_ns["linux"]["namespaces"].as_array_mut().unwrap() {
        if n["type"] == "mount" {
            n["path"] = json!("/proc/42/ns/mnt");
        }
    }
    assert_eq!(check(&own_mount_ns), Err(SpecError::HostNamespace("mount")), "a pod never shares a mount namespace");
    let mut no_pod = ctr_spec();
    no_pod["annotations"] = json!({"io.kubernetes.cri.container-type": "container"});
    assert_eq!(check(&no_pod), Err(SpecError::Annotations));
}

#[test]
fn privileged_and_host_devices_are_refused() {
    let mut spec = ctr_spec();
    spec["process"]["capabilities"]["bounding"] = json!(["CAP_CHOWN", "CAP_SYS_ADMIN"]);
    assert_eq!(check(&spec), Err(SpecError::Privileged));
    let mut spec = ctr_spec();
    spec["linux"]["devices"] = json!([{"path": "/dev/kvm", "type": "c", "major": 10, "minor": 232}]);
    assert_eq!(check(&spec), Err(SpecError::Device("/dev/kvm".into())));
}

#[test]
fn a_bind_mount_of_a_directory_is_a_share_and_other_mounts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = ctr_spec();
    let src = dir.path().display().to_string();
    spec["mounts"].as_array_mut().unwrap().push(json!({
        "destination": "/data", "type": "bind", "source": src, "options": ["rbind", "ro"]
    }));
    let container = check(&spec).unwrap();
    assert_eq!(container.mounts, [HostMount { source: dir.path().into(), target: "/data".into(), readonly: true }]);

    let file = dir.path().join("hosts");
    std::fs::write(&file, "").unwrap();
    for (mount, why) in [
        (json!({"destination": "/etc/hosts", "type": "bind", "source": file, "options": ["rbind"]}), "directories"),
        (json!({"destination": "/data", "type": "bind", "source": "rel", "options": ["rbind"]}), "absolute"),
        (json!({"destination": "/scratch", "type": "overlay", "source": "overlay"}), "bind mounts"),
    ] {
        let mut spec = ctr_spec();
        spec["mounts"].as_array_mut().unwrap().push(mount.clone());
        let err = check(&spec).unwrap_err();
        assert!(matches!(&err, SpecError::Mount { .. }) && err.to_string().contains(why), "{mount}: {err}");
    }
}

#[test]
fn a_tmpfs_is_the_guests_own_with_its_options_and_a_bad_one_is_refused() {
    let mut spec = ctr_spec();
    let scratch = json!({"destination": "/scratch", "type": "tmpfs", "source": "tmpfs",
        "options": ["nosuid", "noexec", "size=1m", "mode=1770"]});
    spec["mounts"].as_array_mut().unwrap().push(scratch.clone());
    let container = check(&spec).unwrap();
    assert_eq!(container.tmpfs, [GuestTmpfs::parse_flag("/scratch:size=1m,mode=1770,noexec").unwrap()]);
    assert!(container.mounts.is_empty());

    spec["mounts"].as_array_mut().unwrap().push(scratch);
    assert_eq!(check(&spec), Err(SpecError::Tmpfs("/scratch".into(), TmpfsError::Twice("/scratch".into()))));
    for (options, error) in [
        (json!(["suid"]), TmpfsError::Option("suid".into())),
        (json!(["size=lots"]), TmpfsError::Value("size=lots".into())),
    ] {
        let mut spec = ctr_spec();
        let mount = json!({"destination": "/scratch", "type": "tmpfs", "source": "tmpfs", "options": options});
        spec["mounts"].as_array_mut().unwrap().push(mount);
        assert_eq!(check(&spec), Err(SpecError::Tmpfs("/scratch".into(), error)));
    }
}

#[test]
fn a_process_without_args_is_refused() {
    let mut spec = ctr_spec();
    spec["process"]["args"] = json!([]);
    assert_eq!(check(&spec), Err(SpecError::NoArgs));
    let mut spec = ctr_spec();
    spec.as_object_mut().unwrap().remove("process");
    assert_eq!(check(&spec), Err(SpecError::NoArgs));
}

#[test]
fn a_bundle_without_a_readable_spec_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(read(dir.path()), Err(SpecError::Unreadable));
    std::fs::write(dir.path().join("config.json"), b"{\"process\": 7").unwrap();
    assert_eq!(read(dir.path()), Err(SpecError::Unreadable));
    std::fs::write(dir.path().join("config.json"), serde_json::to_vec(&ctr_spec()).unwrap()).unwrap();
    assert!(read(dir.path()).is_ok());
}

proptest::proptest! {
    #[test]
    fn any_bytes_as_a_spec_are_an_answer_never_a_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
        if let Ok(spec) = serde_json::from_slice::<Spec>(&bytes) {
            let _ = accept(&spec);
        }
    }
}

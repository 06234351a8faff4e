//! The initramfs layout: what goes where, sorted, with fixed modes.
//!
//! ```text
//! /init                          the guest agent (PID 1)
//! /bin/busybox, applet links     userland for workloads
//! /lib/modules/vm/*.ko           the channel's kernel modules
//! /etc/vm-agent/modules          their load order
//! /dev/console                   so PID 1 has a console before devtmpfs is mounted
//! /etc/passwd, /etc/group        root and the workload user (`vm_protocol::identity::WORKLOAD`)
//! /proc /sys /dev /run /tmp /root mount points and homes
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use vm_protocol::identity::WORKLOAD;

use crate::cpio::{Entry, Kind};

/// Where module files go inside the guest.
pub const MODULE_DIR: &str = "lib/modules/vm";

/// Everything the initramfs is made of.
#[derive(Debug)]
pub struct Contents {
    /// The static guest agent.
    pub agent: Vec<u8>,
    /// The static busybox binary.
    pub busybox: Vec<u8>,
    /// Applet paths from `busybox --list-full` (e.g. `usr/bin/head`).
    pub applets: Vec<String>,
    /// Modules loaded at every boot, in load order: name and file contents.
    pub modules: Vec<(String, Vec<u8>)>,
    /// Modules loaded only to boot an image root (the block device, EROFS, overlayfs), in load order.
    pub root_modules: Vec<(String, Vec<u8>)>,
    /// Modules loaded only when the host shares directories (FUSE, virtiofs), in load order.
    pub mount_modules: Vec<(String, Vec<u8>)>,
}

/// The archive entries, sorted by path, parents before children.
pub fn entries(contents: Contents) -> Vec<Entry> {
    let mut tree: BTreeMap<String, Entry> = BTreeMap::new();
    // The archive's root: without this entry the kernel leaves `/` writable by every user.
    tree.insert(".".into(), Entry { path: ".".into(), perm: 0o755, kind: Kind::Dir });
    let mut add = |path: &str, perm: u32, kind: Kind| {
        for parent in Path::new(path).ancestors().skip(1) {
            let p = parent.to_string_lossy();
            if !p.is_empty() {
                tree.entry(p.to_string()).or_insert(Entry { path: p.to_string(), perm: 0o755, kind: Kind::Dir });
            }
        }
        tree.insert(path.to_owned(), Entry { path: path.to_owned(), perm, kind });
    };

    for dir in ["proc", "sys", "dev", "dev/pts", "run", "root", "etc", "usr/bin", "usr/sbin", "sbin"] {
        add(dir, 0o755, Kind::Dir);
    }
    add("tmp", 0o1777, Kind::Dir);
    add("root", 0o700, Kind::Dir);
    add("dev/console", 0o600, Kind::CharDevice(5, 1));
    add("init", 0o755, Kind::File(contents.agent));
    add("bin/busybox", 0o755, Kind::File(contents.busybox));
    for applet in contents.applets.iter().filter(|a| a.as_str() != "bin/busybox" && !a.contains("..")) {
        add(applet, 0o777, Kind::Symlink("/bin/busybox".into()));
    }
    for (list_path, modules) in [
        ("etc/vm-agent/modules", contents.modules),
        ("etc/vm-agent/modules-root", contents.root_modules),
        ("etc/vm-agent/modules-mount", contents.mount_modules),
    ] {
        let mut list = String::new();
        for (name, bytes) in modules {
            let path = format!("{MODULE_DIR}/{name}.ko");
            list.push_str(&format!("/{path}\n"));
            add(&path, 0o644, Kind::File(bytes));
        }
        add(list_path, 0o644, Kind::File(list.into_bytes()));
    }
    // The workload user's home is made by the agent at boot: archive entries here are all root's.
    let passwd = format!("root:x:0:0:root:/root:/bin/sh\n{}", WORKLOAD.passwd_line());
    add("etc/passwd", 0o644, Kind::File(passwd.into_bytes()));
    add("etc/group", 0o644, Kind::File(format!("root:x:0:\n{}", WORKLOAD.group_line()).into_bytes()));
    add("etc/hostname", 0o644, Kind::File(b"sandbox\n".to_vec()));
    tree.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_sorted_and_complete() {
        let entries = entries(Contents {
            agent: b"agent".to_vec(),
            busybox: b"bb".to_vec(),
            applets: vec!["bin/sh".into(), "usr/bin/head".into(), "bin/busybox".into()],
            modules: vec![("virtio".into(), b"ko".to_vec())],
            root_modules: vec![("erofs".into(), b"ko".to_vec())],
            mount_modules: vec![("virtiofs".into(), b"ko".to_vec())],
        });
        let paths: Vec<_> = entries.iter().map(|e| e.path.as_str()).collect();
        let mut sorted = paths.clone();
        sorted.sort_unstable();
        assert_eq!(paths, sorted);
        for must in
            ["init", "bin/sh", "usr/bin/head", "dev/console", "lib/modules/vm/virtio.ko", "etc/vm-agent/modules"]
        {
            assert!(paths.contains(&must), "{must} missing");
        }
        let list = entries.iter().find(|e| e.path == "etc/vm-agent/modules").unwrap();
        assert_eq!(list.kind, Kind::File(b"/lib/modules/vm/virtio.ko\n".to_vec()));
        let list = entries.iter().find(|e| e.path == "etc/vm-agent/modules-root").unwrap();
        assert_eq!(list.kind, Kind::File(b"/lib/modules/vm/erofs.ko\n".to_vec()));
        assert_eq!(paths.iter().filter(|p| **p == "bin/busybox").count(), 1);
        assert_eq!(paths.first(), Some(&"."), "the root's own mode comes first");
        assert_eq!(entries[0].perm, 0o755);
    }
}

//! Who QEMU runs as, and with what: rlimits, an empty capability bounding set, the jail's ids.

use std::os::unix::fs::MetadataExt;

use nix::unistd::{setgroups, setresgid, setresuid, Gid, Uid};
use rustix::process::{setrlimit, Resource, Rlimit};
use rustix::thread::{remove_capability_from_bounding_set, set_capabilities, CapabilitySet, CapabilitySets};
use vm_contract::jail::{JailIds, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC};

use crate::JailError;

/// Sets QEMU's rlimits: open files, file size (`fsize`), no core dumps (guest memory would be in them),
/// and, when it has a uid of its own, processes (counted per uid, so never for a uid it shares).
pub fn limit(own_uid: bool, fsize: u64) -> Result<(), JailError> {
    let mut limits = vec![(Resource::Nofile, RLIMIT_NOFILE), (Resource::Fsize, fsize), (Resource::Core, 0)];
    if own_uid {
        limits.push((Resource::Nproc, RLIMIT_NPROC));
    }
    for (resource, value) in limits {
        setrlimit(resource, Rlimit { current: Some(value), maximum: Some(value) })
            .map_err(|e| JailError::Step("set an rlimit", e.into()))?;
    }
    Ok(())
}

/// The file server's open-file limit (it holds one for every file the guest looked up), within the hard
/// limit this process has (raising it needs `CAP_SYS_RESOURCE`, which a container may lack), and no core dumps.
pub fn limit_files(nofile: u64) -> Result<(), JailError> {
    let nofile = rustix::process::getrlimit(Resource::Nofile).maximum.map_or(nofile, |hard| hard.min(nofile));
    for (resource, value) in [(Resource::Nofile, nofile), (Resource::Core, 0)] {
        setrlimit(resource, Rlimit { current: Some(value), maximum: Some(value) })
            .map_err(|e| JailError::Step("set an rlimit", e.into()))?;
    }
    Ok(())
}

/// The largest file QEMU may write: none ([`RLIMIT_FSIZE`]), or up to the writable layer's size.
pub fn file_size_limit(writable_disk: Option<&std::path::Path>) -> Result<u64, JailError> {
    match writable_disk {
        Some(disk) => std::fs::metadata(disk).map(|m| m.len()).map_err(JailError::step("read the writable layer")),
        None => Ok(RLIMIT_FSIZE),
    }
}

/// The group that may open `/dev/kvm`: the jailed VMM gets it as its only supplementary group (never group 0).
pub fn kvm_group() -> Result<Option<u32>, JailError> {
    let gid = std::fs::metadata("/dev/kvm").map(|m| m.gid()).map_err(JailError::step("find /dev/kvm"))?;
    Ok((gid != 0).then_some(gid))
}

/// The kernel's highest capability number, read before the jail hides `/proc` (63, every bit, if unreadable).
pub fn last_capability() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(63)
}

/// Empties the capability bounding set, so nothing QEMU execs later could regain one.
fn empty_bounding_set(last: u32) -> Result<(), JailError> {
    limit_bounding_set(last, CapabilitySet::empty())
}

/// Leaves only `keep` in the capability bounding set.
pub fn limit_bounding_set(last: u32, keep: CapabilitySet) -> Result<(), JailError> {
    for bit in 0..=last.min(63) {
        // Every bit is a valid set (rustix's flags are open-ended), and a single bit names one capability.
        let cap = CapabilitySet::from_bits_retain(1 << bit);
        if keep.contains(cap) {
            continue;
        }
        match remove_capability_from_bounding_set(cap) {
            // A capability this kernel does not know is not in the set.
            Ok(()) | Err(rustix::io::Errno::INVAL) => {}
            Err(e) => return Err(JailError::Step("empty the capability bounding set", e.into())),
        }
    }
    Ok(())
}

/// Root: becomes `ids` (with `kvm_group` as the only supplementary group). Leaving uid 0 without
/// `SECBIT_KEEP_CAPS` clears the permitted, effective and ambient sets; they are cleared again to be sure.
pub fn drop_to(ids: JailIds, kvm_group: Option<u32>, last_cap: u32) -> Result<(), JailError> {
    empty_bounding_set(last_cap)?;
    let groups: Vec<Gid> = kvm_group.into_iter().map(Gid::from_raw).collect();
    setgroups(&groups).map_err(JailError::errno("set the supplementary groups"))?;
    let (uid, gid) = (Uid::from_raw(ids.uid), Gid::from_raw(ids.gid));
    setresgid(gid, gid, gid).map_err(JailError::errno("set the jail's gid"))?;
    setresuid(uid, uid, uid).map_err(JailError::errno("set the jail's uid"))?;
    clear_capabilities()
}

/// In a user namespace: maps the caller's own uid and gid to themselves (the only ids an unprivileged
/// process may map), and forbids `setgroups`, as the kernel requires before a gid map.
pub fn map_self(uid: u32, gid: u32) -> Result<(), JailError> {
    let write =
        |file: &str, text: String| std::fs::write(file, text).map_err(JailError::step("map the user namespace"));
    write("/proc/self/setgroups", "deny".into())?;
    write("/proc/self/uid_map", format!("{uid} {uid} 1"))?;
    write("/proc/self/gid_map", format!("{gid} {gid} 1"))
}

/// In a user namespace, after the mounts: gives up the namespace's capabilities.
pub fn drop_capabilities(last_cap: u32) -> Result<(), JailError> {
    empty_bounding_set(last_cap)?;
    clear_capabilities()
}

fn clear_capabilities() -> Result<(), JailError> {
    let none = CapabilitySet::empty();
    set_capabilities(None, CapabilitySets { effective: none, permitted: none, inheritable: none })
        .map_err(|e| JailError::Step("clear the capabilities", e.into()))
}

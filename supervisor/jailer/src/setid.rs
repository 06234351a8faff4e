//! The file server's filter against set-id files and device nodes: a guest that owns a file in a shared
//! directory may `chmod u+s` it (virtiofsd has no option against it), and the host would then hold a
//! set-uid program of the directory's owner for any host user to run. Every call that sets a mode is
//! refused (`EPERM`) when the mode carries a set-uid or set-gid bit or names a device; the server's own
//! seccomp filter, installed after this one, stacks on it.

use std::collections::BTreeMap;

use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

use crate::JailError;

const SET_UID: u64 = 0o4000;
const SET_GID: u64 = 0o2000;
const FILE_TYPE: u64 = 0o170_000;
const CHAR_DEVICE: u64 = 0o020_000;
const BLOCK_DEVICE: u64 = 0o060_000;

/// Each call that takes a mode, with the index of its mode argument.
const MODE_ARGUMENT: [(libc::c_long, u8); 9] = [
    (libc::SYS_chmod, 1),
    (libc::SYS_fchmod, 1),
    (libc::SYS_fchmodat, 2),
    (libc::SYS_fchmodat2, 2),
    (libc::SYS_creat, 1),
    (libc::SYS_open, 2),
    (libc::SYS_openat, 3),
    (libc::SYS_mknod, 1),
    (libc::SYS_mknodat, 2),
];

fn fail(e: impl Into<seccompiler::Error>) -> JailError {
    JailError::Step("install the set-id filter", std::io::Error::other(e.into()))
}

/// Installs the filter on this thread (inherited by the exec). Needs no-new-privileges set.
pub fn forbid() -> Result<(), JailError> {
    let masked = |arg: u8, mask: u64, value: u64| {
        SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(mask), value)
            .and_then(|c| SeccompRule::new(vec![c]))
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (call, arg) in MODE_ARGUMENT {
        let mut refused = vec![masked(arg, SET_UID, SET_UID), masked(arg, SET_GID, SET_GID)];
        if matches!(call, libc::SYS_mknod | libc::SYS_mknodat) {
            refused.push(masked(arg, FILE_TYPE, CHAR_DEVICE));
            refused.push(masked(arg, FILE_TYPE, BLOCK_DEVICE));
        }
        rules.insert(call, refused.into_iter().collect::<Result<_, _>>().map_err(fail)?);
    }
    // Its mode sits in a structure a filter cannot read: refused whole (nothing of the server's uses it).
    rules.insert(libc::SYS_openat2, Vec::new());
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM.unsigned_abs()),
        TargetArch::x86_64,
    )
    .map_err(fail)?;
    let program: seccompiler::BpfProgram = filter.try_into().map_err(fail)?;
    seccompiler::apply_filter(&program).map_err(fail)
}

//! Host directories shared into the guest, as the supervisor and the agent agree on them: one virtiofs
//! device per mount, named by its tag, and one kernel argument that says where each goes.
//!
//! `vm.mounts=0:2f776f726b:rw,1:2f64617461:ro` (index, the guest path's bytes in hex, access). Hex keeps any
//! path off the command line's separators. The guest is told where to mount, never what is shared: the
//! host decides that, and enforces `ro` itself (a read-only bind under its file server); the guest's `ro` is
//! a courtesy.

use std::fmt::Write as _;

/// The kernel argument's name, with its `=`.
pub const KERNEL_ARG_PREFIX: &str = "vm.mounts=";
/// The most host directories one sandbox may have.
pub const MAX_MOUNTS: usize = 8;
/// The longest guest path, in bytes (the kernel's command line is 2 KiB in all).
pub const MAX_TARGET_BYTES: usize = 96;

/// One mount, as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestMount {
    /// The device's index: its virtiofs tag is [`tag`] of it.
    pub index: usize,
    /// Where it is mounted in the guest (absolute).
    pub target: String,
    /// Mounted read-only.
    pub readonly: bool,
}

/// The virtiofs tag of mount `index`.
pub fn tag(index: usize) -> String {
    format!("vmfs{index}")
}

/// Whether `target` may be a mount's guest path: absolute, normal (no `.`, `..` or empty part), short, not `/`
/// and not under the kernel's own filesystems.
pub fn target_ok(target: &str) -> bool {
    let parts: Vec<&str> = target.split('/').skip(1).collect();
    target.starts_with('/')
        && target.len() <= MAX_TARGET_BYTES
        && !parts.is_empty()
        && parts.iter().all(|p| !p.is_empty() && *p != "." && *p != "..")
        && !target.bytes().any(|b| b == 0 || b.is_ascii_control())
        && !matches!(parts[0], "proc" | "sys" | "dev" | "run")
}

/// The kernel argument for `mounts` (indices in order), or `None` when there are none.
pub fn kernel_arg(mounts: &[GuestMount]) -> Option<String> {
    if mounts.is_empty() {
        return None;
    }
    let mut arg = String::from(KERNEL_ARG_PREFIX);
    for (i, m) in mounts.iter().enumerate() {
        if i > 0 {
            arg.push(',');
        }
        let _ = write!(arg, "{}:", m.index);
        push_target(&mut arg, &m.target);
        arg.push_str(if m.readonly { ":ro" } else { ":rw" });
    }
    Some(arg)
}

/// Appends `target`'s bytes in hex: no path reaches the command line's separators.
pub(crate) fn push_target(arg: &mut String, target: &str) {
    for b in target.as_bytes() {
        let _ = write!(arg, "{b:02x}");
    }
}

/// The guest path [`push_target`] wrote, when it is one a mount may have ([`target_ok`]).
pub(crate) fn parse_target(hex: &str) -> Option<String> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect();
    String::from_utf8(bytes?).ok().filter(|t| target_ok(t))
}

/// The mounts a kernel command line asks for. Anything malformed is refused whole: the guest mounts
/// nothing rather than something other than asked.
pub fn parse_cmdline(cmdline: &str) -> Option<Vec<GuestMount>> {
    let value = cmdline.split_whitespace().find_map(|a| a.strip_prefix(KERNEL_ARG_PREFIX))?;
    let mounts: Option<Vec<GuestMount>> = value.split(',').map(parse_one).collect();
    mounts.filter(|m| m.len() <= MAX_MOUNTS)
}

fn parse_one(item: &str) -> Option<GuestMount> {
    let mut parts = item.split(':');
    let (index, hex, access) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let index: usize = index.parse().ok().filter(|i| *i < MAX_MOUNTS)?;
    let target = parse_target(hex)?;
    let readonly = match access {
        "ro" => true,
        "rw" => false,
        _ => return None,
    };
    Some(GuestMount { index, target, readonly })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_round_trip_through_the_command_line() {
        let mounts = vec![
            GuestMount { index: 0, target: "/work".into(), readonly: false },
            GuestMount { index: 1, target: "/data/with space,comma".into(), readonly: true },
        ];
        let arg = kernel_arg(&mounts).unwrap();
        assert!(!arg.contains(' ') && arg.starts_with(KERNEL_ARG_PREFIX));
        assert_eq!(parse_cmdline(&format!("console=ttyS0 {arg} quiet")), Some(mounts));
        assert_eq!(kernel_arg(&[]), None);
        assert_eq!(parse_cmdline("console=ttyS0"), None);
    }

    #[test]
    fn bad_targets_and_malformed_arguments_are_refused() {
        for bad in ["", "/", "work", "/a/../b", "/a//b", "/a/.", "/proc/x", "/dev", "/a\nb", &"/x".repeat(60)] {
            assert!(!target_ok(bad), "{bad:?}");
        }
        assert!(target_ok("/home/sandbox/work") && target_ok("/mnt"));
        for bad in
            ["vm.mounts=", "vm.mounts=0:2f:rw", "vm.mounts=9:2f61:rw", "vm.mounts=0:2f6:rw", "vm.mounts=0:2f61:rx"]
        {
            assert_eq!(parse_cmdline(bad), None, "{bad}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_command_line_parses_without_panicking(line in ".{0,200}") {
            let _ = parse_cmdline(&line);
            let _ = parse_cmdline(&format!("{KERNEL_ARG_PREFIX}{line}"));
        }
    }
}

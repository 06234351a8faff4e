//! Memory file systems the guest mounts in the workload's root (`launch --tmpfs`, a container's `tmpfs`
//! mounts), as the supervisor and the agent agree on them: one kernel argument that says where each goes,
//! how large it may grow and how it is mounted.
//!
//! `vm.tmpfs=2f736372617463680a:1048576:1777:rw:noexec` (the guest path's bytes in hex, the size in bytes or
//! `-` for the kernel's default of half the guest's memory, the root's mode in octal, access, exec). A tmpfs
//! is the guest's own memory: nothing of the host's is shared, and it is gone with the sandbox. Every one is
//! `nosuid` and `nodev`.

use std::fmt::Write as _;

use crate::mounts::{parse_target, push_target, target_ok};

/// The kernel argument's name, with its `=`.
pub const KERNEL_ARG_PREFIX: &str = "vm.tmpfs=";
/// The most tmpfs mounts one sandbox may have.
pub const MAX_TMPFS: usize = 8;
/// The root's mode when none is given: anyone may write, only an owner remove (as `/tmp`).
pub const DEFAULT_MODE: u32 = 0o1777;

/// One tmpfs, as the guest mounts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestTmpfs {
    /// Where it is mounted in the guest (absolute, [`target_ok`]).
    pub target: String,
    /// Its most bytes (`None`: the kernel's default).
    pub size: Option<u64>,
    /// Permission bits of its root (at most `0o7777`).
    pub mode: u32,
    /// Mounted read-only (an empty file system: rarely useful, but what was asked).
    pub readonly: bool,
    /// Programs on it may not be run.
    pub noexec: bool,
}

/// Why a tmpfs cannot be mounted as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TmpfsError {
    /// The guest path is not one a mount may have.
    #[error("a tmpfs's guest path must be absolute and normal, not under /proc, /sys, /dev or /run, at most 96 bytes")]
    Target,
    /// An option this guest does not honour.
    #[error(
        "the tmpfs option {0:?} is not one of size=, mode=, ro, rw, exec, noexec, nosuid, nodev and the atime options"
    )]
    Option(String),
    /// `size=` or `mode=` with a value that is not one.
    #[error("the tmpfs option {0:?} has a malformed value")]
    Value(String),
    /// More than [`MAX_TMPFS`].
    #[error("at most 8 tmpfs mounts")]
    TooMany,
    /// Two at one guest path.
    #[error("two tmpfs mounts at {0}")]
    Twice(String),
}

/// Checks a sandbox's tmpfs mounts together: at most [`MAX_TMPFS`], each at a path of its own.
///
/// # Errors
/// [`TmpfsError::TooMany`], [`TmpfsError::Twice`].
pub fn check(tmpfs: &[GuestTmpfs]) -> Result<(), TmpfsError> {
    if tmpfs.len() > MAX_TMPFS {
        return Err(TmpfsError::TooMany);
    }
    match tmpfs.iter().enumerate().find(|(i, t)| tmpfs[..*i].iter().any(|e| e.target == t.target)) {
        Some((_, t)) => Err(TmpfsError::Twice(t.target.clone())),
        None => Ok(()),
    }
}

impl GuestTmpfs {
    /// A tmpfs at `target` with mount options as Docker's `--tmpfs` and the OCI spec give them
    /// (`size=64m`, `mode=1770`, `ro`, `noexec`, ...). `nosuid` and `nodev` are always in force; the atime
    /// options are accepted and left to the kernel's default.
    ///
    /// # Errors
    /// [`TmpfsError`], for the target or the first option refused.
    pub fn new<'a>(target: &str, options: impl IntoIterator<Item = &'a str>) -> Result<Self, TmpfsError> {
        if !target_ok(target) {
            return Err(TmpfsError::Target);
        }
        let mut tmpfs =
            Self { target: target.to_owned(), size: None, mode: DEFAULT_MODE, readonly: false, noexec: false };
        for option in options.into_iter().filter(|o| !o.is_empty()) {
            let bad_value = || TmpfsError::Value(option.to_owned());
            if let Some(size) = option.strip_prefix("size=") {
                tmpfs.size = Some(parse_size(size).ok_or_else(bad_value)?);
            } else if let Some(mode) = option.strip_prefix("mode=") {
                tmpfs.mode = u32::from_str_radix(mode, 8).ok().filter(|m| *m <= 0o7777).ok_or_else(bad_value)?;
            } else {
                match option {
                    "ro" => tmpfs.readonly = true,
                    "rw" => tmpfs.readonly = false,
                    "noexec" => tmpfs.noexec = true,
                    "exec" => tmpfs.noexec = false,
                    "nosuid" | "nodev" | "strictatime" | "relatime" | "noatime" | "nodiratime" => {}
                    _ => return Err(TmpfsError::Option(option.to_owned())),
                }
            }
        }
        Ok(tmpfs)
    }

    /// Docker's `--tmpfs` form: `PATH[:OPTION,...]`.
    ///
    /// # Errors
    /// As [`GuestTmpfs::new`].
    pub fn parse_flag(flag: &str) -> Result<Self, TmpfsError> {
        let (target, options) = flag.split_once(':').unwrap_or((flag, ""));
        Self::new(target, options.split(','))
    }

    /// The options as [`GuestTmpfs::new`] takes them, `size=` in bytes: `parse_flag` of `TARGET:` and this
    /// gives back the same tmpfs.
    pub fn options(&self) -> String {
        let mut out = format!("mode={:o},{}", self.mode, if self.readonly { "ro" } else { "rw" });
        if self.noexec {
            out.push_str(",noexec");
        }
        if let Some(size) = self.size {
            let _ = write!(out, ",size={size}");
        }
        out
    }
}

/// `64m`, `65536k`, `1g`, `4096`: bytes. A value with no room in a u64 is none.
fn parse_size(text: &str) -> Option<u64> {
    let (digits, unit) = match text.char_indices().last()? {
        (i, c) if c.is_ascii_alphabetic() => (&text[..i], c.to_ascii_lowercase()),
        _ => (text, 'b'),
    };
    let shift = match unit {
        'b' => 0,
        'k' => 10,
        'm' => 20,
        'g' => 30,
        _ => return None,
    };
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(1 << shift)
}

/// The kernel argument for `tmpfs`, or `None` when there are none.
pub fn kernel_arg(tmpfs: &[GuestTmpfs]) -> Option<String> {
    if tmpfs.is_empty() {
        return None;
    }
    let mut arg = String::from(KERNEL_ARG_PREFIX);
    for (i, t) in tmpfs.iter().enumerate() {
        if i > 0 {
            arg.push(',');
        }
        push_target(&mut arg, &t.target);
        let _ = match t.size {
            Some(size) => write!(arg, ":{size}"),
            None => write!(arg, ":-"),
        };
        let _ = write!(arg, ":{:o}", t.mode);
        arg.push_str(if t.readonly { ":ro" } else { ":rw" });
        arg.push_str(if t.noexec { ":noexec" } else { ":exec" });
    }
    Some(arg)
}

/// The tmpfs mounts a kernel command line asks for (none without the argument). Anything malformed is
/// refused whole: the guest mounts nothing rather than something other than asked.
pub fn parse_cmdline(cmdline: &str) -> Option<Vec<GuestTmpfs>> {
    let Some(value) = cmdline.split_whitespace().find_map(|a| a.strip_prefix(KERNEL_ARG_PREFIX)) else {
        return Some(Vec::new());
    };
    let tmpfs: Option<Vec<GuestTmpfs>> = value.split(',').map(parse_one).collect();
    tmpfs.filter(|t| t.len() <= MAX_TMPFS)
}

fn parse_one(item: &str) -> Option<GuestTmpfs> {
    let parts: Vec<&str> = item.split(':').collect();
    let [hex, size, mode, access, exec] = parts[..] else {
        return None;
    };
    let target = parse_target(hex)?;
    let size = match size {
        "-" => None,
        n => Some(n.parse().ok()?),
    };
    let mode = u32::from_str_radix(mode, 8).ok().filter(|m| *m <= 0o7777)?;
    let readonly = match access {
        "ro" => true,
        "rw" => false,
        _ => return None,
    };
    let noexec = match exec {
        "noexec" => true,
        "exec" => false,
        _ => return None,
    };
    Some(GuestTmpfs { target, size, mode, readonly, noexec })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_as_docker_takes_them_and_round_trip() {
        let t = GuestTmpfs::parse_flag("/scratch:size=64m,mode=1770,noexec,nosuid").unwrap();
        assert_eq!(
            t,
            GuestTmpfs { target: "/scratch".into(), size: Some(64 << 20), mode: 0o1770, readonly: false, noexec: true }
        );
        assert_eq!(GuestTmpfs::parse_flag(&format!("/scratch:{}", t.options())), Ok(t));
        let bare = GuestTmpfs::parse_flag("/cache").unwrap();
        assert_eq!((bare.size, bare.mode, bare.readonly, bare.noexec), (None, DEFAULT_MODE, false, false));
        assert_eq!(GuestTmpfs::parse_flag(&format!("/cache:{}", bare.options())), Ok(bare));
        assert_eq!(GuestTmpfs::parse_flag("/x:size=65536k").unwrap().size, Some(64 << 20));
        assert_eq!(GuestTmpfs::parse_flag("/x:size=4096").unwrap().size, Some(4096));
    }

    #[test]
    fn bad_targets_and_options_are_refused_by_name() {
        for bad in ["x", "/", "/proc/x", "/a/../b", ""] {
            assert_eq!(GuestTmpfs::parse_flag(bad), Err(TmpfsError::Target), "{bad:?}");
        }
        assert_eq!(GuestTmpfs::parse_flag("/x:suid"), Err(TmpfsError::Option("suid".into())));
        for bad in [
            "size=",
            "size=1t",
            "size=-1",
            "size=99999999999999999999",
            "size=18446744073709551615k",
            "mode=9",
            "mode=17777",
        ] {
            assert_eq!(GuestTmpfs::parse_flag(&format!("/x:{bad}")), Err(TmpfsError::Value(bad.into())), "{bad}");
        }
    }

    #[test]
    fn mounts_round_trip_through_the_command_line() {
        let tmpfs = vec![
            GuestTmpfs::parse_flag("/scratch:size=1m,noexec").unwrap(),
            GuestTmpfs::parse_flag("/data/with space,comma:ro,mode=700").unwrap(),
        ];
        let arg = kernel_arg(&tmpfs).unwrap();
        assert!(!arg.contains(' ') && arg.starts_with(KERNEL_ARG_PREFIX));
        assert_eq!(parse_cmdline(&format!("console=ttyS0 {arg} quiet")), Some(tmpfs));
        assert_eq!(kernel_arg(&[]), None);
        assert_eq!(parse_cmdline("console=ttyS0"), Some(Vec::new()));
        for bad in [
            "vm.tmpfs=",
            "vm.tmpfs=2f78:-:1777:rw",
            "vm.tmpfs=2f:-:1777:rw:exec",
            "vm.tmpfs=2f78:x:1777:rw:exec",
            "vm.tmpfs=2f78:-:9:rw:exec",
            "vm.tmpfs=2f78:-:1777:rx:exec",
            "vm.tmpfs=2f78:-:1777:rw:run",
        ] {
            assert_eq!(parse_cmdline(bad), None, "{bad}");
        }
        let x = GuestTmpfs::parse_flag("/x").unwrap();
        assert_eq!(check(&[x.clone(), GuestTmpfs::parse_flag("/y").unwrap()]), Ok(()));
        assert_eq!(check(&[x.clone(), x.clone()]), Err(TmpfsError::Twice("/x".into())));
        assert_eq!(check(&vec![x; MAX_TMPFS + 1]), Err(TmpfsError::TooMany));
        let nine = ["2f78:-:1777:rw:exec"; MAX_TMPFS + 1].join(",");
        assert_eq!(parse_cmdline(&format!("{KERNEL_ARG_PREFIX}{nine}")), None);
    }

    proptest::proptest! {
        #[test]
        fn any_command_line_or_flag_parses_without_panicking(line in ".{0,200}") {
            let _ = parse_cmdline(&line);
            let _ = parse_cmdline(&format!("{KERNEL_ARG_PREFIX}{line}"));
            let _ = GuestTmpfs::parse_flag(&line);
        }
    }
}

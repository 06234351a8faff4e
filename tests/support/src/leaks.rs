//! Looking for a secret where it must not be: the files under a directory (disks included) and every
//! process of the host. Each probe is only worth something with a control that shows it finds a planted
//! copy.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Whether `needle` occurs in `haystack`.
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}

/// The regular files under `dir`, recursively, that hold `needle`. What cannot be read (a directory or
/// file that vanished under the scan) is skipped.
pub fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_owned()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let (path, Ok(kind)) = (entry.path(), entry.file_type()) else { continue };
            if kind.is_dir() {
                dirs.push(path);
            } else if kind.is_file() && std::fs::read(&path).is_ok_and(|bytes| contains(&bytes, needle)) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The processes of the host whose argv or environment holds `needle`, as `PID/cmdline` or `PID/environ`.
pub fn processes_holding(needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        for file in ["cmdline", "environ"] {
            if std::fs::read(entry.path().join(file)).is_ok_and(|b| contains(&b, needle)) {
                found.push(format!("{name}/{file}"));
            }
        }
    }
    found
}

/// Searches the VMM's writable mappings of 16 MiB or more (the guest's RAM) for `needle`; returns whether
/// it was found and how many bytes were read.
pub fn guest_memory_holds(vmm: i32, needle: &[u8]) -> (bool, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{vmm}/maps")).unwrap();
    let mem = std::fs::File::open(format!("/proc/{vmm}/mem")).unwrap();
    let (mut scanned, chunk) = (0u64, 8usize << 20);
    let mut buf = vec![0u8; chunk + needle.len()];
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (range, perms) = (fields.next().unwrap(), fields.next().unwrap());
        let (start, end) = range.split_once('-').unwrap();
        let (start, end) = (u64::from_str_radix(start, 16).unwrap(), u64::from_str_radix(end, 16).unwrap());
        if !perms.starts_with("rw") || end - start < 16 << 20 {
            continue;
        }
        let mut at = start;
        while at < end {
            let want = usize::try_from((end - at).min(buf.len() as u64)).unwrap();
            let Ok(n) = mem.read_at(&mut buf[..want], at) else { break };
            if n == 0 {
                break;
            }
            scanned += n as u64;
            if contains(&buf[..n], needle) {
                return (true, scanned);
            }
            at += chunk as u64;
        }
    }
    (false, scanned)
}

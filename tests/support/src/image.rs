//! Deliberately broken guest images, made from the real one: read its `newc` archive, swap `/init`, write
//! it back with the image builder's own writer.

use std::path::{Path, PathBuf};

use vm_image::cpio::{self, Entry, Kind, S_IFCHR, S_IFDIR, S_IFLNK, S_IFREG};

/// Parses a `newc` archive (enough of it for images this project builds).
pub fn read_cpio(bytes: &[u8]) -> Vec<Entry> {
    let mut entries = Vec::new();
    let mut at = 0;
    let field = |at: usize, i: usize| -> u32 {
        let text = std::str::from_utf8(&bytes[at + 6 + i * 8..at + 14 + i * 8]).unwrap();
        u32::from_str_radix(text, 16).unwrap()
    };
    let align = |n: usize| (n + 3) & !3;
    loop {
        assert_eq!(&bytes[at..at + 6], b"070701", "not a newc archive");
        let mode = field(at, 1);
        let size = field(at, 6) as usize;
        let namesize = field(at, 11) as usize;
        let rdev = (field(at, 9), field(at, 10));
        let name = std::str::from_utf8(&bytes[at + 110..at + 110 + namesize - 1]).unwrap().to_owned();
        let data_at = align(at + 110 + namesize);
        let data = bytes[data_at..data_at + size].to_vec();
        at = align(data_at + size);
        if name == "TRAILER!!!" {
            return entries;
        }
        let kind = match mode & 0o170_000 {
            S_IFDIR => Kind::Dir,
            S_IFREG => Kind::File(data),
            S_IFLNK => Kind::Symlink(String::from_utf8(data).unwrap()),
            S_IFCHR => Kind::CharDevice(rdev.0, rdev.1),
            other => panic!("unexpected file type {other:o} for {name}"),
        };
        entries.push(Entry { path: name, perm: mode & 0o7777, kind });
    }
}

/// A busybox script that brings the guest channel up the way the agent does, and waits for its port: the
/// start of a guest that then speaks on `/dev/vport0p1` itself.
pub const CHANNEL_UP: &str = r#"
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $(/bin/busybox cat /etc/vm-agent/modules); do /bin/busybox insmod $m; done
while [ ! -e /sys/class/virtio-ports/vport0p1/name ]; do :; done"#;

/// Writes a copy of the harness image's initramfs with `/init` replaced by `script` (run by busybox sh),
/// into `dir`, and returns its path. The agent stays in the archive (as `/init.agent`), so the image is as
/// large as the real one and a boot-time baseline built from it unpacks the same bytes.
pub fn with_init_script(dir: &Path, script: &str) -> PathBuf {
    with_init(dir, "broken-initramfs.cpio", format!("#!/bin/busybox sh\n{script}\n").into_bytes(), &[])
}

/// A copy of the harness image whose PID 1 prints [`CANARY`](crate::CANARY) on the console and then loops
/// forever, ignoring everything: a guest that never powers itself off (a compromised one would not), so that
/// only the host's mechanisms can end it. Boot it with a long `--boot-timeout`: it never says hello.
pub fn with_init_that_never_stops(dir: &Path) -> PathBuf {
    with_init_script(dir, &format!("echo {} > /dev/console\nwhile :; do /bin/busybox sleep 1; done", crate::CANARY))
}

/// Where `scripts/test` builds the rogue agent (`scripts/guest-cargo -p vm-rogue-agent`).
pub fn rogue_agent() -> PathBuf {
    let path = crate::repo().join("target/guest/x86_64-unknown-linux-gnu/release/vm-rogue-agent");
    assert!(
        path.is_file(),
        "{} is missing: scripts/test builds it (scripts/guest-cargo -p vm-rogue-agent)",
        path.display()
    );
    path
}

/// A copy of the harness image whose PID 1 is the rogue agent, attacking in `mode` (see
/// `tests/rogue-agent`), written into `dir`.
pub fn with_rogue_agent(dir: &Path, mode: &str) -> PathBuf {
    with_rogue_agent_files(dir, mode, &[])
}

/// The same, with `extra` files (path in the image, contents) beside `/etc/rogue-mode`.
pub fn with_rogue_agent_files(dir: &Path, mode: &str, extra: &[(&str, Vec<u8>)]) -> PathBuf {
    let rogue = std::fs::read(rogue_agent()).unwrap();
    let name = format!("rogue-{mode}.cpio");
    let mut files = vec![("etc/rogue-mode", format!("{mode}\n").into_bytes())];
    files.extend(extra.iter().cloned());
    with_init(dir, &name, rogue, &files)
}

/// An image directory for `serve --images`: `default` (the harness image) and, for each mode, `rogue-MODE`,
/// whose PID 1 is the rogue agent attacking in that mode. Returns the directory.
pub fn images_with_rogues(dir: &Path, modes: &[&str]) -> PathBuf {
    let root = dir.join("images");
    let image = &crate::harness().image;
    for (name, initrd) in std::iter::once(("default".to_owned(), image.join("initramfs.cpio")))
        .chain(modes.iter().map(|m| (format!("rogue-{m}"), with_rogue_agent(dir, m))))
    {
        let into = root.join(name);
        std::fs::create_dir_all(&into).unwrap();
        std::os::unix::fs::symlink(image.join("vmlinuz"), into.join("vmlinuz")).unwrap();
        std::os::unix::fs::symlink(initrd, into.join("initramfs.cpio")).unwrap();
    }
    root
}

fn with_init(dir: &Path, name: &str, init_bytes: Vec<u8>, extra: &[(&str, Vec<u8>)]) -> PathBuf {
    let original = std::fs::read(crate::harness().image.join("initramfs.cpio")).unwrap();
    let mut entries = read_cpio(&original);
    let init = entries.iter_mut().find(|e| e.path == "init").expect("the image has /init");
    init.perm = 0o755;
    let agent = std::mem::replace(&mut init.kind, Kind::File(init_bytes));
    entries.push(Entry { path: "init.agent".into(), perm: 0o644, kind: agent });
    for (path, bytes) in extra {
        entries.push(Entry { path: (*path).to_owned(), perm: 0o644, kind: Kind::File(bytes.clone()) });
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    let mut out = Vec::new();
    cpio::write(&mut out, &entries, 0).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, out).unwrap();
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_what_the_builder_writes() {
        let entries = vec![
            Entry { path: "bin".into(), perm: 0o755, kind: Kind::Dir },
            Entry { path: "bin/sh".into(), perm: 0o777, kind: Kind::Symlink("busybox".into()) },
            Entry { path: "dev/console".into(), perm: 0o600, kind: Kind::CharDevice(5, 1) },
            Entry { path: "init".into(), perm: 0o755, kind: Kind::File(b"#!x\n".to_vec()) },
        ];
        let mut out = Vec::new();
        cpio::write(&mut out, &entries, 0).unwrap();
        assert_eq!(read_cpio(&out), entries);
    }
}

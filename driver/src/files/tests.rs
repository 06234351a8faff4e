//! The hardened extractor against crafted tars, each on a real directory: the refusal it names, and nothing
//! written outside the destination (or left beside it). The same tars through the `unchecked-extract`
//! control show what the checks prevent.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use tar::{EntryType, Header};

use super::*;

/// A tar made entry by entry, with any name, type and size the test wants.
struct Crafted(Vec<u8>);

impl Crafted {
    fn new() -> Self {
        Self(Vec::new())
    }

    fn entry(mut self, kind: EntryType, name: &[u8], link: &[u8], mode: u32, data: &[u8]) -> Self {
        let mut h = Header::new_gnu();
        h.set_entry_type(kind);
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
        h.set_mode(mode);
        h.set_size(data.len() as u64);
        h.set_cksum();
        self.0.extend_from_slice(h.as_bytes());
        self.0.extend_from_slice(data);
        self.0.resize(self.0.len().div_ceil(512) * 512, 0);
        self
    }

    fn dir(self, name: &str) -> Self {
        self.entry(EntryType::Directory, name.as_bytes(), b"", 0o755, b"")
    }

    fn file(self, name: &str, data: &[u8]) -> Self {
        self.entry(EntryType::Regular, name.as_bytes(), b"", 0o644, data)
    }

    fn symlink(self, name: &str, target: &str) -> Self {
        self.entry(EntryType::Symlink, name.as_bytes(), target.as_bytes(), 0o777, b"")
    }

    /// A header that claims `size` bytes of data, and none follows.
    fn claims(mut self, name: &str, size: u64) -> Self {
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Regular);
        h.set_path(name).unwrap();
        h.set_mode(0o644);
        h.set_size(size);
        h.set_cksum();
        self.0.extend_from_slice(h.as_bytes());
        self
    }

    fn end(mut self) -> Vec<u8> {
        self.0.extend_from_slice(&[0; 1024]);
        self.0
    }
}

/// Copies `tar` (the guest's `/out`) into `dir/dest`.
fn out(dir: &Path, tar: &[u8], confined: bool) -> Result<Unpacked, CopyOutError> {
    let dest = Destination::resolve("/out", &dir.join("dest"))?;
    copy_out(tar, &dest, Limits::default(), confined, || true)
}

/// Everything under `dir`, as relative paths.
fn listing(dir: &Path) -> Vec<String> {
    let mut all = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            all.push(p.strip_prefix(dir).unwrap().display().to_string());
            if p.symlink_metadata().unwrap().is_dir() {
                todo.push(p);
            }
        }
    }
    all.sort();
    all
}

fn refused(tar: Vec<u8>, reason: TarRefusal) {
    let dir = tempfile::tempdir().unwrap();
    match out(dir.path(), &tar, true) {
        Err(CopyOutError::Refused(r)) => assert_eq!(r, reason),
        other => panic!("expected {reason:?}, got {other:?}"),
    }
    assert_eq!(listing(dir.path()), Vec::<String>::new(), "nothing is left beside the destination");
}

#[test]
fn a_tree_lands_whole_with_its_modes_and_without_set_id_bits() {
    let dir = tempfile::tempdir().unwrap();
    let tar = Crafted::new()
        .dir("out/")
        .dir("out/ro/")
        .file("out/ro/a", b"alpha")
        .entry(EntryType::Regular, b"out/suid", b"", 0o4755, b"#!/bin/sh\n")
        .symlink("out/link", "ro/a")
        .entry(EntryType::Link, b"out/hard", b"out/ro/a", 0o644, b"")
        .end();
    let unpacked = out(dir.path(), &tar, true).unwrap();
    assert!(unpacked.top_is_dir);
    let dest = dir.path().join("dest");
    assert_eq!(fs::read(dest.join("link")).unwrap(), b"alpha");
    assert_eq!(fs::metadata(dest.join("hard")).unwrap().ino(), fs::metadata(dest.join("ro/a")).unwrap().ino());
    assert_eq!(fs::metadata(dest.join("suid")).unwrap().permissions().mode() & 0o7777, 0o755);
    assert_eq!(listing(dir.path()), ["dest", "dest/hard", "dest/link", "dest/ro", "dest/ro/a", "dest/suid"]);
}

#[test]
fn into_an_existing_directory_it_lands_under_the_sources_name_and_never_merges() {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir(dir.path().join("dest")).unwrap();
    let tar = Crafted::new().dir("whatever-the-guest-says/").file("whatever-the-guest-says/f", b"1").end();
    out(dir.path(), &tar, true).unwrap();
    assert_eq!(fs::read(dir.path().join("dest/out/f")).unwrap(), b"1");
    // Refused before any byte is read.
    match Destination::resolve("/out", &dir.path().join("dest")) {
        Err(CopyOutError::Destination(why)) => assert!(why.contains("does not merge"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(listing(dir.path()), ["dest", "dest/out", "dest/out/f"]);
}

#[test]
fn a_whole_tar_of_a_failed_operation_does_not_land() {
    let dir = tempfile::tempdir().unwrap();
    let dest = Destination::resolve("/out", &dir.path().join("dest")).unwrap();
    let tar = Crafted::new().file("out", b"x").end();
    assert!(matches!(copy_out(&tar[..], &dest, Limits::default(), true, || false), Err(CopyOutError::Abandoned)));
    assert_eq!(listing(dir.path()), Vec::<String>::new());
}

#[test]
fn a_file_replaces_a_file() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("dest"), b"old").unwrap();
    out(dir.path(), &Crafted::new().file("out", b"new").end(), true).unwrap();
    assert_eq!(fs::read(dir.path().join("dest")).unwrap(), b"new");
}

#[test]
fn names_that_leave_are_refused() {
    refused(Crafted::new().file("/etc/evil", b"x").end(), TarRefusal::AbsolutePath);
    refused(Crafted::new().dir("out/").file("out/../../evil", b"x").end(), TarRefusal::ParentDir);
    refused(Crafted::new().dir("out/").file("other/x", b"x").end(), TarRefusal::Duplicate);
    refused(Crafted::new().dir("out/").file("out/x", b"1").file("out/x", b"2").end(), TarRefusal::Duplicate);
}

#[test]
fn a_symlink_out_then_a_file_through_it_is_refused_and_the_control_writes_outside() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let escape = |target: &str| Crafted::new().dir("out/").symlink("out/esc", target).file("out/esc/pwned", b"x").end();
    refused(escape(outside.path().to_str().unwrap()), TarRefusal::AbsolutePath);
    refused(escape("../.."), TarRefusal::ParentDir);
    // A symlink that stays inside is kept, but no entry may pass through it.
    refused(escape("."), TarRefusal::ThroughSymlink);
    assert!(!outside.path().join("pwned").exists());
    // The control: the checks off, the file lands outside the destination.
    let _ = out(dir.path(), &escape(outside.path().to_str().unwrap()), false);
    assert!(outside.path().join("pwned").exists(), "the unchecked extractor writes through the symlink");
}

#[test]
fn hard_links_reach_only_the_tars_own_files() {
    let host = tempfile::tempdir().unwrap();
    let secret = host.path().join("secret");
    fs::write(&secret, b"host").unwrap();
    let link = |target: &[u8]| Crafted::new().dir("out/").entry(EntryType::Link, b"out/h", target, 0o644, b"").end();
    refused(link(secret.to_str().unwrap().as_bytes()), TarRefusal::ForeignHardLink);
    refused(link(b"out/../../secret"), TarRefusal::ForeignHardLink);
    refused(link(b"out/not-yet"), TarRefusal::ForeignHardLink);
    assert_eq!(fs::metadata(&secret).unwrap().nlink(), 1);
}

#[test]
fn devices_fifos_and_sparse_entries_are_refused() {
    for kind in [EntryType::Char, EntryType::Block, EntryType::Fifo, EntryType::GNUSparse] {
        refused(Crafted::new().dir("out/").entry(kind, b"out/dev", b"", 0o666, b"").end(), TarRefusal::SpecialFile);
    }
}

#[test]
fn sizes_are_judged_from_the_header_before_any_data() {
    // 10 GiB claimed and never sent: refused at the header, with nothing read or written.
    refused(Crafted::new().dir("out/").claims("out/huge", 10 << 30).end(), TarRefusal::TooManyBytes);
    let dir = tempfile::tempdir().unwrap();
    let dest = Destination::resolve("/out", &dir.path().join("dest")).unwrap();
    let small = Limits { max_bytes: 3, ..Limits::default() };
    let tar = Crafted::new().dir("out/").file("out/a", b"12").file("out/b", b"34").end();
    assert!(matches!(
        copy_out(&tar[..], &dest, small, true, || true),
        Err(CopyOutError::Refused(TarRefusal::TooManyBytes))
    ));
    // A header whose data is cut short.
    let mut cut = Crafted::new().dir("out/").file("out/a", &[7; 2000]).end();
    cut.truncate(1024 + 600);
    refused(cut, TarRefusal::Malformed);
}

#[test]
fn entries_and_names_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let dest = Destination::resolve("/out", &dir.path().join("dest")).unwrap();
    let mut many = Crafted::new().dir("out/");
    for i in 0..20 {
        many = many.file(&format!("out/{i}"), b"");
    }
    let few = Limits { max_entries: 10, ..Limits::default() };
    assert!(matches!(
        copy_out(&many.end()[..], &dest, few, true, || true),
        Err(CopyOutError::Refused(TarRefusal::TooManyEntries))
    ));
    assert_eq!(listing(dir.path()), Vec::<String>::new());
    // A GNU long name that claims more than a path can be: refused before it is read.
    let long = Crafted::new().dir("out/").entry(EntryType::GNULongName, b"././@LongLink", b"", 0o644, &[b'a'; 5000]);
    refused(long.file("out/x", b"").end(), TarRefusal::PathTooLong);
}

#[test]
fn long_names_from_the_tar_crate_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let deep = format!("out/{}/{}", "d".repeat(90), "f".repeat(120));
    let mut b = tar::Builder::new(Vec::new());
    let mut h = Header::new_gnu();
    h.set_size(3);
    h.set_mode(0o600);
    b.append_data(&mut h, &deep, &b"abc"[..]).unwrap();
    out(dir.path(), &b.into_inner().unwrap(), true).unwrap();
    assert_eq!(fs::read(dir.path().join("dest").join(&deep[4..])).unwrap(), b"abc");
}

#[test]
fn garbage_is_refused_and_never_panics() {
    for junk in [&b""[..], b"not a tar", &[0xff; 2048]] {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(out(dir.path(), junk, true), Err(CopyOutError::Refused(TarRefusal::Malformed))));
    }
}

#[test]
fn a_source_without_a_name_or_a_missing_directory_is_refused_before_any_byte() {
    let dir = tempfile::tempdir().unwrap();
    assert!(Destination::resolve("/", dir.path()).is_err());
    assert!(Destination::resolve("/out", &dir.path().join("missing/dest")).is_err());
    assert!(Destination::resolve("/out", &dir.path().join("missing/")).is_err());
}

#[test]
fn a_host_tree_packs_and_unpacks_to_the_same_bytes_and_modes() {
    let src = tempfile::tempdir().unwrap();
    let tree = src.path().join("tree");
    fs::create_dir_all(tree.join("sub")).unwrap();
    fs::write(tree.join("sub/x"), b"xx").unwrap();
    fs::set_permissions(tree.join("sub/x"), fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::symlink("sub/x", tree.join("l")).unwrap();
    let (mut rx, packer) = pack::start(&tree).unwrap();
    let mut tar = Vec::new();
    while let Some(chunk) = rx.blocking_recv() {
        tar.extend_from_slice(&chunk);
    }
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    rt.block_on(packer.finish()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dest = Destination::resolve("/tree", &dir.path().join("copy")).unwrap();
    copy_out(&tar[..], &dest, Limits::default(), true, || true).unwrap();
    let copy = dir.path().join("copy");
    assert_eq!(fs::read(copy.join("sub/x")).unwrap(), b"xx");
    assert_eq!(fs::metadata(copy.join("sub/x")).unwrap().permissions().mode() & 0o777, 0o640);
    assert_eq!(fs::read_link(copy.join("l")).unwrap(), Path::new("sub/x"));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

    /// Any bytes, and any corruption of a good tar, end in a refusal or a clean landing inside the
    /// destination: never a panic, never a file beside it.
    #[test]
    fn corrupted_tars_never_panic_or_write_outside(
        flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 0..16),
        cut in 0usize..4096,
    ) {
        let mut tar = Crafted::new()
            .dir("out/")
            .file("out/a", b"alpha")
            .symlink("out/l", "a")
            .entry(EntryType::Link, b"out/h", b"out/a", 0o644, b"")
            .end();
        for (at, byte) in flips {
            let n = tar.len();
            tar[at % n] = byte;
        }
        tar.truncate(cut.max(1).min(tar.len()));
        let dir = tempfile::tempdir().unwrap();
        let _ = out(dir.path(), &tar, true);
        for name in listing(dir.path()) {
            proptest::prop_assert!(name == "dest" || name.starts_with("dest/"), "{name}");
        }
    }
}

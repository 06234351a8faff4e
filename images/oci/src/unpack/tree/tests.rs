use super::*;

/// Contents by id, in memory.
#[derive(Debug, Default)]
struct Memory(HashMap<ContentId, Vec<u8>>);

impl Spool for Memory {
    fn put(&mut self, id: ContentId, data: &mut dyn Read, _size: u64) -> io::Result<()> {
        let mut bytes = Vec::new();
        data.read_to_end(&mut bytes)?;
        self.0.insert(id, bytes);
        Ok(())
    }
}

/// One tar entry, its name written raw (so crafted names are possible).
enum E<'a> {
    Dir(&'a str),
    File(&'a str, &'a str),
    Link(&'a str, &'a str),
    Hard(&'a str, &'a str),
    Dev(&'a str),
}

fn layer(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_ustar();
        let (name, kind, data, link): (&str, EntryType, &[u8], Option<&str>) = match e {
            E::Dir(n) => (n, EntryType::Directory, b"", None),
            E::File(n, d) => (n, EntryType::Regular, d.as_bytes(), None),
            E::Link(n, t) => (n, EntryType::Symlink, b"", Some(t)),
            E::Hard(n, t) => (n, EntryType::Link, b"", Some(t)),
            E::Dev(n) => (n, EntryType::Char, b"", None),
        };
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(t) = link {
            h.as_old_mut().linkname[..t.len()].copy_from_slice(t.as_bytes());
        }
        h.set_entry_type(kind);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mode(if kind == EntryType::Directory { 0o755 } else { 0o644 });
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append(&h, data).unwrap();
    }
    b.into_inner().unwrap()
}

fn apply(layers: &[&[E]]) -> Result<(Tree, Memory), UnpackError> {
    let mut tree = Tree::new(Limits::default());
    let mut spool = Memory::default();
    for l in layers {
        tree.apply(layer(l).as_slice(), &mut spool)?;
    }
    Ok((tree, spool))
}

/// `path -> what`, for every node: `d`, `f:<content>`, `l:<target>`.
fn listing(tree: &Tree, spool: &Memory) -> Vec<String> {
    fn walk(prefix: &str, node: &Node, spool: &Memory, out: &mut Vec<String>) {
        let Node::Dir(_, children) = node else { return };
        for (name, child) in children {
            let path = format!("{prefix}{}", String::from_utf8_lossy(name));
            out.push(match &child.node {
                Node::Dir(..) => format!("{path} d"),
                Node::File(_, id, _) => format!("{path} f:{}", String::from_utf8_lossy(&spool.0[id])),
                Node::Symlink(_, t) => format!("{path} l:{}", String::from_utf8_lossy(t)),
            });
            walk(&format!("{path}/"), &child.node, spool, out);
        }
    }
    let mut out = Vec::new();
    walk("", tree.root(), spool, &mut out);
    out
}

fn tree_of(layers: &[&[E]]) -> Vec<String> {
    let (tree, spool) = apply(layers).unwrap();
    listing(&tree, &spool)
}

#[test]
fn later_layers_replace_and_merge() {
    let got = tree_of(&[
        &[E::Dir("./etc/"), E::File("./etc/os", "debian"), E::Link("bin", "usr/bin"), E::File("usr/bin/sh", "sh")],
        &[E::File("etc/os", "changed"), E::Dir("etc"), E::File("etc/new", "n")],
    ]);
    assert_eq!(
        got,
        ["bin l:usr/bin", "etc d", "etc/new f:n", "etc/os f:changed", "usr d", "usr/bin d", "usr/bin/sh f:sh"]
    );
}

#[test]
fn a_whiteout_removes_only_what_lower_layers_wrote() {
    let got = tree_of(&[
        &[E::File("a", "1"), E::Dir("d"), E::File("d/x", "x"), E::File("keep", "k")],
        &[E::File(".wh.a", ""), E::File(".wh.d", ""), E::File("b", "2"), E::File(".wh.b", "")],
    ]);
    assert_eq!(got, ["b f:2", "keep f:k"]);
}

#[test]
fn an_opaque_directory_hides_lower_content_in_any_order() {
    for upper in [
        &[E::File("d/.wh..wh..opq", ""), E::File("d/new", "n"), E::File("d/sub/y", "y")][..],
        &[E::File("d/new", "n"), E::File("d/sub/y", "y"), E::File("d/.wh..wh..opq", "")][..],
    ] {
        let got = tree_of(&[&[E::File("d/old", "o"), E::File("d/sub/x", "x"), E::File("e", "e")], upper]);
        assert_eq!(got, ["d d", "d/new f:n", "d/sub d", "d/sub/y f:y", "e f:e"]);
    }
}

#[test]
fn a_hardlink_shares_its_target_and_must_name_a_file() {
    let (tree, spool) = apply(&[&[E::File("a", "data"), E::Hard("b", "./a")]]).unwrap();
    assert_eq!(listing(&tree, &spool), ["a f:data", "b f:data"]);
    assert_eq!(live_contents(tree.root()).values().copied().collect::<Vec<_>>(), [2]);
    for bad in [E::Hard("b", "missing"), E::Hard("b", "../a"), E::Hard("b", "d")] {
        let err = apply(&[&[E::File("a", "x"), E::Dir("d"), bad]]).unwrap_err();
        assert!(matches!(err, UnpackError::Hardlink { .. }), "{err}");
    }
}

#[test]
fn crafted_names_are_refused() {
    for (entries, what) in [
        (vec![E::File("/etc/passwd", "x")], "absolute"),
        (vec![E::File("../../etc/passwd", "x")], "'..'"),
        (vec![E::File("a/../../x", "x")], "'..'"),
        // SymlinkOverridePath: a link, then an entry through it.
        (vec![E::Link("etc", "/etc"), E::File("etc/passwd", "x")], "through the symlink"),
        (vec![E::Link("up", "../../.."), E::File("up/x", "x")], "through the symlink"),
        (vec![E::File("f", "x"), E::File("f/child", "y")], "not a directory"),
        (vec![E::File(".wh..", "")], "malformed whiteout"),
        (vec![E::File("d/.wh.", "")], "malformed whiteout"),
        (vec![E::File(".wh..wh.x", "")], "malformed whiteout"),
    ] {
        let err = apply(&[&entries]).unwrap_err();
        let text = format!("{err} {}", std::error::Error::source(&err).map(ToString::to_string).unwrap_or_default());
        assert!(text.contains(what), "{what}: {text}");
    }
    // The link in one layer, the entry through it in the next.
    let err = apply(&[&[E::Link("etc", "/etc")], &[E::File("etc/shadow", "x")]]).unwrap_err();
    assert!(matches!(err, UnpackError::ThroughSymlink { layer: 2, .. }), "{err}");
}

#[test]
fn devices_are_dropped_and_counted() {
    let mut tree = Tree::new(Limits::default());
    let stats = tree.apply(layer(&[E::Dev("dev/null"), E::File("a", "x")]).as_slice(), &mut Memory::default()).unwrap();
    assert_eq!((stats.entries, stats.dropped), (2, 1));
    assert!(matches!(tree.root(), Node::Dir(_, c) if c.len() == 1));
}

#[test]
fn limits_stop_a_bomb() {
    let big = "x".repeat(5000);
    let mut tree = Tree::new(Limits { entries: 100, bytes: 4096 });
    let err = tree.apply(layer(&[E::File("a", &big)]).as_slice(), &mut Memory::default()).unwrap_err();
    assert!(matches!(err, UnpackError::TooLarge(4096)), "{err}");
    let many: Vec<String> = (0..101).map(|i| format!("f{i}")).collect();
    let entries: Vec<E> = many.iter().map(|n| E::File(n, "")).collect();
    let mut tree = Tree::new(Limits { entries: 100, bytes: 4096 });
    let err = tree.apply(layer(&entries).as_slice(), &mut Memory::default()).unwrap_err();
    assert!(matches!(err, UnpackError::TooManyEntries(100)), "{err}");
}

#[test]
fn a_truncated_stream_is_an_error() {
    let bytes = layer(&[E::File("a", &"x".repeat(2000))]);
    let err = Tree::new(Limits::default()).apply(&bytes[..1000], &mut Memory::default()).unwrap_err();
    assert!(matches!(err, UnpackError::Tar { .. }), "{err}");
}

proptest::proptest! {
    /// Any bytes as a layer: an error or a tree, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096)) {
        let _ = Tree::new(Limits::default()).apply(bytes.as_slice(), &mut Memory::default());
    }

    /// Any sequence of entries from a small alphabet of names: never a panic, and no node ever sits below a
    /// symlink or a file.
    #[test]
    fn arbitrary_entries_keep_the_tree_sound(ops in proptest::collection::vec((0u8..6, 0usize..8, 0usize..8), 0..40)) {
        const NAMES: [&str; 8] = ["a", "a/b", "a/b/c", ".wh.a", "a/.wh.b", "a/.wh..wh..opq", "l", "l/x"];
        let entries: Vec<E> = ops.iter().map(|(k, n, t)| match k {
            0 => E::Dir(NAMES[*n]),
            1 => E::File(NAMES[*n], "x"),
            2 => E::Link(NAMES[*n], NAMES[*t]),
            3 => E::Hard(NAMES[*n], NAMES[*t]),
            4 => E::Dev(NAMES[*n]),
            _ => E::File(NAMES[*n], ""),
        }).collect();
        let half = entries.len() / 2;
        let mut tree = Tree::new(Limits::default());
        let mut spool = Memory::default();
        for part in [&entries[..half], &entries[half..]] {
            if tree.apply(layer(part).as_slice(), &mut spool).is_err() {
                return Ok(());
            }
        }
        for id in live_contents(tree.root()).keys() {
            proptest::prop_assert!(spool.0.contains_key(id), "a live file has its content");
        }
    }
}

//! Images from real sources into the store and onto a disk (issue 21, the library half): a real registry
//! (`docker-registry` with TLS from a throwaway CA, and htpasswd logins), images made by `umoci` and copied
//! by `skopeo`, disks made by `mkfs.erofs`. Booting them is not wired yet (docs/images.md).

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use vm_oci::fetch::{Fetch, FromArchive, FromLayout, FromRegistry};
use vm_oci::pull::{pull, Image, Quiet};
use vm_oci::registry::{self, Options};
use vm_oci::store::Store;
use vm_oci::unpack::tree::{Limits, Tree};
use vm_oci::unpack::write::{write, DirSpool};
use vm_test_support::registry::{run, umoci_image, Registry};
use vm_test_support::{test_image, Scratch};

/// Two layers: files, a directory, a symlink and a hardlink; then a change and a deletion (a whiteout).
fn test_layout(dir: &Path) -> PathBuf {
    let first = |root: &Path| {
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/greeting"), "hello\n").unwrap();
        std::fs::create_dir_all(root.join("srv")).unwrap();
        std::fs::write(root.join("srv/data"), vec![b'd'; 100_000]).unwrap();
        std::fs::write(root.join("srv/tool"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(root.join("srv/tool"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::hard_link(root.join("srv/tool"), root.join("srv/tool-again")).unwrap();
        std::os::unix::fs::symlink("/etc/greeting", root.join("srv/link")).unwrap();
    };
    let second = |root: &Path| {
        std::fs::remove_file(root.join("srv/data")).unwrap();
        std::fs::write(root.join("etc/greeting"), "changed\n").unwrap();
    };
    umoci_image(
        dir,
        "v1",
        &[&first, &second],
        &[
            "--config.env",
            "GREETING=hi",
            "--config.workingdir",
            "/srv",
            "--config.cmd",
            "cat",
            "--config.cmd",
            "/etc/greeting",
        ],
    )
}

fn store(dir: &Path, name: &str) -> Store {
    Store::open(&dir.join(name)).unwrap()
}

fn registry_fetch(reg: &Registry, name: &str, auth_file: Option<PathBuf>) -> FromRegistry {
    let options = Options { ca_file: Some(reg.ca.clone()), auth_file, ..Options::default() };
    FromRegistry { registry: registry::Registry::new(&options).unwrap(), reference: name.parse().unwrap() }
}

/// Every path under `root`: its type, mode, and content hash or link target.
fn listing(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let name = path.strip_prefix(root).unwrap().display().to_string();
            let what = if meta.file_type().is_symlink() {
                format!("l {}", std::fs::read_link(&path).unwrap().display())
            } else if meta.is_dir() {
                walk(root, &path, out);
                format!("d {:o}", meta.mode() & 0o7777)
            } else if !meta.is_file() {
                // A device node or FIFO (only umoci's tree has them).
                format!("c {:o}", meta.mode() & 0o7777)
            } else {
                let bytes = std::fs::read(&path).unwrap();
                format!("f {:o} {} {}", meta.mode() & 0o7777, bytes.len(), vm_oci::digest::Digest::of(&bytes))
            };
            out.insert(name, what);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// Our tree of `image`, written under `out`.
fn our_tree(store: &Store, image: &Image, out: &Path) {
    let mut spool = DirSpool::create(&out.with_extension("spool")).unwrap();
    let mut tree = Tree::new(Limits::default());
    for layer in &image.layers {
        let mut stream = vm_oci::layer::open(&store.blob_path(&layer.digest), layer, 1 << 30).unwrap();
        tree.apply(&mut stream, &mut spool).unwrap();
        stream.finish().unwrap();
    }
    write(tree.root(), &spool, out, true).unwrap();
}

fn disk_bytes(store: &Store, image: &Image) -> Vec<u8> {
    let dir = vm_oci::disk::build(store, image, Limits::default()).unwrap();
    std::fs::read(dir.join(vm_oci::disk::DISK_FILE)).unwrap()
}

#[test]
fn a_registry_image_is_pulled_verified_and_its_disk_is_byte_identical() {
    let s = Scratch::new("img-pull");
    let reg = Registry::start(&s.dir.join("registry"), None);
    let layout = test_layout(&s.dir);
    let name = reg.push(&format!("oci:{}:v1", layout.display()), "e2e/app:v1");
    let a = store(&s.dir, "store-a");
    let started = Instant::now();
    let image = pull(&mut registry_fetch(&reg, &name, None), &a, &mut Quiet).unwrap();
    eprintln!(
        "e2e: pulled {name} ({} layers, {} bytes) in {:?}",
        image.layers.len(),
        image.stored_bytes(),
        started.elapsed()
    );
    assert_eq!(image.layers.len(), 2);
    assert_eq!(image.run.env.iter().filter(|e| *e == "GREETING=hi").count(), 1, "{:?}", image.run.env);
    assert_eq!(image.run.working_dir.as_deref(), Some("/srv"));
    assert_eq!(image.run.cmd, ["cat", "/etc/greeting"]);
    // The same tree umoci unpacks.
    let ours = s.dir.join("ours");
    our_tree(&a, &image, &ours);
    let bundle = s.dir.join("umoci-bundle");
    run(Command::new("umoci").arg("unpack").arg("--image").arg(format!("{}:v1", layout.display())).arg(&bundle));
    let (mine, theirs) = (listing(&ours), listing(&bundle.join("rootfs")));
    assert_eq!(mine, theirs, "our merged tree differs from umoci's");
    assert!(
        !mine.contains_key("srv/data")
            && mine["etc/greeting"].contains(&vm_oci::digest::Digest::of(b"changed\n").to_string())
    );
    // Two disks, two stores, one image: the same bytes.
    let b = store(&s.dir, "store-b");
    let again = pull(&mut registry_fetch(&reg, &name, None), &b, &mut Quiet).unwrap();
    let (disk_a, disk_b) = (disk_bytes(&a, &image), disk_bytes(&b, &again));
    assert!(!disk_a.is_empty());
    assert_eq!(vm_oci::digest::Digest::of(&disk_a), vm_oci::digest::Digest::of(&disk_b), "two builds differ");
    eprintln!("e2e: disk {} bytes, byte-identical across two stores", disk_a.len());
}

#[test]
fn a_tampered_blob_is_refused_and_nothing_of_it_is_stored() {
    let s = Scratch::new("img-tamper");
    let reg = Registry::start(&s.dir.join("registry"), None);
    let layout = test_layout(&s.dir);
    let name = reg.push(&format!("oci:{}:v1", layout.display()), "e2e/app:v1");
    // Find the first layer through a clean pull, then flip a byte of it in the registry's storage.
    let clean = store(&s.dir, "clean");
    let image = pull(&mut registry_fetch(&reg, &name, None), &clean, &mut Quiet).unwrap();
    let layer = &image.layers[0];
    let data = reg.blob_data(layer.digest.hex());
    let mut bytes = std::fs::read(&data).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&data, bytes).unwrap();
    let fresh = store(&s.dir, "fresh");
    let err = pull(&mut registry_fetch(&reg, &name, None), &fresh, &mut Quiet).unwrap_err();
    let text = vm_contract::logs::chain(&err);
    eprintln!("e2e: tampered layer: {text}");
    assert!(text.contains("digest mismatch"), "{text}");
    assert!(!fresh.has(&layer.digest), "the tampered blob was stored");
    let partials = std::fs::read_dir(fresh.root().join("ingest")).unwrap().flatten();
    assert_eq!(partials.filter(|e| !e.file_name().to_string_lossy().ends_with(".lock")).count(), 0);
    assert!(!fresh.root().join("disks").exists(), "no disk");
}

#[test]
fn a_login_is_needed_and_comes_from_the_auth_file() {
    let s = Scratch::new("img-login");
    let reg = Registry::start(&s.dir.join("registry"), Some(("e2e", "pw-7c1d")));
    let layout = test_layout(&s.dir);
    let name = reg.push(&format!("oci:{}:v1", layout.display()), "e2e/private:v1");
    let none = store(&s.dir, "none");
    let nowhere = s.dir.join("no-such-auth.json");
    std::fs::write(&nowhere, r#"{"auths":{}}"#).unwrap();
    let err = pull(&mut registry_fetch(&reg, &name, Some(nowhere)), &none, &mut Quiet).unwrap_err();
    let text = vm_contract::logs::chain(&err);
    assert!(text.contains("refused access"), "{text}");
    let with = store(&s.dir, "with");
    pull(&mut registry_fetch(&reg, &name, reg.auth_file.clone()), &with, &mut Quiet).unwrap();
    eprintln!("e2e: without a login: {text}; with the auth file's login: pulled");
}

#[test]
fn a_registry_that_stalls_fails_within_its_bound() {
    let s = Scratch::new("img-stall");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    // Accepts and never answers.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            held.push(conn);
        }
    });
    let options =
        Options { insecure: vec![addr.clone()], read_timeout: Some(Duration::from_secs(2)), ..Options::default() };
    let mut fetch = FromRegistry {
        registry: registry::Registry::new(&options).unwrap(),
        reference: format!("{addr}/stuck:v1").parse().unwrap(),
    };
    let started = Instant::now();
    let err = pull(&mut fetch, &store(&s.dir, "stall"), &mut Quiet).unwrap_err();
    let took = started.elapsed();
    eprintln!("e2e: a stalled registry: {} after {took:?}", vm_contract::logs::chain(&err));
    assert!(took < Duration::from_secs(10), "{took:?}");
    assert!(vm_contract::logs::chain(&err).contains("did not answer"));
}

#[test]
fn a_layout_and_a_docker_archive_of_one_image_give_the_same_layers() {
    let s = Scratch::new("img-layout-archive");
    let layout = test_layout(&s.dir);
    let archive = s.dir.join("image.tar");
    run(Command::new("skopeo")
        .arg("copy")
        .arg("--quiet")
        .arg(format!("oci:{}:v1", layout.display()))
        .arg(format!("docker-archive:{}:e2e/app:v1", archive.display())));
    let from_layout =
        pull(&mut FromLayout { dir: layout.clone(), tag: Some("v1".into()) }, &store(&s.dir, "l"), &mut Quiet).unwrap();
    let st = store(&s.dir, "a");
    let mut fetch = FromArchive::open(&archive, &st).unwrap();
    let from_archive = pull(&mut fetch as &mut dyn Fetch, &st, &mut Quiet).unwrap();
    let diff_ids = |i: &Image| i.layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>();
    assert_eq!(diff_ids(&from_layout), diff_ids(&from_archive));
    assert_eq!(from_layout.run, from_archive.run);
    let err =
        pull(&mut FromLayout { dir: layout, tag: Some("nope".into()) }, &store(&s.dir, "n"), &mut Quiet).unwrap_err();
    assert!(vm_contract::logs::chain(&err).contains("no manifest tagged"), "{err}");
    eprintln!("e2e: layout and docker-archive: {} layers, same diff_ids and config", from_layout.layers.len());
}

/// A real Debian root with python3 and curl (`scripts/test-image`: mmdebstrap, then umoci; cached by its
/// inputs) merges into the tree `umoci unpack` makes of it, file for file: type, mode (setuid bits
/// included), owner, size, content and link target. Only the device nodes differ: we drop them.
#[test]
fn the_debian_test_image_merges_as_umoci_unpacks_it() {
    let s = Scratch::with_deadline("img-debian", Duration::from_secs(600));
    s.waiting_for("scripts/test-image (mmdebstrap on first use)");
    let layout = test_image::layout().to_owned();
    let st = store(&s.dir, "store");
    let image = pull(&mut FromLayout { dir: layout.clone(), tag: Some("py".into()) }, &st, &mut Quiet).unwrap();
    assert!(image.run.env.iter().any(|e| e == "IMAGE_GREETING=from-the-image"), "{:?}", image.run.env);
    let ours = s.dir.join("ours");
    our_tree(&st, &image, &ours);
    let bundle = s.dir.join("bundle");
    run(Command::new("umoci").arg("unpack").arg("--image").arg(format!("{}:py", layout.display())).arg(&bundle));
    let owned = |root: &Path| {
        let mut out = listing(root);
        for (path, what) in &mut out {
            let meta = std::fs::symlink_metadata(root.join(path)).unwrap();
            what.push_str(&format!(" {}:{}", meta.uid(), meta.gid()));
        }
        out
    };
    let mine = owned(&ours);
    let mut theirs = owned(&bundle.join("rootfs"));
    let devices: Vec<String> =
        theirs.iter().filter(|(_, w)| w.starts_with("c ") || w.starts_with("b ")).map(|(p, _)| p.clone()).collect();
    for device in &devices {
        theirs.remove(device);
    }
    assert!(mine.len() > 5000, "a whole Debian root: {} entries", mine.len());
    let differ: Vec<_> = mine.iter().filter(|(p, w)| theirs.get(*p) != Some(*w)).take(5).collect();
    assert!(differ.is_empty() && mine.len() == theirs.len(), "differs from umoci's tree: {differ:?}");
    let setuid = mine.values().filter(|w| w.starts_with("f 4")).count();
    assert!(setuid > 0, "setuid bits kept");
    let disk = disk_bytes(&st, &image);
    eprintln!(
        "e2e: Debian test image: {} entries as umoci unpacks them ({setuid} setuid, {} device nodes dropped); layer {} bytes, disk {} bytes",
        mine.len(),
        devices.len(),
        image.stored_bytes(),
        disk.len()
    );
}

/// `vm-driver image ...` on the shipped build.
fn cli(store: &Path, args: &[&str]) -> std::process::Output {
    Command::new(&vm_test_support::harness().shipped.driver)
        .arg("image")
        .arg("--image-cache")
        .arg(store)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn the_image_commands_pull_list_and_remove() {
    let s = Scratch::new("img-cli");
    let reg = Registry::start(&s.dir.join("registry"), None);
    let layout = test_layout(&s.dir);
    let name = reg.push(&format!("oci:{}:v1", layout.display()), "e2e/app:v1");
    let store_dir = s.dir.join("store");
    let ca = reg.ca.to_str().unwrap();
    let pulled = cli(&store_dir, &["pull", &name, "--registry-ca", ca]);
    let text = String::from_utf8_lossy(&pulled.stderr).into_owned() + &String::from_utf8_lossy(&pulled.stdout);
    assert!(pulled.status.success(), "{text}");
    // Not a terminal: a plain line per layer.
    assert_eq!(text.matches("vm-driver: layer ").count(), 2, "{text}");
    let listed = String::from_utf8(cli(&store_dir, &["ls"]).stdout).unwrap();
    assert!(listed.contains(name.as_str()), "{listed}");
    // A tag that is not there: a clear error, exit 125, nothing new in the store.
    let missing = cli(&store_dir, &["pull", &format!("{}/e2e/app:nope", reg.addr), "--registry-ca", ca]);
    let err = String::from_utf8_lossy(&missing.stderr);
    assert_eq!(missing.status.code(), Some(125), "{err}");
    assert!(err.contains("not found"), "{err}");
    // Without the CA the registry's certificate is not trusted.
    let untrusted = cli(&s.dir.join("store-2"), &["pull", &name]);
    assert_eq!(untrusted.status.code(), Some(125));
    let removed = cli(&store_dir, &["rm", &name]);
    assert!(removed.status.success(), "{}", String::from_utf8_lossy(&removed.stderr));
    let listed = String::from_utf8(cli(&store_dir, &["ls"]).stdout).unwrap();
    assert!(!listed.contains(&name), "{listed}");
    let blobs = std::fs::read_dir(store_dir.join("blobs/sha256")).unwrap().count();
    assert_eq!(blobs, 0, "the image's blobs went with it");
    eprintln!("e2e: image pull/ls/rm through the CLI; missing tag: {}", err.trim());
}

#[test]
fn a_cached_name_needs_no_source_and_a_refresh_does() {
    use vm_oci::obtain::{obtain, Freshness};
    let s = Scratch::new("img-cached");
    let layout = test_layout(&s.dir);
    let st = store(&s.dir, "store");
    let source: vm_oci::source::Source = format!("oci:{}:v1", layout.display()).parse().unwrap();
    let get = |freshness| obtain(&source, &st, &Options::default(), Limits::default(), freshness, &mut Quiet);
    let (first, dir) = get(Freshness::Refresh).unwrap();
    assert!(dir.join(vm_oci::disk::DISK_FILE).is_file());
    // The source goes away: the name is still served from the store, and only a refresh needs the source.
    std::fs::remove_dir_all(&layout).unwrap();
    let (cached, _) = get(Freshness::Cached).unwrap();
    assert_eq!(cached.manifest, first.manifest);
    let err = get(Freshness::Refresh).unwrap_err();
    assert!(vm_contract::logs::chain(&err).contains("cannot read"), "{err}");
}

/// Token auth in front of the registry: distribution itself verifies the JWTs a token issuer signs
/// (`tests/python/token_server.py`, PyJWT); the issuer wants the login, which comes from the auth file and
/// goes only to the issuer, over TLS.
#[test]
fn a_registry_behind_token_auth_is_pulled_with_a_token_got_by_the_login() {
    let s = Scratch::new("img-token");
    let password = "token-login-secret";
    let reg = Registry::start_with(&s.dir.join("registry"), vm_test_support::registry::Auth::Token("puller", password));
    let layout = test_layout(&s.dir);
    let name = reg.push(&format!("oci:{}:v1", layout.display()), "e2e/token:v1");
    let ca = reg.ca.display().to_string();

    let refused = cli(&s.dir.join("store-a"), &["pull", "--registry-ca", &ca, &name]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "pulled without a login");
    assert!(stderr.contains("refused access") || stderr.contains("gave no usable token"), "{stderr}");
    assert!(vm_oci::catalog::list(&store(&s.dir, "store-a")).is_empty(), "nothing stored");

    let auth = reg.auth_file.as_ref().unwrap().display().to_string();
    let pulled = cli(&s.dir.join("store-b"), &["pull", "--registry-ca", &ca, "--registry-auth-file", &auth, &name]);
    let (stdout, stderr) = (String::from_utf8_lossy(&pulled.stdout), String::from_utf8_lossy(&pulled.stderr));
    assert!(pulled.status.success(), "{stderr}");
    assert!(stdout.contains("sha256:"), "{stdout}");
    assert!(!stdout.contains(password) && !stderr.contains(password), "the login appears nowhere");
    let grants = std::fs::read_to_string(reg.grants.as_ref().unwrap()).unwrap();
    assert!(grants.lines().any(|g| g.contains(r#""name": "e2e/token""#) && g.contains(r#"["pull"]"#)), "{grants}");
    eprintln!("e2e: token auth: {} grants by the issuer, the pull's among them", grants.lines().count());
}

//! The files API on real VMs: each operation through the supervisor's attach socket (what the driver's
//! `cp` will use), run by the agent as the workload identity; denied by policy; reported as File System
//! Activity without the contents.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use vm_protocol::files::FileOp;
use vm_protocol::message::Refusal;
use vm_protocol::ExitStatus;
use vm_test_support::attach::AttachClient;
use vm_test_support::serve::Serve;
use vm_test_support::{events, ocsf_schema, wait_until, Scratch};

/// A small sandbox of `serve` under `policy`, and an attach connection to it.
fn create(serve: &Serve, id: &str, policy: Option<&str>) -> AttachClient {
    serve.create_small(id, policy);
    AttachClient::connect(&serve.sandbox(id))
}

fn path(p: &str) -> String {
    p.to_owned()
}

#[test]
fn every_file_operation_works_as_the_workload_and_is_recorded_without_contents() {
    let s = Scratch::new("files-ops");
    let serve = Serve::start(&s);
    let mut client = create(&serve, "f", None);
    let canary = b"files-canary-7f3a\n".repeat(1000);
    client.files_ok(FileOp::MakeDir { path: path("/tmp/w/sub"), parents: true }, b"");
    client.files_ok(FileOp::Write { path: path("/tmp/w/sub/a"), mode: 0o4640 }, &canary);
    assert_eq!(client.files_ok(FileOp::Read { path: path("/tmp/w/sub/a") }, b""), canary, "read back whole");

    let stat = client.files_ok(FileOp::Stat { path: path("/tmp/w/sub/a") }, b"");
    let stat: serde_json::Value = serde_json::from_slice(&stat).unwrap();
    assert_eq!((stat["type"].as_str(), stat["size"].as_u64()), (Some("file"), Some(canary.len() as u64)));
    assert_eq!(stat["mode"], "640", "the mode as asked, without the set-uid bit");

    client.files_ok(FileOp::Rename { from: path("/tmp/w/sub/a"), to: path("/tmp/w/b") }, b"");
    let listing = String::from_utf8(client.files_ok(FileOp::List { path: path("/tmp/w") }, b"")).unwrap();
    let names: Vec<String> = listing
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["b", "sub"]);

    // Who wrote it: the workload identity, as an exec sees it.
    let owner = serve.cli("exec", &["f", "--", "ls", "-ln", "/tmp/w/b"]);
    let owner = String::from_utf8_lossy(&owner.stdout).into_owned();
    assert_eq!(owner.split_whitespace().skip(2).take(2).collect::<Vec<_>>(), ["1000", "1000"], "{owner}");

    let tar = client.files_ok(FileOp::CopyOut { path: path("/tmp/w") }, b"");
    assert!(tar.len() > canary.len() && tar.windows(4).any(|w| w == b"w/b\0"), "a tar named from the source");
    client.files_ok(FileOp::Remove { path: path("/tmp/w"), recursive: true }, b"");
    let (_, stderr, status) = client.files(FileOp::Read { path: path("/tmp/w/b") }, b"").unwrap();
    assert_eq!(status, ExitStatus::Code(1));
    assert!(stderr.contains("No such file or directory"), "{stderr}");

    // A file the workload may not read stays unread: the operation is the workload's, not root's.
    let (_, stderr, status) = client.files(FileOp::Read { path: path("/proc/1/environ") }, b"").unwrap();
    assert_eq!(status, ExitStatus::Code(1), "{stderr}");

    // Ten operations, each one event, written out by the supervisor's sinks shortly after.
    let dir = serve.sandbox("f");
    let of_files = || events::of_class(&events::read(&dir), 1001).into_iter().cloned().collect::<Vec<_>>();
    assert!(wait_until(Duration::from_secs(20), || of_files().len() >= 10), "one event per operation");
    let files = of_files();
    assert!(
        files.iter().any(|e| e["file"]["path"] == "/tmp/w/sub/a" && e["file"]["size"] == canary.len() as u64),
        "the write with its size"
    );
    assert!(!events::text(&dir).contains("files-canary"), "never the contents");
    ocsf_schema::assert_valid(&files);
}

/// The checksums of every file under `dir`, as `sha256sum` prints them, in order of path.
const SUMS: &str = "cd \"$0\" && find . -type f | LC_ALL=C sort | xargs sha256sum";

#[test]
fn cp_of_a_tar_into_and_out_of_a_sandbox_round_trips_byte_for_byte() {
    let s = Scratch::new("files-cp");
    let serve = Serve::start(&s);
    let mut client = create(&serve, "c", None);
    let tree = s.dir.join("tree");
    for i in 0..200 {
        let dir = tree.join(format!("d{}", i % 7));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("f{i}")), format!("{i}").repeat(i * 37)).unwrap();
    }
    let tar = Command::new("tar").arg("-C").arg(&tree).args(["-cf", "-", "."]).output().unwrap();
    assert!(tar.status.success());
    client.files_ok(FileOp::MakeDir { path: path("/tmp/in"), parents: false }, b"");
    let mut cp_in = serve.cli_command("cp", &["-", "c:/tmp/in"]).stdin(Stdio::piped()).spawn().unwrap();
    cp_in.stdin.take().unwrap().write_all(&tar.stdout).unwrap();
    assert!(cp_in.wait().unwrap().success(), "cp - c:/tmp/in");

    let host = Command::new("sh").args(["-c", SUMS]).arg(&tree).output().unwrap();
    let guest = serve.cli("exec", &["c", "--", "sh", "-c", SUMS, "/tmp/in"]);
    assert!(!host.stdout.is_empty());
    assert_eq!(String::from_utf8_lossy(&guest.stdout), String::from_utf8_lossy(&host.stdout), "the tree arrived whole");

    let out = serve.cli("cp", &["c:/tmp/in", "-"]);
    assert!(out.status.success(), "cp c:/tmp/in -: {}", String::from_utf8_lossy(&out.stderr));
    let mut list = Command::new("tar").args(["-tf", "-"]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    list.stdin.take().unwrap().write_all(&out.stdout).unwrap();
    let names = String::from_utf8(list.wait_with_output().unwrap().stdout).unwrap();
    assert_eq!(names.lines().filter(|n| n.starts_with("in/d") && n.contains("/f")).count(), 200, "{names}");
    assert!(names.lines().any(|n| n == "in/d3/f10"), "entries named from the source: {names}");
}

#[test]
fn file_operations_are_denied_by_policy_with_a_finding() {
    let s = Scratch::new("files-denied");
    let serve = Serve::start(&s);
    let mut client = create(&serve, "ro", Some(r#"{"allow":["exec","stdin","files_read"]}"#));
    let write = client.files(FileOp::Write { path: path("/tmp/x"), mode: 0o644 }, b"x");
    assert_eq!(write.err(), Some(Refusal::Denied), "files_write is not allowed");
    client.files_ok(FileOp::Stat { path: path("/tmp") }, b"");
    let exists = serve.cli("exec", &["ro", "--", "test", "-e", "/tmp/x"]);
    assert!(!exists.status.success(), "the denied write wrote nothing");
    let denied = || events::text(&serve.sandbox("ro")).contains("files_write denied");
    assert!(wait_until(Duration::from_secs(20), denied), "a policy_denied finding names the operation");
}

//! The audit chain on real sandboxes: sealed at an orderly stop with its head kept outside the sandbox
//! directory; each edit a forger could make (one byte, a deleted entry, two swapped, a cut tail, a chain
//! rebuilt after an edit, an older copy of the database) named by `vm-driver audit verify`, which exits 1;
//! a SIGKILLed supervisor's chain read as unsealed, not tampered. Control: with the chain off
//! (`no-audit-chain`), an edit of `events.jsonl` goes unnoticed: nothing holds what to check it against.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use vm_contract::layout::SandboxFile;
use vm_test_support::api::Client;
use vm_test_support::output::ok;
use vm_test_support::procs::signal;
use vm_test_support::serve::Serve;
use vm_test_support::{events, gone_within, harness, Launch, Running, Scratch, TestControl, CANARY};

/// `vm-driver audit ACTION --state-dir STATE TARGET`: its exit code and stdout.
fn audit(state: &Path, action: &str, target: &str) -> (Option<i32>, String) {
    let out = Command::new(&harness().build(&[]).driver)
        .args(["audit", action, "--state-dir"])
        .arg(state)
        .arg(target)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("e2e: vm-driver audit {action} {target} (exit {:?}):\n{text}", out.status.code());
    (out.status.code(), text)
}

/// The sandbox `id` of `state`, copied with its anchor into the state directory `to`, for one edit.
fn copy_of(state: &Path, id: &str, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to.join("sandboxes")).unwrap();
    std::fs::create_dir_all(to.join("audit")).unwrap();
    let ok = Command::new("cp").arg("-a").arg(state.join("sandboxes").join(id)).arg(to.join("sandboxes")).status();
    assert!(ok.unwrap().success());
    let anchor = format!("{id}.json");
    std::fs::copy(state.join("audit").join(&anchor), to.join("audit").join(&anchor)).unwrap();
    to.join("sandboxes").join(id).join(SandboxFile::Audit.name())
}

/// One forger's change to a copied sandbox, given its `audit.db`.
type Edit<'a> = dyn Fn(&Path) + 'a;

fn sql(db: &Path, statements: &str) {
    rusqlite::Connection::open(db).unwrap().execute_batch(statements).unwrap();
}

fn flip_a_byte(db: &Path, seq: i64) {
    let conn = rusqlite::Connection::open(db).unwrap();
    let mut hash: Vec<u8> =
        conn.query_row("SELECT event_hash FROM entries WHERE seq = ?1", [seq], |r| r.get(0)).unwrap();
    hash[0] ^= 1;
    conn.execute("UPDATE entries SET event_hash = ?1 WHERE seq = ?2", rusqlite::params![hash, seq]).unwrap();
}

/// Rebuilds the chain of `db` from scratch over `events` (the lines as they now read), for the same
/// sandbox, and seals it: self-consistent, as a forger with the format would make it.
fn rebuild(db: &Path, id: &str, events: &[u8]) {
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    let mut chain = vm_audit::chain::Chain::open(db, id).unwrap();
    for line in events.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let class = serde_json::from_slice::<serde_json::Value>(line).unwrap()["class_uid"].as_u64().unwrap();
        let entry =
            vm_audit::chain::NewEntry { class: u32::try_from(class).unwrap(), event_hash: vm_audit::event_hash(line) };
        chain.append(&[entry]).unwrap();
    }
    chain.seal().unwrap();
}

#[test]
fn a_launched_sandboxs_chain_is_sealed_and_every_edit_is_named() {
    let s = Scratch::new("audit-launch");
    let out = Launch::new(&s, &["/bin/sh", "-c", "echo one; echo two"]).flag("--id").flag("aud").run();
    assert_eq!(out.code, Some(0));
    let (code, text) = audit(&s.state(), "verify", "aud");
    assert_eq!(code, Some(0));
    assert!(text.contains("sealed at entry") && !text.contains("BROKEN"), "{text}");
    assert!(text.contains("head kept outside the sandbox directory: "), "{text}");
    let (code, shown) = audit(&s.state(), "show", "aud");
    assert_eq!(code, Some(0));
    assert!(shown.contains("process aud/1 launched: /bin/sh -c echo one; echo two"), "{shown}");

    let events = events::text(&s.sandbox("aud"));
    let edited = events.replace("echo one", "echo uno");
    let cases: [(&str, &Edit<'_>, &str); 6] = [
        ("one byte", &|db| flip_a_byte(db, 3), "entry 3 was altered"),
        ("deleted", &|db| sql(db, "DELETE FROM entries WHERE seq = 3"), "entry 3 is missing"),
        (
            "swapped",
            &|db| {
                sql(db, "UPDATE entries SET seq = -1 WHERE seq = 3; UPDATE entries SET seq = 3 WHERE seq = 4; UPDATE entries SET seq = 4 WHERE seq = -1")
            },
            "entry 3 does not follow entry 2",
        ),
        (
            "tail cut, seals removed",
            &|db| sql(db, "DELETE FROM entries WHERE seq > 4; DELETE FROM seals"),
            "cut, or replaced",
        ),
        (
            "an events line edited",
            &|db| {
                let file = db.with_file_name(SandboxFile::Events.name());
                std::fs::write(file, &edited).unwrap();
            },
            "of events.jsonl is not in the chain",
        ),
        (
            "rebuilt after an edit",
            &|db| {
                std::fs::write(db.with_file_name(SandboxFile::Events.name()), &edited).unwrap();
                rebuild(db, "aud", edited.as_bytes());
            },
            "the chain was rebuilt",
        ),
    ];
    for (i, (what, edit, named)) in cases.iter().enumerate() {
        let state = s.dir.join(format!("edit-{i}"));
        let db = copy_of(&s.state(), "aud", &state);
        edit(&db);
        let (code, text) = audit(&state, "verify", "aud");
        assert_eq!(code, Some(1), "{what}: a break exits 1");
        assert!(text.contains(named), "{what}: {text}");
        if *what == "rebuilt after an edit" {
            let (code, alone) = audit(&state, "verify", db.to_str().unwrap());
            assert_eq!(code, Some(0), "by itself the rebuilt chain verifies: only the head kept outside catches it");
            assert!(!alone.contains("BROKEN"));
        }
    }
}

/// Control: without the chain the same edit of `events.jsonl` stands, and nothing can say so.
#[test]
fn control_without_the_chain_an_edited_event_goes_unnoticed() {
    let s = Scratch::new("audit-off");
    let out = Launch::new(&s, &["/bin/sh", "-c", "echo one"])
        .flag("--id")
        .flag("off")
        .control(TestControl::NoAuditChain)
        .run();
    assert_eq!(out.code, Some(0));
    let dir = s.sandbox("off");
    assert!(!dir.join(SandboxFile::Audit.name()).exists(), "no chain written");
    let events = events::path(&dir);
    let text = std::fs::read_to_string(&events).unwrap();
    assert!(text.contains("echo one"));
    std::fs::write(&events, text.replace("echo one", "echo uno")).unwrap();
    let (code, said) = audit(&s.state(), "verify", "off");
    assert_ne!(code, Some(1), "no break can be named");
    assert!(said.contains("not an audit chain"), "{said}");
}

#[test]
fn a_killed_supervisors_chain_reads_unsealed_not_tampered() {
    let s = Scratch::new("audit-kill");
    let launch = Launch::sleeper(&s).flag("--id").flag("killed");
    let run = Running::start(launch, &[], CANARY);
    let p = run.procs();
    signal(p.supervisor.pid, Signal::SIGKILL);
    assert!(gone_within(&p.vmm, Duration::from_secs(10)));
    drop(run);
    let (code, text) = audit(&s.state(), "verify", "killed");
    assert_eq!(code, Some(0), "unsealed is not a break");
    assert!(text.contains("unsealed: never sealed") && !text.contains("BROKEN"), "{text}");
    assert!(text.contains("no head kept outside"), "{text}");
}

#[test]
fn a_served_sandboxs_chain_continues_across_generations_and_an_older_copy_is_caught() {
    let s = Scratch::new("audit-serve");
    let serve = Serve::with(&s, &[], &[]);
    ok(serve.cli("create", &["box"]));
    ok(serve.cli("exec", &["box", "--", "true"]));
    ok(serve.cli("stop", &["box"]));
    let (rt, mut client) = serve.grpc();
    let head = |client: &mut Client| {
        let req = vm_protocol::driver_api::SandboxRef { sandbox_id: "box".into() };
        rt.block_on(client.get_audit_head(req)).unwrap().into_inner()
    };
    let first = head(&mut client);
    eprintln!("e2e: GetAuditHead after the first stop: {first:?}");
    assert!(first.seq > 0);
    assert_eq!(
        (first.sealed_seq, first.anchor_seq, first.anchor_hash.as_deref()),
        (first.seq, Some(first.seq), Some(first.hash.as_str()))
    );
    let db = serve.sandbox("box").join(SandboxFile::Audit.name());
    let older = s.dir.join("older.db");
    std::fs::copy(&db, &older).unwrap();
    ok(serve.cli("start", &["box"]));
    // Started again.
    serve.wait_ready("box");
    ok(serve.cli("exec", &["box", "--", "true"]));
    ok(serve.cli("stop", &["box"]));
    let second = head(&mut client);
    assert!(second.seq > first.seq && second.sealed_seq == second.seq, "one chain across generations: {second:?}");
    let (code, text) = audit(&serve.state, "verify", "box");
    assert_eq!(code, Some(0));
    assert!(text.contains(&format!("sealed at entry {}", second.seq)), "{text}");
    std::fs::copy(&older, &db).unwrap();
    let (code, text) = audit(&serve.state, "verify", "box");
    assert_eq!(code, Some(1));
    assert!(text.contains(&format!("is entry {}, but the chain ends at {}", second.seq, first.seq)), "{text}");
}

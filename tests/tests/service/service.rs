//! `vm-driver serve` end to end: the lifecycle through the CLI and through a generic gRPC client, load,
//! terminals, restart recovery, refusals and readiness, on real VMs.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio_stream::StreamExt;
use vm_protocol::driver_api::{
    exec_request, exec_response, CreateSandboxRequest, ExecRequest, ExecStart, SandboxRef, StdinEof, TerminalSize,
};
use vm_test_support::output::{ok, stderr, stdout};
use vm_test_support::serve::Serve;
use vm_test_support::{gone_within, wait_until, Scratch, TestControl};

#[test]
fn lifecycle_through_the_cli() {
    let s = Scratch::new("svc-cli");
    let serve = Serve::start(&s);
    let created = ok(serve.cli("create", &["life"]));
    assert!(created.contains("ready"), "create waits until ready: {created}");
    // A second server on the same state directory is refused: it would boot the same sandboxes again.
    let second = Command::new(&vm_test_support::harness().shipped.driver)
        .args(["serve", "--state-dir"])
        .arg(s.state())
        .arg("--socket")
        .arg(s.dir.join("second.sock"))
        .output()
        .unwrap();
    assert_eq!(second.status.code(), Some(125));
    let why = String::from_utf8_lossy(&second.stderr);
    assert!(why.contains("another vm-driver serve is using the state directory"), "{why}");
    assert_eq!(ok(serve.cli("exec", &["life", "--", "sh", "-c", "echo one; echo two >&2"])), "one\n");
    assert!(ok(serve.cli("list", &[])).contains("ready"));
    // An orderly stop ends a running exec with the process's own status (SIGTERM: 143), not a broken stream.
    let mut sleeper = serve.cli_command("exec", &["life", "--", "sleep", "100"]).stdout(Stdio::null()).spawn().unwrap();
    assert!(wait_until(Duration::from_secs(10), || ok(serve.cli("ps", &["life"])).contains("sleep 100")));
    ok(serve.cli("stop", &["life"]));
    assert_eq!(sleeper.wait().unwrap().code(), Some(143));
    assert_eq!(serve.sandbox_state("life"), "stopped");
    ok(serve.cli("start", &["life"]));
    serve.wait_ready("life");
    assert!(ok(serve.cli("get", &["life"])).contains("   2 "), "a new generation");
    assert_eq!(ok(serve.cli("exec", &["life", "--", "echo", "again"])), "again\n");
    let failing = serve.cli("exec", &["life", "--", "sh", "-c", "exit 5"]);
    assert_eq!(failing.status.code(), Some(5));
    ok(serve.cli("rm", &["life"]));
    assert!(!ok(serve.cli("list", &[])).contains("life"));
    assert!(!s.sandbox("life").exists());
}

#[test]
fn lifecycle_through_a_generic_grpc_client() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/py-grpc/bin/python");
    assert!(python.is_file(), "the Python gRPC client is missing: scripts/test installs it into target/py-grpc");
    let s = Scratch::new("svc-grpc");
    let serve = Serve::start(&s);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/grpc_lifecycle.py");
    let out = Command::new(python).arg(script).arg(&serve.socket).arg("grpc-life").output().unwrap();
    eprintln!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    assert!(stdout(&out).contains("grpc: lifecycle complete"));
}

#[test]
fn eight_sandboxes_at_once_and_thirty_two_streams_in_one() {
    let s = Scratch::new("svc-load");
    let serve = Serve::start(&s);
    let ids: Vec<String> = (0..8).map(|i| format!("load-{i}")).collect();
    let creates: Vec<_> =
        ids.iter().map(|id| serve.cli_command("create", &[id]).stdout(Stdio::null()).spawn().unwrap()).collect();
    for mut c in creates {
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(ok(serve.cli("list", &[])).matches(" ready ").count(), 8, "all eight ready at once");
    for id in &ids {
        assert_eq!(ok(serve.cli("exec", &[id, "--", "hostname"])), "sandbox\n");
    }
    eprintln!("e2e: 8 sandboxes ready at once: {:?} VMMs seen", serve.vmms().len());

    // 32 concurrent exec streams through one sandbox, each pushing its own bytes through `cat`.
    let (rt, client) = serve.grpc();
    let streams = (0..32u8).map(|n| {
        let mut client = client.clone();
        async move {
            let input: Vec<u8> =
                (0..=255u8).cycle().take(256 * 1024).map(|b| b.wrapping_mul(31).wrapping_add(n)).collect();
            let start = ExecStart { sandbox_id: "load-0".into(), argv: vec!["cat".into()], ..Default::default() };
            let reqs = vec![
                ExecRequest { request: Some(exec_request::Request::Start(start)) },
                ExecRequest { request: Some(exec_request::Request::Stdin(input.clone())) },
                ExecRequest { request: Some(exec_request::Request::StdinEof(StdinEof {})) },
            ];
            let mut out = Vec::new();
            let mut stream = client.exec(tokio_stream::iter(reqs)).await.unwrap().into_inner();
            let mut status = None;
            while let Some(r) = stream.next().await {
                match r.unwrap().response {
                    Some(exec_response::Response::Stdout(b)) => out.extend_from_slice(&b),
                    Some(exec_response::Response::Exited(e)) => status = Some(e.status),
                    _ => {}
                }
            }
            (out == input, status)
        }
    });
    let results = rt.block_on(futures_util::future::join_all(streams));
    assert!(results.iter().all(|(exact, status)| *exact && *status == Some(0)), "{results:?}");
    eprintln!("e2e: 32 concurrent exec streams, 256 KiB each, byte-exact");
    for id in &ids {
        ok(serve.cli("rm", &[id]));
    }
}

fn exec_tty(serve: &Serve, id: &str, argv: &[&str], size: (u32, u32), resize: Option<(u32, u32)>) -> (String, i32) {
    let (rt, mut client) = serve.grpc();
    rt.block_on(async {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let start = ExecStart {
            sandbox_id: id.into(),
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            tty: true,
            size: Some(TerminalSize { rows: size.0, cols: size.1 }),
            ..Default::default()
        };
        tx.send(ExecRequest { request: Some(exec_request::Request::Start(start)) }).await.unwrap();
        let mut stream = client.exec(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
        let mut out = String::new();
        let mut resized = false;
        while let Some(r) = stream.next().await {
            match r.unwrap().response {
                Some(exec_response::Response::Stdout(b)) => {
                    out.push_str(&String::from_utf8_lossy(&b));
                    if let (Some((rows, cols)), false) = (resize, resized) {
                        if out.contains("ready") {
                            resized = true;
                            let r = exec_request::Request::Resize(TerminalSize { rows, cols });
                            tx.send(ExecRequest { request: Some(r) }).await.unwrap();
                        }
                    }
                }
                Some(exec_response::Response::Exited(e)) => return (out, e.status),
                _ => {}
            }
        }
        panic!("no exit status; output so far: {out:?}")
    })
}

#[test]
fn terminals_have_their_size_resize_and_ctrl_c() {
    let s = Scratch::new("svc-tty");
    let serve = Serve::start(&s);
    ok(serve.cli("create", &["tty"]));
    let (out, status) = exec_tty(&serve, "tty", &["stty", "size"], (37, 111), None);
    assert_eq!((out.trim(), status), ("37 111", 0));

    let script = "trap 'stty size; exit 0' WINCH; echo ready; while :; do sleep 0.05; done";
    let (out, status) = exec_tty(&serve, "tty", &["/bin/sh", "-c", script], (24, 80), Some((50, 132)));
    assert!(out.contains("50 132"), "SIGWINCH and the new size: {out:?}");
    assert_eq!(status, 0);

    // `vm-driver exec -it`: Ctrl-C is a byte on the terminal, which the guest's terminal turns into SIGINT.
    let mut child = serve
        .cli_command(
            "exec",
            &[
                "-i",
                "-t",
                "tty",
                "--",
                "/bin/sh",
                "-c",
                "trap 'echo got-int; exit 42' INT; echo ready; while :; do sleep 0.05; done",
            ],
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("ready") {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "ended before ready: {:?}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    child.stdin.as_mut().unwrap().write_all(&[0x03]).unwrap();
    stdout.read_to_end(&mut seen).unwrap();
    let status = child.wait().unwrap();
    assert!(String::from_utf8_lossy(&seen).contains("got-int"), "{:?}", String::from_utf8_lossy(&seen));
    assert_eq!(status.code(), Some(42));
}

#[test]
fn a_killed_service_leaves_no_vm_and_restores_its_sandboxes() {
    let s = Scratch::new("svc-recover");
    let mut serve = Serve::start(&s);
    for id in ["r1", "r2", "r3"] {
        ok(serve.cli("create", &[id]));
    }
    ok(serve.cli("stop", &["r3"]));
    let running = serve.vmms().into_iter().filter(vm_test_support::procs::ProcInfo::is_alive).collect::<Vec<_>>();
    assert_eq!(running.len(), 2);
    serve.kill();
    for vmm in &running {
        assert!(gone_within(vmm, Duration::from_secs(5)), "a VM outlived the killed service");
    }
    serve.restart();
    serve.wait_ready("r1");
    serve.wait_ready("r2");
    assert_eq!(serve.sandbox_state("r3"), "stopped", "stopped on purpose, stays stopped");
    assert_eq!(ok(serve.cli("exec", &["r1", "--", "echo", "back"])), "back\n");
    assert_eq!(ok(serve.cli("exec", &["r2", "--", "echo", "back"])), "back\n");
}

/// `vm-driver list` as uid/gid 65534, from a copy of the binary any user can run. Switching users needs
/// root; without it `sudo -n` must be able to (CI runners have passwordless sudo).
fn list_as_another_user(s: &Scratch, socket: &Path) -> Output {
    use std::os::unix::fs::PermissionsExt;
    let copy = s.dir.join("vm-driver-for-nobody");
    if !copy.exists() {
        std::fs::copy(&vm_test_support::harness().shipped.driver, &copy).unwrap();
    }
    std::fs::set_permissions(&s.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = rustix::process::geteuid().is_root();
    let mut cmd = if root { Command::new("setpriv") } else { Command::new("sudo") };
    if !root {
        cmd.args(["-n", "setpriv"]);
    }
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]);
    cmd.arg(&copy).args(["list", "--socket"]).arg(socket).output().unwrap()
}

#[test]
fn refusals_other_uid_bad_id_symlinked_socket() {
    let s = Scratch::new("svc-refuse");
    let serve = Serve::with_controls(&s, &[TestControl::ApiSocketWorldReachable]);
    // Positive control: our own uid is served.
    ok(serve.cli("list", &[]));
    // The socket is reachable by anyone here (test switch), so the peer-credential check is what refuses.
    // Control: with the check off too, the same peer is served, so the user switch, the binary and the
    // socket all work for it.
    let open = Scratch::new("svc-refuse-ctl");
    let unchecked = Serve::with_controls(&open, &[TestControl::ApiSocketWorldReachable, TestControl::ApiNoPeerCheck]);
    let served = list_as_another_user(&open, &unchecked.socket);
    assert!(served.status.success(), "control: not served with the check off: {}", stderr(&served));
    let other = list_as_another_user(&s, &serve.socket);
    assert!(!other.status.success(), "a peer of another uid was served: {}", stdout(&other));

    // A bad id is an invalid-argument error before any path is built.
    let (rt, mut client) = serve.grpc();
    for bad in ["../escape", "a/b", "", "..", &"x".repeat(129)] {
        let req = CreateSandboxRequest { sandbox_id: bad.into(), spec: None, credentials: Vec::new() };
        let err = rt.block_on(client.create_sandbox(req)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad:?}");
        let err = rt.block_on(client.get_sandbox(SandboxRef { sandbox_id: bad.into() })).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
    }
    assert!(std::fs::read_dir(s.state().join("sandboxes")).unwrap().next().is_none(), "nothing was created");

    // A socket path that is a symlink is refused at start.
    let private = s.dir.join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let link = private.join("link.sock");
    std::os::unix::fs::symlink("/tmp/elsewhere.sock", &link).unwrap();
    let out = Command::new(&vm_test_support::harness().shipped.driver)
        .args(["serve", "--state-dir"])
        .arg(s.dir.join("other-state"))
        .arg("--socket")
        .arg(&link)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is a symlink"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn exec_detaches_and_reattaches_with_held_output() {
    let s = Scratch::new("svc-attach");
    let serve = Serve::start(&s);
    ok(serve.cli("create", &["at"]));
    let (rt, mut client) = serve.grpc();
    // It writes `held` while no client is attached, then needs stdin from the client that attaches again.
    let script = "echo first; sleep 2; echo held; read x; echo got-$x; exit 7";
    let pid = rt.block_on(async {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let argv = ["sh", "-c", script].map(String::from).to_vec();
        let start = ExecStart { sandbox_id: "at".into(), argv, ..Default::default() };
        tx.send(ExecRequest { request: Some(exec_request::Request::Start(start)) }).await.unwrap();
        // A resize of a process without a terminal is dropped, never fatal to it or the sandbox.
        let resize = exec_request::Request::Resize(TerminalSize { rows: 5, cols: 5 });
        tx.send(ExecRequest { request: Some(resize) }).await.unwrap();
        let mut stream = client.exec(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
        let (mut pid, mut out) = (None, Vec::new());
        while out != b"first\n" {
            match stream.next().await.unwrap().unwrap().response {
                Some(exec_response::Response::Started(started)) => pid = Some(started.process_id),
                Some(exec_response::Response::Stdout(b)) => out.extend_from_slice(&b),
                other => panic!("unexpected {other:?}"),
            }
        }
        pid.unwrap()
        // The stream and its sender drop here: the client is gone.
    });
    let detached = format!("{pid:>7} no ");
    assert!(
        wait_until(Duration::from_secs(10), || ok(serve.cli("ps", &["at"])).contains(&detached)),
        "the process is not listed as detached"
    );
    std::thread::sleep(Duration::from_secs(4));
    let mut attach = serve.cli_command("exec", &["-i", "--attach", &pid.to_string(), "at"]);
    let mut child = attach.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(b"yes\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "held\ngot-yes\n", "held output replayed, then live output");
    assert_eq!(out.status.code(), Some(7));
    assert!(!ok(serve.cli("ps", &["at"])).contains(&detached), "it is gone once it exited");

    // A pid with no detached process is refused, clearly.
    let bad = serve.cli("exec", &["--attach", "99999", "at"]);
    assert!(!bad.status.success());
    let why = String::from_utf8_lossy(&bad.stderr);
    assert!(why.contains("no detached process"), "{why}");
    eprintln!("e2e: detached pid {pid}, re-attached, held output replayed, exit 7");
}

#[test]
fn readiness_closes_with_the_session_and_reopens_with_it() {
    let s = Scratch::new("svc-ready");
    let serve = Serve::with_controls(&s, &[TestControl::SessionGateSignals]);
    ok(serve.cli("create", &["rd"]));
    let get = ok(serve.cli("get", &["rd"]));
    let endpoint = get.lines().nth(1).and_then(|l| l.split_whitespace().nth(5)).unwrap().to_owned();
    let connects = || std::net::TcpStream::connect(&endpoint).is_ok();
    assert!(connects(), "the readiness endpoint {endpoint} accepts while the session is up");

    // A session that presents the wrong token is refused, and the real one is untouched.
    let mut forged = std::os::unix::net::UnixStream::connect(s.state().join("sessions.sock")).unwrap();
    forged.write_all(b"{\"sandbox_id\":\"rd\",\"generation\":1,\"token\":\"forged\"}\n").unwrap();
    let mut reply = String::new();
    forged.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("\"accepted\":false"), "a forged session was accepted: {reply}");
    assert!(connects() && serve.sandbox_state("rd") == "ready");
    // Fault injection (session-gate-signals): SIGUSR1 drops every supervisor session and holds reconnections.
    serve.signal(Signal::SIGUSR1);
    assert!(wait_until(Duration::from_secs(10), || !connects()), "readiness still open after the session was lost");
    assert_ne!(serve.sandbox_state("rd"), "ready");
    serve.signal(Signal::SIGUSR2);
    assert!(wait_until(Duration::from_secs(10), connects), "readiness did not reopen after reconnection");
    serve.wait_ready("rd");
    let again = ok(serve.cli("get", &["rd"]));
    assert!(again.contains(&endpoint), "the same endpoint: {again}");
}

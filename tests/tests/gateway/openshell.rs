//! A gateway's sandbox from create to delete, as upstream's conformance `smoke` and `sandbox-continuity`
//! scenarios drive it: create, Ready, list, exec, delete; stop and start; a driver restart and a gateway
//! restart with the sandbox kept. Then the main process (attach, replay, its exit reported), port forwards,
//! the sandbox token kept out of the guest and every record, and what is refused at create.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vm_protocol::openshell::compute::v1::{
    watch_sandboxes_event::Payload, DeleteSandboxRequest, DriverResourceRequirements, GetCapabilitiesRequest,
    GpuResourceRequirements, ResourceRequirements, StartSandboxRequest, StopSandboxRequest,
    ValidateSandboxCreateRequest, WatchSandboxesRequest,
};
use vm_test_support::events;
use vm_test_support::openshell::{self, ssh};
use vm_test_support::serve::STATE_WAIT;
use vm_test_support::{wait_until, Scratch};

use crate::common::{absent, Gw};

/// A main process that stays.
const IDLE: [&str; 3] = ["/bin/sh", "-c", "echo main-started; exec sleep 100000"];

#[test]
fn smoke_create_ready_list_exec_delete() {
    let s = Scratch::with_deadline("gw-smoke", Duration::from_secs(420));
    let mut gw = Gw::start(&s);
    let caps = gw.gateway.rt.block_on(gw.driver.get_capabilities(GetCapabilitiesRequest {})).unwrap().into_inner();
    assert_eq!(caps.driver_name, "vm-driver");
    let mut watch = gw.gateway.rt.block_on(gw.driver.watch_sandboxes(WatchSandboxesRequest {})).unwrap().into_inner();
    let (id, took) = gw.ready("smoke", &IDLE, false);
    eprintln!("e2e: gateway create -> Ready (supervisor session) in {took:?}");
    let seen = gw.gateway.seen();
    assert!(seen.hellos.iter().any(|(sid, instance)| *sid == id && instance.len() == 36), "{:?}", seen.hellos);
    // The supervisor dials the gateway as soon as it serves; the driver's Ready follows its own check.
    let listed = wait_until(STATE_WAIT, || gw.list().iter().any(|(sid, reason)| *sid == id && reason == "VmReady"));
    assert!(listed, "listed as ready");

    // The gateway's exec: stdout, stderr (extended data), stdin then EOF, the exit code.
    let out = gw.exec(&id, &["/bin/sh", "-c", "echo out; echo err >&2; cat; exit 3"], b"from stdin", false);
    assert_eq!(out.stdout_text(), "out\nfrom stdin");
    assert_eq!(out.stderr_text(), "err\n");
    assert_eq!(out.code, Some(3));
    let quoted = gw.exec(&id, &["printf", "%s|", "a b", "it's", ""], b"", false);
    assert_eq!(quoted.stdout_text(), "a b|it's||", "the gateway's quoting reaches the guest's shell intact");
    let tty = gw.exec(&id, &["tty"], b"", true);
    assert!(tty.stdout_text().starts_with("/dev/pts/"), "a terminal: {:?}", tty.stdout_text());
    let missing = gw.exec(&id, &["no-such-command"], b"", false);
    assert_eq!(missing.code, Some(127));

    // Its events: every process, as for any client.
    let recorded = events::settled(&gw.serve.sandbox(&id));
    assert!(events::of_class(&recorded, 1007).len() >= 8, "process events");
    assert!(events::has(&recorded, 6003, 3), "the gateway's session is API Activity");

    let deleted = gw.gateway.rt.block_on(
        gw.driver.delete_sandbox(DeleteSandboxRequest { sandbox_id: id.clone(), sandbox_name: "smoke".into() }),
    );
    assert!(deleted.unwrap().into_inner().deleted);
    let saw_deleted = gw.gateway.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(Ok(event)) = tokio_stream::StreamExt::next(&mut watch).await {
                if matches!(event.payload, Some(Payload::Deleted(ref d)) if d.sandbox_id == id) {
                    return true;
                }
            }
            false
        })
        .await
        .unwrap_or(false)
    });
    assert!(saw_deleted, "the watch saw the delete");
    assert!(gw.list().is_empty());
    assert!(wait_until(Duration::from_secs(30), || gw.serve.vmms().iter().all(|p| !p.is_alive())), "no VM left");
    let again = gw
        .gateway
        .rt
        .block_on(gw.driver.delete_sandbox(DeleteSandboxRequest { sandbox_id: id, sandbox_name: String::new() }));
    assert!(!again.unwrap().into_inner().deleted, "a second delete finds nothing");
}

#[test]
fn continuity_across_stop_start_a_driver_restart_and_a_gateway_restart() {
    let s = Scratch::with_deadline("gw-continuity", Duration::from_secs(600));
    let mut gw = Gw::start(&s);
    let (id, _) = gw.ready("keep", &IDLE, false);
    gw.exec(&id, &["/bin/sh", "-c", "echo kept > /tmp/kept"], b"", false);
    let first_instance = gw.gateway.seen().hellos.last().unwrap().1.clone();

    // Stop: answered once the VM is down; the session goes with it; listed as stopped.
    let stop = StopSandboxRequest { sandbox_id: id.clone(), sandbox_name: String::new() };
    gw.gateway.rt.block_on(gw.driver.stop_sandbox(stop)).unwrap();
    assert!(wait_until(Duration::from_secs(30), || !gw.gateway.connected(&id)), "the session ended with the stop");
    assert!(gw.list().iter().any(|(sid, reason)| *sid == id && reason == "ContainerStopped"));

    // Start: a new main process, a new session.
    let start = StartSandboxRequest { sandbox_id: id.clone(), sandbox_name: String::new() };
    gw.gateway.rt.block_on(gw.driver.start_sandbox(start)).unwrap();
    gw.wait_connected(&id);
    let second_instance = gw.gateway.seen().hellos.last().unwrap().1.clone();
    assert_ne!(first_instance, second_instance, "each start's main process is a new instance");
    assert_eq!(gw.exec(&id, &["echo", "after start"], b"", false).stdout_text(), "after start\n");

    // The driver restarts: the sandbox comes back with the token it kept, and connects again.
    gw.serve.signal(nix::sys::signal::Signal::SIGTERM);
    let _ = gw.serve.child.wait();
    assert!(wait_until(Duration::from_secs(30), || !gw.gateway.connected(&id)));
    gw.serve.restart();
    gw.driver = gw.gateway.driver(&gw.socket);
    gw.wait_connected(&id);
    assert_eq!(gw.exec(&id, &["echo", "after driver restart"], b"", false).code, Some(0));

    // The gateway restarts: the supervisor opens its session again by itself.
    gw.gateway.restart();
    gw.wait_connected(&id);
    let out = gw.exec(&id, &["echo", "after gateway restart"], b"", false);
    assert_eq!(out.stdout_text(), "after gateway restart\n");
    assert!(gw.list().iter().any(|(sid, _)| *sid == id), "still listed");
}

#[test]
fn the_main_process_is_replayed_to_an_attachment_and_its_exit_is_reported() {
    let s = Scratch::with_deadline("gw-main", Duration::from_secs(420));
    let mut gw = Gw::start(&s);
    let main = ["/bin/sh", "-c", "echo main-started; read line; echo got $line; exit 7"];
    let (id, _) = gw.ready("main", &main, false);
    let hello_instance = gw.gateway.seen().hellos.last().unwrap().1.clone();
    let (replayed, rest, code) = gw.gateway.rt.block_on(async {
        let relay = gw.gateway.relay(&id, None).await.unwrap();
        let handle = ssh(relay).await.unwrap();
        let mut channel = handle.channel_open_session().await.unwrap();
        channel.request_subsystem(true, "openshell-main").await.unwrap();
        let mut text = Vec::new();
        while !String::from_utf8_lossy(&text).contains("main-started") {
            match channel.wait().await {
                Some(russh::ChannelMsg::Data { data }) => text.extend_from_slice(&data),
                Some(_) => {}
                None => break,
            }
        }
        let replayed = String::from_utf8_lossy(&text).into_owned();
        channel.data_bytes(b"hello\n".to_vec()).await.unwrap();
        let (mut rest, mut code) = (Vec::new(), None);
        while let Some(msg) = channel.wait().await {
            match msg {
                russh::ChannelMsg::Data { data } => rest.extend_from_slice(&data),
                russh::ChannelMsg::ExitStatus { exit_status } => code = Some(exit_status),
                russh::ChannelMsg::Close => break,
                _ => {}
            }
        }
        (replayed, String::from_utf8_lossy(&rest).into_owned(), code)
    });
    assert!(replayed.contains("main-started"), "what it printed before the attachment is replayed");
    assert_eq!(rest, "got hello\n", "the attachment's input reached it");
    assert_eq!(code, Some(7), "its exit status ends the attachment");
    assert!(wait_until(Duration::from_secs(30), || !gw.gateway.seen().exits.is_empty()), "the exit was reported");
    let exit = gw.gateway.seen().exits[0].clone();
    assert_eq!(
        (exit.exit_code, exit.instance_id.as_str(), exit.sandbox_id.as_str()),
        (7, hello_instance.as_str(), id.as_str())
    );
}

#[test]
fn forwards_reach_only_the_guests_loopback() {
    let s = Scratch::with_deadline("gw-forward", Duration::from_secs(420));
    let mut gw = Gw::start(&s);
    let (id, _) = gw.ready("fwd", &IDLE, false);
    let serve_page =
        "mkdir -p /tmp/www && echo page-7d1 > /tmp/www/index.html && busybox httpd -p 127.0.0.1:8080 -h /tmp/www";
    assert_eq!(gw.exec(&id, &["/bin/sh", "-c", serve_page], b"", false).code, Some(0));
    let get = b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n";
    let (direct, tcp_relay, elsewhere, relay_elsewhere) = gw.gateway.rt.block_on(async {
        // `openshell sandbox forward`: OpenSSH's -L, a direct-tcpip channel.
        let handle = ssh(gw.gateway.relay(&id, None).await.unwrap()).await.unwrap();
        let channel = handle.channel_open_direct_tcpip("127.0.0.1", 8080, "127.0.0.1", 40000).await.unwrap();
        let mut stream = channel.into_stream();
        stream.write_all(get).await.unwrap();
        let mut direct = Vec::new();
        let _ = stream.read_to_end(&mut direct).await;
        // The gateway's own TCP relay target (service routing).
        let mut relay = gw.gateway.relay(&id, Some(("127.0.0.1", 8080))).await.unwrap();
        relay.write_all(get).await.unwrap();
        let mut tcp = Vec::new();
        let _ = relay.read_to_end(&mut tcp).await;
        // Anywhere but the guest's loopback is refused.
        let elsewhere = handle.channel_open_direct_tcpip("10.0.2.2", 80, "127.0.0.1", 40001).await.is_err();
        let relay_elsewhere = gw.gateway.relay(&id, Some(("192.168.1.1", 80))).await.err().unwrap_or_default();
        (
            String::from_utf8_lossy(&direct).into_owned(),
            String::from_utf8_lossy(&tcp).into_owned(),
            elsewhere,
            relay_elsewhere,
        )
    });
    assert!(direct.contains("200") && direct.contains("page-7d1"), "{direct}");
    assert!(tcp_relay.contains("page-7d1"), "{tcp_relay}");
    assert!(elsewhere, "a direct-tcpip channel off the guest's loopback is refused");
    assert!(relay_elsewhere.contains("only the sandbox's loopback"), "{relay_elsewhere}");
}

#[test]
fn the_sandbox_token_reaches_the_gateway_and_nothing_else() {
    let s = Scratch::with_deadline("gw-token", Duration::from_secs(420));
    let mut gw = Gw::start(&s);
    let (id, token) = gw.gateway.mint();
    gw.create(openshell::sandbox(&id, &token, "token", &IDLE, false)).unwrap();
    gw.wait_connected(&id);
    let guest = gw.exec(&id, &["/bin/sh", "-c", "env; cat /proc/*/environ; cat /proc/*/cmdline"], b"", false);
    assert!(absent(&guest.stdout, &token) && absent(&guest.stderr, &token), "not in the guest");
    let dir = gw.serve.sandbox(&id);
    for file in ["events.jsonl", "supervisor.log", "console.log", "spec.json", "gateway.json"] {
        let text = std::fs::read(dir.join(file)).unwrap_or_default();
        assert!(absent(&text, &token), "not in {file}");
    }
    for process in gw.serve.seen().iter().filter(|p| p.is_alive()) {
        for what in ["cmdline", "environ"] {
            let text = std::fs::read(format!("/proc/{}/{what}", process.pid)).unwrap_or_default();
            assert!(absent(&text, &token), "not in the {what} of pid {}", process.pid);
        }
    }
    let kept = dir.join("gateway-token");
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&kept).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "kept host-side, private");
    let at_gateway = gw.gateway.seen().authorizations;
    assert!(at_gateway.iter().any(|a| *a == format!("Bearer {token}")), "presented to the gateway");

    // The reason the token is refused in the sandbox's environment: anything there reaches the guest.
    let (other, other_token) = gw.gateway.mint();
    let mut leaky = openshell::sandbox(&other, &other_token, "leaky", &IDLE, false);
    let spec = leaky.spec.as_mut().unwrap();
    spec.environment.insert("OPENSHELL_SANDBOX_TOKEN".into(), other_token.clone());
    let refused = gw.create(leaky.clone()).unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("spec.environment"), "{}", refused.message());
    let spec = leaky.spec.as_mut().unwrap();
    spec.environment.clear();
    spec.environment.insert("CONTROL_VAR".into(), other_token.clone());
    gw.create(leaky).unwrap();
    gw.wait_connected(&other);
    let control = gw.exec(&other, &["env"], b"", false);
    assert!(!absent(&control.stdout, &other_token), "control: a value in the environment reaches the guest");
}

#[test]
fn what_a_vm_cannot_honour_is_refused_at_create_naming_the_field() {
    let s = Scratch::with_deadline("gw-refuse", Duration::from_secs(240));
    let mut gw = Gw::start(&s);
    let (id, token) = gw.gateway.mint();
    let refused = |gw: &mut Gw, sandbox| {
        let req = ValidateSandboxCreateRequest { sandbox: Some(sandbox) };
        let validated = gw.gateway.rt.block_on(gw.driver.validate_sandbox_create(req)).unwrap_err();
        assert_eq!(validated.code(), tonic::Code::InvalidArgument);
        validated.message().to_owned()
    };
    let mut gpu = openshell::sandbox(&id, &token, "gpu", &IDLE, false);
    gpu.spec.as_mut().unwrap().resource_requirements =
        Some(ResourceRequirements { gpu: Some(GpuResourceRequirements { count: Some(1) }) });
    assert!(refused(&mut gw, gpu.clone()).contains("gpu"));
    assert_eq!(gw.create(gpu).unwrap_err().code(), tonic::Code::InvalidArgument);
    let mut big = openshell::sandbox(&id, &token, "big", &IDLE, false);
    big.spec.as_mut().unwrap().template.as_mut().unwrap().resources =
        Some(DriverResourceRequirements { memory_limit: "1Ti".into(), ..Default::default() });
    assert!(refused(&mut gw, big).contains("resources"));
    let untokened = openshell::sandbox(&id, "", "none", &IDLE, false);
    assert!(refused(&mut gw, untokened).contains("sandbox_token"));
    let bad_id = openshell::sandbox("../../etc", &token, "path", &IDLE, false);
    assert!(refused(&mut gw, bad_id).contains("sandbox.id"));
    assert!(gw.list().is_empty(), "nothing was made");
    assert!(gw.serve.vmms().is_empty(), "nothing was started");
    let ok = openshell::sandbox(&id, &token, "fine", &IDLE, false);
    let req = ValidateSandboxCreateRequest { sandbox: Some(ok) };
    assert!(gw.gateway.rt.block_on(gw.driver.validate_sandbox_create(req)).is_ok());
    let _ = STATE_WAIT;
}

#[test]
fn the_sandbox_policy_gates_what_the_gateway_asks() {
    let s = Scratch::with_deadline("gw-policy", Duration::from_secs(420));
    let mut gw = Gw::start(&s);
    let (id, token) = gw.gateway.mint();
    let mut sandbox = openshell::sandbox(&id, &token, "gated", &IDLE, false);
    let config = prost_types::Struct {
        fields: [(
            "policy".to_owned(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(
                    r#"{"allow":["exec","stdin"],"exec_programs":["/bin/sh"]}"#.into(),
                )),
            },
        )]
        .into_iter()
        .collect(),
    };
    sandbox.spec.as_mut().unwrap().template.as_mut().unwrap().driver_config = Some(config);
    gw.create(sandbox).unwrap();
    gw.wait_connected(&id);
    assert_eq!(gw.exec(&id, &["echo", "through the shell"], b"", false).code, Some(0), "the shell is allowed");
    let forward = gw.gateway.rt.block_on(async {
        let handle = ssh(gw.gateway.relay(&id, None).await.unwrap()).await.unwrap();
        let channel = handle.channel_open_direct_tcpip("127.0.0.1", 22, "127.0.0.1", 40000).await.unwrap();
        let mut stream = channel.into_stream();
        let mut buf = Vec::new();
        let _ = stream.read_to_end(&mut buf).await;
        buf
    });
    assert!(forward.is_empty(), "port_forward is not allowed: the stream ends at once");
    let found = events::finding_descs(&events::settled(&gw.serve.sandbox(&id)));
    assert!(found.iter().any(|f| f.contains("port_forward denied")), "{found:#?}");
}

//! Network by policy under `vm-driver serve` (issue 22): live policy updates restrict and restore the
//! approved network rules and close what they revoke (with a control that shows what that prevents), and
//! `vm-driver port-forward` serves a web server in the guest (busybox `httpd`) to the host, only where the
//! policy allows `port_forward`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vm_contract::test_control::TestControl;
use vm_test_support::net::{self, server_dir, EchoServer, WebServer, HOST_GATEWAY};
use vm_test_support::output::{ok, text};
use vm_test_support::serve::Serve;
use vm_test_support::{events, wait_until, Scratch};

/// A rule for `port` on the host's loopback.
fn rule(port: u16) -> String {
    net::rule(HOST_GATEWAY, port)
}

/// A small sandbox allowed the operations `allow` and, on the network, `rules`.
fn create(serve: &Serve, id: &str, allow: &[&str], rules: &[String]) {
    serve.create_small(id, Some(&net::policy(allow, rules)));
}

fn events(serve: &Serve, id: &str) -> Vec<Value> {
    events::read(&serve.sandbox(id))
}

/// `wget` of `url` in the sandbox: what it printed, or `None` when it failed.
fn wget(serve: &Serve, id: &str, url: &str) -> Option<String> {
    let out = serve.cli("exec", &[id, "--", "wget", "-q", "-O-", url]);
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn update(serve: &Serve, id: &str, revision: u64, network: Option<&str>) {
    ok(serve.update_policy(id, revision, "exec,stdin", network));
}

#[test]
fn a_policy_update_refuses_and_closes_what_it_revokes_and_restores_it() {
    let s = Scratch::with_deadline("net-revoke", Duration::from_secs(400));
    let web = WebServer::start(&server_dir("revoke-web"), None);
    std::fs::write(web.root.join("f.txt"), "allowed\n").unwrap();
    let echo = EchoServer::start();
    let serve = Serve::start(&s);
    create(&serve, "rv", &["exec", "stdin"], &[rule(web.port), rule(echo.port)]);
    let url = format!("http://{HOST_GATEWAY}:{}/f.txt", web.port);
    assert_eq!(wget(&serve, "rv", &url).as_deref(), Some("allowed\n"));

    // A connection held open (a tunnel to the echo server) while its rule is revoked. The sleep runs in the
    // background so that only the tunnel's end, not the sleep's, ends the pipeline.
    let tunnel = format!(
        "(printf 'CONNECT {HOST_GATEWAY}:{} HTTP/1.1\\r\\n\\r\\n'; sleep 60 2>/dev/null &) | nc 127.0.0.1 3128 >/dev/null; echo closed",
        echo.port
    );
    let mut held =
        serve.cli_command("exec", &["rv", "--", "sh", "-c", &tunnel]).stdout(Stdio::piped()).spawn().unwrap();
    let opened = |serve: &Serve| {
        events(serve, "rv")
            .iter()
            .any(|e| e["class_uid"] == 4001 && e["activity_id"] == 1 && e["dst_endpoint"]["port"] == echo.port)
    };
    assert!(wait_until(Duration::from_secs(30), || opened(&serve)), "the tunnel opened");
    let revoked_at = Instant::now();
    update(&serve, "rv", 1, Some(&format!("[{}]", rule(web.port))));
    let status = held.wait().unwrap();
    let mut said = String::new();
    held.stdout.take().unwrap().read_to_string(&mut said).unwrap();
    assert!(status.success() && said.trim() == "closed", "{said}");
    assert!(revoked_at.elapsed() < Duration::from_secs(20), "closed by the update, not by its own end");
    let closes: Vec<Value> = events(&serve, "rv")
        .into_iter()
        .filter(|e| e["class_uid"] == 4001 && e["activity_id"] == 2 && e["dst_endpoint"]["port"] == echo.port)
        .collect();
    assert!(closes.iter().any(|e| e.to_string().contains("no longer allows")), "{closes:?}");
    // The rule still approved and in force keeps working; none in force: refused; no list: all restored.
    assert_eq!(wget(&serve, "rv", &url).as_deref(), Some("allowed\n"));
    update(&serve, "rv", 2, Some("[]"));
    assert_eq!(wget(&serve, "rv", &url), None, "no rule in force");
    update(&serve, "rv", 3, None);
    assert_eq!(wget(&serve, "rv", &url).as_deref(), Some("allowed\n"), "restored");
    // A rule never approved is refused, and closes admission.
    let out = serve.update_policy("rv", 4, "exec", Some(&format!("[{}]", rule(1))));
    assert!(!out.status.success() && text(&out).contains("never approved"), "{}", text(&out));
}

#[test]
fn with_egress_ignoring_updates_a_revoked_host_still_connects() {
    let s = Scratch::with_deadline("net-revoke-control", Duration::from_secs(300));
    let web = WebServer::start(&server_dir("revoke-ctl-web"), None);
    std::fs::write(web.root.join("f.txt"), "allowed\n").unwrap();
    let serve = Serve::with_controls(&s, &[TestControl::EgressIgnoresUpdates]);
    create(&serve, "rc", &["exec", "stdin"], &[rule(web.port)]);
    let url = format!("http://{HOST_GATEWAY}:{}/f.txt", web.port);
    update(&serve, "rc", 1, Some("[]"));
    assert_eq!(wget(&serve, "rc", &url).as_deref(), Some("allowed\n"), "the revoked rule still decides");
}

/// Runs `vm-driver port-forward ID 0:PORT`; returns it and the host port it listens on.
fn port_forward(serve: &Serve, id: &str, port: u16) -> (Child, u16) {
    let mut child = serve
        .cli_command("port-forward", &[id, &format!("0:{port}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    // "Forwarding from 127.0.0.1:NNNN -> PORT"
    let host_port = line.split_whitespace().nth(2).and_then(|a| a.rsplit(':').next()).and_then(|p| p.parse().ok());
    (child, host_port.unwrap_or_else(|| panic!("port-forward said {line:?}")))
}

/// An HTTP/1.0 GET on the host's `127.0.0.1:port`: the whole answer, or what came before an error.
fn get(port: u16, path: &str) -> String {
    let Ok(mut conn) = TcpStream::connect(("127.0.0.1", port)) else { return String::new() };
    conn.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let _ = conn.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes());
    let mut answer = Vec::new();
    let _ = conn.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

#[test]
fn port_forward_serves_a_guest_web_server_to_the_host_where_the_policy_allows_it() {
    let s = Scratch::with_deadline("net-forward", Duration::from_secs(400));
    let serve = Serve::start(&s);
    create(&serve, "pf", &["exec", "port_forward"], &[]);
    let httpd = "mkdir -p /tmp/w && echo forwarded-ok > /tmp/w/hello.txt && exec httpd -f -p 127.0.0.1:8000 -h /tmp/w";
    let mut server = serve.cli_command("exec", &["pf", "--", "sh", "-c", httpd]).spawn().unwrap();
    let (mut forward, host_port) = port_forward(&serve, "pf", 8000);
    let mut answer = String::new();
    assert!(
        wait_until(Duration::from_secs(30), || {
            answer = get(host_port, "/hello.txt");
            answer.contains("forwarded-ok")
        }),
        "the guest's server through the forward: {answer:?}"
    );
    assert!(answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"), "{answer}");
    // A port nothing listens on: the connection is closed, the forward goes on serving.
    let (mut nothing, nothing_port) = port_forward(&serve, "pf", 8001);
    assert_eq!(get(nothing_port, "/"), "");
    assert!(get(host_port, "/hello.txt").contains("forwarded-ok"));
    let mut all = Vec::new();
    let opened_and_closed = wait_until(Duration::from_secs(10), || {
        all = events(&serve, "pf");
        let inbound = || all.iter().filter(|e| e["class_uid"] == 4001 && e["connection_info"]["direction_id"] == 1);
        inbound().any(|e| e["activity_id"] == 1) && inbound().any(|e| e["activity_id"] == 2)
    });
    assert!(opened_and_closed, "inbound open and close events: {all:?}");

    // Without port_forward in the policy: refused, with a finding.
    create(&serve, "nopf", &["exec"], &[]);
    let (mut denied, denied_port) = port_forward(&serve, "nopf", 8000);
    assert_eq!(get(denied_port, "/"), "");
    // Events reach events.jsonl once the audit chain holds them: a moment after the refusal.
    let mut findings: Vec<String> = Vec::new();
    let found = wait_until(Duration::from_secs(10), || {
        findings = events(&serve, "nopf").iter().filter(|e| e["class_uid"] == 2004).map(Value::to_string).collect();
        findings.iter().any(|f| f.contains("port_forward"))
    });
    assert!(found, "{findings:?}");
    for child in [&mut forward, &mut nothing, &mut denied, &mut server] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

//! Network by policy with no guest NIC (issue 22), on real VMs against real servers on the host's loopback:
//! Python's `http.server` over HTTP and HTTPS (a throwaway CA), a TCP echo server, and `dnsmasq` answering
//! names with public, private and loopback addresses, and `tinyproxy` as an operator's proxy. Real clients in the guest: busybox `wget` and `nc` in
//! the built-in root; `curl`, `python3`, `pip` and `git` in the Debian test image. Every connection goes
//! through the agent's loopback proxies and the supervisor's decision.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use vm_contract::test_control::TestControl;
use vm_test_support::events::{self, of_class};
use vm_test_support::net::{
    self, rule, server_dir, throwaway_ca, Dns, EchoServer, UpstreamProxy, WebServer, HOST_GATEWAY,
};
use vm_test_support::test_image::{layout_ref, shared_store};
use vm_test_support::{leaks, ocsf_schema, Launch, Outcome, Scratch};

/// A policy that allows exec, stdin and the given network rules (JSON objects), in a file of the test's.
fn policy(s: &Scratch, rules: &[String]) -> PathBuf {
    let file = s.dir.join("policy.json");
    std::fs::write(&file, net::policy(&["exec", "stdin"], rules)).unwrap();
    file
}

fn launch<'a>(s: &'a Scratch, policy: &Path, script: &str) -> Launch<'a> {
    Launch::new(s, &["/bin/sh", "-c", script]).policy(policy)
}

/// The lines the workload printed, after `rc=` markers are checked by the caller.
fn lines(out: &Outcome) -> Vec<String> {
    out.succeeded().lines().map(str::to_owned).collect()
}

#[test]
fn wget_reaches_the_host_only_through_a_rule_that_names_it() {
    let s = Scratch::with_deadline("net-gateway", Duration::from_secs(300));
    let web = WebServer::start(&server_dir("gateway-web"), None);
    std::fs::write(web.root.join("file.txt"), "through the boundary\n").unwrap();
    let url = format!("http://{HOST_GATEWAY}:{}/file.txt", web.port);
    let p = policy(&s, &[rule(HOST_GATEWAY, web.port), rule("*.vm-driver.internal", 80)]);
    // The query never reaches an event: it may carry a secret.
    let script = format!("wget -q -O- '{url}?token=q-secret-1'; echo rc=$?");
    let got = lines(&launch(&s, &p, &script).run());
    assert_eq!(got, ["through the boundary", "rc=0"]);
    assert!(web.requests().contains("GET /file.txt?token=q-secret-1"), "{}", web.requests());

    let all = events::read(&s.only_sandbox());
    // (The workload's own argv, in its process events, is the workload's to log.)
    let network: Vec<&Value> = all.iter().filter(|e| e["class_uid"] == 4001 || e["class_uid"] == 4002).collect();
    assert!(!serde_json::to_string(&network).unwrap().contains("q-secret-1"), "a query string reached the events");
    let net = of_class(&all, 4001);
    let open = net.iter().find(|e| e["activity_id"] == 1).expect("a Network Activity open");
    assert_eq!(open["dst_endpoint"]["hostname"], HOST_GATEWAY);
    assert_eq!(open["dst_endpoint"]["ip"], "127.0.0.1");
    assert_eq!(open["firewall_rule"]["name"], HOST_GATEWAY, "{open}");
    let close = net.iter().find(|e| e["activity_id"] == 2).expect("a Network Activity close");
    assert!(close["traffic"]["bytes_in"].as_u64().unwrap() > 20, "{close}");
    let http = of_class(&all, 4002);
    assert_eq!(http.len(), 1, "{http:?}");
    assert_eq!(http[0]["http_request"]["url"]["path"], "/file.txt");
    ocsf_schema::assert_valid(&all);

    // Without a rule for it, and through a wildcard (which never matches the host gateway): refused, clearly.
    let t = Scratch::with_deadline("net-gateway-no", Duration::from_secs(300));
    let p = policy(&t, &[rule(HOST_GATEWAY, 1), rule("*.vm-driver.internal", web.port)]);
    let out = launch(&t, &p, &format!("wget -q -O- {url}; echo rc=$?")).run();
    assert_eq!(out.code, Some(0));
    assert!(out.stdout_text().contains("rc=1"), "{}", out.stdout_text());
    assert!(out.workload_stderr().contains("403"), "{}", out.workload_stderr());
    let all = events::read(&t.only_sandbox());
    let refused = of_class(&all, 4001).into_iter().find(|e| e["activity_id"] == 5).expect("a refuse event");
    assert_eq!(refused["dst_endpoint"]["port"], web.port);
    assert!(refused["status_detail"].as_str().unwrap().contains("no network rule"), "{refused}");
    let denied = of_class(&all, 2004);
    assert!(denied.iter().any(|f| f.to_string().contains("refused")), "a policy_denied finding: {denied:?}");
    ocsf_schema::assert_valid(&all);
    assert_eq!(web.requests().lines().count(), 1, "the refused request never reached the server");
}

#[test]
fn names_resolve_on_the_host_and_every_answer_is_checked() {
    let s = Scratch::with_deadline("net-dns", Duration::from_secs(400));
    let web = WebServer::start(&server_dir("dns-web"), None);
    std::fs::write(web.root.join("secret.txt"), "host-only\n").unwrap();
    let dns = Dns::start(&[("rebind.test", "127.0.0.1"), ("private.test", "10.0.0.1"), ("listed.test", "127.0.0.1")]);
    let port = web.port;
    let listed = format!(r#"{{"host":"listed.test","ports":[{port}],"allowed_ips":["127.0.0.1/32"]}}"#);
    let p = policy(&s, &[rule("rebind.test", port), rule("private.test", port), listed]);
    let script = format!(
        "for h in rebind.test private.test listed.test; do wget -q -O- http://$h:{port}/secret.txt; echo $h=$?; done"
    );
    let resolver = dns.addr.to_string();
    let out = launch(&s, &p, &script).flag("--egress-resolver").flag(&resolver).run();
    let got = lines(&out);
    assert_eq!(got, ["rebind.test=1", "private.test=1", "host-only", "listed.test=0"], "{}", out.workload_stderr());
    let all = events::read(&s.only_sandbox());
    let refusals: Vec<String> = of_class(&all, 4001)
        .into_iter()
        .filter(|e| e["activity_id"] == 5)
        .map(|e| format!("{} {}", e["dst_endpoint"]["ip"], e["status_detail"]))
        .collect();
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    assert!(refusals[0].contains("127.0.0.1") && refusals[0].contains("loopback"), "{refusals:?}");
    assert!(refusals[1].contains("10.0.0.1") && refusals[1].contains("private"), "{refusals:?}");
    ocsf_schema::assert_valid(&all);

    // The control: with the address check off, the rebinding name reaches the host's loopback.
    let t = Scratch::with_deadline("net-dns-control", Duration::from_secs(300));
    let p = policy(&t, &[rule("rebind.test", port)]);
    let script = format!("wget -q -O- http://rebind.test:{port}/secret.txt; echo rc=$?");
    let out =
        launch(&t, &p, &script).flag("--egress-resolver").flag(&resolver).control(TestControl::NoAddressCheck).run();
    assert_eq!(lines(&out), ["host-only", "rc=0"], "without the check the DNS answer is trusted");
}

/// A PEP 503 index with one wheel, made by the host's Python.
fn package_index(root: &Path) {
    let dir = root.join("simple/demo");
    std::fs::create_dir_all(&dir).unwrap();
    let wheel = dir.join("demo-1.0-py3-none-any.whl");
    let script = "import sys, zipfile\n\
        with zipfile.ZipFile(sys.argv[1], 'w') as z:\n\
        \x20   z.writestr('demo/__init__.py', 'VALUE = 42\\n')\n\
        \x20   z.writestr('demo-1.0.dist-info/METADATA', 'Metadata-Version: 2.1\\nName: demo\\nVersion: 1.0\\n')\n\
        \x20   z.writestr('demo-1.0.dist-info/WHEEL', 'Wheel-Version: 1.0\\nGenerator: e2e\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
        \x20   z.writestr('demo-1.0.dist-info/RECORD', '')\n";
    let ok = Command::new("/usr/bin/python3").arg("-c").arg(script).arg(&wheel).status().unwrap();
    assert!(ok.success());
    std::fs::write(
        dir.join("index.html"),
        "<html><body><a href=\"demo-1.0-py3-none-any.whl\">demo-1.0</a></body></html>\n",
    )
    .unwrap();
}

/// A bare repository served over git's dumb HTTP protocol.
fn git_repo(root: &Path) {
    let work = root.parent().unwrap().join("repo-work");
    let git = |dir: &Path, args: &[&str]| {
        let out = Command::new("git").current_dir(dir).args(args).output().unwrap();
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    std::fs::create_dir_all(&work).unwrap();
    git(&work, &["init", "-q", "-b", "main"]);
    std::fs::write(work.join("README"), "cloned through the boundary\n").unwrap();
    git(&work, &["add", "README"]);
    git(&work, &["-c", "user.name=e2e", "-c", "user.email=e2e@example.invalid", "commit", "-q", "-m", "one"]);
    git(root, &["clone", "-q", "--bare", work.to_str().unwrap(), "repo.git"]);
    git(&root.join("repo.git"), &["update-server-info"]);
}

#[test]
fn curl_https_python_pip_git_and_raw_tcp_work_through_allowed_rules() {
    let s = Scratch::with_deadline("net-clients", Duration::from_secs(600));
    let web = WebServer::start(&server_dir("clients-web"), None);
    std::fs::write(web.root.join("file.txt"), "plain\n").unwrap();
    package_index(&web.root);
    git_repo(&web.root);
    let (ca, cert, key) = throwaway_ca(&server_dir("clients-ca"), &[HOST_GATEWAY]);
    let tls = WebServer::start(&server_dir("clients-tls"), Some((&cert, &key)));
    std::fs::write(tls.root.join("file.txt"), "over tls\n").unwrap();
    let echo = EchoServer::start();
    let (h, t, e) = (web.port, tls.port, echo.port);
    let p = policy(&s, &[rule(HOST_GATEWAY, h), rule(HOST_GATEWAY, t), rule(HOST_GATEWAY, e)]);
    // Raw TCP by hand through both proxies, half-closing its side and reading the echo to the end.
    let raw = format!(
        "import socket\n\
         def via_http():\n\
         \x20   s = socket.create_connection(('127.0.0.1', 3128))\n\
         \x20   s.sendall(b'CONNECT {HOST_GATEWAY}:{e} HTTP/1.1\\r\\n\\r\\n')\n\
         \x20   head = b''\n\
         \x20   while not head.endswith(b'\\r\\n\\r\\n'):\n\
         \x20       head += s.recv(1)\n\
         \x20   return s\n\
         def via_socks():\n\
         \x20   s = socket.create_connection(('127.0.0.1', 1080))\n\
         \x20   s.sendall(b'\\x05\\x01\\x00')\n\
         \x20   assert s.recv(2) == b'\\x05\\x00'\n\
         \x20   name = b'{HOST_GATEWAY}'\n\
         \x20   s.sendall(b'\\x05\\x01\\x00\\x03' + bytes([len(name)]) + name + ({e}).to_bytes(2, 'big'))\n\
         \x20   assert s.recv(10)[1] == 0\n\
         \x20   return s\n\
         for open_ in (via_http, via_socks):\n\
         \x20   s = open_()\n\
         \x20   s.sendall(b'ping ' * 1000)\n\
         \x20   s.shutdown(socket.SHUT_WR)\n\
         \x20   got = b''\n\
         \x20   while True:\n\
         \x20       chunk = s.recv(65536)\n\
         \x20       if not chunk:\n\
         \x20           break\n\
         \x20       got += chunk\n\
         \x20   print(open_.__name__, got == b'PING ' * 1000, len(got), got[:30], got[-10:])\n"
    );
    std::fs::write(web.root.join("raw.py"), raw).unwrap();
    let g = HOST_GATEWAY;
    let script = format!(
        "cat > /tmp/ca.pem; \
         curl -sS --cacert /tmp/ca.pem https://{g}:{t}/file.txt; \
         curl -sS --proxy socks5h://127.0.0.1:1080 http://{g}:{h}/file.txt; \
         curl -sS --proxy socks5://127.0.0.1:1080 http://{g}:{h}/file.txt 2>/dev/null || echo socks5-local-dns-fails; \
         python3 -c \"import urllib.request; print(urllib.request.urlopen('http://{g}:{h}/file.txt').read().decode(), end='')\"; \
         pip download -q --no-deps --disable-pip-version-check --trusted-host {g} --index-url http://{g}:{h}/simple \
             -d /tmp/dl demo && ls /tmp/dl; \
         git clone -q http://{g}:{h}/repo.git /tmp/repo && cat /tmp/repo/README; \
         curl -sS http://{g}:{h}/raw.py -o /tmp/raw.py && python3 /tmp/raw.py"
    );
    let out = Launch::new(&s, &["/bin/sh", "-c", &script])
        .policy(&p)
        .root_image(&layout_ref(), shared_store())
        .stdin(std::fs::read(&ca).unwrap())
        .run();
    let mut got = lines(&out);
    // The raw lines end with what was received (its length and ends), for the failure message.
    let raw: Vec<String> = got.split_off(got.len().saturating_sub(2));
    for (line, via) in raw.iter().zip(["via_http True ", "via_socks True "]) {
        assert!(line.starts_with(via), "{raw:?}: {}", out.workload_stderr());
    }
    assert_eq!(
        got,
        [
            "over tls",
            "plain",
            "socks5-local-dns-fails",
            "plain",
            "demo-1.0-py3-none-any.whl",
            "cloned through the boundary",
        ],
        "stderr: {}",
        out.workload_stderr()
    );
    let all = events::read(&s.only_sandbox());
    ocsf_schema::assert_valid(&all);
    let opened = of_class(&all, 4001).into_iter().filter(|e| e["activity_id"] == 1).count();
    assert!(opened >= 8, "every connection is an event: {opened} opens");
}

#[test]
fn a_request_that_never_ends_and_one_too_large_are_answered_and_closed() {
    let s = Scratch::with_deadline("net-bounds", Duration::from_secs(300));
    let p = policy(&s, &[rule(HOST_GATEWAY, 1)]);
    // Silence: the supervisor's request timer answers 408. A head past 8 KiB: 431. The time is taken when the
    // answer's first line arrives, not when the pipeline ends (its writer sleeps on past the bound).
    let script = "start=$(date +%s); (printf 'CONNECT a'; sleep 25) | timeout 30 nc 127.0.0.1 3128 \
                  | { head -1; echo took=$(( $(date +%s) - start )); }; \
                  head -c 9000 /dev/zero | tr '\\0' 'x' | timeout 30 nc 127.0.0.1 3128 | head -1";
    let got = lines(&launch(&s, &p, script).run());
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got[0].starts_with("HTTP/1.1 408"), "{got:?}");
    let took: u64 = got[1].trim_start_matches("took=").parse().unwrap();
    assert!((9..=20).contains(&took), "answered after {took} s (the bound is 10 s)");
    assert!(got[2].starts_with("HTTP/1.1 431"), "{got:?}");
}

/// An operator's proxy (a real `tinyproxy` that wants a login): every connection leaves as a CONNECT to the
/// address the supervisor checked, with the login from a 0600 file, which no argv, log or sandbox file holds.
/// Control: a wrong login, and the same request is refused by the proxy (so the login is what let it pass).
#[test]
fn egress_leaves_through_the_operators_proxy_with_its_login() {
    let password = "pw-canary-5f1c9e07";
    let dir = server_dir("upstream");
    let proxy = UpstreamProxy::start(&dir, "operator", password);
    let web = WebServer::start(&dir, None);
    std::fs::write(web.root.join("f.txt"), "via the operator's proxy\n").unwrap();
    let url = format!("http://{HOST_GATEWAY}:{}/f.txt", web.port);
    let login = |name: &str, text: &str| {
        use std::os::unix::fs::PermissionsExt;
        let file = dir.join(name);
        std::fs::write(&file, text).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        file
    };
    let through = |s: &Scratch, file: &Path| {
        let p = policy(s, &[rule(HOST_GATEWAY, web.port)]);
        launch(s, &p, &format!("wget -q -O- {url}; echo rc=$?"))
            .flag("--egress-proxy")
            .flag(&format!("http://127.0.0.1:{}", proxy.port))
            .flag("--egress-proxy-credentials")
            .flag(file.to_str().unwrap())
            .run()
    };

    let s = Scratch::with_deadline("net-upstream", Duration::from_secs(300));
    let out = through(&s, &login("good.login", &format!("operator:{password}\n")));
    let seen = out.seen.clone();
    assert_eq!(lines(&out), ["via the operator's proxy", "rc=0"]);
    let asked = proxy.requests();
    assert!(asked.contains(&format!("CONNECT 127.0.0.1:{} HTTP/1.1", web.port)), "the proxy was asked: {asked}");
    assert!(!asked.contains(HOST_GATEWAY), "the proxy is given the checked address, never the name: {asked}");
    assert!(web.requests().contains("GET /f.txt"), "{}", web.requests());
    // The login is in its file and the proxy's configuration only.
    assert!(!String::from_utf8_lossy(&out.stderr).contains(password), "the driver's stderr holds the login");
    for p in &seen {
        assert!(!p.cmdline.join(" ").contains(password), "an argv holds the login: {:?}", p.cmdline);
    }
    let holding = leaks::files_holding(&s.dir, password.as_bytes());
    assert!(holding.is_empty(), "files hold the login: {holding:?}");

    let t = Scratch::with_deadline("net-upstream-bad", Duration::from_secs(300));
    let out = through(&t, &login("bad.login", "operator:not-the-password\n"));
    assert_eq!(out.code, Some(0));
    assert!(out.stdout_text().contains("rc=1"), "{}", out.stdout_text());
    assert!(out.workload_stderr().contains("502"), "{}", out.workload_stderr());
    let all = events::read(&t.only_sandbox());
    assert!(of_class(&all, 4001).iter().any(|e| e["activity_id"] == 5), "a refuse event");
    assert_eq!(web.requests().lines().count(), 1, "the refused login reached nothing");
}

//! Secrets the guest never holds (issue 24), on real VMs against a real HTTPS server on the host's loopback
//! (Python's `http.server` with a throwaway CA, which the supervisor trusts through `--egress-ca` and which
//! logs each `Authorization` header it receives), with real clients in the Debian test image (`curl`,
//! `python3`). The key is a random canary: the server must receive it; the guest's memory (read from the
//! VMM's guest RAM while the workload runs), its disks, every file of the sandbox directory and the
//! driver's output must not hold it. Controls show the scan can fail (the key put in the environment is
//! found in guest memory) and what the swap prevents (with `pass-placeholders` the server gets the
//! placeholder).

use std::io::{BufRead, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use vm_contract::test_control::TestControl;
use vm_test_support::events::{self, finding_descs};
use vm_test_support::leaks::{self, files_holding};
use vm_test_support::net::{server_dir, throwaway_ca, Dns, WebServer, HOST_GATEWAY};
use vm_test_support::procs::PeakRss;
use vm_test_support::serve::Serve;
use vm_test_support::test_image::{layout_ref, shared_store};
use vm_test_support::{ocsf_schema, Launch, Running, Scratch};

const G: &str = HOST_GATEWAY;
use vm_supervisor::network::intercept::ca::LEAF_CACHE_ITEMS as LEAF_CACHE;

/// The servers, the CA, the canary and the files a test hands the driver.
struct Setup {
    tls: WebServer,
    plain: WebServer,
    ca: PathBuf,
    canary: String,
    credentials: PathBuf,
    policy: PathBuf,
}

fn random_hex() -> String {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut bytes).unwrap();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A credentials file of mode 0600: `API_KEY` (`value`) bound to the host gateway, `OTHER_KEY` bound to a
/// host the policy does not even allow.
fn credentials_file(path: &Path, value: &str) {
    let text = format!(
        r#"[{{"name": "API_KEY", "value": "{value}", "hosts": ["{G}"]}},
            {{"name": "OTHER_KEY", "value": "sk-other-{}", "hosts": ["api.example.com"]}}]"#,
        random_hex()
    );
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn setup(s: &Scratch, name: &str) -> Setup {
    let (ca, cert, key) = throwaway_ca(&server_dir(&format!("{name}-ca")), &[G]);
    let tls = WebServer::start(&server_dir(&format!("{name}-tls")), Some((&cert, &key)));
    std::fs::write(tls.root.join("file.txt"), "over tls\n").unwrap();
    std::fs::write(tls.root.join("secret.txt"), "not for the workload\n").unwrap();
    let plain = WebServer::start(&server_dir(&format!("{name}-web")), None);
    std::fs::write(plain.root.join("file.txt"), "plain\n").unwrap();
    let canary = format!("sk-canary-{}", random_hex());
    let credentials = s.dir.join("credentials.json");
    credentials_file(&credentials, &canary);
    let policy = s.dir.join("policy.json");
    let text = format!(
        r#"{{"allow": ["exec", "stdin"], "network": {{"allow": [
            {{"host": "{G}", "ports": [{}], "tls": "intercept",
              "http": [{{"methods": ["GET", "POST"], "paths": ["/file.txt", "/api/*"]}}]}},
            {{"host": "{G}", "ports": [{}], "http": [{{"methods": ["GET"], "paths": ["/file.txt"]}}]}}]}}}}"#,
        tls.port, plain.port
    );
    std::fs::write(&policy, text).unwrap();
    Setup { tls, plain, ca, canary, credentials, policy }
}

fn launch<'a>(s: &'a Scratch, policy: &Path, script: &str) -> Launch<'a> {
    Launch::new(s, &["/bin/sh", "-c", script])
        .policy(policy)
        .root_image(&layout_ref(), shared_store())
        .flag("--disk")
        .flag("64")
}

/// The requests every interception test makes, each printing one line.
fn requests(setup: &Setup) -> String {
    let (t, p) = (setup.tls.port, setup.plain.port);
    format!(
        "curl -sS -H \"Authorization: Bearer $API_KEY\" https://{G}:{t}/file.txt https://{G}:{t}/file.txt; \
         curl -sS --http2 -H \"Authorization: Bearer $API_KEY\" -o /dev/null -w 'h2 %{{http_version}} %{{http_code}}\\n' https://{G}:{t}/file.txt; \
         curl -sS -H \"Authorization: Bearer $API_KEY\" --data-binary hello https://{G}:{t}/api/x; \
         python3 -c \"import os, urllib.request as u; r = u.Request('https://{G}:{t}/file.txt', headers={{'Authorization': 'Bearer ' + os.environ['API_KEY']}}); print(u.urlopen(r).read().decode(), end='')\"; \
         curl -sS -o /dev/null -w 'rule %{{http_code}}\\n' https://{G}:{t}/secret.txt; \
         curl -sS -o /dev/null -w 'unbound %{{http_code}}\\n' -H \"Authorization: Bearer $OTHER_KEY\" https://{G}:{t}/file.txt; \
         curl -s -o /dev/null -w 'passthrough %{{http_code}}\\n' -H \"X-Key: $API_KEY\" http://{G}:{p}/file.txt; \
         curl -sS -o /dev/null -w 'other host %{{http_code}}\\n' -H 'Host: other.example' https://{G}:{t}/file.txt; \
         env -u CURL_CA_BUNDLE -u SSL_CERT_FILE curl -sS -o /dev/null -w 'system path %{{http_code}}\\n' https://{G}:{t}/file.txt; \
         curl -s -o /dev/null -w 'tunnel %{{http_connect}}\\n' -p http://{G}:{p}/file.txt; \
         curl -sS http://{G}:{p}/file.txt; \
         curl -s -o /dev/null -w 'plain rule %{{http_code}}\\n' --data x http://{G}:{p}/file.txt; \
         echo \"env ${{API_KEY%%-*}}\""
    )
}

/// The first two lines are one `curl` making two requests on one connection: the server (HTTP/1.0) closes
/// after the first, so the second needs the proxy to connect to the destination again.
const EXPECTED: [&str; 14] = [
    "over tls",
    "over tls",
    "h2 2 200",
    "posted 5",
    "over tls",
    "rule 403",
    "unbound 403",
    "passthrough 000",
    "other host 403",
    "system path 200",
    "tunnel 403",
    "plain",
    "plain rule 403",
    "env vmdrv",
];

/// Reads the workload's lines up to `END`.
fn lines_until_end(running: &mut Running) -> Vec<String> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if running.stdout.read_line(&mut line).unwrap() == 0 || line.trim_end() == "END" {
            return lines;
        }
        lines.push(line.trim_end().to_owned());
    }
}

#[test]
fn the_key_reaches_only_its_host_and_never_the_guest() {
    let s = Scratch::with_deadline("secrets-canary", Duration::from_secs(600));
    let setup = setup(&s, "canary");
    // The workload makes its requests, then holds still while the host reads the guest's memory.
    let script = format!("{{ {}; }} > /tmp/out 2>&1; echo READY; cat /tmp/out; echo END; sleep 25", requests(&setup));
    let launch = launch(&s, &setup.policy, &script)
        .flag("--egress-ca")
        .flag(setup.ca.to_str().unwrap())
        .flag("--credentials-file")
        .flag(setup.credentials.to_str().unwrap());
    let mut running = Running::start(launch, &[], "READY");
    let lines = lines_until_end(&mut running);
    assert_eq!(lines, EXPECTED, "the workload's view");
    let vmm = running.procs().vmm.pid;
    let (in_memory, scanned) = leaks::guest_memory_holds(vmm, setup.canary.as_bytes());
    eprintln!("e2e: scanned {} MiB of the running guest's memory", scanned >> 20);
    assert!(scanned >= 128 << 20, "the guest's RAM was read: {scanned} bytes");
    assert!(!in_memory, "the key is in the guest's memory");

    let status = running.driver.wait().unwrap();
    let mut driver_output = running.stderr_text();
    let mut rest = String::new();
    running.stdout.read_to_string(&mut rest).unwrap();
    driver_output.push_str(&rest);
    assert_eq!(status.code(), Some(0), "{driver_output}");
    assert!(!driver_output.contains(&setup.canary), "the driver's output holds the key");

    // The server got the key where the workload wrote the placeholder, and only on the bound host.
    let received = setup.tls.authorizations();
    let with_key = received.lines().filter(|l| *l == format!("Bearer {}", setup.canary)).count();
    assert_eq!(with_key, 5, "the server's Authorization headers:\n{received}");
    assert!(!received.contains("vmdrv-placeholder-"), "a placeholder reached the server:\n{received}");
    let plain = setup.plain.requests();
    assert_eq!(plain, "GET /file.txt\n", "only the plain request without a placeholder, and allowed, went out");

    let dir = running.sandbox_dir.clone();
    let holding = files_holding(&dir, setup.canary.as_bytes());
    assert!(holding.is_empty(), "files of the sandbox directory hold the key: {holding:?}");
    let all = events::read(&dir);
    ocsf_schema::assert_valid(&all);
    let https: Vec<&Value> =
        all.iter().filter(|e| e["class_uid"] == 4002 && e["http_request"]["url"]["scheme"] == "https").collect();
    assert!(https.len() >= 6, "every intercepted request is an HTTP Activity: {}", https.len());
    let statuses: Vec<(u64, &str)> =
        https.iter().filter_map(|e| Some((e["http_response"]["code"].as_u64()?, e["action"].as_str()?))).collect();
    assert!(statuses.contains(&(200, "Allowed")) && statuses.contains(&(403, "Denied")), "{statuses:?}");
    let with_bytes = https.iter().filter(|e| e["traffic"]["bytes_in"] == 9).count();
    assert!(with_bytes >= 3, "the answers' bytes are counted: {with_bytes}");
    assert!(!all.iter().any(|e| e.to_string().contains("vmdrv-placeholder-")), "an event holds a placeholder");
    let found = finding_descs(&all);
    let has = |needle: &str| found.iter().any(|f| f.contains(needle));
    assert!(has("no http rule"), "the HTTP rule's refusal is a finding: {found:#?}");
    assert!(has("credential OTHER_KEY was sent to"), "the unbound placeholder is a finding: {found:#?}");
    assert!(has("credential API_KEY was sent on a stream"), "the passthrough placeholder is a finding: {found:#?}");
    assert!(has("another host than its connection"), "a request for another host is a finding: {found:#?}");
    assert!(has("cannot judge a tunnel"), "a tunnel under http rules it does not intercept is refused: {found:#?}");
    eprintln!(
        "e2e: key at the server 5 times; none in {} MiB of guest memory, the sandbox directory or the driver's output",
        scanned >> 20
    );
}

#[test]
fn control_the_key_in_the_environment_is_found_in_guest_memory() {
    let s = Scratch::with_deadline("secrets-env-control", Duration::from_secs(300));
    let canary = format!("sk-canary-{}", random_hex());
    let launch = Launch::new(&s, &["/bin/sh", "-c", "echo READY; echo END; sleep 25"])
        .flag("-e")
        .flag(&format!("API_KEY={canary}"));
    let mut running = Running::start(launch, &[], "READY");
    lines_until_end(&mut running);
    let (in_memory, scanned) = leaks::guest_memory_holds(running.procs().vmm.pid, canary.as_bytes());
    assert!(in_memory, "control: a key in the workload's environment is in the guest's memory ({scanned} bytes read)");
    eprintln!("e2e: control: the key given as an environment variable was found in guest memory");
}

#[test]
fn control_without_the_swap_the_server_gets_the_placeholder() {
    let s = Scratch::with_deadline("secrets-swap-control", Duration::from_secs(400));
    let setup = setup(&s, "swap");
    let script = format!("curl -sS -H \"Authorization: Bearer $API_KEY\" https://{G}:{}/file.txt", setup.tls.port);
    let out = launch(&s, &setup.policy, &script)
        .control(TestControl::PassPlaceholders)
        .flag("--egress-ca")
        .flag(setup.ca.to_str().unwrap())
        .flag("--credentials-file")
        .flag(setup.credentials.to_str().unwrap())
        .run();
    assert_eq!(out.stdout_text(), "over tls\n", "{}", out.workload_stderr());
    let received = setup.tls.authorizations();
    assert!(received.starts_with("Bearer vmdrv-placeholder-"), "control: the placeholder went out:\n{received}");
    assert!(!received.contains(&setup.canary));
}

#[test]
fn a_destination_the_supervisor_does_not_trust_is_a_502_and_a_finding() {
    let s = Scratch::with_deadline("secrets-untrusted", Duration::from_secs(400));
    let setup = setup(&s, "untrusted");
    let script = format!("curl -sS -o /dev/null -w '%{{http_code}}\\n' https://{G}:{}/file.txt", setup.tls.port);
    // No --egress-ca: the server's throwaway CA is in no root store of the supervisor.
    let out =
        launch(&s, &setup.policy, &script).flag("--credentials-file").flag(setup.credentials.to_str().unwrap()).run();
    assert_eq!(out.stdout_text(), "502\n", "{}", out.workload_stderr());
    assert!(setup.tls.requests().is_empty(), "no request reached the untrusted server");
    let found = finding_descs(&events::read(&s.only_sandbox()));
    assert!(found.iter().any(|f| f.contains("certificate is not trusted")), "{found:#?}");
}

#[test]
fn a_rotated_key_reaches_the_server_on_the_next_request_with_nothing_restarted() {
    let s = Scratch::with_deadline("secrets-rotate", Duration::from_secs(500));
    let setup = setup(&s, "rotate");
    let store = shared_store().display().to_string();
    let serve = Serve::with(&s, &[], &["--image-cache", &store, "--egress-ca", setup.ca.to_str().unwrap()]);
    let image = layout_ref();
    let args = ["--image", &image, "--disk", "64", "--policy", setup.policy.to_str().unwrap()];
    let mut create: Vec<&str> = args.to_vec();
    create.extend(["--credentials-file", setup.credentials.to_str().unwrap(), "rot"]);
    let out = serve.cli("create", &create);
    assert!(out.status.success(), "create: {}", String::from_utf8_lossy(&out.stderr));
    let fetch = format!("curl -sS -H \"Authorization: Bearer $API_KEY\" https://{G}:{}/file.txt", setup.tls.port);
    let exec = || {
        let out = serve.cli("exec", &["rot", "--", "sh", "-c", &fetch]);
        assert!(out.status.success(), "exec: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(exec(), "over tls\n");
    let vmms = serve.vmms();

    let rotated = format!("sk-rotated-{}", random_hex());
    let file = s.dir.join("rotated.json");
    credentials_file(&file, &rotated);
    let out = serve.cli("credentials", &["--credentials-file", file.to_str().unwrap(), "rot"]);
    assert!(out.status.success(), "rotate: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(exec(), "over tls\n");
    let received: Vec<String> = setup.tls.authorizations().lines().map(str::to_owned).collect();
    assert_eq!(received, [format!("Bearer {}", setup.canary), format!("Bearer {rotated}")]);
    assert_eq!(
        serve.vmms().iter().map(|p| p.pid).collect::<Vec<_>>(),
        vmms.iter().map(|p| p.pid).collect::<Vec<_>>(),
        "nothing restarted"
    );

    // A name the sandbox does not hold changes nothing.
    std::fs::write(&file, r#"[{"name": "NOPE", "value": "x", "hosts": ["a.example"]}]"#).unwrap();
    let out = serve.cli("credentials", &["--credentials-file", file.to_str().unwrap(), "rot"]);
    assert!(!out.status.success(), "an unknown credential's rotation is refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("names none the sandbox holds"));
    assert_eq!(exec(), "over tls\n");
    assert!(setup.tls.authorizations().ends_with(&format!("Bearer {rotated}\n")));
}

/// The supervisor's peak resident memory while a hostile workload attacks its interception stays under this
/// (`docs/network.md`, Interception: bounds).
const HOSTILE_PEAK_RSS_MIB: u64 = 64;

#[test]
fn a_hostile_workload_meets_bounds_and_findings() {
    let s = Scratch::with_deadline("secrets-hostile", Duration::from_secs(600));
    let setup = setup(&s, "hostile");
    let dns = Dns::domain("flood.test", "127.0.0.1");
    let t = setup.tls.port;
    let policy = s.dir.join("hostile-policy.json");
    let text = format!(
        r#"{{"allow": ["exec", "stdin"], "network": {{"allow": [
            {{"host": "{G}", "ports": [{t}], "tls": "intercept"}},
            {{"host": "*.flood.test", "ports": [{t}], "allowed_ips": ["127.0.0.1"], "tls": "intercept"}}]}}}}"#
    );
    std::fs::write(&policy, text).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/hostile_tls.py");
    let names = LEAF_CACHE + 44;
    let peak = PeakRss::supervisors(&s.dir, "hostile-tls");
    let run = format!("cat > /tmp/h.py && python3 /tmp/h.py {G} {t} {names}");
    let out = launch(&s, &policy, &run)
        .flag("--id")
        .flag("hostile-tls")
        .flag("--egress-ca")
        .flag(setup.ca.to_str().unwrap())
        .flag("--egress-resolver")
        .flag(&dns.addr.to_string())
        .stdin(std::fs::read(script).unwrap())
        .run();
    let peak_mib = peak.peak() >> 10;
    assert_eq!(out.code, Some(0), "{}\n{}", out.stdout_text(), out.workload_stderr());
    let lines: Vec<String> = out.stdout_text().lines().map(str::to_owned).collect();
    let found = finding_descs(&events::read(&s.only_sandbox()));
    assert_eq!(lines[0], format!("names {names}"), "every host got a leaf that verifies for it");
    assert!(lines[1].starts_with("head bounded HTTP/1.1 431"), "{lines:?}\n{found:#?}");
    assert!(lines[2].starts_with("h2 ") && lines[2].ends_with(" bounded"), "{lines:?}\n{found:#?}");
    let has = |needle: &str| found.iter().any(|f| f.contains(needle));
    assert!(has("request head passed the proxy's 64 KiB bound"), "{found:#?}");
    let broke = found.iter().filter(|f| f.contains("broke HTTP's rules or the proxy's bounds")).count();
    assert_eq!(broke, 1, "the HTTP/2 flood, and only it, is a finding: {found:#?}");
    eprintln!("e2e: {names} hosts, an endless head and an HTTP/2 reset flood: supervisor peak {peak_mib} MiB");
    assert!(peak_mib < HOSTILE_PEAK_RSS_MIB, "the supervisor's peak memory: {peak_mib} MiB");
}

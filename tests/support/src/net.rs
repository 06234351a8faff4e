//! Real servers on the host's loopback for the network tests: a file server over HTTP and HTTPS (Python's
//! `http.server`, with a throwaway CA made here), a TCP echo server, a DNS server (`dnsmasq`) whose
//! answers the test chooses, and an operator's HTTP proxy (`tinyproxy`) that wants a login.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::procs::Killed;

/// The name that reaches the host's loopback from a sandbox.
pub const HOST_GATEWAY: &str = vm_protocol::policy::network::HOST_GATEWAY;

/// A network rule of a sandbox policy (JSON): `host` on `port`.
pub fn rule(host: &str, port: u16) -> String {
    format!(r#"{{"host":"{host}","ports":[{port}]}}"#)
}

/// A sandbox policy (JSON) that allows the operations `allow` (`exec`, `stdin`, ...) and, on the network,
/// `rules` (JSON objects, such as [`rule`]'s).
pub fn policy(allow: &[&str], rules: &[String]) -> String {
    let allow: Vec<String> = allow.iter().map(|a| format!("\"{a}\"")).collect();
    format!(r#"{{"allow":[{}],"network":{{"allow":[{}]}}}}"#, allow.join(","), rules.join(","))
}

/// A fresh directory for a server's files, outside every scratch directory: the scratch's watcher counts
/// each process that names its directory as the sandbox's, and these servers outlive the sandbox on purpose.
/// `name` is the test's own: the tests of one binary share the pid in the path.
pub fn server_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("e2e-srv-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `web_server.py` serving a directory.
#[derive(Debug)]
pub struct WebServer {
    _child: Killed,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// The directory it serves.
    pub root: PathBuf,
    /// Where it logs each request's method and path.
    pub log: PathBuf,
}

impl WebServer {
    /// Serves `dir/www` over HTTP, or over HTTPS with `tls` (certificate and key files).
    pub fn start(dir: &Path, tls: Option<(&Path, &Path)>) -> Self {
        let root = dir.join("www");
        std::fs::create_dir_all(&root).unwrap();
        let script = crate::repo().join("tests/python/web_server.py");
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.arg(script).arg(&root);
        if let Some((cert, key)) = tls {
            cmd.arg(cert).arg(key);
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("python3 for the web server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let port = line.trim().parse().unwrap_or_else(|_| panic!("web_server.py printed {line:?}"));
        Self { _child: Killed(child), port, root, log: dir.join("requests.log") }
    }

    /// The request lines it logged so far.
    pub fn requests(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The `Authorization` headers it received so far, one per line.
    pub fn authorizations(&self) -> String {
        std::fs::read_to_string(self.log.with_file_name("authorization.log")).unwrap_or_default()
    }
}

/// A CA and a server certificate it signed for `names`, as PEM files in `dir`: (ca, cert, key).
pub fn throwaway_ca(dir: &Path, names: &[&str]) -> (PathBuf, PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let issued = crate::tls::issue("e2e network CA", names);
    let paths = (dir.join("ca.pem"), dir.join("server.pem"), dir.join("server.key"));
    std::fs::write(&paths.0, issued.ca_pem).unwrap();
    std::fs::write(&paths.1, issued.cert_pem).unwrap();
    std::fs::write(&paths.2, issued.key_pem).unwrap();
    paths
}

/// A TCP server on 127.0.0.1 that echoes every connection's bytes back, upper-cased (so an answer cannot be
/// mistaken for the request), until the client closes.
#[derive(Debug)]
pub struct EchoServer {
    /// Its port.
    pub port: u16,
}

impl EchoServer {
    /// Starts it on a thread of its own (it lives as long as the test process).
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n @ 1..) = conn.read(&mut buf) {
                        if conn.write_all(&buf[..n].to_ascii_uppercase()).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { port }
    }
}

/// `dnsmasq` answering only the names it is given, nothing else (no upstream, no hosts file).
#[derive(Debug)]
pub struct Dns {
    _child: Killed,
    /// Where it listens (UDP).
    pub addr: SocketAddr,
}

impl Dns {
    /// Answers each `(name, address)`.
    pub fn start(records: &[(&str, &str)]) -> Self {
        Self::spawn(records.iter().map(|(name, addr)| format!("--host-record={name},{addr}")))
    }

    /// Answers every name under `domain` with `addr`.
    pub fn domain(domain: &str, addr: &str) -> Self {
        Self::spawn([format!("--address=/{domain}/{addr}")])
    }

    fn spawn(answers: impl IntoIterator<Item = String>) -> Self {
        let port = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut cmd = Command::new("dnsmasq");
        cmd.args(["--keep-in-foreground", "--no-resolv", "--no-hosts", "--no-poll", "--bind-interfaces"])
            .args(["--listen-address=127.0.0.1", "--pid-file=", "--user=root", "--log-facility=-"])
            .arg(format!("--port={port}"))
            .args(answers);
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dnsmasq (scripts/deps installs dnsmasq-base)");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let dns = Self { _child: Killed(child), addr };
        assert!(crate::wait_until(Duration::from_secs(10), || dns.answers()), "dnsmasq did not start on {addr}");
        dns
    }

    /// Whether it answers a query yet (any reply will do).
    fn answers(&self) -> bool {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        // A query for `probe.` type A, id 0x1234, recursion desired.
        let query = [0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 5, b'p', b'r', b'o', b'b', b'e', 0, 0, 1, 0, 1];
        let _ = socket.send_to(&query, self.addr);
        let mut buf = [0u8; 512];
        socket.recv_from(&mut buf).is_ok()
    }
}

/// `tinyproxy` on the host's loopback, as an operator's upstream proxy: HTTP CONNECT to any port, for the one
/// login `user:password` (Basic), every request logged.
#[derive(Debug)]
pub struct UpstreamProxy {
    _child: Killed,
    /// Its port on 127.0.0.1.
    pub port: u16,
    log: PathBuf,
}

impl UpstreamProxy {
    /// Listens on a free port; `dir` holds its configuration and log.
    pub fn start(dir: &Path, user: &str, password: &str) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (conf, log) = (dir.join("tinyproxy.conf"), dir.join("tinyproxy.log"));
        let text = format!(
            "Port {port}\nListen 127.0.0.1\nTimeout 60\nMaxClients 32\nLogLevel Info\nLogFile \"{}\"\n\
             BasicAuth {user} {password}\n",
            log.display()
        );
        std::fs::write(&conf, text).unwrap();
        let child = Command::new("tinyproxy")
            .arg("-d")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("tinyproxy (scripts/deps installs tinyproxy-bin)");
        let proxy = Self { _child: Killed(child), port, log };
        let up = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        assert!(crate::wait_until(Duration::from_secs(10), up), "tinyproxy did not start on {port}");
        proxy
    }

    /// The request lines it logged (`CONNECT 127.0.0.1:8080 HTTP/1.1`), one per line.
    pub fn requests(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        log.lines()
            .filter_map(|l| l.split_once("): ").map(|(_, r)| r))
            .filter(|r| r.contains(" HTTP/"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

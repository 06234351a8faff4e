//! A real registry for the image tests: Debian's `docker-registry` (distribution v2) on 127.0.0.1, with
//! TLS from a throwaway CA and, optionally, htpasswd logins or token auth (distribution verifying the JWTs
//! of `tests/python/token_server.py`, signed with PyJWT); and images made by `umoci` and pushed by `skopeo`,
//! tools no one here wrote.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How a registry admits its clients.
#[derive(Debug, Clone, Copy)]
pub enum Auth<'a> {
    /// Anyone may pull and push.
    Open,
    /// This user and password, checked by the registry (htpasswd, a Basic challenge).
    Htpasswd(&'a str, &'a str),
    /// This user and password, checked by a token issuer in front of it (a Bearer challenge).
    Token(&'a str, &'a str),
}

/// A running registry, killed on drop.
#[derive(Debug)]
pub struct Registry {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// The CA that signed its certificate (PEM).
    pub ca: PathBuf,
    /// A directory holding `ca.crt`, as skopeo's `--*-cert-dir` wants.
    pub cert_dir: PathBuf,
    /// The registry's storage root.
    pub storage: PathBuf,
    /// A Docker `config.json` with the login, when it has one.
    pub auth_file: Option<PathBuf>,
    /// `Auth::Token`: every grant the issuer made, one JSON line each.
    pub grants: Option<PathBuf>,
    child: Child,
    issuer: Option<Child>,
}

/// Runs `cmd`, panicking with its output if it fails.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed: {text}");
    text
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Registry {
    /// Starts a registry under `dir`; `login` (user, password) puts htpasswd auth in front of it.
    pub fn start(dir: &Path, login: Option<(&str, &str)>) -> Self {
        Self::start_with(dir, login.map_or(Auth::Open, |(user, password)| Auth::Htpasswd(user, password)))
    }

    /// Starts a registry under `dir` that admits clients as `auth` says.
    pub fn start_with(dir: &Path, auth: Auth<'_>) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let issued = crate::tls::issue("e2e registry CA", &["127.0.0.1", "localhost"]);
        let cert_dir = dir.join("certs");
        std::fs::create_dir_all(&cert_dir).unwrap();
        let ca = cert_dir.join("ca.crt");
        std::fs::write(&ca, issued.ca_pem).unwrap();
        std::fs::write(dir.join("server.crt"), issued.cert_pem).unwrap();
        std::fs::write(dir.join("server.key"), issued.key_pem).unwrap();
        let storage = dir.join("storage");
        let addr = format!("127.0.0.1:{}", free_port());
        let (mut auth_yaml, mut auth_file, mut grants, mut issuer) = (String::new(), None, None, None);
        let mut login_file = |user: &str, password: &str| {
            let pair = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, format!("{user}:{password}"));
            let file = dir.join("docker-config.json");
            std::fs::write(&file, format!(r#"{{"auths":{{"{addr}":{{"auth":"{pair}"}}}}}}"#)).unwrap();
            auth_file = Some(file);
        };
        match auth {
            Auth::Open => {}
            Auth::Htpasswd(user, password) => {
                run(Command::new("htpasswd").arg("-Bbc").arg(dir.join("htpasswd")).arg(user).arg(password));
                auth_yaml =
                    format!("auth:\n  htpasswd:\n    realm: e2e\n    path: {}\n", dir.join("htpasswd").display());
                login_file(user, password);
            }
            Auth::Token(user, password) => {
                let port = free_port().to_string();
                let (child, signer) = start_issuer(dir, &port, user, password);
                auth_yaml = format!(
                    "auth:\n  token:\n    realm: https://127.0.0.1:{port}/token\n    service: {TOKEN_SERVICE}\n    \
                     issuer: e2e-token-issuer\n    rootcertbundle: {}\n",
                    signer.display()
                );
                login_file(user, password);
                grants = Some(dir.join("token-grants.log"));
                issuer = Some(child);
            }
        }
        let auth = auth_yaml;
        let config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n  tls:\n    certificate: {}\n    key: {}\n{auth}",
            storage.display(),
            dir.join("server.crt").display(),
            dir.join("server.key").display(),
        );
        std::fs::write(dir.join("config.yml"), config).unwrap();
        let log = std::fs::File::create(dir.join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("docker-registry (scripts/deps installs it)");
        let up = crate::wait_until(Duration::from_secs(20), || std::net::TcpStream::connect(&addr).is_ok());
        assert!(
            up,
            "the registry did not start: {}",
            std::fs::read_to_string(dir.join("registry.log")).unwrap_or_default()
        );
        Self { addr, ca, cert_dir, storage, auth_file, grants, child, issuer }
    }

    /// Pushes `source` (a skopeo source such as `oci:DIR:TAG`) as `NAME:TAG` here.
    pub fn push(&self, source: &str, name: &str) -> String {
        let mut cmd = Command::new("skopeo");
        cmd.arg("copy").arg("--quiet").arg("--dest-cert-dir").arg(&self.cert_dir);
        if let Some(file) = &self.auth_file {
            cmd.arg("--dest-authfile").arg(file);
        }
        run(cmd.arg(source).arg(format!("docker://{}/{name}", self.addr)));
        format!("{}/{name}", self.addr)
    }

    /// The data file of a blob in the registry's storage, to tamper with.
    pub fn blob_data(&self, hex: &str) -> PathBuf {
        self.storage.join("docker/registry/v2/blobs/sha256").join(&hex[..2]).join(hex).join("data")
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        for child in std::iter::once(&mut self.child).chain(self.issuer.as_mut()) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `service` the registry and its token issuer agree on.
const TOKEN_SERVICE: &str = "e2e-registry";

/// Starts the token issuer on `port` (its TLS is the registry's certificate, in `dir`); returns it and the
/// certificate of its signing key, for the registry's `rootcertbundle`.
fn start_issuer(dir: &Path, port: &str, user: &str, password: &str) -> (Child, PathBuf) {
    let script = crate::repo().join("tests/python/token_server.py");
    // Debian's interpreter, where scripts/deps installs python3-jwt and python3-cryptography.
    let mut child = Command::new("/usr/bin/python3")
        .arg(script)
        .args([dir.to_str().unwrap(), port, TOKEN_SERVICE, user, password])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 for the token issuer");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "ready", "the token issuer did not start");
    (child, dir.join("token-signer.pem"))
}

/// An OCI layout at `dir` with image `tag`, one layer per step: each step changes the unpacked root (add,
/// change, delete: umoci writes the whiteouts), then umoci repacks it. `config` args go to `umoci config`.
pub fn umoci_image(dir: &Path, tag: &str, steps: &[&dyn Fn(&Path)], config: &[&str]) -> PathBuf {
    let layout = dir.join(format!("layout-{tag}"));
    let image = format!("{}:{tag}", layout.display());
    run(Command::new("umoci").arg("init").arg("--layout").arg(&layout));
    run(Command::new("umoci").arg("new").arg("--image").arg(&image));
    for (i, step) in steps.iter().enumerate() {
        let bundle = dir.join(format!("bundle-{tag}-{i}"));
        run(Command::new("umoci").arg("unpack").arg("--image").arg(&image).arg(&bundle));
        step(&bundle.join("rootfs"));
        run(Command::new("umoci").arg("repack").arg("--image").arg(&image).arg(&bundle));
        std::fs::remove_dir_all(&bundle).unwrap();
    }
    if !config.is_empty() {
        run(Command::new("umoci").arg("config").arg("--image").arg(&image).args(config));
    }
    layout
}

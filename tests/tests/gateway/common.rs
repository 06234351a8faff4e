//! What the gateway tests share: a `serve` with its ComputeDriver socket, driven by a stand-in gateway.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use vm_protocol::openshell::compute::v1::compute_driver_client::ComputeDriverClient;
use vm_protocol::openshell::compute::v1::{CreateSandboxRequest, DriverSandbox, ListSandboxesRequest};
use vm_test_support::openshell::{self, ExecOutput, StandIn};
use vm_test_support::serve::{Serve, STATE_WAIT};
use vm_test_support::{wait_until, Scratch, TestControl};

/// A `serve` a stand-in gateway drives.
pub struct Gw {
    pub gateway: StandIn,
    pub serve: Serve,
    pub socket: PathBuf,
    pub driver: ComputeDriverClient<tonic::transport::Channel>,
}

impl Gw {
    pub fn start(s: &Scratch) -> Self {
        Self::with(s, &[], &[])
    }

    pub fn with(s: &Scratch, controls: &[TestControl], extra: &[&str]) -> Self {
        let gateway = StandIn::start();
        let socket = s.state().join("compute.sock");
        let mut args = vec!["--openshell-socket", socket.to_str().unwrap(), "--openshell-endpoint", &gateway.url];
        args.extend_from_slice(extra);
        let serve = Serve::with(s, controls, &args);
        let driver = gateway.driver(&socket);
        Self { gateway, serve, socket, driver }
    }

    /// Creates `sandbox` through the ComputeDriver service.
    pub fn create(&mut self, sandbox: DriverSandbox) -> Result<(), tonic::Status> {
        let req = CreateSandboxRequest { sandbox: Some(sandbox) };
        self.gateway.rt.block_on(self.driver.create_sandbox(req)).map(|_| ())
    }

    /// A new sandbox named `name` running `command` as its main process; returns its id once the gateway
    /// calls it Ready (its supervisor's session is up), with how long that took.
    pub fn ready(&mut self, name: &str, command: &[&str], tty: bool) -> (String, Duration) {
        let (id, token) = self.gateway.mint();
        let started = Instant::now();
        self.create(openshell::sandbox(&id, &token, name, command, tty)).unwrap();
        self.wait_connected(&id);
        (id, started.elapsed())
    }

    /// Waits for sandbox `id`'s supervisor's session.
    pub fn wait_connected(&self, id: &str) {
        assert!(wait_until(STATE_WAIT, || self.gateway.connected(id)), "{id}'s supervisor never connected");
    }

    /// Runs `argv` in `id` as the gateway's exec does.
    pub fn exec(&self, id: &str, argv: &[&str], stdin: &[u8], tty: bool) -> ExecOutput {
        self.gateway.rt.block_on(openshell::exec(&self.gateway, id, argv, stdin, tty)).unwrap()
    }

    /// The sandboxes `ListSandboxes` shows, with their first `Ready` condition's reason.
    pub fn list(&mut self) -> Vec<(String, String)> {
        let listed = self.gateway.rt.block_on(self.driver.list_sandboxes(ListSandboxesRequest {})).unwrap();
        listed
            .into_inner()
            .sandboxes
            .into_iter()
            .map(|s| {
                let status = s.status.unwrap_or_default();
                let ready = status.conditions.iter().find(|c| c.r#type == "Ready").map(|c| c.reason.clone());
                (s.id, ready.unwrap_or_default())
            })
            .collect()
    }
}

/// The bytes `needle` is nowhere in `haystack`.
pub fn absent(haystack: &[u8], needle: &str) -> bool {
    !haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

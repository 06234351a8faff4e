//! A plain client of a supervisor's attach socket, speaking the boundary protocol directly (what a gateway
//! would do), for tests that need many processes.

use std::os::unix::net::UnixStream;
use std::path::Path;
use vm_contract::layout::SandboxFile;

use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::{frame, Capabilities, ExitStatus, Hello, ProcId, Spawn, ToGuest, ToHost};

/// A handshaken attach connection.
#[derive(Debug)]
pub struct AttachClient {
    stream: UnixStream,
    scratch: Vec<u8>,
    next_id: u32,
}

impl AttachClient {
    /// Connects to `<sandbox_dir>/attach.sock` and handshakes.
    pub fn connect(sandbox_dir: &Path) -> Self {
        let mut stream =
            UnixStream::connect(sandbox_dir.join(SandboxFile::Attach.name())).expect("connect to attach.sock");
        let mut scratch = Vec::new();
        match frame::read::<ToHost, _>(&mut stream, &mut scratch).unwrap() {
            Some(ToHost::Hello(h)) => h.check(Capabilities::EXEC).unwrap(),
            other => panic!("expected hello, got {other:?}"),
        }
        frame::write(&mut stream, &ToGuest::Hello(Hello::ours(Capabilities::NONE, "e2e-client")), &mut Vec::new())
            .unwrap();
        Self { stream, scratch, next_id: 1 }
    }

    /// Runs `count` processes of `argv`, at most `in_flight` at a time, discarding output (and returning its
    /// credit); returns their exit statuses in completion order.
    pub fn run_many(&mut self, argv: &[&str], count: usize, in_flight: usize) -> Vec<ExitStatus> {
        let mut started = 0;
        let mut statuses = Vec::with_capacity(count);
        let mut out = Vec::new();
        while statuses.len() < count {
            while started < count && started - statuses.len() < in_flight {
                let id = ProcId(self.next_id);
                self.next_id += 1;
                let spawn = Spawn {
                    id,
                    argv: argv.iter().map(|s| (*s).to_owned()).collect(),
                    env: vec![],
                    cwd: None,
                    pty: None,
                    output_window: DEFAULT_WINDOW_BYTES,
                };
                frame::write(&mut self.stream, &ToGuest::Spawn(spawn), &mut out).unwrap();
                frame::write(&mut self.stream, &ToGuest::StdinEof { id }, &mut out).unwrap_or(());
                started += 1;
            }
            match frame::read::<ToHost, _>(&mut self.stream, &mut self.scratch).unwrap() {
                Some(ToHost::Exited { status, .. }) => statuses.push(status),
                Some(ToHost::Output { id, data, .. }) => {
                    let bytes = u32::try_from(data.len()).unwrap();
                    frame::write(&mut self.stream, &ToGuest::Credit { id, bytes }, &mut out).unwrap();
                }
                Some(ToHost::Refused { reason, .. }) => panic!("spawn refused: {reason:?}"),
                Some(ToHost::SpawnFailed { status, .. }) => statuses.push(status),
                Some(_) => {}
                None => panic!("the sandbox closed the attach connection"),
            }
        }
        statuses
    }
}

//! A plain client of a supervisor's attach socket, speaking the boundary protocol directly (what a gateway
//! would do), for tests that need many processes.

use std::os::unix::net::UnixStream;
use std::path::Path;
use vm_contract::layout::SandboxFile;

use vm_protocol::attach::{SupervisorRequest, ToClient, ToSupervisor};
use vm_protocol::files::{FileOp, FileSpawn};
use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::message::Refusal;
use vm_protocol::{frame, Capabilities, ExitStatus, Hello, ProcId, ProcessEvent, ProcessRequest, Spawn};

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
        match frame::read::<ToClient, _>(&mut stream, &mut scratch).unwrap() {
            Some(ToClient::Hello(h)) => h.check(Capabilities::EXEC).unwrap(),
            other => panic!("expected hello, got {other:?}"),
        }
        frame::write(&mut stream, &ToSupervisor::Hello(Hello::ours(Capabilities::NONE, "e2e-client")), &mut Vec::new())
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
                self.start(argv);
                started += 1;
            }
            match frame::read::<ToClient, _>(&mut self.stream, &mut self.scratch).unwrap() {
                Some(ToClient::Process(ProcessEvent::Exited { status, .. })) => statuses.push(status),
                Some(ToClient::Process(ProcessEvent::Output { id, data, .. })) => {
                    let bytes = u32::try_from(data.len()).unwrap();
                    frame::write(
                        &mut self.stream,
                        &ToSupervisor::Process(ProcessRequest::Credit { id, bytes }),
                        &mut out,
                    )
                    .unwrap();
                }
                Some(ToClient::Process(ProcessEvent::Refused { reason, .. })) => panic!("spawn refused: {reason:?}"),
                Some(ToClient::Process(ProcessEvent::SpawnFailed { status, .. })) => statuses.push(status),
                Some(_) => {}
                None => panic!("the sandbox closed the attach connection"),
            }
        }
        statuses
    }

    fn next(&mut self) -> ProcId {
        let id = ProcId(self.next_id);
        self.next_id += 1;
        id
    }

    /// A `Spawn` of `argv` under a new id, not sent.
    pub fn spawn_message(&mut self, argv: &[&str]) -> (ProcId, ToSupervisor) {
        let id = self.next();
        let spawn = Spawn {
            id,
            argv: argv.iter().map(|s| (*s).to_owned()).collect(),
            env: vec![],
            cwd: None,
            pty: None,
            output_window: DEFAULT_WINDOW_BYTES,
            rlimits: Vec::new(),
            root: None,
        };
        (id, ToSupervisor::Process(ProcessRequest::Spawn(spawn)))
    }

    /// Runs one file operation with `input` on its stdin (sent whole, within the first window: keep it
    /// under 2 MiB): its stdout, stderr and exit status, or the refusal.
    pub fn files(&mut self, op: FileOp, input: &[u8]) -> Result<(Vec<u8>, String, ExitStatus), Refusal> {
        let id = self.next();
        self.send(&ToSupervisor::Process(ProcessRequest::Files(FileSpawn {
            id,
            op,
            output_window: DEFAULT_WINDOW_BYTES,
        })));
        let (mut stdout, mut stderr, mut input) = (Vec::new(), Vec::new(), Some(input));
        loop {
            match self.recv().expect("the sandbox closed the attach connection") {
                ToClient::Process(ProcessEvent::Started { id: got, .. }) if got == id => {
                    for chunk in input.take().unwrap_or_default().chunks(frame::MAX_DATA_BYTES) {
                        self.send(&ToSupervisor::Process(ProcessRequest::Stdin { id, data: chunk.to_vec().into() }));
                    }
                    self.send(&ToSupervisor::Process(ProcessRequest::StdinEof { id }));
                }
                ToClient::Process(ProcessEvent::Output { id: got, stream, data }) if got == id => {
                    let bytes = u32::try_from(data.len()).unwrap();
                    match stream {
                        vm_protocol::Stream::Stdout => stdout.extend_from_slice(&data),
                        vm_protocol::Stream::Stderr => stderr.extend_from_slice(&data),
                    }
                    self.send(&ToSupervisor::Process(ProcessRequest::Credit { id, bytes }));
                }
                ToClient::Process(ProcessEvent::Exited { id: got, status }) if got == id => {
                    return Ok((stdout, String::from_utf8_lossy(&stderr).into_owned(), status));
                }
                ToClient::Process(ProcessEvent::SpawnFailed { id: got, status, message }) if got == id => {
                    return Ok((stdout, message, status));
                }
                ToClient::Process(ProcessEvent::Refused { id: got, reason }) if got == id => return Err(reason),
                _ => {}
            }
        }
    }

    /// Runs one file operation that must succeed (exit status 0, not refused), as [`Self::files`]; its
    /// stdout.
    pub fn files_ok(&mut self, op: FileOp, input: &[u8]) -> Vec<u8> {
        let (stdout, stderr, status) = self.files(op, input).expect("refused");
        assert_eq!(status, ExitStatus::Code(0), "stderr: {stderr}");
        stdout
    }

    /// Sends `msgs` in one write, so that the supervisor finds them queued together, in this order.
    pub fn send_together(&mut self, msgs: &[ToSupervisor]) {
        let mut wire = Vec::new();
        for msg in msgs {
            frame::encode(msg, &mut wire).unwrap();
        }
        std::io::Write::write_all(&mut self.stream, &wire).unwrap();
    }

    /// Reads, crediting all output, until `done` is true of what was read; returns it all, in order.
    pub fn read_until(&mut self, mut done: impl FnMut(&[ToClient]) -> bool) -> Vec<ToClient> {
        let mut seen = Vec::new();
        while !done(&seen) {
            let msg = self.recv().expect("the sandbox closed the attach connection");
            if let ToClient::Process(ProcessEvent::Output { id, data, .. }) = &msg {
                self.send(&ToSupervisor::Process(ProcessRequest::Credit {
                    id: *id,
                    bytes: u32::try_from(data.len()).unwrap(),
                }));
            }
            seen.push(msg);
        }
        seen
    }

    /// Sends a `Spawn` of `argv` under a new id, with its stdin closed at once; returns the id.
    fn start(&mut self, argv: &[&str]) -> ProcId {
        let (id, spawn) = self.spawn_message(argv);
        self.send(&spawn);
        // A process that already exited may have closed its stdin: nothing to close then.
        let _ =
            frame::write(&mut self.stream, &ToSupervisor::Process(ProcessRequest::StdinEof { id }), &mut Vec::new());
        id
    }

    fn send(&mut self, msg: &ToSupervisor) {
        frame::write(&mut self.stream, msg, &mut Vec::new()).unwrap();
    }

    fn recv(&mut self) -> Option<ToClient> {
        frame::read::<ToClient, _>(&mut self.stream, &mut self.scratch).unwrap()
    }

    /// Starts `argv` with an empty stdin and returns its guest pid, reading nothing else.
    pub fn spawn(&mut self, argv: &[&str]) -> u32 {
        let id = self.start(argv);
        loop {
            match self.recv() {
                Some(ToClient::Process(ProcessEvent::Started { id: got, pid, .. })) if got == id => return pid,
                Some(
                    other @ (ToClient::Process(ProcessEvent::Refused { .. })
                    | ToClient::Process(ProcessEvent::SpawnFailed { .. })),
                ) => panic!("not started: {other:?}"),
                Some(_) => {}
                None => panic!("the sandbox closed the attach connection"),
            }
        }
    }

    /// Re-attaches to the detached process `pid` and reads it to its exit, crediting every byte; returns its
    /// stdout and status.
    pub fn reattach(&mut self, pid: u32) -> (Vec<u8>, ExitStatus) {
        let id = self.next();
        self.send(&ToSupervisor::Supervisor(SupervisorRequest::Reattach { id, pid }));
        let mut stdout = Vec::new();
        loop {
            match self.recv() {
                Some(ToClient::Process(ProcessEvent::Output { id: got, data, .. })) if got == id => {
                    stdout.extend_from_slice(&data);
                    let bytes = u32::try_from(data.len()).unwrap();
                    self.send(&ToSupervisor::Process(ProcessRequest::Credit { id, bytes }));
                }
                Some(ToClient::Process(ProcessEvent::Exited { id: got, status })) if got == id => {
                    return (stdout, status)
                }
                Some(ToClient::Process(ProcessEvent::Refused { reason, .. })) => {
                    panic!("re-attach refused: {reason:?}")
                }
                Some(_) => {}
                None => panic!("the sandbox closed the attach connection"),
            }
        }
    }
}

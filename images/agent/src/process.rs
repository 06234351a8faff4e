//! The process table: spawning, output pumps, stdin writers, and the rule that `Exited` follows the last
//! byte of output.
//!
//! A process leaves the table when it has been reaped *and* its output pump reached EOF on every stream.
//! The pump sends all of a stream's output before it counts the stream closed, and `Exited` is sent after removal, so the order on
//! the wire is always `Started`, `Output`..., `Exited`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;

use crate::pty::Pty;
use std::path::Path;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread;

use nix::unistd::Pid;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::io::{ioctl_fionread, Errno};
use rustix::pipe::PipeFlags;
use vm_protocol::files::{FileSpawn, AGENT_FILES_MODE};
use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::frame::MAX_DATA_BYTES;
use vm_protocol::message::{Refusal, MAX_FAILURE_MESSAGE_BYTES};
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, PtySize, Spawn, Stream, Window};

use crate::credit::Credit;
use crate::link::{Config, Shared};
use crate::outbox::{OutputFrame, Staging};
use crate::spawn;

/// Exit code for a command that was not found, as shells report it.
pub(crate) const EXIT_NOT_FOUND: i32 = 127;
/// Exit code for a command that was found but could not be started, as shells report it.
pub(crate) const EXIT_CANNOT_RUN: i32 = 126;

/// Capacity asked for each output pipe. A writer that can run ahead by a megabyte trades the CPU with the
/// pump far less often, which under emulation costs more than the copies.
const PIPE_BYTES: usize = 1024 * 1024;

/// Smallest chunk a pipe's pump splices; a smaller one is copied, which costs no more than the splices
/// and the prefix write would (one write into the port takes up to 32 KiB).
const SPLICE_MIN_BYTES: usize = 32 * 1024;

pub(crate) enum StdinCmd {
    Data(Vec<u8>),
    Eof,
}

/// One running (or not yet fully drained) process.
pub(crate) struct Proc {
    pub(crate) pid: Pid,
    pub(crate) credit: Arc<Credit>,
    /// `None` once the host sent `StdinEof`.
    pub(crate) stdin: Option<Sender<StdinCmd>>,
    /// The stdin writer's pipe and queue until the first stdin bytes come: most processes get none (only
    /// an EOF), and a thread per process costs more than the process itself under emulation.
    stdin_idle: Option<(File, Receiver<StdinCmd>, bool)>,
    pub(crate) stdin_window: Window,
    /// The PTY's master side, for resizing; `None` for piped processes.
    pub(crate) terminal: Option<OwnedFd>,
    open_streams: u8,
    status: Option<ExitStatus>,
}

/// What the host's message refers to.
pub(crate) enum Lookup<'a> {
    Live(&'a mut Proc),
    /// An id that existed and has exited: a late message is a benign race.
    Finished,
    /// An id that was never spawned: a protocol violation.
    Unknown,
}

#[derive(Default)]
pub(crate) struct Table {
    live: HashMap<ProcId, Proc>,
    by_pid: HashMap<Pid, ProcId>,
    highest: Option<ProcId>,
    pub(crate) stopping: bool,
    /// Counts spawns, so the reaper can tell whether a child appeared while it was not looking.
    pub(crate) spawned: u64,
}

impl Table {
    pub(crate) fn lookup(&mut self, id: ProcId) -> Lookup<'_> {
        match self.live.get_mut(&id) {
            Some(p) => Lookup::Live(p),
            None if self.highest.is_some_and(|h| id <= h) => Lookup::Finished,
            None => Lookup::Unknown,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub(crate) fn pids(&self) -> Vec<Pid> {
        self.live.values().map(|p| p.pid).collect()
    }

    pub(crate) fn credits(&self) -> Vec<Arc<Credit>> {
        self.live.values().map(|p| Arc::clone(&p.credit)).collect()
    }

    /// Records a reaped child. Returns the `Exited` to send if that finished the process.
    pub(crate) fn reaped(&mut self, pid: Pid, status: ExitStatus) -> Option<ProcessEvent> {
        let id = self.by_pid.remove(&pid)?;
        self.live.get_mut(&id)?.status = Some(status);
        self.finish_if_done(id)
    }

    /// Records that one output stream reached EOF. Returns the `Exited` to send if that finished it.
    fn stream_closed(&mut self, id: ProcId) -> Option<ProcessEvent> {
        let proc = self.live.get_mut(&id)?;
        proc.open_streams = proc.open_streams.saturating_sub(1);
        self.finish_if_done(id)
    }

    fn finish_if_done(&mut self, id: ProcId) -> Option<ProcessEvent> {
        let proc = self.live.get(&id)?;
        let status = proc.status.filter(|_| proc.open_streams == 0)?;
        self.live.remove(&id);
        Some(ProcessEvent::Exited { id, status })
    }
}

/// Handles one file operation: the agent's own binary in files mode, run as a workload process would be.
pub(crate) fn files(shared: &Arc<Shared>, config: &Config, req: FileSpawn) {
    let Some(op) = req.op.validate().ok().and_then(|()| req.op.to_arg().ok()) else {
        return shared.send(ProcessEvent::Refused { id: req.id, reason: Refusal::Invalid });
    };
    // `/proc/self/exe` is the agent in the child too (a clone of the agent until it execs), whatever root
    // the sandbox has.
    let argv = vec!["/proc/self/exe".to_owned(), AGENT_FILES_MODE.to_owned(), op];
    // Relative paths are the workload's home's, where it has one.
    let home = vm_protocol::identity::WORKLOAD.home;
    let cwd = Path::new(home).is_dir().then(|| home.to_owned());
    let spawn = Spawn {
        id: req.id,
        argv,
        env: Vec::new(),
        cwd,
        pty: None,
        output_window: req.output_window,
        rlimits: Vec::new(),
        root: None,
    };
    self::spawn(shared, config, spawn);
}

/// Handles one `Spawn`. Never blocks on the process itself.
pub(crate) fn spawn(shared: &Arc<Shared>, config: &Config, req: Spawn) {
    let id = req.id;
    if let Err(reason) = admit(shared, config, &req) {
        shared.send(ProcessEvent::Refused { id, reason });
        return;
    }
    let output = Arc::new(Credit::new(req.output_window));
    if let Err(e) = vm_protocol::rlimit::check(&req.rlimits) {
        return fail_early(shared, id, &format!("vm-agent: {e}"), EXIT_CANNOT_RUN);
    }
    let root = match req.root.as_ref().map(crate::containers::enter).transpose() {
        Ok(root) => root,
        Err(e) => return fail_early(shared, id, &format!("vm-agent: the container's root: {e}"), EXIT_CANNOT_RUN),
    };
    // A container's image has no workload home: its own directory is `/` unless it names one.
    let cwd = req.cwd.as_deref().unwrap_or(if root.is_some() { "/" } else { &config.default_cwd });
    if let Some(asked) = req.cwd.as_deref() {
        let dir =
            root.as_deref().map_or_else(|| Path::new(asked).to_path_buf(), |r| r.join(asked.trim_start_matches('/')));
        if !dir.is_dir() {
            let msg = format!("vm-agent: cannot change to directory '{asked}': not a directory");
            return fail_early(shared, id, &msg, EXIT_CANNOT_RUN);
        }
    }

    let stdio = match ChildStdio::open(req.pty) {
        Ok(stdio) => stdio,
        Err(e) => return fail_early(shared, id, &format!("vm-agent: cannot set up stdio ({e})"), EXIT_CANNOT_RUN),
    };
    let mut env: Vec<(&str, &str)> = config.default_env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    if req.pty.is_some() && !req.env.iter().any(|e| e.key == "TERM") {
        env.push(("TERM", "xterm-256color"));
    }
    env.extend(req.env.iter().map(|e| (e.key.as_str(), e.value.as_str())));
    let plan = spawn::Plan {
        argv: &req.argv,
        env,
        cwd,
        run_as: config.run_as,
        stdio: stdio.child_side(),
        rlimits: &req.rlimits,
        root: root.as_deref(),
    };

    // The table lock is held across spawn and insert: the reaper takes it before reaping, so it cannot
    // reap this child before the child is registered.
    let mut table = shared.table();
    let spawned = spawn::spawn(&plan);
    let pid = match spawned {
        Ok(pid) => pid,
        Err(spawn::SpawnError::Limit(e)) => {
            drop(table);
            let msg = format!("vm-agent: {}: the guest's kernel refused a resource limit ({e})", req.argv[0]);
            return fail_early(shared, id, &msg, EXIT_CANNOT_RUN);
        }
        Err(spawn::SpawnError::Start(e)) => {
            drop(table);
            let (code, msg) = match e.kind() {
                io::ErrorKind::NotFound => (EXIT_NOT_FOUND, format!("vm-agent: {}: command not found", req.argv[0])),
                io::ErrorKind::PermissionDenied => {
                    (EXIT_CANNOT_RUN, format!("vm-agent: {}: permission denied", req.argv[0]))
                }
                _ => (EXIT_CANNOT_RUN, format!("vm-agent: {}: cannot execute ({e})", req.argv[0])),
            };
            return fail_early(shared, id, &msg, code);
        }
    };
    let Ok(io) = stdio.agent_side() else {
        // Out of descriptors for the terminal's copies: refuse rather than run a process we cannot serve.
        // (The reaper reports nothing for it: it is in no table.)
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        drop(table);
        shared.send(ProcessEvent::Refused { id, reason: Refusal::Invalid });
        return;
    };
    let (stdin_tx, stdin_rx) = mpsc::channel();
    table.live.insert(
        id,
        Proc {
            pid,
            credit: Arc::clone(&output),
            stdin: Some(stdin_tx),
            stdin_idle: Some((io.stdin, stdin_rx, req.pty.is_some())),
            stdin_window: Window::new(DEFAULT_WINDOW_BYTES),
            terminal: io.terminal,
            open_streams: u8::try_from(io.outputs.len()).unwrap_or(u8::MAX),
            status: None,
        },
    );
    table.by_pid.insert(pid, id);
    table.spawned += 1;
    drop(table);
    shared.children_changed();

    // `Started` goes out before any pump exists, so it precedes all output.
    shared.send(ProcessEvent::Started {
        id,
        pid: pid.as_raw().unsigned_abs(),
        stdin_window: DEFAULT_WINDOW_BYTES,
        output_window: req.output_window,
    });
    // One thread drains every output stream of the process.
    let (outputs, piped) = (io.outputs, req.pty.is_none());
    start_thread(shared, "output", move |s| pump(&s, id, outputs, piped, &output));
}

impl Proc {
    /// Stdin bytes are coming: starts the process's stdin writer, once.
    pub(crate) fn stdin_writer(&mut self, shared: &Arc<Shared>, id: ProcId) {
        if let Some((pipe, rx, tty)) = self.stdin_idle.take() {
            start_thread(shared, "stdin", move |s| write_stdin(&s, id, pipe, tty, &rx));
        }
    }

    /// Stdin ends before any byte came: closes it here (a terminal gets its EOF character), no thread.
    /// `false` when a writer runs, which must be told instead.
    pub(crate) fn close_idle_stdin(&mut self) -> bool {
        let Some((mut pipe, _, tty)) = self.stdin_idle.take() else { return false };
        if tty {
            // An empty terminal takes one byte without blocking.
            let _ = pipe.write_all(&[0x04]);
        }
        true
    }
}

/// The stdio made for a process: a terminal, or three pipes (each `(read end, write end)`, close-on-exec:
/// the child's ends become its stdio in the child only).
enum ChildStdio {
    Terminal(Pty),
    Pipes { stdin: (OwnedFd, OwnedFd), stdout: (OwnedFd, OwnedFd), stderr: (OwnedFd, OwnedFd) },
}

impl ChildStdio {
    fn open(pty: Option<PtySize>) -> io::Result<Self> {
        let pipe = || rustix::pipe::pipe_with(PipeFlags::CLOEXEC).map_err(io::Error::from);
        Ok(match pty {
            Some(size) => Self::Terminal(Pty::open(size)?),
            None => Self::Pipes { stdin: pipe()?, stdout: pipe()?, stderr: pipe()? },
        })
    }

    /// The child's ends.
    fn child_side(&self) -> spawn::Stdio<'_> {
        match self {
            Self::Terminal(pty) => spawn::Stdio::Terminal(&pty.slave),
            Self::Pipes { stdin, stdout, stderr } => spawn::Stdio::Pipes([&stdin.0, &stdout.1, &stderr.1]),
        }
    }

    /// The agent's ends, once the child runs; the child's ends close here (only the child may keep them,
    /// and a terminal's slave side, open).
    fn agent_side(self) -> io::Result<ProcessIo> {
        match self {
            Self::Terminal(Pty { master, slave: _ }) => Ok(ProcessIo {
                stdin: File::from(master.try_clone()?),
                outputs: vec![(Stream::Stdout, master.try_clone()?)],
                terminal: Some(master),
            }),
            Self::Pipes { stdin, stdout, stderr } => Ok(ProcessIo {
                stdin: File::from(stdin.1),
                outputs: vec![(Stream::Stdout, stdout.0), (Stream::Stderr, stderr.0)],
                terminal: None,
            }),
        }
    }
}

/// The agent's ends of a process's stdio.
struct ProcessIo {
    stdin: File,
    outputs: Vec<(Stream, OwnedFd)>,
    terminal: Option<OwnedFd>,
}

fn admit(shared: &Shared, config: &Config, req: &Spawn) -> Result<(), Refusal> {
    let mut table = shared.table();
    if table.stopping {
        return Err(Refusal::ShuttingDown);
    }
    if table.highest.is_some_and(|h| req.id <= h) {
        return Err(Refusal::IdNotIncreasing);
    }
    table.highest = Some(req.id);
    if table.live.len() >= config.max_processes {
        return Err(Refusal::TooManyProcesses);
    }
    if req.argv.is_empty() {
        return Err(Refusal::Invalid);
    }
    Ok(())
}

/// A process that never started: what a shell would print, and the status it would exit with.
fn fail_early(shared: &Shared, id: ProcId, msg: &str, code: i32) {
    let mut end = msg.len().min(MAX_FAILURE_MESSAGE_BYTES);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    let message = msg[..end].to_owned();
    shared.send(ProcessEvent::SpawnFailed { id, status: ExitStatus::Code(code), message });
}

fn start_thread(shared: &Arc<Shared>, role: &str, body: impl FnOnce(Arc<Shared>) + Send + 'static) {
    let s = Arc::clone(shared);
    if let Err(e) = thread::Builder::new().name(format!("vm-agent-{role}")).spawn(move || body(s)) {
        shared.log(&format!("cannot start {role} thread: {e}"));
    }
}

/// One output stream as its pump holds it.
struct Output {
    stream: Stream,
    src: File,
    /// Made for the first chunk worth splicing, so a quiet stream costs no descriptors; without one (out of
    /// descriptors) the chunk is copied.
    staging: Option<Staging>,
}

/// Moves a process's output streams to the host, on one thread (a thread per stream cost a thread start
/// per exec, and a wakeup per stream at the exit). It waits for data first and for credit second, so a
/// quiet stream never holds credit a busy one needs, and it takes only as many bytes as are waiting: the
/// data stays in the pipe (bounded by the kernel) until it can be sent. A pipe's bytes are spliced through
/// a staging pipe (see [`crate::outbox`]); a PTY's (`piped` false) are copied.
fn pump(shared: &Shared, id: ProcId, outputs: Vec<(Stream, OwnedFd)>, piped: bool, credit: &Credit) {
    let mut open: Vec<Output> = outputs
        .into_iter()
        .map(|(stream, src)| {
            // Best effort: the default size still works, only slower.
            let _ = rustix::pipe::fcntl_setpipe_size(&src, PIPE_BYTES);
            Output { stream, src: File::from(src), staging: None }
        })
        .collect();
    let mut frame = OutputFrame::default();
    while !open.is_empty() {
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = open.iter().map(|o| PollFd::new(&o.src, PollFlags::IN)).collect();
            match poll(&mut fds, None) {
                Ok(_) => {}
                Err(Errno::INTR) => continue,
                Err(_) => break,
            }
            fds.iter().map(|f| !f.revents().is_empty()).collect()
        };
        let mut at = 0;
        for ready in ready {
            if ready && !pump_once(shared, id, &mut open[at], piped, credit, &mut frame) {
                open.remove(at);
                // Everything this stream will ever send is on the wire; only now may `Exited` follow.
                let exited = shared.table().stream_closed(id);
                shared.finish(exited);
            } else {
                at += 1;
            }
        }
    }
    // A failed poll: the streams left count as closed, so the process can still finish.
    for _ in open {
        let exited = shared.table().stream_closed(id);
        shared.finish(exited);
    }
}

/// Sends what waits in the stream, within credit; `false` at EOF (or when it cannot go on).
fn pump_once(
    shared: &Shared,
    id: ProcId,
    out: &mut Output,
    piped: bool,
    credit: &Credit,
    frame: &mut OutputFrame,
) -> bool {
    // With the write end closed and nothing left, the pipe reports 0 bytes: EOF.
    let waiting = match ioctl_fionread(&out.src) {
        Ok(0) | Err(_) => return false,
        Ok(n) => usize::try_from(n).unwrap_or(MAX_DATA_BYTES).min(MAX_DATA_BYTES),
    };
    let Some(n) = credit.reserve(waiting) else { return false };
    let splice = piped && n >= SPLICE_MIN_BYTES && shared.outbox.splices();
    if splice && out.staging.is_none() {
        out.staging = Staging::new().ok();
    }
    let (stream, src) = (out.stream, &out.src);
    let sent = match out.staging.as_ref().filter(|_| splice) {
        Some(staging) => shared.outbox.splice_output(id, stream, src, n, staging, frame),
        None => shared.outbox.send_output(id, stream, src, n, frame).map(|()| n),
    };
    match sent {
        // What did not fit in the staging pipe stays in the process's pipe, and its credit with us.
        Ok(sent) if sent < n => credit.give_back(n - sent),
        Ok(_) => {}
        Err(e) => {
            shared.log(&format!("process {id}: {stream:?} not delivered: {e}"));
            return false;
        }
    }
    true
}

/// Writes stdin chunks into the process in arrival order and returns credit for each. After the process
/// stops reading (EPIPE) chunks are dropped but still credited, so the host never stalls on a dead pipe.
fn write_stdin(shared: &Shared, id: ProcId, mut pipe: impl Write, tty: bool, rx: &Receiver<StdinCmd>) {
    let mut broken = false;
    loop {
        let data = match rx.recv() {
            Ok(StdinCmd::Data(data)) => data,
            Ok(StdinCmd::Eof) if tty => {
                // A terminal cannot be half-closed: EOF is the VEOF character, as a user's Ctrl-D.
                let _ = pipe.write_all(&[0x04]);
                break;
            }
            Ok(StdinCmd::Eof) | Err(_) => break,
        };
        broken = broken || pipe.write_all(&data).is_err();
        let bytes = u32::try_from(data.len()).unwrap_or(u32::MAX);
        // Widen our own view of the window before the host can use the credit.
        if let Lookup::Live(p) = shared.table().lookup(id) {
            if p.stdin_window.grant(bytes).is_err() {
                return;
            }
        }
        shared.send(ProcessEvent::StdinCredit { id, bytes });
    }
    // `Eof`, or the process left the table: dropping `pipe` closes the process's stdin.
}

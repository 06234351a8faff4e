//! One boundary link to the host: handshake, then the host's requests until it asks to shut down or goes
//! away.
//!
//! ```text
//! guest                                   host
//!   | -- Hello(version, capabilities) -->  |
//!   | <-- Hello(version, capabilities) --  |   mismatch on either side: close
//!   | <-- Spawn / Stdin / Signal / ... --  |
//!   | -- Started / Output / Exited ... --> |
//!   | <----- Shutdown{grace,signal} ------ |   or EOF: the host went away
//! ```
//!
//! The calling thread reads; each process has a stdin writer and two output pumps; one reaper thread
//! collects exit statuses. Nothing the host sends is ignored: a late message for a process that already
//! exited is a benign race, and anything else unexpected ends the link as a violation.

use std::fs::File;
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use vm_protocol::handshake::{self, FirstFrameError};
use vm_protocol::identity::{WorkloadIdentity, WORKLOAD};
use vm_protocol::link::{ToGuest, ToHost, VmRequest, RESEED_BYTES};
use vm_protocol::{frame, Capabilities, FrameError, Hello, ProcId, ProcessEvent, ProcessRequest, SignalName};

use crate::outbox::Outbox;
use crate::process::{self, Lookup, StdinCmd, Table};
use crate::reaper;

/// What this agent can do.
pub const CAPABILITIES: Capabilities = Capabilities::EXEC
    .union(Capabilities::SIGNALS)
    .union(Capabilities::POWER_OFF)
    .union(Capabilities::PING)
    .union(Capabilities::PTY)
    .union(Capabilities::NET)
    .union(Capabilities::FILES);

/// After SIGKILL, how long to wait for the last `Exited` frames before giving up on them.
const KILL_DRAIN_MS: u64 = 1000;

/// Guest-side settings for processes.
#[derive(Debug, Clone)]
pub struct Config {
    /// Environment every process starts with, before the request's own variables.
    pub default_env: Vec<(String, String)>,
    /// Working directory when the request names none.
    pub default_cwd: String,
    /// Most processes alive at once.
    pub max_processes: usize,
    /// Who every process runs as: the fixed workload identity; `None` keeps the agent's own ids (tests on a
    /// host).
    pub run_as: Option<WorkloadIdentity>,
    /// Whether this agent is PID 1 of its own guest, and so feeds `Reseed` to the kernel (its RNG and
    /// clock). Off by default: tests drive the link on a host, whose kernel it must never touch.
    pub own_kernel: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            default_env: vec![
                ("PATH".into(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()),
                ("HOME".into(), WORKLOAD.home.into()),
                ("USER".into(), WORKLOAD.name.into()),
                ("LOGNAME".into(), WORKLOAD.name.into()),
            ],
            default_cwd: "/".into(),
            max_processes: 1024,
            run_as: Some(WORKLOAD),
            own_kernel: false,
        }
    }
}

/// How a link ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The host asked for a shutdown; every process was stopped.
    Shutdown,
    /// The channel closed: the host side is gone. Every process was killed.
    HostGone,
}

/// Why a link failed. Every process was killed before this is returned.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Sending our hello failed.
    #[error("cannot send hello")]
    SendHello(#[source] FrameError),
    /// The host's hello never came, or did not match.
    #[error("host handshake failed")]
    Handshake(#[source] FirstFrameError),
    /// The host closed the channel during the handshake.
    #[error("host closed the channel during the handshake")]
    ClosedDuringHandshake,
    /// The host sent something the protocol forbids.
    #[error("protocol violation by the host: {what}")]
    Violation {
        /// What was wrong (fixed text plus ids).
        what: String,
    },
    /// The host sent bytes that are not a frame.
    #[error("malformed frame from the host")]
    Frame(#[source] FrameError),
    /// The kernel did not take the host's entropy or clock: serving on would hand out a weak or cloned RNG.
    #[error("cannot reseed the guest: {0}")]
    Reseed(#[source] crate::entropy::ReseedError),
}

/// State shared by the reader, the pumps, the stdin writers and the reaper.
pub(crate) struct Shared {
    pub(crate) outbox: Outbox,
    table: Mutex<Table>,
    /// The reaper waits here when there are no children.
    pub(crate) children: Condvar,
    /// Notified whenever a process leaves the table.
    drained: Condvar,
    /// Set when the link is over; the reaper then stops.
    pub(crate) ended: AtomicBool,
    /// Network streams and the proxy listeners.
    pub(crate) net: crate::net::Streams,
}

impl Shared {
    pub(crate) fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn children_changed(&self) {
        self.children.notify_all();
    }

    /// Sends a control frame; a failure means the host is gone, which the reader notices on its own.
    pub(crate) fn send(&self, msg: impl Into<ToHost>) {
        let _ = self.outbox.send(&msg.into());
    }

    /// Sends the `Exited` of a process that just left the table.
    pub(crate) fn finish(&self, exited: Option<ProcessEvent>) {
        if let Some(msg) = exited {
            self.send(msg);
            self.drained.notify_all();
        }
    }

    pub(crate) fn log(&self, msg: &str) {
        eprintln!("vm-agent: {msg}");
    }
}

/// Serves one link on `reader`/`writer` (the two halves of the channel) until it ends.
///
/// The host's requests are read on a thread of their own, which keeps running while a stop is under way:
/// the credit the host returns during the stop is what lets the last output drain.
///
/// # Errors
/// A [`LinkError`] when the handshake fails or the host breaks the protocol.
pub fn serve(mut reader: impl Read + Send + 'static, writer: File, config: &Config) -> Result<End, LinkError> {
    let shared = Arc::new(Shared {
        outbox: Outbox::new(writer),
        table: Mutex::new(Table::default()),
        children: Condvar::new(),
        drained: Condvar::new(),
        ended: AtomicBool::new(false),
        net: crate::net::Streams::default(),
    });
    let mut scratch = Vec::new();
    handshake(&shared, &mut reader, &mut scratch)?;

    let reaper_shared = Arc::clone(&shared);
    thread::Builder::new()
        .name("vm-agent-reaper".into())
        .spawn(move || reaper::run(&reaper_shared))
        .map_err(|_| LinkError::Violation { what: "cannot start the reaper thread".into() })?;

    let (ends, end) = mpsc::channel();
    let (reader_shared, reader_config) = (Arc::clone(&shared), config.clone());
    thread::Builder::new()
        .name("vm-agent-reader".into())
        .spawn(move || {
            let mut scratch = scratch;
            serve_requests(&reader_shared, &reader_config, &mut reader, &mut scratch, &ends);
        })
        .map_err(|_| LinkError::Violation { what: "cannot start the reader thread".into() })?;

    // The first ending decides; a shutdown request lets the workload drain within its grace period.
    let ending = end.recv().unwrap_or(Ending::HostGone);
    match ending {
        Ending::Shutdown(grace, signal) => stop_all(&shared, grace, to_nix(signal)),
        _ => stop_all(&shared, Duration::ZERO, Signal::SIGTERM),
    }
    shared.ended.store(true, Ordering::Release);
    shared.children_changed();
    crate::net::Streams::set_listening(&shared, false);
    shared.net.close_all();
    match ending {
        Ending::Shutdown(..) => Ok(End::Shutdown),
        Ending::HostGone => Ok(End::HostGone),
        Ending::Violation(e) => Err(e),
    }
}

fn handshake(shared: &Shared, reader: &mut impl Read, scratch: &mut Vec<u8>) -> Result<Hello, LinkError> {
    let ours = Hello::ours(CAPABILITIES, concat!("vm-agent ", env!("CARGO_PKG_VERSION")));
    shared.outbox.send(&ToHost::Hello(ours)).map_err(LinkError::SendHello)?;
    match frame::read_body(reader, scratch) {
        Ok(true) => {}
        Ok(false) => return Err(LinkError::ClosedDuringHandshake),
        Err(e) => return Err(LinkError::Handshake(e.into())),
    }
    handshake::accept_first(scratch, Capabilities::NONE).map_err(LinkError::Handshake)
}

/// How the reading of requests ended, or a shutdown request (after which reading goes on).
#[derive(Debug)]
enum Ending {
    /// `Shutdown { grace, signal }` from the host.
    Shutdown(Duration, SignalName),
    /// The channel closed or failed: the host is gone.
    HostGone,
    /// The host broke the protocol.
    Violation(LinkError),
}

/// Reads and handles the host's requests until the channel ends or breaks, reporting each ending on `ends`
/// (the first one counts) and going on after a shutdown request.
fn serve_requests(
    shared: &Arc<Shared>,
    config: &Config,
    reader: &mut impl Read,
    scratch: &mut Vec<u8>,
    ends: &Sender<Ending>,
) {
    loop {
        let msg = match frame::read::<ToGuest, _>(reader, scratch) {
            Ok(Some(msg)) => msg,
            Ok(None) | Err(FrameError::Io(_) | FrameError::Truncated) => {
                let _ = ends.send(Ending::HostGone);
                return;
            }
            Err(e) => {
                let _ = ends.send(Ending::Violation(LinkError::Frame(e)));
                return;
            }
        };
        match handle(shared, config, msg) {
            Ok(None) => {}
            Ok(Some((grace, signal))) => {
                let _ = ends.send(Ending::Shutdown(grace, signal));
            }
            Err(violation) => {
                let _ = ends.send(Ending::Violation(violation));
                return;
            }
        }
    }
}

/// Handles one request; `Ok(Some((grace, signal)))` is a shutdown request. Attach-socket requests have no tag on the
/// link: the decoder already refused them.
fn handle(shared: &Arc<Shared>, config: &Config, msg: ToGuest) -> Result<Option<(Duration, SignalName)>, LinkError> {
    match msg {
        ToGuest::Process(req) => process_request(shared, config, req)?,
        ToGuest::Vm(VmRequest::Reseed { entropy, unix_nanos }) => {
            let Ok(entropy) = <&[u8; RESEED_BYTES]>::try_from(entropy.0.as_slice()) else {
                return Err(LinkError::Violation { what: "reseed without 64 bytes of entropy".into() });
            };
            // Fails closed: the link ends (and the VM with it) rather than serve with the saved RNG state.
            if config.own_kernel {
                crate::entropy::reseed(entropy, unix_nanos).map_err(LinkError::Reseed)?;
            }
        }
        ToGuest::Vm(VmRequest::Shutdown { grace_ms, signal }) => {
            return Ok(Some((Duration::from_millis(u64::from(grace_ms)), signal)))
        }
        ToGuest::Vm(VmRequest::Egress { listen }) => crate::net::Streams::set_listening(shared, listen),
        // Best effort: a workload that cannot trust the CA gets TLS errors, which is what it would get anyway.
        ToGuest::Vm(VmRequest::Trust { ca_pem }) if config.own_kernel => {
            if let Err(e) = crate::trust::install(&ca_pem) {
                shared.log(&format!("cannot install the sandbox's CA: {e}"));
            }
        }
        ToGuest::Vm(VmRequest::Trust { .. }) => {}
        ToGuest::Net(msg) => crate::net::handle(shared, msg)?,
        ToGuest::Ping { nonce } => shared.send(ToHost::Pong { nonce }),
        ToGuest::Hello(_) => return Err(LinkError::Violation { what: "unexpected hello after the handshake".into() }),
    }
    Ok(None)
}

/// Handles one request about a process.
fn process_request(shared: &Arc<Shared>, config: &Config, msg: ProcessRequest) -> Result<(), LinkError> {
    match msg {
        ProcessRequest::Spawn(req) => process::spawn(shared, config, req),
        ProcessRequest::Files(req) => process::files(shared, config, req),
        ProcessRequest::Stdin { id, data } if data.is_empty() => return Err(violation(id, "empty stdin")),
        ProcessRequest::Credit { id, bytes: 0 } => return Err(violation(id, "zero credit")),
        ProcessRequest::Stdin { id, data } => {
            let mut table = shared.table();
            if let Lookup::Live(p) = known(&mut table, id)? {
                p.stdin_window.consume(data.len()).map_err(|e| violation(id, &e.to_string()))?;
                // After EOF there is no idle stdin left to start a writer for; the next line refuses it.
                p.stdin_writer(shared, id);
                let tx = p.stdin.as_ref().ok_or_else(|| violation(id, "stdin after EOF"))?;
                // A closed receiver means the process is finishing; its stdin no longer matters.
                let _ = tx.send(StdinCmd::Data(data.into_vec()));
            }
        }
        ProcessRequest::StdinEof { id } => {
            let mut table = shared.table();
            if let Lookup::Live(p) = known(&mut table, id)? {
                let tx = p.stdin.take().ok_or_else(|| violation(id, "second stdin EOF"))?;
                if !p.close_idle_stdin() {
                    let _ = tx.send(StdinCmd::Eof);
                }
            }
        }
        ProcessRequest::Signal { id, signal } => {
            let mut table = shared.table();
            if let Lookup::Live(p) = known(&mut table, id)? {
                // ESRCH: the group is already gone, a benign race with its exit.
                let _ = killpg(p.pid, to_nix(signal));
            }
        }
        ProcessRequest::Credit { id, bytes } => {
            let mut table = shared.table();
            if let Lookup::Live(p) = known(&mut table, id)? {
                p.credit.grant(bytes).map_err(|e| violation(id, &e.to_string()))?;
            }
        }
        ProcessRequest::Resize { id, size } => {
            let mut table = shared.table();
            if let Lookup::Live(p) = known(&mut table, id)? {
                // Only a terminal has a size. `Refused` is for spawns alone: answering a running process
                // with it would make the host forget the process.
                if let Some(terminal) = p.terminal.as_ref() {
                    let _ = crate::pty::resize(terminal, size);
                }
            }
        }
    }
    Ok(())
}

/// Resolves an id, turning a never-spawned id into a violation.
fn known(table: &mut Table, id: ProcId) -> Result<Lookup<'_>, LinkError> {
    match table.lookup(id) {
        Lookup::Unknown => Err(violation(id, "message for a process that was never spawned")),
        other => Ok(other),
    }
}

fn violation(id: ProcId, what: &str) -> LinkError {
    LinkError::Violation { what: format!("process {id}: {what}") }
}

fn to_nix(signal: SignalName) -> Signal {
    match signal {
        SignalName::Hup => Signal::SIGHUP,
        SignalName::Int => Signal::SIGINT,
        SignalName::Quit => Signal::SIGQUIT,
        SignalName::Kill => Signal::SIGKILL,
        SignalName::Usr1 => Signal::SIGUSR1,
        SignalName::Usr2 => Signal::SIGUSR2,
        SignalName::Pipe => Signal::SIGPIPE,
        SignalName::Alrm => Signal::SIGALRM,
        SignalName::Term => Signal::SIGTERM,
        SignalName::Cont => Signal::SIGCONT,
        SignalName::Stop => Signal::SIGSTOP,
        SignalName::Tstp => Signal::SIGTSTP,
        SignalName::Winch => Signal::SIGWINCH,
    }
}

/// `signal` (SIGTERM, or the image's stop signal) to every process group, up to `grace` for them to finish,
/// then SIGKILL and a short drain so their `Exited` frames still reach the host. Refuses new spawns from
/// here on.
fn stop_all(shared: &Shared, grace: Duration, signal: Signal) {
    let pids = {
        let mut table = shared.table();
        table.stopping = true;
        table.pids()
    };
    if !grace.is_zero() {
        for pid in &pids {
            let _ = killpg(*pid, signal);
        }
        wait_drained(shared, grace);
    }
    let pids = shared.table().pids();
    for pid in &pids {
        let _ = killpg(*pid, Signal::SIGKILL);
    }
    wait_drained(shared, Duration::from_millis(KILL_DRAIN_MS));
    // Whatever is still blocked on credit will never be read now.
    for credit in shared.table().credits() {
        credit.close();
    }
}

fn wait_drained(shared: &Shared, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut table = shared.table();
    while !table.is_empty() {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return;
        };
        table = shared.drained.wait_timeout(table, left).unwrap_or_else(PoisonError::into_inner).0;
    }
}

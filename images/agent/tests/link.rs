//! The agent's session logic driven over a Unix socket pair on the host, with real processes.
//!
//! The reaper waits for any child of the process, so sessions run one at a time (`SERIAL`).
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::fs::File;
use std::io::Write;

use sha2::Digest;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use vm_agent::link::{self, End, LinkError};
use vm_protocol::handshake::{FirstFrameError, HandshakeError};
use vm_protocol::link::{HostEntropy, ToGuest, ToHost, VmRequest, RESEED_BYTES};
use vm_protocol::message::{EnvVar, Refusal};
use vm_protocol::{
    frame, Capabilities, ExitStatus, Hello, ProcId, ProcessEvent, ProcessRequest, PtySize, SignalName, Spawn, Stream,
};

static SERIAL: Mutex<()> = Mutex::new(());

struct Host {
    stream: UnixStream,
    agent: Option<JoinHandle<Result<End, LinkError>>>,
    scratch: Vec<u8>,
}

#[derive(Debug, Default)]
struct Run {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    status: Option<ExitStatus>,
    started: bool,
    refused: Option<Refusal>,
}

impl Host {
    fn start() -> Self {
        let (host, guest) = UnixStream::pair().unwrap();
        let writer = guest.try_clone().unwrap();
        let agent =
            thread::spawn(move || link::serve(guest, File::from(OwnedFd::from(writer)), &link::Config::default()));
        let mut host = Self { stream: host, agent: Some(agent), scratch: Vec::new() };
        host.stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        match host.recv() {
            Some(ToHost::Hello(h)) => h.check(Capabilities::EXEC.union(Capabilities::SIGNALS)).unwrap(),
            other => panic!("expected hello, got {other:?}"),
        }
        host.send(&ToGuest::Hello(Hello::ours(Capabilities::NONE, "test-host")));
        host
    }

    fn send(&mut self, msg: &ToGuest) {
        frame::write(&mut self.stream, msg, &mut Vec::new()).unwrap();
    }

    fn recv(&mut self) -> Option<ToHost> {
        frame::read(&mut self.stream, &mut self.scratch).unwrap()
    }

    fn spawn(&mut self, id: u32, argv: &[&str], window: u32) {
        self.send(&ToGuest::Process(ProcessRequest::Spawn(Spawn {
            id: ProcId(id),
            argv: argv.iter().map(|s| (*s).to_string()).collect(),
            env: vec![],
            cwd: None,
            pty: None,
            output_window: window,
            rlimits: Vec::new(),
            root: None,
        })));
    }

    /// Collects one process's frames until `Exited`, granting credit for every byte it receives.
    fn collect(&mut self, id: u32) -> Run {
        let mut run = Run::default();
        loop {
            match self.recv().expect("channel closed before Exited") {
                ToHost::Process(ProcessEvent::Started { id: got, .. }) if got == ProcId(id) => run.started = true,
                ToHost::Process(ProcessEvent::Output { id: got, stream, data }) if got == ProcId(id) => {
                    assert!(run.status.is_none(), "output after exit");
                    match stream {
                        Stream::Stdout => run.stdout.extend_from_slice(&data),
                        Stream::Stderr => run.stderr.extend_from_slice(&data),
                    }
                    let bytes = u32::try_from(data.len()).unwrap();
                    self.send(&ToGuest::Process(ProcessRequest::Credit { id: ProcId(id), bytes }));
                }
                ToHost::Process(ProcessEvent::Exited { id: got, status }) if got == ProcId(id) => {
                    run.status = Some(status);
                    return run;
                }
                ToHost::Process(ProcessEvent::Refused { id: got, reason }) if got == ProcId(id) => {
                    run.refused = Some(reason);
                    return run;
                }
                // As the host shows it: the message on the process's stderr, then the status.
                ToHost::Process(ProcessEvent::SpawnFailed { id: got, status, message }) if got == ProcId(id) => {
                    run.stderr.extend_from_slice(format!("{message}\n").as_bytes());
                    run.status = Some(status);
                    return run;
                }
                ToHost::Process(ProcessEvent::StdinCredit { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    fn finish(mut self) -> Result<End, LinkError> {
        self.send(&ToGuest::Vm(VmRequest::Shutdown { grace_ms: 1000, signal: SignalName::Term }));
        self.agent.take().unwrap().join().unwrap()
    }
}

fn run_one(argv: &[&str]) -> Run {
    let mut host = Host::start();
    host.spawn(1, argv, 1 << 20);
    let run = host.collect(1);
    assert_eq!(host.finish().unwrap(), End::Shutdown);
    run
}

#[test]
fn separates_streams_and_reports_the_exit_code() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run = run_one(&["/bin/sh", "-c", "echo out; echo err >&2; exit 7"]);
    assert!(run.started);
    assert_eq!(run.stdout, b"out\n");
    assert_eq!(run.stderr, b"err\n");
    assert_eq!(run.status, Some(ExitStatus::Code(7)));
}

#[test]
fn a_signal_death_is_reported_as_a_signal() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run = run_one(&["/bin/sh", "-c", "kill -KILL $$"]);
    assert_eq!(run.status, Some(ExitStatus::Signaled(9)));
    assert_eq!(run.status.unwrap().shell_code(), 137);
}

#[test]
fn a_missing_command_exits_127_with_a_message() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let run = run_one(&["no-such-command-xyz"]);
    assert!(!run.started);
    assert_eq!(run.status, Some(ExitStatus::Code(127)));
    assert_eq!(String::from_utf8_lossy(&run.stderr), "vm-agent: no-such-command-xyz: command not found\n");
}

#[test]
fn a_missing_working_directory_is_a_clear_error() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.send(&ToGuest::Process(ProcessRequest::Spawn(Spawn {
        id: ProcId(1),
        argv: vec!["true".into()],
        env: vec![],
        cwd: Some("/no/such/dir".into()),
        pty: None,
        output_window: 4096,
        rlimits: Vec::new(),
        root: None,
    })));
    let run = host.collect(1);
    assert_eq!(run.status, Some(ExitStatus::Code(126)));
    assert!(String::from_utf8_lossy(&run.stderr).contains("/no/such/dir"));
    host.finish().unwrap();
}

#[test]
fn stdin_reaches_the_process_and_eof_is_explicit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.spawn(1, &["cat"], 1 << 20);
    host.send(&ToGuest::Process(ProcessRequest::Stdin { id: ProcId(1), data: b"abc".to_vec().into() }));
    // Without EOF, cat keeps running: nothing but output may arrive.
    host.stream.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut seen = Vec::new();
    while let Ok(Some(msg)) = frame::read::<ToHost, _>(&mut host.stream, &mut host.scratch) {
        assert!(!matches!(msg, ToHost::Process(ProcessEvent::Exited { .. })), "cat exited without stdin EOF");
        if let ToHost::Process(ProcessEvent::Output { data, .. }) = msg {
            seen.extend_from_slice(&data);
        }
    }
    host.stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    host.send(&ToGuest::Process(ProcessRequest::StdinEof { id: ProcId(1) }));
    let run = host.collect(1);
    seen.extend_from_slice(&run.stdout);
    assert_eq!(seen, b"abc");
    assert_eq!(run.status, Some(ExitStatus::Code(0)));
    host.finish().unwrap();
}

#[test]
fn stdin_larger_than_the_window_flows_with_credit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const TOTAL: usize = 5 << 20;
    let mut host = Host::start();
    host.spawn(1, &["sha256sum"], 4096);
    let mut credit = match host.recv().unwrap() {
        ToHost::Process(ProcessEvent::Started { stdin_window, .. }) => stdin_window as usize,
        other => panic!("{other:?}"),
    };
    let input: Vec<u8> = (0..TOTAL).map(|i| u8::try_from(i * 7 % 251).unwrap()).collect();
    let mut sent = 0;
    while sent < TOTAL {
        while credit == 0 {
            match host.recv().unwrap() {
                ToHost::Process(ProcessEvent::StdinCredit { bytes, .. }) => credit += bytes as usize,
                other => panic!("{other:?}"),
            }
        }
        let n = credit.min(frame::MAX_DATA_BYTES).min(TOTAL - sent);
        host.send(&ToGuest::Process(ProcessRequest::Stdin {
            id: ProcId(1),
            data: input[sent..sent + n].to_vec().into(),
        }));
        sent += n;
        credit -= n;
    }
    host.send(&ToGuest::Process(ProcessRequest::StdinEof { id: ProcId(1) }));
    let run = host.collect(1);
    // Hashed in-process: a child of ours would be reaped by the agent's reaper, which waits for any child.
    let expected: String = sha2::Sha256::digest(&input).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(String::from_utf8_lossy(&run.stdout), format!("{expected}  -\n"));
    host.finish().unwrap();
}

#[test]
fn env_and_cwd_reach_the_process() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.send(&ToGuest::Process(ProcessRequest::Spawn(Spawn {
        id: ProcId(1),
        argv: vec!["/bin/sh".into(), "-c".into(), "echo \"$GREETING\"; pwd".into()],
        env: vec![EnvVar { key: "GREETING".into(), value: "hello there".into() }],
        cwd: Some("/tmp".into()),
        pty: None,
        output_window: 4096,
        rlimits: Vec::new(),
        root: None,
    })));
    let run = host.collect(1);
    assert_eq!(String::from_utf8_lossy(&run.stdout), "hello there\n/tmp\n");
    host.finish().unwrap();
}

#[test]
fn output_stops_at_the_credit_window_and_resumes_when_granted() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const WINDOW: u32 = 64 * 1024;
    const TOTAL: usize = 4 << 20;
    let mut host = Host::start();
    host.spawn(1, &["head", "-c", &TOTAL.to_string(), "/dev/zero"], WINDOW);
    // Take no credit back for a while: the agent must stop at the window.
    host.stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut held = 0usize;
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        match frame::read::<ToHost, _>(&mut host.stream, &mut host.scratch) {
            Ok(Some(ToHost::Process(ProcessEvent::Output { data, .. }))) => held += data.len(),
            Ok(Some(ToHost::Process(ProcessEvent::Started { .. }))) => {}
            Ok(Some(other)) => panic!("unexpected {other:?}"),
            Ok(None) => panic!("closed"),
            Err(_) => {}
        }
    }
    assert_eq!(held, WINDOW as usize, "the agent sent exactly its window and then waited");
    host.stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    host.send(&ToGuest::Process(ProcessRequest::Credit { id: ProcId(1), bytes: WINDOW }));
    let run = host.collect(1);
    assert_eq!(held + run.stdout.len(), TOTAL);
    assert_eq!(run.status, Some(ExitStatus::Code(0)));
    host.finish().unwrap();
}

#[test]
fn every_output_byte_arrives_before_exited() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Output on both streams right up to the exit; `collect` fails on any output after `Exited`.
    let run = run_one(&["/bin/sh", "-c", "head -c 3000000 /dev/zero; head -c 1000000 /dev/zero >&2; exit 3"]);
    assert_eq!(run.stdout.len(), 3_000_000);
    assert_eq!(run.stderr.len(), 1_000_000);
    assert_eq!(run.status, Some(ExitStatus::Code(3)));
}

#[test]
fn spliced_output_keeps_every_byte_in_order_at_odd_windows() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // A window that is no multiple of a page cuts frames inside pipe pages, so the staging pipe gets parts
    // of pages the process's pipe still holds the rest of; `cat` writes large chunks, which are spliced.
    let file = std::env::temp_dir().join(format!("agent-seq-{}", std::process::id()));
    let script = format!("seq 1 400000 > {0}; cat {0}; rm {0}", file.display());
    let mut host = Host::start();
    host.spawn(1, &["sh", "-c", &script], 100_003);
    let run = host.collect(1);
    let expected: String = (1..=400_000).map(|i| format!("{i}\n")).collect();
    assert!(run.stdout == expected.as_bytes(), "output differs from `seq` ({} bytes)", run.stdout.len());
    assert_eq!(run.status, Some(ExitStatus::Code(0)));
    host.finish().unwrap();
}

/// The guest pid of the process just spawned, from its `Started`.
fn started(host: &mut Host) -> u32 {
    match host.recv() {
        Some(ToHost::Process(ProcessEvent::Started { pid, .. })) => pid,
        other => panic!("expected Started, got {other:?}"),
    }
}

/// Waits until a process named `comm` runs in process group `pgid`.
fn wait_for_group_member(pgid: u32, comm: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ppid pgrp ...
            let Some((head, tail)) = stat.rsplit_once(") ") else {
                continue;
            };
            let fields: Vec<&str> = tail.split(' ').collect();
            if head.ends_with(&format!("({comm}")) && fields.get(2) == Some(&pgid.to_string().as_str()) {
                return;
            }
        }
        thread::sleep(Duration::from_millis(10));
    }
    panic!("no {comm} appeared in group {pgid}");
}

#[test]
fn signals_reach_the_process_group() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    // The shell waits on sleep; SIGINT to the group interrupts both, as Ctrl-C in a terminal would.
    host.spawn(1, &["/bin/sh", "-c", "sleep 30; echo not reached"], 4096);
    let pid = started(&mut host);
    // Signal only once sleep has exec'd: a signal that lands between fork and exec hits the shell's
    // handler in the child and is lost, which would test dash rather than us.
    wait_for_group_member(pid, "sleep");
    host.send(&ToGuest::Process(ProcessRequest::Signal { id: ProcId(1), signal: SignalName::Int }));
    let run = host.collect(1);
    assert_eq!(run.status, Some(ExitStatus::Signaled(2)));
    assert!(run.stdout.is_empty());
    host.finish().unwrap();
}

/// A shell's background job starts with SIGINT and SIGQUIT ignored, and an ignored signal stays ignored across
/// an exec: the agent gives its workloads every default action back. Control: before it did, the three signal
/// tests above failed when the suite ran from a background job (`SigIgn` here read 0x80000006).
#[test]
fn a_workload_gets_every_default_signal_action_whatever_the_agent_inherited() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    use nix::sys::signal::{signal, SigHandler, Signal};
    for sig in [Signal::SIGINT, Signal::SIGQUIT] {
        // SAFETY: SIG_IGN installs no handler; the test process only ever ignores these two, which every
        // other test here tolerates (the agent resets them for its workloads).
        unsafe { signal(sig, SigHandler::SigIgn) }.unwrap();
    }
    let mut host = Host::start();
    host.spawn(1, &["/bin/grep", "^SigIgn", "/proc/self/status"], 4096);
    let run = host.collect(1);
    assert_eq!(String::from_utf8_lossy(&run.stdout), "SigIgn:\t0000000000000000\n");
    host.finish().unwrap();
}

fn spawn_tty(host: &mut Host, id: u32, argv: &[&str], rows: u16, cols: u16) {
    host.send(&ToGuest::Process(ProcessRequest::Spawn(Spawn {
        id: ProcId(id),
        argv: argv.iter().map(|s| (*s).to_string()).collect(),
        env: vec![],
        cwd: None,
        pty: Some(PtySize { rows, cols }),
        output_window: 1 << 20,
        rlimits: Vec::new(),
        root: None,
    })));
}

#[test]
fn a_pty_has_the_requested_size_and_is_the_controlling_terminal() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    spawn_tty(
        &mut host,
        1,
        &["/bin/sh", "-c", "stty size; tty -s && echo is-a-tty; ps -o tty= -p $$ >/dev/null; echo $TERM"],
        33,
        101,
    );
    let run = host.collect(1);
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(text.starts_with("33 101\r\n"), "{text:?}");
    assert!(text.contains("is-a-tty") && text.contains("xterm-256color"), "{text:?}");
    assert!(run.stderr.is_empty(), "a terminal merges stderr into stdout");
    host.finish().unwrap();
}

#[test]
fn a_resize_delivers_sigwinch_and_the_new_size() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    let script = "trap 'stty size; exit 0' WINCH; echo ready; while :; do sleep 0.05; done";
    spawn_tty(&mut host, 1, &["/bin/sh", "-c", script], 24, 80);
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("ready") {
        if let Some(ToHost::Process(ProcessEvent::Output { data, .. })) = host.recv() {
            seen.extend_from_slice(&data);
        }
    }
    host.send(&ToGuest::Process(ProcessRequest::Resize { id: ProcId(1), size: PtySize { rows: 50, cols: 132 } }));
    let run = host.collect(1);
    assert!(String::from_utf8_lossy(&run.stdout).contains("50 132"), "{:?}", String::from_utf8_lossy(&run.stdout));
    assert_eq!(run.status, Some(ExitStatus::Code(0)));
    host.finish().unwrap();
}

#[test]
fn ctrl_c_on_a_pty_interrupts_the_foreground_job() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    spawn_tty(
        &mut host,
        1,
        &["/bin/sh", "-c", "trap 'echo got-int; exit 42' INT; echo ready; while :; do sleep 0.05; done"],
        24,
        80,
    );
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("ready") {
        match host.recv() {
            Some(ToHost::Process(ProcessEvent::Output { data, .. })) => seen.extend_from_slice(&data),
            Some(ToHost::Process(ProcessEvent::Started { .. })) => {}
            other => panic!("{other:?}"),
        }
    }
    // The byte a terminal sends for Ctrl-C; the line discipline turns it into SIGINT.
    host.send(&ToGuest::Process(ProcessRequest::Stdin { id: ProcId(1), data: vec![0x03].into() }));
    let run = host.collect(1);
    assert!(String::from_utf8_lossy(&run.stdout).contains("got-int"));
    assert_eq!(run.status, Some(ExitStatus::Code(42)));
    host.finish().unwrap();
}

#[test]
fn ids_must_increase() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.spawn(5, &["true"], 4096);
    assert_eq!(host.collect(5).status, Some(ExitStatus::Code(0)));
    host.spawn(5, &["true"], 4096);
    assert_eq!(host.collect(5).refused, Some(Refusal::IdNotIncreasing));
    // A late message for an exited process is a benign race, not a violation.
    host.send(&ToGuest::Process(ProcessRequest::Credit { id: ProcId(5), bytes: 1 }));
    host.spawn(6, &["true"], 4096);
    assert_eq!(host.collect(6).status, Some(ExitStatus::Code(0)));
    host.finish().unwrap();
}

#[test]
fn a_message_for_a_never_spawned_id_is_a_violation() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.send(&ToGuest::Process(ProcessRequest::StdinEof { id: ProcId(99) }));
    let result = host.agent.take().unwrap().join().unwrap();
    assert!(matches!(result, Err(LinkError::Violation { .. })), "{result:?}");
}

#[test]
fn stdin_beyond_the_granted_window_is_a_violation() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.spawn(1, &["sleep", "30"], 4096);
    let window = match host.recv().unwrap() {
        ToHost::Process(ProcessEvent::Started { stdin_window, .. }) => stdin_window as usize,
        other => panic!("{other:?}"),
    };
    // sleep never reads, so after its pipe fills no more credit comes back: twice the window must overrun.
    let chunk = vec![0u8; frame::MAX_DATA_BYTES];
    for _ in 0..2 * window / chunk.len() {
        let msg = ToGuest::Process(ProcessRequest::Stdin { id: ProcId(1), data: chunk.clone().into() });
        if frame::write(&mut host.stream, &msg, &mut Vec::new()).is_err() {
            break; // the agent already hung up on us
        }
    }
    let result = host.agent.take().unwrap().join().unwrap();
    assert!(matches!(result, Err(LinkError::Violation { .. })), "{result:?}");
}

#[test]
fn shutdown_stops_running_processes_and_reports_them() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.spawn(1, &["sleep", "300"], 4096);
    let pid = started(&mut host);
    // As in `signals_reach_the_process_group`: a signal between fork and exec would test the fork's window.
    wait_for_group_member(pid, "sleep");
    host.send(&ToGuest::Vm(VmRequest::Shutdown { grace_ms: 2000, signal: SignalName::Term }));
    let run = host.collect(1);
    assert_eq!(run.status, Some(ExitStatus::Signaled(15)), "SIGTERM within the grace period");
    assert_eq!(host.agent.take().unwrap().join().unwrap().unwrap(), End::Shutdown);
}

#[test]
fn shutdown_asks_with_the_signal_it_is_given() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.spawn(1, &["sleep", "300"], 4096);
    let pid = started(&mut host);
    wait_for_group_member(pid, "sleep");
    // An image's StopSignal (SIGINT here) in place of SIGTERM.
    host.send(&ToGuest::Vm(VmRequest::Shutdown { grace_ms: 2000, signal: SignalName::Int }));
    let run = host.collect(1);
    assert_eq!(run.status, Some(ExitStatus::Signaled(2)), "the image's stop signal within the grace period");
    assert_eq!(host.agent.take().unwrap().join().unwrap().unwrap(), End::Shutdown);
}

#[test]
fn host_going_away_kills_everything() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut host = Host::start();
    host.spawn(1, &["/bin/sh", "-c", "echo $$; exec sleep 300"], 4096);
    let pid: i32 = loop {
        if let Some(ToHost::Process(ProcessEvent::Output { data, .. })) = host.recv() {
            break String::from_utf8_lossy(&data).trim().parse().unwrap();
        }
    };
    host.stream.shutdown(std::net::Shutdown::Both).unwrap();
    assert_eq!(host.agent.take().unwrap().join().unwrap().unwrap(), End::HostGone);
    // The agent reaped it, so the pid is gone from /proc.
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(state.is_empty(), "workload survived the host: {state}");
}

#[test]
fn rejects_a_host_of_another_version() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut host, guest) = UnixStream::pair().unwrap();
    let writer = guest.try_clone().unwrap();
    let agent = thread::spawn(move || link::serve(guest, File::from(OwnedFd::from(writer)), &link::Config::default()));
    let mut scratch = Vec::new();
    let _hello: Option<ToHost> = frame::read(&mut host, &mut scratch).unwrap();
    let mut theirs = Hello::ours(Capabilities::NONE, "future-host");
    theirs.version += 1;
    frame::write(&mut host, &ToGuest::Hello(theirs), &mut scratch).unwrap();
    host.flush().unwrap();
    let result = agent.join().unwrap();
    assert!(
        matches!(result, Err(LinkError::Handshake(FirstFrameError::Handshake(HandshakeError::VersionMismatch { .. })))),
        "{result:?}"
    );
}

#[test]
fn the_host_breaking_the_rules_ends_the_link() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let broken: [fn(ProcId) -> ToGuest; 3] = [
        |id| ToGuest::Process(ProcessRequest::Stdin { id, data: Vec::new().into() }),
        |id| ToGuest::Process(ProcessRequest::Credit { id, bytes: 0 }),
        // Credit for output that was never sent: the window would pass its capacity.
        |id| ToGuest::Process(ProcessRequest::Credit { id, bytes: 1 }),
    ];
    for make in broken {
        let mut host = Host::start();
        host.spawn(1, &["sleep", "30"], 4096);
        assert!(matches!(host.recv(), Some(ToHost::Process(ProcessEvent::Started { .. }))));
        let msg = make(ProcId(1));
        host.send(&msg);
        let result = host.agent.take().unwrap().join().unwrap();
        assert!(matches!(result, Err(LinkError::Violation { .. })), "{msg:?}: {result:?}");
    }
}

#[test]
fn a_reseed_is_taken_in_turn_and_one_without_64_bytes_ends_the_link() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // On a host the link leaves the kernel alone (`own_kernel` off): the message is checked and answered in
    // order, nothing more.
    let mut host = Host::start();
    let entropy = |n: usize| HostEntropy(vec![7u8; n].into());
    host.send(&ToGuest::Vm(VmRequest::Reseed { entropy: entropy(RESEED_BYTES), unix_nanos: 1 }));
    host.send(&ToGuest::Ping { nonce: 9 });
    assert_eq!(host.recv(), Some(ToHost::Pong { nonce: 9 }));
    host.finish().unwrap();
    for size in [0, RESEED_BYTES - 1, RESEED_BYTES + 1] {
        let mut host = Host::start();
        host.send(&ToGuest::Vm(VmRequest::Reseed { entropy: entropy(size), unix_nanos: 1 }));
        let result = host.agent.take().unwrap().join().unwrap();
        assert!(matches!(result, Err(LinkError::Violation { .. })), "{size} bytes: {result:?}");
    }
}

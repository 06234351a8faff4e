//! `vm-rogue-agent`: a hostile PID 1 for the end-to-end tests. It boots like the real agent (the agent's own
//! `init` and `port`), completes the handshake, and then attacks the host in the mode named by
//! `/etc/rogue-mode` (the test writes it into the image):
//!
//! | mode | attack |
//! |---|---|
//! | `garbage-after-handshake` | a frame header announcing 2.9 GB, then junk |
//! | `oversized-frame` | a frame one byte over the limit |
//! | `unknown-id` | output for a process the host never started |
//! | `empty-output-flood` | zero-length `Output` frames for a real process, as fast as it can |
//! | `repeated-started` | `Started` for the same process, over and over |
//! | `credit-overrun` | more output than the host granted |
//! | `stdin-credit-overflow` | stdin credit past the window cap |
//! | `exit-signal-max` / `exit-signal-negative` | a process "killed by" signal `i32::MAX` / `-128` |
//! | `stream-data-after-close` | opens a network stream, then sends data on it after the host refused it |
//! | `stream-open-flood` | opens network streams without end and never reads what the host sends |
//! | `download-hoard` | at the first `Spawn` (`hoard PORT`), opens [`HOARD_STREAMS`] egress streams, each granting the largest download window, to the host's `PORT`, and never reads its link again |
//! | `console-flood` | answers politely, and writes to the serial console without end |
//! | `ignore-shutdown` | answers politely, and never powers off when told to |
//! | `one-byte-output` | legal: 1 MiB of stdout in 1-byte frames within the credit, then `Exited(3)` |
//! | `one-byte-interleaved` | the same with 512 KiB, stdout and stderr taking turns (frames no host can join) |
//! | `tar-*` | answers politely, and every `CopyOut` with a malicious tar (see `tar.rs`) |
//!
//! "Answers politely" means: every `Spawn` gets `Started`, one line of output and `Exited(0)`, without
//! running anything; a `Spawn` of `hang` gets `Started` only, and a signal ends it. The fixture never powers
//! the VM off on its own: the host has to.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a test fixture; a panic is an attack too")]

mod tar;

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::frame::{self, MAX_FRAME_BYTES};
use vm_protocol::handshake::{self, Capabilities, Hello};
use vm_protocol::link::{ToGuest, ToHost, VmRequest};
use vm_protocol::net::{
    Listener, NetToHost, StreamFrame, StreamId, EGRESS_DOWNLOAD_WINDOW_BYTES, HOST_OPENED, NET_WINDOW_BYTES,
};
use vm_protocol::policy::network::HOST_GATEWAY;
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, Spawn, Stream, CHANNEL_PORT_NAME};

/// Streams the `download-hoard` mode opens.
const HOARD_STREAMS: u32 = 16;

const CAPABILITIES: Capabilities = Capabilities::EXEC
    .union(Capabilities::SIGNALS)
    .union(Capabilities::POWER_OFF)
    .union(Capabilities::PING)
    .union(Capabilities::FILES);

fn main() {
    let mode = std::fs::read_to_string("/etc/rogue-mode").unwrap_or_default().trim().to_owned();
    eprintln!("vm-rogue-agent: mode {mode}");
    vm_agent::init::boot().expect("boot");
    let mut port = vm_agent::port::open(CHANNEL_PORT_NAME, Duration::from_secs(10)).expect("port");
    let mut out = port.try_clone().expect("clone");
    send(&mut out, &ToHost::Hello(Hello::ours(CAPABILITIES, "vm-rogue-agent")));
    let mut scratch = Vec::new();
    frame::read_body(&mut port, &mut scratch).expect("host hello");
    handshake::accept_first(&scratch, Capabilities::NONE).expect("host hello");
    eprintln!("vm-rogue-agent: handshake done; attacking");
    match mode.as_str() {
        "garbage-after-handshake" => {
            out.write_all(&0xAC00_0000u32.to_le_bytes()).unwrap();
            out.write_all(b"junk-junk-junk").unwrap();
        }
        "oversized-frame" => {
            out.write_all(&u32::try_from(MAX_FRAME_BYTES + 1).unwrap().to_le_bytes()).unwrap();
        }
        "unknown-id" => send(&mut out, &output(ProcId(999), b"who am i")),
        "stream-data-after-close" => {
            let id = StreamId(1);
            send(&mut out, &ToHost::Net(NetToHost::Opened { id, listener: Listener::Http, window: NET_WINDOW_BYTES }));
            // Without a network policy the host refuses it at once: everything after is on a closed stream.
            std::thread::sleep(Duration::from_millis(500));
            let data = StreamFrame::Data { id, data: b"CONNECT evil:443 HTTP/1.1\r\n\r\n".to_vec().into() };
            send(&mut out, &ToHost::Net(NetToHost::Stream(data)));
            std::thread::sleep(Duration::from_secs(3600));
        }
        "stream-open-flood" => {
            let mut wire = Vec::new();
            for n in 1..HOST_OPENED {
                wire.clear();
                let opened = NetToHost::Opened { id: StreamId(n), listener: Listener::Socks, window: NET_WINDOW_BYTES };
                frame::encode(&ToHost::Net(opened), &mut wire).unwrap();
                if out.write_all(&wire).is_err() {
                    break;
                }
            }
            std::thread::sleep(Duration::from_secs(3600));
        }
        "download-hoard" => {
            let spawn = first_spawn(&mut port);
            let target: u16 = spawn.argv.get(1).and_then(|p| p.parse().ok()).expect("hoard PORT");
            let connect = format!("CONNECT {HOST_GATEWAY}:{target} HTTP/1.1\r\n\r\n");
            for n in 1..=HOARD_STREAMS {
                let id = StreamId(n);
                let window = EGRESS_DOWNLOAD_WINDOW_BYTES;
                send(&mut out, &ToHost::Net(NetToHost::Opened { id, listener: Listener::Http, window }));
                let data = StreamFrame::Data { id, data: connect.as_bytes().to_vec().into() };
                send(&mut out, &ToHost::Net(NetToHost::Stream(data)));
            }
            eprintln!("vm-rogue-agent: {HOARD_STREAMS} downloads asked for; the link is read no more");
            std::thread::sleep(Duration::from_secs(3600));
        }
        "console-flood" => {
            std::thread::spawn(|| {
                let mut console = File::options().write(true).open("/dev/console").expect("console");
                let line = [b'x'; 4095];
                loop {
                    let _ = console.write_all(&line);
                    let _ = console.write_all(b"\n");
                }
            });
            polite(&mut port, &mut out, false);
        }
        "ignore-shutdown" => polite(&mut port, &mut out, true),
        tar if tar.starts_with("tar-") => {
            tar::serve(port.try_clone().expect("clone"), out.try_clone().expect("clone"), tar)
        }
        "one-byte-output" | "one-byte-interleaved" => {
            let spawned = wait_for_spawn(&mut port);
            one_byte_flood(port, &mut out, spawned, mode == "one-byte-interleaved");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        attack => {
            let id = wait_for_spawn(&mut port);
            attack_process(&mut out, attack, id);
        }
    }
    loop {
        // Keep reading (so the host's writes never block) and ignore everything, Shutdown included.
        if frame::read_body(&mut port, &mut scratch).ok() != Some(true) {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

fn attack_process(out: &mut File, attack: &str, (id, window): (ProcId, u32)) {
    let started = ToHost::Process(ProcessEvent::Started {
        id,
        pid: 4242,
        stdin_window: DEFAULT_WINDOW_BYTES,
        output_window: window,
    });
    match attack {
        "empty-output-flood" => {
            send(out, &started);
            let empty = output(id, b"");
            let mut wire = Vec::new();
            frame::encode(&empty, &mut wire).unwrap();
            let burst = wire.repeat(4096);
            loop {
                if out.write_all(&burst).is_err() {
                    return;
                }
            }
        }
        "repeated-started" => loop {
            let mut wire = Vec::new();
            frame::encode(&started, &mut wire).unwrap();
            if out.write_all(&wire.repeat(1024)).is_err() {
                return;
            }
        },
        "credit-overrun" => {
            send(out, &started);
            let chunk = vec![b'o'; 1024 * 1024];
            for _ in 0..(2 * DEFAULT_WINDOW_BYTES as usize / chunk.len()) {
                send(out, &output(id, &chunk));
            }
        }
        "stdin-credit-overflow" => {
            send(out, &started);
            for _ in 0..64 {
                send(out, &ToHost::Process(ProcessEvent::StdinCredit { id, bytes: u32::MAX }));
            }
        }
        "exit-signal-max" => {
            send(out, &started);
            send(out, &ToHost::Process(ProcessEvent::Exited { id, status: ExitStatus::Signaled(i32::MAX) }));
        }
        "exit-signal-negative" => {
            send(out, &started);
            send(out, &ToHost::Process(ProcessEvent::Exited { id, status: ExitStatus::Signaled(-128) }));
        }
        other => eprintln!("vm-rogue-agent: unknown mode {other:?}; idling"),
    }
}

/// Bytes `one-byte-output` sends; byte `i` is `i % 251`, so the receiver can check every one, in order.
const ONE_BYTE_TOTAL: u64 = 1024 * 1024;
/// Bytes `one-byte-interleaved` sends: half on each stream (a reader of many tiny frames is slow).
const INTERLEAVED_TOTAL: u64 = 512 * 1024;
/// The exit status that follows them.
const ONE_BYTE_EXIT: i32 = 3;

/// A legal flood: every byte its own frame, never past the credit (the host's `Credit`s are read on a
/// thread of their own, which also keeps reading after the flood so the host's writes never block).
fn one_byte_flood(mut port: File, out: &mut File, (id, window): (ProcId, u32), interleaved: bool) {
    let credit = Arc::new(AtomicU64::new(u64::from(window)));
    let granted = Arc::clone(&credit);
    std::thread::spawn(move || {
        let mut scratch = Vec::new();
        while let Ok(true) = frame::read_body(&mut port, &mut scratch) {
            if let Ok(ToGuest::Process(ProcessRequest::Credit { id: got, bytes })) =
                frame::decode_body::<ToGuest>(&scratch)
            {
                if got == id {
                    granted.fetch_add(u64::from(bytes), Ordering::AcqRel);
                }
            }
        }
    });
    let started = ProcessEvent::Started { id, pid: 4242, stdin_window: DEFAULT_WINDOW_BYTES, output_window: window };
    send(out, &ToHost::Process(started));
    let total = if interleaved { INTERLEAVED_TOTAL } else { ONE_BYTE_TOTAL };
    let mut sent = 0u64;
    let mut wire = Vec::new();
    while sent < total {
        let n = credit.load(Ordering::Acquire).min(total - sent).min(4096);
        if n == 0 {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        credit.fetch_sub(n, Ordering::AcqRel);
        wire.clear();
        for i in sent..sent + n {
            let stream = if interleaved && i % 2 == 1 { Stream::Stderr } else { Stream::Stdout };
            let data = vec![u8::try_from(i % 251).unwrap()].into();
            frame::encode(&ToHost::Process(ProcessEvent::Output { id, stream, data }), &mut wire).unwrap();
        }
        if out.write_all(&wire).is_err() {
            return;
        }
        sent += n;
    }
    send(out, &ToHost::Process(ProcessEvent::Exited { id, status: ExitStatus::Code(ONE_BYTE_EXIT) }));
}

/// Answers every request as a well-behaved agent would, without running anything; on `Shutdown`, keeps
/// going (`ignore_shutdown`) or returns.
fn polite(port: &mut File, out: &mut File, ignore_shutdown: bool) {
    let mut scratch = Vec::new();
    while let Ok(true) = frame::read_body(port, &mut scratch) {
        match frame::decode_body::<ToGuest>(&scratch) {
            Ok(ToGuest::Process(ProcessRequest::Spawn(spawn))) => {
                let id = spawn.id;
                let output_window = spawn.output_window;
                send(
                    out,
                    &ToHost::Process(ProcessEvent::Started {
                        id,
                        pid: 1000 + id.0,
                        stdin_window: DEFAULT_WINDOW_BYTES,
                        output_window,
                    }),
                );
                if spawn.argv.first().map(String::as_str) != Some("hang") {
                    send(out, &output(id, b"polite\n"));
                    send(out, &ToHost::Process(ProcessEvent::Exited { id, status: ExitStatus::Code(0) }));
                }
            }
            Ok(ToGuest::Process(ProcessRequest::Signal { id, signal })) => {
                send(out, &ToHost::Process(ProcessEvent::Exited { id, status: ExitStatus::Signaled(signal.number()) }));
            }
            Ok(ToGuest::Ping { nonce }) => send(out, &ToHost::Pong { nonce }),
            Ok(ToGuest::Vm(VmRequest::Shutdown { .. })) if ignore_shutdown => {
                eprintln!("vm-rogue-agent: ignoring Shutdown")
            }
            Ok(ToGuest::Vm(VmRequest::Shutdown { .. })) => return,
            _ => {}
        }
    }
}

/// The id and output window of the first `Spawn`.
fn wait_for_spawn(port: &mut File) -> (ProcId, u32) {
    let spawn = first_spawn(port);
    (spawn.id, spawn.output_window)
}

/// The first `Spawn`.
fn first_spawn(port: &mut File) -> Spawn {
    let mut scratch = Vec::new();
    loop {
        match frame::read_body(port, &mut scratch) {
            Ok(true) => {
                if let Ok(ToGuest::Process(ProcessRequest::Spawn(spawn))) = frame::decode_body::<ToGuest>(&scratch) {
                    return spawn;
                }
            }
            _ => std::thread::sleep(Duration::from_secs(3600)),
        }
    }
}

fn output(id: ProcId, data: &[u8]) -> ToHost {
    ToHost::Process(ProcessEvent::Output { id, stream: Stream::Stdout, data: data.to_vec().into() })
}

fn send(out: &mut File, msg: &ToHost) {
    let mut wire = Vec::new();
    frame::encode(msg, &mut wire).unwrap();
    let _ = out.write_all(&wire);
}

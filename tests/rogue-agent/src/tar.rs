//! `tar-*` modes: a guest that answers every `CopyOut` with a malicious tar, streamed within the host's
//! credit, and every `Spawn` politely. `/etc/rogue-target` (written by the test) names the host path the
//! escapes aim at.
//!
//! | mode | the tar |
//! |---|---|
//! | `tar-symlink-escape` | `out/esc` -> the target (absolute), then `out/esc/pwned` through it |
//! | `tar-symlink-inside` | `out/esc` -> `.` (a link that stays inside), then `out/esc/pwned` through it |
//! | `tar-dotdot` | `out/../../pwned` |
//! | `tar-hardlink` | `out/h`, a hard link to the target |
//! | `tar-huge` | `out/huge`, a header that claims 10 GiB, then data for as long as the host takes it |
//! | `tar-sparse` | `out/sparse`, a GNU sparse entry |
//! | `tar-device` | `out/dev`, a character device |
//! | `tar-many` | a million empty files |

use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tar::{EntryType, Header};
use vm_protocol::files::FileOp;
use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::frame::{self, MAX_DATA_BYTES};
use vm_protocol::link::{ToGuest, ToHost};
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, Stream};

/// Entries `tar-many` sends (the host's cap is far below).
const MANY: u32 = 1_000_000;

/// The tar, in pieces.
type Pieces = Box<dyn Iterator<Item = Vec<u8>> + Send>;

fn header(kind: EntryType, name: &str, link: &str, size: u64) -> Vec<u8> {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
    h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
    h.set_mode(0o644);
    h.set_size(size);
    h.set_cksum();
    h.as_bytes().to_vec()
}

/// The tar's bytes, made lazily in pieces (a million headers are never held at once).
fn pieces(mode: &str, target: &str) -> Pieces {
    let dir = header(EntryType::Directory, "out/", "", 0);
    let file = |name: &str| {
        let mut data = header(EntryType::Regular, name, "", 5);
        data.extend_from_slice(b"pwned");
        data.resize(1024, 0);
        data
    };
    let end = vec![0u8; 1024];
    let body: Vec<Vec<u8>> = match mode {
        "tar-symlink-escape" => vec![header(EntryType::Symlink, "out/esc", target, 0), file("out/esc/pwned")],
        "tar-symlink-inside" => vec![header(EntryType::Symlink, "out/esc", ".", 0), file("out/esc/pwned")],
        "tar-dotdot" => vec![file("out/../../pwned")],
        "tar-hardlink" => vec![header(EntryType::Link, "out/h", target, 0)],
        "tar-sparse" => vec![header(EntryType::GNUSparse, "out/sparse", "", 0)],
        "tar-device" => vec![header(EntryType::Char, "out/dev", "", 0)],
        "tar-huge" => {
            let head = header(EntryType::Regular, "out/huge", "", 10 << 30);
            return Box::new([dir, head].into_iter().chain(std::iter::repeat_with(|| vec![b'z'; MAX_DATA_BYTES])));
        }
        "tar-many" => {
            let files = (0..MANY).map(|i| header(EntryType::Regular, &format!("out/{i}"), "", 0));
            // Headers in batches, so each frame is full.
            let batched = files.collect_chunks(MAX_DATA_BYTES / 512);
            return Box::new(std::iter::once(dir).chain(batched).chain(std::iter::once(end)));
        }
        _ => Vec::new(),
    };
    Box::new(std::iter::once(dir).chain(body).chain(std::iter::once(end)))
}

trait CollectChunks: Iterator<Item = Vec<u8>> + Sized + Send + 'static {
    fn collect_chunks(mut self, n: usize) -> Pieces {
        Box::new(std::iter::from_fn(move || {
            let batch: Vec<u8> = self.by_ref().take(n).flatten().collect();
            (!batch.is_empty()).then_some(batch)
        }))
    }
}

impl<I: Iterator<Item = Vec<u8>> + Send + 'static> CollectChunks for I {}

fn encode(msg: &ToHost) -> Vec<u8> {
    let mut wire = Vec::new();
    frame::encode(msg, &mut wire).unwrap();
    wire
}

fn send(out: &Mutex<File>, msg: &ToHost) -> bool {
    out.lock().unwrap().write_all(&encode(msg)).is_ok()
}

/// A copy out in flight: the credit the host granted, and whether it ended (killed, or exited). Both are
/// changed only under the writer's lock, so nothing follows its `Exited`.
struct CopyOut {
    credit: AtomicU64,
    ended: AtomicBool,
}

/// Serves the link: `Spawn`s politely, `CopyOut`s with the mode's tar.
pub fn serve(mut port: File, out: File, mode: &str) {
    let target = std::fs::read_to_string("/etc/rogue-target").unwrap_or_default().trim().to_owned();
    let out = Arc::new(Mutex::new(out));
    let mut copies: Vec<(ProcId, Arc<CopyOut>)> = Vec::new();
    let mut scratch = Vec::new();
    while let Ok(true) = frame::read_body(&mut port, &mut scratch) {
        match frame::decode_body::<ToGuest>(&scratch) {
            Ok(ToGuest::Process(ProcessRequest::Spawn(spawn))) => {
                let id = spawn.id;
                let (pid, output_window) = (1000 + id.0, spawn.output_window);
                let started = ProcessEvent::Started { id, pid, stdin_window: DEFAULT_WINDOW_BYTES, output_window };
                send(&out, &ToHost::Process(started));
                let data = b"polite\n".to_vec().into();
                send(&out, &ToHost::Process(ProcessEvent::Output { id, stream: Stream::Stdout, data }));
                send(&out, &ToHost::Process(ProcessEvent::Exited { id, status: ExitStatus::Code(0) }));
            }
            Ok(ToGuest::Process(ProcessRequest::Files(files))) if matches!(files.op, FileOp::CopyOut { .. }) => {
                let id = files.id;
                let (pid, output_window) = (2000 + id.0, files.output_window);
                let started = ProcessEvent::Started { id, pid, stdin_window: DEFAULT_WINDOW_BYTES, output_window };
                send(&out, &ToHost::Process(started));
                let credit = AtomicU64::new(u64::from(output_window));
                let copy = Arc::new(CopyOut { credit, ended: AtomicBool::new(false) });
                copies.push((id, Arc::clone(&copy)));
                let (out, tar) = (Arc::clone(&out), pieces(mode, &target));
                std::thread::spawn(move || stream(&out, id, &copy, tar));
            }
            Ok(ToGuest::Process(ProcessRequest::Credit { id, bytes })) => {
                if let Some((_, copy)) = copies.iter().find(|(c, _)| *c == id) {
                    copy.credit.fetch_add(u64::from(bytes), Ordering::AcqRel);
                }
            }
            Ok(ToGuest::Process(ProcessRequest::Signal { id, signal })) => {
                if let Some((_, copy)) = copies.iter().find(|(c, _)| *c == id) {
                    let mut writer = out.lock().unwrap();
                    if !copy.ended.swap(true, Ordering::AcqRel) {
                        let exited = ProcessEvent::Exited { id, status: ExitStatus::Signaled(signal.number()) };
                        let _ = writer.write_all(&encode(&ToHost::Process(exited)));
                    }
                }
            }
            Ok(ToGuest::Ping { nonce }) => {
                send(&out, &ToHost::Pong { nonce });
            }
            _ => {}
        }
    }
}

/// Streams the tar within the credit, then exits 0 (unless killed first).
fn stream(out: &Mutex<File>, id: ProcId, copy: &CopyOut, tar: Pieces) {
    let last = |msg: &ToHost| {
        let mut writer = out.lock().unwrap();
        !copy.ended.load(Ordering::Acquire) && writer.write_all(&encode(msg)).is_ok()
    };
    for piece in tar {
        for chunk in piece.chunks(MAX_DATA_BYTES) {
            while copy.credit.load(Ordering::Acquire) < chunk.len() as u64 {
                if copy.ended.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            copy.credit.fetch_sub(chunk.len() as u64, Ordering::AcqRel);
            if !last(&ToHost::Process(ProcessEvent::Output { id, stream: Stream::Stdout, data: chunk.to_vec().into() }))
            {
                return;
            }
        }
    }
    let mut writer = out.lock().unwrap();
    if !copy.ended.swap(true, Ordering::AcqRel) {
        let _ = writer.write_all(&encode(&ToHost::Process(ProcessEvent::Exited { id, status: ExitStatus::Code(0) })));
    }
}

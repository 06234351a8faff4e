//! Issue 20: a guest that sends a legal stream of 1-byte `Output` frames (within its credit) once filled a
//! `launch` client's outbound queue in under a millisecond, and the supervisor cut the client as "not
//! reading" while it was reading; `launch` then said only "the sandbox stopped before the process exited".
//! Now a client that reads gets every byte, and only one that stops reading is cut, and told why.
//!
//! The flood is the rogue agent's (`tests/rogue-agent`, modes `one-byte-output` and `one-byte-interleaved`):
//! 1 MiB (512 KiB interleaved), byte `i` being `i % 251`, each byte its own frame, then `Exited(3)`.

use std::io::Read;
use std::time::Duration;

use vm_contract::layout::SandboxFile;
use vm_supervisor::serve::attach_server::outbox::{FAREWELL_MS, STALL_MS};
use vm_test_support::image::with_rogue_agent;
use vm_test_support::procs::PeakRss;
use vm_test_support::{sandbox, wait_until, Launch, Running, Scratch, DRIVER_ERROR};

/// What the rogue agent sends, on one stream and on two, and how its process ends.
const TOTAL_BYTES: usize = 1024 * 1024;
const INTERLEAVED_BYTES: usize = 512 * 1024;
const EXIT_CODE: i32 = 3;

fn flood<'a>(s: &'a Scratch, mode: &str) -> Launch<'a> {
    let initrd = with_rogue_agent(&s.dir, mode);
    Launch::new(s, &["flood"]).initrd(&initrd).flag("--id").flag("flood")
}

/// Byte `i` of the flood, as the rogue agent numbers them.
fn nth(i: usize) -> u8 {
    u8::try_from(i % 251).unwrap()
}

fn assert_numbered(bytes: &[u8], first: usize, step: usize, what: &str) {
    if let Some((k, b)) = bytes.iter().enumerate().find(|(k, b)| **b != nth(first + k * step)) {
        panic!("{what}: byte {k} is {b}, not {}: lost or reordered output", nth(first + k * step));
    }
}

#[test]
fn r20_a_reading_client_gets_every_byte_of_a_one_byte_flood_and_the_exit() {
    let s = Scratch::new("flood-read");
    let out = flood(&s, "one-byte-output").run();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.code, Some(EXIT_CODE), "the workload's own status: {stderr}");
    assert_eq!(out.stdout.len(), TOTAL_BYTES, "every byte: {stderr}");
    assert_numbered(&out.stdout, 0, 1, "stdout");
    eprintln!("e2e: 1-byte flood of {TOTAL_BYTES} frames delivered whole in {:?}", out.elapsed);
}

/// Frames of two streams taking turns cannot be joined: the client's pace holds the guest back instead.
#[test]
fn r20_a_reading_client_gets_every_byte_of_an_interleaved_one_byte_flood() {
    let s = Scratch::with_deadline("flood-read2", Duration::from_secs(360));
    let out = flood(&s, "one-byte-interleaved").run();
    assert_eq!(out.code, Some(EXIT_CODE), "the workload's own status: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout.len(), INTERLEAVED_BYTES / 2, "every stdout byte");
    assert_numbered(&out.stdout, 0, 2, "stdout");
    // The driver's own lines come before the workload's first byte or after its last.
    let mut stderr = &out.stderr[..];
    while stderr.starts_with(b"vm-driver: ") {
        let end = stderr.iter().position(|b| *b == b'\n').map_or(stderr.len(), |i| i + 1);
        stderr = &stderr[end..];
    }
    assert!(stderr.len() >= INTERLEAVED_BYTES / 2, "every stderr byte: {} of {}", stderr.len(), INTERLEAVED_BYTES / 2);
    let (workload, after) = stderr.split_at(INTERLEAVED_BYTES / 2);
    assert_numbered(workload, 1, 2, "stderr");
    assert!(after.is_empty() || after.starts_with(b"vm-driver: "), "nothing else on stderr");
    eprintln!("e2e: interleaved 1-byte flood delivered whole in {:?}", out.elapsed);
}

/// A client that stops reading (here: nobody reads the driver's stdout, so `launch` stops reading its
/// attach connection) is cut once its queue stayed full for the stall, and its error says so; what was on
/// its way reaches it first. (The supervisor's peak is printed, not bounded: the output it retains for the
/// process costs a piece per frame when two streams take turns.)
#[test]
fn r20_a_client_that_stops_reading_is_cut_and_told_why() {
    let s = Scratch::new("flood-stuck");
    let peak = PeakRss::supervisors(&s.dir, "flood");
    let mut run = Running::start(flood(&s, "one-byte-interleaved"), &[], "");
    let mut stderr = run.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = stderr.read_to_end(&mut all);
        all
    });
    s.waiting_for("the supervisor to cut the client that stopped reading");
    let cut = wait_until(Duration::from_secs(60) + Duration::from_millis(STALL_MS), || {
        sandbox::read(&run.sandbox_dir, SandboxFile::SupervisorLog).contains("took no frame from a full queue")
    });
    assert!(cut, "the client that stopped reading was cut");
    // Reading again within the farewell: what was on its way, then the reason.
    let started = std::time::Instant::now();
    let mut stdout = Vec::new();
    run.stdout.read_to_end(&mut stdout).unwrap();
    assert!(started.elapsed() < Duration::from_millis(FAREWELL_MS), "read within the farewell");
    let status = run.driver.wait().unwrap();
    let stderr = String::from_utf8_lossy(&stderr.join().unwrap()).into_owned();
    let peak = peak.peak();
    let said = stderr.lines().filter(|l| l.starts_with("vm-driver: ")).collect::<Vec<_>>().join("\n");
    assert_eq!(status.code(), Some(DRIVER_ERROR), "{said}");
    assert!(
        said.contains("the sandbox cut the attach connection: the client was not reading its frames"),
        "the client learns why it was cut: {said}"
    );
    assert!(!said.contains("the sandbox stopped before the process exited"), "{said}");
    assert!(stdout.len() < INTERLEAVED_BYTES / 2, "cut before the end ({} bytes)", stdout.len());
    assert_numbered(&stdout, 0, 2, "stdout up to the cut");
    eprintln!("e2e: a client that stopped reading was cut after {} bytes; peak RSS {peak} KiB; {said}", stdout.len());
}

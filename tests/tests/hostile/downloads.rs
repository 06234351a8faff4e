//! A guest that asks for downloads and then stops reading its link (the rogue agent's `download-hoard`): each
//! of its 16 streams grants the host a 2 MiB window, 32 MiB together, but what the supervisor holds of them
//! stays within its download budget (`egress::DOWNLOAD_BUDGET_BYTES`) and it stays under its memory bound.
//! The control, without the budget, holds the windows and grows past the bound.

use std::io::Write;
use std::net::TcpListener;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use vm_contract::pids::SandboxPids;
use vm_protocol::policy::network::HOST_GATEWAY;
use vm_test_support::image::images_with_rogues;
use vm_test_support::output::ok;
use vm_test_support::procs::{status_kib, PeakRss};
use vm_test_support::serve::Serve;
use vm_test_support::{wait_until, Scratch, TestControl};

use crate::RSS_BOUND_KIB;

/// Streams the rogue agent opens (its `HOARD_STREAMS`).
const STREAMS: usize = 16;

/// A destination on the host's loopback that sends to every connection without end.
struct Endless {
    port: u16,
    conns: Arc<AtomicUsize>,
    bytes: Arc<AtomicU64>,
}

impl Endless {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (conns, bytes) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicU64::new(0)));
        let (c, b) = (Arc::clone(&conns), Arc::clone(&bytes));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                c.fetch_add(1, Ordering::SeqCst);
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    let chunk = [b'd'; 64 * 1024];
                    while conn.write_all(&chunk).is_ok() {
                        b.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                    }
                });
            }
        });
        Self { port, conns, bytes }
    }
}

/// The hoard, running: its service, the supervisor's pid and peak, and the exec that started it (the rogue
/// never answers it).
struct Hoard {
    serve: Serve,
    supervisor: i32,
    peak: PeakRss,
    client: Child,
}

fn hoard(s: &Scratch, controls: &[TestControl], to: &Endless) -> Hoard {
    let images = images_with_rogues(&s.dir, &["download-hoard"]);
    let serve = Serve::with(s, controls, &["--boot-images", images.to_str().unwrap()]);
    let policy = s.dir.join("policy.json");
    let rules = format!(
        r#"{{"allow":["exec"],"network":{{"allow":[{{"host":"{HOST_GATEWAY}","ports":[{}]}}],"max_connections":32}}}}"#,
        to.port
    );
    std::fs::write(&policy, rules).unwrap();
    ok(serve.cli("create", &["--boot-image", "rogue-download-hoard", "--policy", policy.to_str().unwrap(), "hoard"]));
    let supervisor = SandboxPids::read(&serve.sandbox("hoard")).expect("a pids file").supervisor.pid;
    let peak = PeakRss::supervisors(&s.dir, "hoard");
    let port = to.port.to_string();
    let client = serve
        .cli_command("exec", &["hoard", "--", "hoard", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    s.waiting_for("the rogue's downloads to be dialed");
    assert!(
        wait_until(Duration::from_secs(120), || to.conns.load(Ordering::SeqCst) == STREAMS),
        "{} of {STREAMS} downloads reached the destination",
        to.conns.load(Ordering::SeqCst)
    );
    Hoard { serve, supervisor, peak, client }
}

impl Hoard {
    fn end(mut self) -> u64 {
        let _ = self.client.kill();
        let _ = self.client.wait();
        let peak = self.peak.peak();
        drop(self.serve);
        peak
    }
}

#[test]
fn a_guest_that_stops_reading_its_downloads_holds_the_supervisor_to_the_budget() {
    let s = Scratch::with_deadline("rogue-hoard", Duration::from_secs(420));
    let to = Endless::start();
    let hoard = hoard(&s, &[], &to);
    // The destinations stall once every buffer on the way is full: the kernel's, and what the supervisor
    // takes of them. Then it holds all it ever will.
    s.waiting_for("the downloads to stall");
    let mut last = (to.bytes.load(Ordering::SeqCst), 0);
    let stalled = wait_until(Duration::from_secs(180), || {
        std::thread::sleep(Duration::from_secs(1));
        let now = to.bytes.load(Ordering::SeqCst);
        last = if now == last.0 { (now, last.1 + 1) } else { (now, 0) };
        last.1 >= 5
    });
    assert!(stalled, "the downloads never stalled");
    let now = status_kib(hoard.supervisor, "VmRSS").unwrap_or(0);
    let peak = hoard.end();
    eprintln!("e2e: hoard: {} MiB sent by the destinations; supervisor at {now} KiB, peak {peak} KiB", last.0 >> 20);
    assert!(peak <= RSS_BOUND_KIB, "the supervisor peaked at {peak} KiB");
}

/// Control: without the budget, the windows alone bound what the supervisor holds: 32 MiB of downloads, past
/// the bound.
#[test]
fn control_without_the_download_budget_a_hoard_grows_the_supervisor() {
    let s = Scratch::with_deadline("rogue-hoard-ctl", Duration::from_secs(420));
    let to = Endless::start();
    let hoard = hoard(&s, &[TestControl::NoDownloadBudget], &to);
    s.waiting_for("the unbudgeted downloads to grow the supervisor");
    let grew =
        wait_until(Duration::from_secs(180), || status_kib(hoard.supervisor, "VmRSS").unwrap_or(0) > RSS_BOUND_KIB);
    let peak = hoard.end();
    assert!(
        grew,
        "control: without the budget, the hoard grows the supervisor past {RSS_BOUND_KIB} KiB (peak {peak} KiB)"
    );
    eprintln!("e2e: control confirmed: supervisor grew to {peak} KiB");
}

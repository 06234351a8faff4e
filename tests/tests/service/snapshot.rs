//! Pooled VMs restored from a snapshot (`serve --pool-snapshots`) on real VMs: each clone is reseeded with
//! fresh host entropy and the wall clock before it is claimed, so no two sandboxes read the same random bytes
//! and none keeps the saved clock (with a control that skips the reseed at restore: the clones read the same
//! bytes, and a late one the stale clock), and a snapshot that cannot be restored turns the pool back to
//! booting, as does a save whose stream passes its cap. Restored VMs keep the leash of booted ones.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::Signal;
use vm_test_support::exclusive;
use vm_test_support::output::ok;
use vm_test_support::procs::{signal, ProcInfo};
use vm_test_support::serve::Serve;
use vm_test_support::{gone_within, wait_until, Scratch, TestControl};

/// What one clone said right after its claim.
#[derive(Debug)]
struct Reading {
    /// A random UUID its kernel made: 16 bytes of its RNG, the first it handed out after the restore.
    random: String,
    /// Its wall clock minus the host's, in seconds (the host's read just before the exec).
    clock_skew: i64,
    /// Its uptime at the read.
    uptime: String,
    /// Host time from seeing it ready to the read's answer.
    delay: Duration,
}

/// How soon after a restore a read must come to tell anything: the kernel reseeds on its own about a second
/// of guest time after the save, and clones read after that differ whether or not the restore reseeded them.
/// The delay is host time and includes the claim's and the exec's round trips (slower in the controls'
/// debug build under a loaded 2-core host): the control, read at up to 800 ms, still saw its clones share
/// their bytes, so 750 ms keeps the pair causal. The reseed tests and their control time their reads
/// within it, so each runs alone ([`exclusive::alone`]): a neighbour's restores would make every read late.
const READ_WITHIN: Duration = Duration::from_millis(750);

/// The first ready pooled VM not in `seen`: its slot and its VMM's pid, polled as fast as the CLI answers so
/// the claim follows the restore closely.
fn ready_slot(serve: &Serve, seen: &[String]) -> (String, u32) {
    let mut found = None;
    let ready = wait_until(Duration::from_secs(180), || {
        let listing = String::from_utf8_lossy(&serve.cli("pool", &[]).stdout).into_owned();
        found = listing.lines().find_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            match cols[..] {
                [slot, "ready", .., vmm] if !seen.iter().any(|s| s == slot) => {
                    Some((slot.to_owned(), vmm.parse().ok()?))
                }
                _ => None,
            }
        });
        found.is_some()
    });
    assert!(ready, "no pooled VM became ready");
    found.unwrap()
}

/// Whether QEMU `pid` was started from a migration stream rather than booted.
fn restored(pid: u32) -> bool {
    ProcInfo::read(i32::try_from(pid).unwrap()).is_some_and(|p| p.cmdline.iter().any(|a| a == "-incoming"))
}

fn unix_now() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()).unwrap()
}

/// Claims `serve`'s next restored pooled VM as `id` as soon as it is ready, and has it read its kernel's RNG
/// and its clock first thing.
fn claim_and_read(s: &Scratch, serve: &Serve, seen: &mut Vec<String>, id: &str) -> Reading {
    s.waiting_for("a pooled VM restored from the snapshot");
    let (slot, vmm) = ready_slot(serve, seen);
    let ready = Instant::now();
    assert!(restored(vmm), "pooled VM {slot} was booted, not restored");
    seen.push(slot);
    assert!(ok(serve.cli("create", &[id])).contains(" pool"), "{id} did not come from the pool");
    let host = unix_now();
    let read = "cat /proc/sys/kernel/random/uuid; date +%s; cut -d' ' -f1 /proc/uptime";
    let out = ok(serve.cli("exec", &[id, "--", "sh", "-c", read]));
    let delay = ready.elapsed();
    let lines: Vec<&str> = out.lines().collect();
    let [random, clock, uptime] = lines[..] else { panic!("unexpected output {out:?}") };
    let reading = Reading {
        random: random.to_owned(),
        clock_skew: clock.parse::<i64>().unwrap() - host,
        uptime: uptime.to_owned(),
        delay,
    };
    eprintln!(
        "e2e: {id}: random {}, clock {} s from the host's, uptime {} s at the read, {:?} after it was ready",
        reading.random, reading.clock_skew, reading.uptime, reading.delay
    );
    reading
}

/// As [`claim_and_read`], from the next restored VMs until one is read within [`READ_WITHIN`] (eight tries:
/// a busy host makes some reads late).
fn prompt_reading(s: &Scratch, serve: &Serve, seen: &mut Vec<String>, id: &str) -> Reading {
    for attempt in 0..8 {
        let reading = claim_and_read(s, serve, seen, &format!("{id}-{attempt}"));
        if reading.delay <= READ_WITHIN {
            return reading;
        }
        eprintln!("e2e: {id}: read too late to tell ({:?}); the next one", reading.delay);
    }
    panic!("no restored VM could be read within {READ_WITHIN:?} of its restore: the host is too slow to tell");
}

/// Seconds between the save and the late clone's restore: far more than any clock slack.
const LATE_RESTORE_SECS: u64 = 10;

/// Three sandboxes from one snapshot: two read within [`READ_WITHIN`] of their restore (the first right after
/// the save), then one restored [`LATE_RESTORE_SECS`] after the save (its predecessor's VMM killed).
fn three_clones(s: &Scratch, controls: &[TestControl]) -> [Reading; 3] {
    let serve = Serve::with(s, controls, &["--pool", "1", "--pool-snapshots"]);
    let mut seen = Vec::new();
    let first = prompt_reading(s, &serve, &mut seen, "clone-a");
    let second = prompt_reading(s, &serve, &mut seen, "clone-b");
    let (slot, vmm) = ready_slot(&serve, &seen);
    seen.push(slot);
    std::thread::sleep(Duration::from_secs(LATE_RESTORE_SECS));
    signal(i32::try_from(vmm).unwrap(), Signal::SIGKILL);
    let late = claim_and_read(s, &serve, &mut seen, "clone-late");
    [first, second, late]
}

#[test]
fn restored_sandboxes_never_share_random_bytes_and_have_the_hosts_clock() {
    let _alone = exclusive::alone();
    let s = Scratch::new("snapshot-reseed");
    let [a, b, late] = three_clones(&s, &[]);
    assert_eq!(a.random.len(), 36, "{a:?}");
    assert_ne!(a.random, b.random, "two sandboxes restored from one snapshot read the same random bytes");
    assert_ne!(a.random, late.random);
    for clone in [&a, &b, &late] {
        // Set at the restore; reads within a second of it.
        assert!(clone.clock_skew.abs() <= 2, "the clock was not set at the restore: {clone:?}");
    }
}

#[test]
fn control_without_the_reseed_at_restore_clones_share_random_bytes_and_a_stale_clock() {
    let _alone = exclusive::alone();
    let s = Scratch::new("snapshot-reseed-ctl");
    let [a, b, late] = three_clones(&s, &[TestControl::NoReseedAtRestore]);
    assert_eq!(a.random, b.random, "control: without a reseed the clones hand out the saved RNG's bytes");
    let stale = i64::try_from(LATE_RESTORE_SECS).unwrap() - 2;
    assert!(late.clock_skew <= -stale, "control: a late clone keeps the saved clock: {late:?}");
}

#[test]
fn a_snapshot_that_cannot_be_restored_turns_the_pool_back_to_booting() {
    let s = Scratch::new("snapshot-broken");
    let serve = Serve::with(&s, &[], &["--pool", "1", "--pool-snapshots"]);
    let (slot, vmm) = ready_slot(&serve, &[]);
    assert!(restored(vmm));
    // The stream cut short: every restore from it fails; the claim still works (the VM is already up).
    let snapshots = s.state().join("snapshots");
    let dir = std::fs::read_dir(&snapshots).unwrap().next().unwrap().unwrap().path();
    let state = dir.join(vm_contract::snapshot::SnapshotFile::State.name());
    // It holds all guest memory: the driver's user only.
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    assert_eq!(std::fs::metadata(&state).unwrap().permissions().mode() & 0o777, 0o600);
    std::fs::OpenOptions::new().write(true).open(&state).unwrap().set_len(4096).unwrap();
    assert!(ok(serve.cli("create", &["first"])).contains(" pool"));
    s.waiting_for("two failed restores and a booted pooled VM");
    let (next, vmm) = ready_slot(&serve, &[slot]);
    assert!(!restored(vmm), "pooled VM {next} was restored from a broken snapshot");
    assert!(!dir.exists(), "the broken snapshot was kept");
    assert_eq!(ok(serve.cli("exec", &["first", "--", "id", "-un"])), "sandbox\n");
    assert!(ok(serve.cli("create", &["second"])).contains(" pool"));
    assert_eq!(ok(serve.cli("exec", &["second", "--", "id", "-un"])), "sandbox\n");
}

#[test]
fn a_killed_service_takes_its_restored_vms_along() {
    let s = Scratch::new("snapshot-leash");
    let mut serve = Serve::with(&s, &[], &["--pool", "2", "--pool-snapshots"]);
    let (first, vmm) = ready_slot(&serve, &[]);
    let (_, second) = ready_slot(&serve, &[first]);
    assert!(restored(vmm) && restored(second));
    // Every QEMU of the service still running: the two restored ones (the saver's is gone).
    let vmms: Vec<ProcInfo> = serve.vmms().into_iter().filter(ProcInfo::is_alive).collect();
    assert_eq!(vmms.len(), 2, "{vmms:?}");
    let start = Instant::now();
    serve.kill();
    for vmm in &vmms {
        assert!(gone_within(vmm, Duration::from_secs(2)), "a restored VM outlived its service");
    }
    eprintln!("e2e: service SIGKILL -> both restored VMMs gone in {:?}", start.elapsed());
}

#[test]
fn a_stream_past_its_cap_is_refused_and_the_pool_boots_instead() {
    // Fault injection: the cap on the stream is cut to 1 MiB, as if QEMU sent more than its guest holds.
    let s = Scratch::new("snapshot-cap");
    let log = s.dir.join("serve.log");
    let serve =
        Serve::with_env(&s, &[TestControl::SnapshotStreamCap], &["--pool", "1", "--pool-snapshots"], &[], Some(&log));
    s.waiting_for("two refused saves and a booted pooled VM");
    let (slot, vmm) = ready_slot(&serve, &[]);
    assert!(!restored(vmm), "pooled VM {slot} was restored from a refused save");
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(said.matches("the migration stream passed 1048576 bytes").count(), 2, "{said}");
    assert!(said.contains("snapshots failed 2 times in a row; booting pooled VMs"), "{said}");
    let left = std::fs::read_dir(s.state().join("snapshots")).unwrap().count();
    assert_eq!(left, 0, "a refused save left its partial stream");
    assert!(ok(serve.cli("create", &["booted"])).contains(" pool"));
    assert_eq!(ok(serve.cli("exec", &["booted", "--", "id", "-un"])), "sandbox\n");
}

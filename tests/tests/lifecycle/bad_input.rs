//! Bad input gets a clear error, fast, and leaves nothing running: bad ids, missing images, an unusable
//! accelerator, a guest that never answers, a guest that speaks garbage, a kernel that is not a kernel.

use std::path::Path;
use std::time::Duration;

use vm_test_support::image::{with_init_script, CHANNEL_UP};
use vm_test_support::{harness, Launch, Outcome, Scratch, DRIVER_ERROR};

fn assert_failed_cleanly(out: &Outcome, needle: &str, limit: Duration) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(needle), "expected {needle:?} in:\n{stderr}");
    assert!(out.elapsed < limit, "took {:?}", out.elapsed);
    out.assert_nothing_left();
}

#[test]
fn a_bad_sandbox_id_is_refused_before_anything_starts() {
    let s = Scratch::new("badid");
    for bad in ["../escape", "a/b", "", ".", &"x".repeat(129)] {
        let out = Launch::new(&s, &["true"]).flag("--id").flag(bad).run();
        assert_eq!(out.code, Some(2), "a usage error for {bad:?}");
        assert_failed_cleanly(&out, "sandbox id", Duration::from_secs(5));
        assert!(out.seen.iter().all(|p| !p.is_supervisor()), "no supervisor for a bad id");
    }
    assert!(
        !s.state().join("sandboxes").exists()
            || std::fs::read_dir(s.state().join("sandboxes")).unwrap().next().is_none()
    );
}

#[test]
fn a_missing_image_is_a_clear_error() {
    let s = Scratch::new("noimage");
    let out = Launch::new(&s, &["true"]).image(Path::new("/nonexistent/image")).run();
    assert_eq!(out.code, Some(DRIVER_ERROR));
    assert_failed_cleanly(&out, "guest kernel not found at /nonexistent/image/vmlinuz", Duration::from_secs(5));
    assert!(out.seen.iter().all(|p| !p.is_supervisor()));
}

/// What the host really offers, read by the test itself from /dev and /sys.
fn host_kvm_boots_stock_kernels() -> bool {
    let kvm_rw = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok();
    let loaded = |m: &str| Path::new("/sys/module").join(m).exists();
    kvm_rw && (loaded("kvm_intel") || loaded("kvm_amd"))
}

#[test]
fn accel_kvm_never_falls_back_silently() {
    let s = Scratch::new("kvm");
    let out = Launch::new(&s, &["/bin/sh", "-c", "echo canary"]).accel("kvm").run();
    if host_kvm_boots_stock_kernels() {
        assert_eq!(out.code, Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout_text(), "canary\n");
        assert_eq!(out.accel().as_deref(), Some("kvm"));
    } else {
        assert!(harness().accel != "kvm", "VM_TEST_ACCEL=kvm on a host whose KVM cannot boot a stock kernel");
        assert_eq!(out.code, Some(DRIVER_ERROR));
        assert_failed_cleanly(&out, "--accel kvm: KVM cannot be used here", Duration::from_secs(10));
        assert!(out.seen.iter().all(|p| !p.is_qemu()), "no VMM for an unusable accelerator");
        eprintln!("e2e: --accel kvm refused as expected: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    out.assert_nothing_left();
}

#[test]
fn a_kernel_that_is_not_a_kernel_fails_fast() {
    let s = Scratch::new("badkernel");
    let bogus = s.dir.join("not-a-kernel");
    std::fs::write(&bogus, b"this is not a bzImage").unwrap();
    let out = Launch::new(&s, &["true"]).flag("--kernel").flag(bogus.to_str().unwrap()).run();
    assert_eq!(out.code, Some(DRIVER_ERROR));
    assert_failed_cleanly(&out, "the VMM exited during boot", Duration::from_secs(20));
}

#[test]
fn a_guest_that_never_answers_hits_the_boot_timeout() {
    let s = Scratch::new("silent");
    let initrd = with_init_script(&s.dir, "/bin/busybox sleep 1000");
    let out = Launch::new(&s, &["true"]).initrd(&initrd).flag("--boot-timeout").flag("5").run();
    assert_eq!(out.code, Some(DRIVER_ERROR));
    assert!(out.accel().is_some(), "a VM did start");
    assert_failed_cleanly(&out, "did not answer within 5000 ms", Duration::from_secs(40));
}

#[test]
fn a_guest_that_speaks_garbage_is_refused() {
    let s = Scratch::new("garbage");
    // A rogue PID 1: brings the channel up like the agent, then sends a frame that is not a hello.
    let script = format!(
        "{CHANNEL_UP}\n/bin/busybox printf '\\020\\000\\000\\000garbage-garbage!' > /dev/vport0p1\n/bin/busybox sleep 1000"
    );
    let initrd = with_init_script(&s.dir, &script);
    let out = Launch::new(&s, &["true"]).initrd(&initrd).run();
    assert_eq!(out.code, Some(DRIVER_ERROR));
    assert_failed_cleanly(&out, "peer does not speak the vm boundary protocol", Duration::from_secs(40));
}

#[test]
fn a_guest_without_init_fails_fast() {
    let s = Scratch::new("noinit");
    let initrd = with_init_script(&s.dir, "exit 1");
    let out = Launch::new(&s, &["true"]).initrd(&initrd).run();
    assert_eq!(out.code, Some(DRIVER_ERROR));
    // PID 1 exits -> kernel panic -> reboot -> QEMU exits (-no-reboot): no waiting for the boot timeout.
    assert_failed_cleanly(&out, "the VMM exited during boot", Duration::from_secs(30));
}

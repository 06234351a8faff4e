//! Templates (`docs/templates.md`): starts restored from a saved boot against cold boots of the same spec in
//! the same runs, the memory a clone holds of its own against a booted sandbox's, and create -> ready of a
//! burst from templates. Medians over `BENCH_RUNS` runs (default 10).
//!
//! - `launch -- true` and `launch --image REF -- true`, restored (a template made before the first run)
//!   and `--cold`, alternating in each run.
//! - Unique memory (`Private_Clean + Private_Dirty` of QEMU's `smaps_rollup`, not RSS: a clone's clean pages
//!   are the template's, shared) of idle 128 MiB sandboxes of one `serve`: the first booted (it makes the
//!   template), the next restored, each measured `IDLE` after it was ready.
//! - A burst of `BURST` creates, one every `BURST_GAP`, on a `serve` with templates and no pool (each create
//!   restores), and on one whose pool of `POOL` refills from the template (each create claims); p99 of
//!   create -> ready against a cold create's p50 on a `--cold` serve.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]
#![allow(clippy::cast_precision_loss, reason = "figures for a table")]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::api::pool_full;
use common::{ms, percentile, Report};
use vm_contract::pids::SandboxPids;
use vm_protocol::driver_api::{SandboxRef, SandboxSpec};
use vm_test_support::api::{create_ready, Client};
use vm_test_support::procs::unique_kib;
use vm_test_support::serve::Serve;
use vm_test_support::test_image::{layout_ref, shared_store};
use vm_test_support::{harness, Scratch};

const BURST: usize = 16;
const BURST_GAP: Duration = Duration::from_millis(500);
const POOL: usize = 2;
const IDLE: Duration = Duration::from_secs(10);
const CLONES: usize = 3;

/// `vm-driver launch` on `state`, the template's kind when `image` is given.
fn launch(state: &std::path::Path, image: Option<&str>, cold: bool) -> Command {
    let h = harness();
    let mut cmd = Command::new(&h.shipped.driver);
    cmd.arg("launch").arg("--state-dir").arg(state).args(["--accel", &h.accel]);
    if let Some(reference) = image {
        cmd.args(["--image", reference, "--image-cache"]).arg(shared_store());
    }
    if cold {
        cmd.arg("--cold");
    }
    cmd.args(["--", "true"]).stdin(Stdio::null()).stdout(Stdio::null());
    cmd
}

/// Runs `cmd`; its wall time in ms, and whether it said it was restored.
fn timed(mut cmd: Command) -> (f64, bool) {
    let start = Instant::now();
    let out = cmd.stderr(Stdio::piped()).output().unwrap();
    let took = ms(&start.elapsed());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (took, String::from_utf8_lossy(&out.stderr).contains("restored from a template"))
}

/// What `pid` alone holds, MiB.
fn unique_mib(pid: i32) -> f64 {
    unique_kib(pid).unwrap() as f64 / 1024.0
}

fn small() -> Option<SandboxSpec> {
    Some(SandboxSpec { memory_mib: 128, ..SandboxSpec::default() })
}

/// A burst of creates on `client`, one every [`BURST_GAP`]: each create -> ready (ms), and how many were
/// served by `origin`.
async fn burst(client: &mut Client, run: usize, origin: &str) -> (Vec<f64>, usize) {
    let mut took = Vec::with_capacity(BURST);
    let mut served = 0;
    for b in 0..BURST {
        let id = format!("burst-{run}-{b}");
        let (t, created) = create_ready(client, &id, small()).await;
        served += usize::from(created.origin == origin);
        took.push(ms(&t));
        tokio::time::sleep(BURST_GAP.saturating_sub(t)).await;
    }
    for b in 0..BURST {
        client.delete_sandbox(SandboxRef { sandbox_id: format!("burst-{run}-{b}") }).await.unwrap();
    }
    (took, served)
}

fn main() {
    let runs = common::runs();
    let mut report = Report::new("templates");
    let s = Scratch::new("bench-templates");
    let state = s.dir.join("launch-state");
    let image = layout_ref();
    // The templates, made by a first launch of each kind.
    timed(launch(&state, None, false));
    timed(launch(&state, Some(&image), false));
    for i in 0..runs {
        eprintln!("bench: launch run {}/{runs}", i + 1);
        report.sample("launch -- true, cold (ms)", timed(launch(&state, None, true)).0);
        let (took, restored) = timed(launch(&state, None, false));
        assert!(restored, "launch -- true was not restored");
        report.sample("launch -- true, template (ms)", took);
        report.sample("launch --image -- true, cold (ms)", timed(launch(&state, Some(&image), true)).0);
        let (took, restored) = timed(launch(&state, Some(&image), false));
        assert!(restored, "launch --image was not restored");
        report.sample("launch --image -- true, template (ms)", took);
    }

    // Memory: one serve, its first sandbox booted (it makes the template), the next ones restored.
    let mem_scratch = Scratch::new("bench-templates-memory");
    let serve = Serve::with_templates(&mem_scratch, &[], &[]);
    let (rt, mut client) = serve.grpc();
    rt.block_on(create_ready(&mut client, "booted", small()));
    serve.wait_template(Duration::from_secs(300));
    for c in 0..CLONES {
        let (_, created) = rt.block_on(create_ready(&mut client, &format!("clone-{c}"), small()));
        assert_eq!(created.origin, "template");
    }
    std::thread::sleep(IDLE);
    let vmm = |id: &str| SandboxPids::read(&serve.sandbox(id)).unwrap().vmm.unwrap().pid;
    report.sample("booted sandbox unique memory (MiB)", unique_mib(vmm("booted")));
    for c in 0..CLONES {
        report.sample("clone unique memory (MiB)", unique_mib(vmm(&format!("clone-{c}"))));
    }
    drop((client, rt, serve));

    // Bursts: cold creates for the baseline, then from templates without and with a pool.
    let cold_scratch = Scratch::new("bench-templates-cold");
    let cold = Serve::start(&cold_scratch);
    let (cold_rt, mut cold_client) = cold.grpc();
    let restore_scratch = Scratch::new("bench-templates-restore");
    let restoring = Serve::with_templates(&restore_scratch, &[], &[]);
    let (restore_rt, mut restore_client) = restoring.grpc();
    restore_rt.block_on(create_ready(&mut restore_client, "first", small()));
    restoring.wait_template(Duration::from_secs(300));
    let pool_scratch = Scratch::new("bench-templates-pool");
    let pooled = Serve::with_templates(&pool_scratch, &[], &["--pool", &format!("{POOL}:1:128")]);
    let (pool_rt, mut pool_client) = pooled.grpc();
    pooled.wait_template(Duration::from_secs(300));
    let mut served = (0, 0, 0);
    for i in 0..runs {
        eprintln!("bench: burst run {}/{runs}", i + 1);
        cold_rt.block_on(async {
            let id = format!("cold-{i}");
            report.sample("cold create -> ready (ms)", ms(&create_ready(&mut cold_client, &id, small()).await.0));
            cold_client.delete_sandbox(SandboxRef { sandbox_id: id }).await.unwrap();
        });
        let (took, n) = restore_rt.block_on(burst(&mut restore_client, i, "template"));
        report.sample("templates: burst create -> ready p99 (ms)", percentile(&took, 99));
        let (took, m) = pool_rt.block_on(async {
            pool_full(&mut pool_client, POOL).await;
            let measured = burst(&mut pool_client, i, "pool").await;
            pool_full(&mut pool_client, POOL).await;
            measured
        });
        report.sample("pool from templates: burst create -> ready p99 (ms)", percentile(&took, 99));
        served = (served.0 + n, served.1 + m, served.2 + BURST);
    }

    report.compare(
        "`launch -- true` from a template vs `--cold` (ms)",
        "launch -- true, template (ms)",
        "launch -- true, cold (ms)",
        1,
        "<= 0.30",
    );
    report.compare(
        "`launch --image REF -- true` from a template vs `--cold` (ms)",
        "launch --image -- true, template (ms)",
        "launch --image -- true, cold (ms)",
        1,
        "<= 0.30",
    );
    report.compare(
        &format!("unique memory per idle 128 MiB clone vs a booted sandbox's, {} s idle (MiB)", IDLE.as_secs()),
        "clone unique memory (MiB)",
        "booted sandbox unique memory (MiB)",
        1,
        "<= 0.25",
    );
    report.compare(
        &format!(
            "create -> ready p99 of a burst of {BURST} at 2/s, each restored from a template ({} of {} were) vs \
             cold create p50 (ms)",
            served.0, served.2
        ),
        "templates: burst create -> ready p99 (ms)",
        "cold create -> ready (ms)",
        1,
        "<= 0.05",
    );
    report.compare(
        &format!(
            "create -> ready p99 of a burst of {BURST} at 2/s, a pool of {POOL} refilled from the template ({} of {} \
             claimed) vs cold create p50 (ms)",
            served.1, served.2
        ),
        "pool from templates: burst create -> ready p99 (ms)",
        "cold create -> ready (ms)",
        1,
        "<= 0.05",
    );
    report.finish("Templates: starts from a saved boot, memory shared by clones", runs);
}

//! The warm pool: create -> ready when a pooled VM is claimed, against a cold boot of the same shape and
//! image on a service without a pool, measured in the same runs; the p95 of a burst of creates while the
//! pool refills; and how long a refill takes when pooled VMs are booted and when they are restored from a
//! snapshot (`--pool-snapshots`). Medians over `BENCH_RUNS` runs (default 10).
//!
//! Each run: a cold create on the plain service; then, on each pool of `POOL` (booted, restored), a claim
//! from the full pool, the time until the pool is full again, and a burst of `BURST` creates, one every
//! `BURST_GAP`, with the pool refilling behind them (one VM at a time). Every sandbox is deleted before the
//! next run.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::time::{Duration, Instant};

use common::api::pool_full;
use common::{ms, percentile, Report};
use vm_protocol::driver_api::SandboxRef;
use vm_test_support::api::{create_ready, Client};
use vm_test_support::serve::Serve;
use vm_test_support::Scratch;

const POOL: usize = 2;
const BURST: usize = 6;
const BURST_GAP: Duration = Duration::from_millis(500);

/// One pooled service.
struct Pooled {
    /// `booted` or `restored`: the prefix of its measures.
    kind: &'static str,
    _scratch: Scratch,
    _serve: Serve,
    rt: tokio::runtime::Runtime,
    client: Client,
    /// Burst creates served from the pool, and cold.
    origins: (usize, usize),
}

impl Pooled {
    fn start(kind: &'static str, extra: &[&str]) -> Self {
        let scratch = Scratch::new(&format!("bench-pool-{kind}"));
        let mut args = vec!["--pool".to_owned(), POOL.to_string()];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let serve = Serve::with(&scratch, &[], &args);
        let (rt, client) = serve.grpc();
        Self { kind, _scratch: scratch, _serve: serve, rt, client, origins: (0, 0) }
    }

    fn run(&mut self, report: &mut Report, i: usize) {
        let kind = self.kind;
        let (client, origins) = (&mut self.client, &mut self.origins);
        self.rt.block_on(async {
            pool_full(client, POOL).await;
            let id = format!("claim-{i}");
            let (took, created) = create_ready(client, &id, None).await;
            assert_eq!(created.origin, "pool", "a full pool serves the create");
            report.sample(&format!("{kind}: pooled create -> ready (ms)"), ms(&took));
            let claimed = Instant::now();
            pool_full(client, POOL).await;
            report.sample(&format!("{kind}: refill of one claimed VM (ms)"), ms(&claimed.elapsed()));
            client.delete_sandbox(SandboxRef { sandbox_id: id }).await.unwrap();
            pool_full(client, POOL).await;
            let mut burst = Vec::with_capacity(BURST);
            for b in 0..BURST {
                let id = format!("burst-{i}-{b}");
                let (took, created) = create_ready(client, &id, None).await;
                if created.origin == "pool" {
                    origins.0 += 1;
                } else {
                    origins.1 += 1;
                }
                burst.push(ms(&took));
                tokio::time::sleep(BURST_GAP.saturating_sub(took)).await;
            }
            report.sample(&format!("{kind}: burst create -> ready p95 (ms)"), percentile(&burst, 95));
            for b in 0..BURST {
                client.delete_sandbox(SandboxRef { sandbox_id: format!("burst-{i}-{b}") }).await.unwrap();
            }
            // Refilled before anything else is measured: a refill's boots would load the next measure.
            pool_full(client, POOL).await;
        });
    }
}

fn main() {
    let runs = common::runs();
    let cold_scratch = Scratch::new("bench-pool-cold");
    let cold = Serve::start(&cold_scratch);
    let (cold_rt, mut cold_client) = cold.grpc();
    let mut pools = [Pooled::start("booted", &[]), Pooled::start("restored", &["--pool-snapshots"])];
    let mut report = Report::new("pool");
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        let id = format!("cold-{i}");
        cold_rt.block_on(async {
            report.sample("cold create -> ready (ms)", ms(&create_ready(&mut cold_client, &id, None).await.0));
            cold_client.delete_sandbox(SandboxRef { sandbox_id: id }).await.unwrap();
        });
        for pool in &mut pools {
            pool.run(&mut report, i);
        }
    }
    for pool in &pools {
        let kind = pool.kind;
        report.compare(
            &format!("create -> ready (ms), claimed from a full {kind} pool vs cold boot (p50)"),
            &format!("{kind}: pooled create -> ready (ms)"),
            "cold create -> ready (ms)",
            1,
            "<= 0.10",
        );
        report.compare(
            &format!(
                "create -> ready (ms), p95 of a burst of {BURST} (one per {} ms, {kind} pool of {POOL} refilling) vs \
                 cold boot p50; {} of {} served from the pool",
                BURST_GAP.as_millis(),
                pool.origins.0,
                pool.origins.0 + pool.origins.1
            ),
            &format!("{kind}: burst create -> ready p95 (ms)"),
            "cold create -> ready (ms)",
            1,
            "<= 0.20",
        );
    }
    report.compare(
        "refill of one claimed VM (ms): restored from the snapshot vs booted",
        "restored: refill of one claimed VM (ms)",
        "booted: refill of one claimed VM (ms)",
        1,
        "-",
    );
    report.finish("The warm pool (`serve --pool`, with and without `--pool-snapshots`)", runs);
}

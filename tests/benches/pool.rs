//! The warm pool: create -> ready when a pooled VM is claimed, against a cold boot of the same shape and
//! image on a service without a pool, measured in the same runs; and the p95 of a burst of creates while the
//! pool refills. Medians over `BENCH_RUNS` runs (default 10).
//!
//! Each run: a cold create on the plain service; a claim from a full pool; then a burst of `BURST` creates,
//! one every `BURST_GAP`, on a pool of `POOL` that refills behind them (one boot at a time). Every sandbox is
//! deleted before the next run.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "a benchmark fails loudly")]

mod common;

use std::time::Duration;

use common::api::{create_ready, Client};
use common::Report;
use vm_e2e::serve::Serve;
use vm_e2e::Scratch;
use vm_protocol::driver_api::{ListPoolRequest, SandboxRef};

const POOL: usize = 2;
const BURST: usize = 6;
const BURST_GAP: Duration = Duration::from_millis(1500);

fn ms(d: &Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Waits until the pool holds `POOL` ready VMs.
async fn pool_full(client: &mut Client) {
    for _ in 0..1200 {
        let vms = client.list_pool(ListPoolRequest {}).await.unwrap().into_inner().vms;
        if vms.iter().filter(|v| v.state == "ready").count() == POOL {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the pool never filled")
}

/// The `pct`-th percentile (nearest rank) of `xs`.
fn percentile(xs: &[f64], pct: usize) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (pct * v.len()).div_ceil(100).clamp(1, v.len());
    v[rank - 1]
}

fn main() {
    let runs = common::runs();
    let cold_scratch = Scratch::new("bench-pool-cold");
    let cold = Serve::start(&cold_scratch);
    let (cold_rt, mut cold_client) = cold.grpc();
    let scratch = Scratch::new("bench-pool");
    let pooled = Serve::with(&scratch, &[], &["--pool", &POOL.to_string()]);
    let (rt, mut client) = pooled.grpc();
    let mut report = Report::new("pool");
    let mut burst_origins = (0, 0);
    for i in 0..runs {
        eprintln!("bench: run {}/{runs}", i + 1);
        let id = format!("cold-{i}");
        cold_rt.block_on(async {
            report.sample("cold create -> ready (ms)", ms(&create_ready(&mut cold_client, &id).await.0));
            cold_client.delete_sandbox(SandboxRef { sandbox_id: id }).await.unwrap();
        });
        rt.block_on(async {
            pool_full(&mut client).await;
            let id = format!("claim-{i}");
            let (took, created) = create_ready(&mut client, &id).await;
            assert_eq!(created.origin, "pool", "a full pool serves the create");
            report.sample("pooled create -> ready (ms)", ms(&took));
            client.delete_sandbox(SandboxRef { sandbox_id: id }).await.unwrap();
            pool_full(&mut client).await;
            let mut burst = Vec::with_capacity(BURST);
            for b in 0..BURST {
                let id = format!("burst-{i}-{b}");
                let (took, created) = create_ready(&mut client, &id).await;
                if created.origin == "pool" {
                    burst_origins.0 += 1;
                } else {
                    burst_origins.1 += 1;
                }
                burst.push(ms(&took));
                tokio::time::sleep(BURST_GAP.saturating_sub(took)).await;
            }
            report.sample("burst create -> ready p95 (ms)", percentile(&burst, 95));
            for b in 0..BURST {
                client.delete_sandbox(SandboxRef { sandbox_id: format!("burst-{i}-{b}") }).await.unwrap();
            }
        });
    }
    report.compare(
        "create -> ready (ms), claimed from a full pool vs cold boot (p50)",
        "pooled create -> ready (ms)",
        "cold create -> ready (ms)",
        1,
        "<= 0.10",
    );
    report.compare(
        &format!(
            "create -> ready (ms), p95 of a burst of {BURST} (one per {} ms, pool of {POOL} refilling) vs cold boot \
             p50; {} of {} served from the pool",
            BURST_GAP.as_millis(),
            burst_origins.0,
            burst_origins.0 + burst_origins.1
        ),
        "burst create -> ready p95 (ms)",
        "cold create -> ready (ms)",
        1,
        "<= 0.20",
    );
    report.finish("The warm pool (`serve --pool`)", runs);
}

//! One pooled VM's task: boot it, keep it until it is claimed or ends, and replace nothing itself (the
//! refill does, once this slot is gone).

use std::os::fd::AsFd;
use std::os::unix::fs::DirBuilderExt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxLayout;
use vm_contract::tombstone::EndReason;

use super::{Pool, PoolKey};
use crate::sandbox::supervisor::Ready;
use crate::sandbox::{self, Ended, PooledStart, Running, VmSpec, HUNG_STOP_TIMEOUT};
use crate::service::context::Context;
use crate::service::ledger::{BootTurn, Share};
use crate::template::{self, TemplateKey};

/// Why a pooled VM could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    /// The slot's directory could not be made.
    #[error("cannot create the pool slot's directory")]
    Dir(#[source] std::io::Error),
    /// The supervisor could not be started.
    #[error(transparent)]
    Start(#[from] sandbox::StartError),
    /// The blocking boot ended abnormally.
    #[error("the pooled boot's task ended abnormally")]
    Task,
}

/// A started pooled VM, and the template its kind lacks (made next, for the slots after it).
pub(super) struct Started {
    pub(super) running: Running,
    pub(super) template_wanted: Option<(TemplateKey, VmSpec)>,
}

/// Starts a pooled VM in a new slot directory. It has no identity: no telemetry settings, credentials,
/// session or policy (`sandbox::start_pooled`). A VM to boot is restored from its kind's template instead
/// when `serve` has templates and there is one.
pub(super) fn boot(
    ctx: &Context,
    id: &SandboxId,
    layout: &SandboxLayout,
    key: &PoolKey,
    start: &PooledStart,
    root: Option<vm_contract::root::RootImage>,
) -> Result<Started, SlotError> {
    std::fs::DirBuilder::new().mode(0o700).create(layout.dir()).map_err(SlotError::Dir)?;
    let vm = ctx.vm_spec(layout.clone(), key.image.clone(), key.shape, root, Vec::new());
    let template_key = match (&ctx.templates, start) {
        (Some(_), PooledStart::Boot) => template::key::of(&vm).ok(),
        _ => None,
    };
    if let (Some(templates), Some(template_key)) = (&ctx.templates, &template_key) {
        if let Ok(Some(found)) = templates.load(template_key, u64::from(key.shape.memory_mib()) << 20) {
            let how = PooledStart::Restore(found.dir.clone());
            let running = sandbox::start_pooled(&vm, id, &how, Some(found.ram.as_fd()), &ctx.telemetry)?;
            return Ok(Started { running, template_wanted: None });
        }
    }
    // The telemetry settings reach the VM only under the `pool-identity-at-boot` control.
    let running = sandbox::start_pooled(&vm, id, start, None, &ctx.telemetry)?;
    Ok(Started { running, template_wanted: template_key.map(|k| (k, vm)) })
}

/// Stops a pooled generation in order and ends it (reap, sweep, tombstone).
pub(super) async fn end(running: Running, timeout: Duration) {
    running.stop(timeout).await.end(EndReason::Failed).await;
}

/// The slot's life: booting (holding its turn), then waiting for a claim (answered with the VM and its share), its own end, or
/// the pool's.
pub(super) async fn run(
    pool: Arc<Pool>,
    id: SandboxId,
    (mut running, mut share, turn): (Running, Share, BootTurn),
    mut claims: mpsc::Receiver<oneshot::Sender<(Running, Share)>>,
    mut closing: watch::Receiver<bool>,
) {
    let stop_timeout = pool.ctx.stop_timeout;
    let ready = tokio::select! {
        ready = running.ready() => ready,
        () = closed(&mut closing) => {
            finish(&pool, &id, (running, share), stop_timeout, true).await;
            return;
        }
    };
    drop(turn);
    let vmm_pid = match ready {
        Ok(Ready { saved: Some(bytes), .. }) => {
            pool.snapshot_saved(&id, bytes);
            finish(&pool, &id, (running, share), stop_timeout, true).await;
            return;
        }
        Ok(ready) if ready.pooled => {
            let vmm_pid = ready.vmm.map_or(0, |v| v.pid.unsigned_abs());
            pool.slot_ready(&id, vmm_pid);
            vmm_pid
        }
        Ok(_) => {
            eprintln!("vm-driver: pooled VM {id} reported ready as a sandbox; stopping it");
            finish(&pool, &id, (running, share), stop_timeout, false).await;
            return;
        }
        Err(e) => {
            let what = if pool.saves(&id) { "could not be saved" } else { "did not boot" };
            eprintln!("vm-driver: pooled VM {id} {what}: {}", vm_contract::logs::chain(&e));
            finish(&pool, &id, (running, share), stop_timeout, false).await;
            return;
        }
    };
    loop {
        tokio::select! {
            claim = claims.recv() => {
                let Some(reply) = claim else { break };
                match reply.send((running, share)) {
                    // The sandbox owns it now; the claimer removed the slot.
                    Ok(()) => return,
                    // The claimer gave up before taking it: claimable again.
                    Err(back) => {
                        (running, share) = back;
                        pool.slot_ready(&id, vmm_pid);
                    }
                }
            }
            ended = running.ended() => {
                let timeout = if matches!(ended, Ended::Hung) { HUNG_STOP_TIMEOUT } else { stop_timeout };
                eprintln!("vm-driver: pooled VM {id} ended on its own; replacing it");
                finish(&pool, &id, (running, share), timeout, true).await;
                return;
            }
            () = closed(&mut closing) => break,
        }
    }
    finish(&pool, &id, (running, share), stop_timeout, true).await;
}

/// Ends an unclaimed slot: its VM down, its directory removed, its share given back.
async fn finish(pool: &Pool, id: &SandboxId, (running, share): (Running, Share), timeout: Duration, booted: bool) {
    let layout = running.layout().clone();
    end(running, timeout).await;
    let _ = std::fs::remove_dir_all(layout.dir());
    drop(share);
    pool.slot_gone(id, booted);
}

/// Once the pool is closing.
async fn closed(closing: &mut watch::Receiver<bool>) {
    let _ = closing.wait_for(|c| *c).await;
}

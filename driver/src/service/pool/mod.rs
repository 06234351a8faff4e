//! The warm pool (`serve --pool`): VMs booted ahead of demand, each under its own supervisor, watchdog, jail
//! and cgroups like any sandbox's, with no identity until `CreateSandbox` claims one.
//!
//! - **Slots.** Each pooled VM lives in `STATE/pool/<slot>/` under a random `pool-…` id that is never a
//!   sandbox's. A claim moves the directory to `STATE/sandboxes/<id>/` ([`crate::jail::move_sandbox`]) and
//!   hands the VM its identity ([`crate::sandbox::Running::claim`]); the slot is gone from then on. A
//!   pooled VM serves one sandbox and is never returned: when the sandbox stops, its VM is shut down.
//! - **Refill.** One slot boots at a time, in the background, and only within capacity: a slot reserves its
//!   share ([`Ledger::admit_pooled`]) before it boots, so pooled VMs count against the same limits as
//!   sandboxes, and a claim transfers the share instead of needing room. The boot itself (locks, files,
//!   the supervisor's fork and exec) runs on a blocking thread. Boots that fail back off (2 s
//!   doubling to a minute) instead of looping.
//! - **Snapshots** (`--pool-snapshots`). The first slot of a target boots and saves its idle VM into
//!   `STATE/snapshots/<slot>/` ([`PooledStart::Save`]) and ends; every later slot is restored from it
//!   ([`PooledStart::Restore`]), and its supervisor reseeds the guest before anything runs. Two failures in a
//!   row (a save, or restores) turn the target back to booting, said once. Each `serve` saves anew, so a
//!   snapshot never outlives the QEMU, image and driver build that made it.
//! - **Leash.** A slot's supervisor holds the liveness pipe and lease like any other; a slot whose VM or
//!   supervisor ends on its own is cleaned up (reaped, swept, its share given back) and replaced. Slots of
//!   an earlier `serve` (their VMs died with its liveness pipes) are reaped and removed once their
//!   supervisors have exited.

mod listing;
mod slot;
pub mod target;

use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch, Notify};
use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxLayout;
use vm_contract::pids::SandboxPids;

pub use self::listing::{PoolListing, PooledView};
pub use self::target::{root_key, PoolKey, PoolTarget};
use super::context::Context;
use super::ledger::{Ledger, Share};
use crate::image::Image;
use crate::sandbox::{PooledStart, Running};

/// How often the refill looks again when nothing woke it (capacity freed by a stop or delete).
const RECHECK: Duration = Duration::from_secs(1);
/// The first back-off after a failed pooled boot; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(2);
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// A pooled VM handed to a sandbox: its slot and its running generation, ready as pooled.
#[derive(Debug)]
pub struct ClaimedVm {
    /// The slot it came from.
    pub slot: SandboxId,
    /// The VM, still in the slot's directory.
    pub running: Running,
    /// The slot's share of the host: the sandbox's once the sandbox is registered.
    pub share: Option<Share>,
}

/// One slot as the pool lists it.
#[derive(Debug)]
struct Slot {
    id: SandboxId,
    target: usize,
    start: PooledStart,
    state: SlotState,
    supervisor_pid: u32,
    /// The slot's task takes a claim from here and answers with its VM and share.
    claims: mpsc::Sender<oneshot::Sender<(Running, Share)>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Booting,
    Ready { vmm_pid: u32 },
    Claiming,
}

/// Per target: the resolved key, and the back-off after failed boots.
#[derive(Debug)]
struct Target {
    config: PoolTarget,
    key: PoolKey,
    /// Its image root, once pulled (before its first slot boots).
    root: Option<vm_contract::root::RootImage>,
    failures: u32,
    retry_at: Option<tokio::time::Instant>,
    /// Said once while the host has no room for it, until it has again.
    no_room: bool,
    snapshot: Snapshot,
    /// Snapshot saves or restores that failed in a row.
    snapshot_failures: u32,
}

/// A target's snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Snapshot {
    /// Its VMs boot.
    Off,
    /// Its next slot saves one (one slot boots at a time, so there is never a second saver).
    Wanted,
    /// Its VMs are restored from this directory.
    Ready(PathBuf),
}

/// Snapshot failures in a row after which a target boots its VMs instead.
const SNAPSHOT_ATTEMPTS: u32 = 2;

#[derive(Debug)]
struct State {
    targets: Vec<Target>,
    slots: Vec<Slot>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// The pool.
#[derive(Debug)]
pub struct Pool {
    ctx: Arc<Context>,
    ledger: Arc<Ledger>,
    state: Mutex<State>,
    /// Slots whose boot is under way on a blocking thread (not yet in `state`).
    starting: AtomicUsize,
    wake: Notify,
    closing: watch::Sender<bool>,
}

/// A pool target whose image cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("--pool: {0}")]
pub struct PoolError(#[from] crate::image::NamedImageError);

impl Pool {
    /// The pool for `targets` (empty: no pool), its shares taken from `ledger`; [`Self::start`] starts its
    /// refill. With `snapshots`, each target's VMs are restored from a snapshot saved by its first slot.
    ///
    /// # Errors
    /// [`PoolError`] when a target's image cannot be resolved.
    pub fn new(
        ctx: Arc<Context>,
        ledger: Arc<Ledger>,
        targets: Vec<PoolTarget>,
        snapshots: bool,
    ) -> Result<Arc<Self>, PoolError> {
        // An earlier serve's snapshots may come from another QEMU, image or build: never restored.
        let dir = ctx.state.snapshots_dir();
        let _ = std::fs::remove_dir_all(&dir);
        let made = snapshots && std::fs::DirBuilder::new().mode(0o700).create(&dir).is_ok();
        if snapshots && !made {
            eprintln!("vm-driver: warm pool: cannot create {}; booting pooled VMs", dir.display());
        }
        let snapshots = made;
        let snapshot = if snapshots { Snapshot::Wanted } else { Snapshot::Off };
        let targets = targets
            .into_iter()
            .map(|config| {
                // Pooled VMs boot the default boot image.
                let image = ctx.images.resolve("")?;
                let key = PoolKey { shape: config.shape, image, root: config.image.clone() };
                let snapshot = snapshot.clone();
                Ok(Target {
                    config,
                    key,
                    root: None,
                    failures: 0,
                    retry_at: None,
                    no_room: false,
                    snapshot,
                    snapshot_failures: 0,
                })
            })
            .collect::<Result<Vec<_>, PoolError>>()?;
        Ok(Arc::new(Self {
            ctx,
            ledger,
            state: Mutex::new(State { targets, slots: Vec::new(), tasks: Vec::new() }),
            starting: AtomicUsize::new(0),
            wake: Notify::new(),
            closing: watch::channel(false).0,
        }))
    }

    /// Starts the refill (after the restored sandboxes took their shares).
    pub fn start(self: &Arc<Self>) {
        let active = !self.lock().targets.is_empty();
        tokio::spawn(Arc::clone(self).refill(active));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims a ready pooled VM of `shape`, boot image `image` and root `root` ([`root_key`]), if one
    /// is free. Not cancel-safe (a VM handed over to a dropped claim would be lost with its slot): run it to
    /// the end, in a task of its own.
    pub async fn claim(
        &self,
        shape: vm_contract::shape::SandboxShape,
        image: &Image,
        root: Option<&str>,
    ) -> Option<ClaimedVm> {
        loop {
            let (id, claims) = {
                let mut state = self.lock();
                let State { targets, slots, .. } = &mut *state;
                let slot = slots.iter_mut().find(|s| {
                    matches!(s.state, SlotState::Ready { .. })
                        && targets[s.target].key.shape == shape
                        && targets[s.target].key.image == *image
                        && targets[s.target].key.root.as_deref() == root
                })?;
                slot.state = SlotState::Claiming;
                (slot.id.clone(), slot.claims.clone())
            };
            let (tx, rx) = oneshot::channel();
            let handed = match claims.send(tx).await {
                Ok(()) => rx.await.ok(),
                Err(_) => None,
            };
            // `None`: the slot's VM ended in that instant; its task cleans up and removes it. Try another.
            if let Some((running, share)) = handed {
                self.lock().slots.retain(|s| s.id != id);
                self.wake.notify_one();
                return Some(ClaimedVm { slot: id, running, share: Some(share) });
            }
        }
    }

    /// Stops a claimed VM that no sandbox took (its id was taken meanwhile) and gives its share back.
    pub async fn discard(&self, claimed: ClaimedVm) {
        let layout = claimed.running.layout().clone();
        slot::end(claimed.running, self.ctx.stop_timeout).await;
        let _ = std::fs::remove_dir_all(layout.dir());
        drop(claimed.share);
    }

    /// Stops every pooled VM (in order, in parallel) and the refill.
    pub async fn close(&self) {
        self.closing.send_replace(true);
        // Until none is left: a slot started in the same instant pushes its task after the first take.
        loop {
            let tasks = std::mem::take(&mut self.lock().tasks);
            if tasks.is_empty() && self.starting.load(Ordering::SeqCst) == 0 {
                return;
            }
            if tasks.is_empty() {
                // A boot is under way on a blocking thread: its task is pushed once it is back.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            futures_util::future::join_all(tasks).await;
        }
    }

    /// Keeps each target's count booted, one boot at a time, within capacity, and sweeps an earlier
    /// `serve`'s slots; without targets (`active` false) it ends once none is left.
    async fn refill(self: Arc<Self>, active: bool) {
        let mut closing = self.closing.subscribe();
        loop {
            if *closing.borrow() {
                return;
            }
            if !self.sweep_strays() && !active {
                return;
            }
            if let Some(target) = self.next_target() {
                self.start_slot(target).await;
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(RECHECK) => {}
                _ = closing.changed() => {}
            }
        }
    }

    /// Removes slot directories that are no slot of this pool (an earlier `serve`'s, whose VMs died with its
    /// liveness pipes) once their supervisor is gone: reaped, swept, removed.
    /// Whether any is left (its supervisor still exiting).
    fn sweep_strays(&self) -> bool {
        let mut left = false;
        let Ok(entries) = std::fs::read_dir(self.ctx.state.pool_dir()) else { return false };
        for entry in entries.flatten() {
            let ours = self.lock().slots.iter().any(|s| entry.file_name().to_str() == Some(s.id.as_str()));
            let layout = SandboxLayout::new(entry.path());
            let running = SandboxPids::read(layout.dir()).is_some_and(|p| p.supervisor.is_alive());
            if !ours && !running {
                crate::reap::reap_one(&layout, self.ctx.controls.reaper);
                let _ = std::fs::remove_dir_all(layout.dir());
            }
            left |= !ours && running;
        }
        left
    }

    /// The first target short of its count, when no slot is booting and its back-off is over.
    fn next_target(&self) -> Option<usize> {
        let state = self.lock();
        if state.slots.iter().any(|s| s.state == SlotState::Booting) {
            return None;
        }
        let now = tokio::time::Instant::now();
        state.targets.iter().enumerate().find_map(|(i, t)| {
            let live = state.slots.iter().filter(|s| s.target == i).count();
            (live < t.config.count as usize && t.retry_at.is_none_or(|at| at <= now)).then_some(i)
        })
    }

    /// Starts one slot of `target`, if it fits; its boot runs on a blocking thread.
    async fn start_slot(self: &Arc<Self>, target: usize) {
        let Ok(id) = crate::state::random_id("pool") else { return };
        let shape = self.lock().targets[target].key.shape;
        // No room: the next look (a wake or the recheck) tries again.
        let reserved = self.ledger.admit_pooled(shape);
        let said = std::mem::replace(&mut self.lock().targets[target].no_room, reserved.is_err());
        let share = match reserved {
            Ok(share) => share,
            Err(why) => {
                if !said {
                    eprintln!("vm-driver: warm pool: no room for another pooled VM ({why}); waiting");
                }
                return;
            }
        };
        let layout = SandboxLayout::new(self.ctx.state.pool_dir().join(id.as_str()));
        let key = self.lock().targets[target].key.clone();
        let Ok(root) = self.target_root(target, &key).await else {
            drop(share);
            self.boot_failed(target);
            return;
        };
        let start = self.pooled_start(target, &id);
        // Behind the cold boots asked for before it: they are what a caller waits on.
        let turn = self.ledger.boot_turn().await;
        self.starting.fetch_add(1, Ordering::SeqCst);
        let (ctx, slot_id, slot_layout, how) = (Arc::clone(&self.ctx), id.clone(), layout.clone(), start.clone());
        let booted =
            tokio::task::spawn_blocking(move || slot::boot(&ctx, &slot_id, &slot_layout, &key, &how, root)).await;
        let running = match booted.map_err(|_| slot::SlotError::Task).and_then(|started| started) {
            Ok(slot::Started { running, template_wanted }) => {
                if let Some((key, vm)) = template_wanted {
                    crate::service::templates::make(&self.ctx, &self.ledger, key, vm);
                }
                running
            }
            Err(e) => {
                self.starting.fetch_sub(1, Ordering::SeqCst);
                eprintln!("vm-driver: cannot start a pooled VM: {}", vm_contract::logs::chain(&e));
                let _ = std::fs::remove_dir_all(layout.dir());
                drop(share);
                self.snapshot_failed(target, &start);
                self.boot_failed(target);
                return;
            }
        };
        let (claims_tx, claims_rx) = mpsc::channel(1);
        let supervisor_pid = running.supervisor_pid().unwrap_or(0);
        let run = slot::run(Arc::clone(self), id.clone(), (running, share, turn), claims_rx, self.closing.subscribe());
        let task = tokio::spawn(run);
        let mut state = self.lock();
        state.slots.push(Slot { id, target, start, state: SlotState::Booting, supervisor_pid, claims: claims_tx });
        state.tasks.retain(|t| !t.is_finished());
        state.tasks.push(task);
        self.starting.fetch_sub(1, Ordering::SeqCst);
    }

    /// `target`'s image root, pulled on its first slot (a failure is said, and backs the target off).
    async fn target_root(&self, target: usize, key: &PoolKey) -> Result<Option<vm_contract::root::RootImage>, ()> {
        let Some(reference) = key.root.clone() else { return Ok(None) };
        if let Some(root) = self.lock().targets[target].root.clone() {
            return Ok(Some(root));
        }
        let oci = self.ctx.oci.clone();
        let disk_mib = vm_contract::root::DEFAULT_DISK_MIB;
        let got = tokio::task::spawn_blocking(move || oci.root(&reference, disk_mib, &mut vm_oci::pull::Quiet)).await;
        match got {
            Ok(Ok(root)) => {
                self.lock().targets[target].root = Some(root.clone());
                Ok(Some(root))
            }
            Ok(Err(e)) => {
                eprintln!("vm-driver: warm pool: {}", vm_contract::logs::chain(&e));
                Err(())
            }
            Err(_) => Err(()),
        }
    }

    /// How the next slot of `target` (`id`) comes up: booted, restored, or booted to save the snapshot.
    fn pooled_start(&self, target: usize, id: &SandboxId) -> PooledStart {
        let snapshot = self.lock().targets[target].snapshot.clone();
        match snapshot {
            Snapshot::Off => PooledStart::Boot,
            Snapshot::Ready(dir) => PooledStart::Restore(dir),
            Snapshot::Wanted => {
                let dir = self.ctx.state.snapshots_dir().join(id.as_str());
                match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                    Ok(()) => PooledStart::Save(dir),
                    // Counted like a failed save: two in a row and the target boots.
                    Err(_) => {
                        self.snapshot_failed(target, &PooledStart::Save(dir));
                        PooledStart::Boot
                    }
                }
            }
        }
    }

    /// Whether slot `id` boots to save its target's snapshot.
    fn saves(&self, id: &SandboxId) -> bool {
        self.lock().slots.iter().any(|s| s.id == *id && matches!(s.start, PooledStart::Save(_)))
    }

    /// A slot saved its target's snapshot (and ended).
    fn snapshot_saved(&self, id: &SandboxId, bytes: u64) {
        let mut state = self.lock();
        let State { targets, slots, .. } = &mut *state;
        let Some(slot) = slots.iter().find(|s| s.id == *id) else { return };
        if let (PooledStart::Save(dir), Some(t)) = (&slot.start, targets.get_mut(slot.target)) {
            eprintln!("vm-driver: warm pool: saved a snapshot of a pooled VM ({bytes} bytes); restoring from it");
            t.snapshot = Snapshot::Ready(dir.clone());
            t.snapshot_failures = 0;
        }
    }

    /// A save or restore failed: try again, or after [`SNAPSHOT_ATTEMPTS`] boot instead.
    fn snapshot_failed(&self, target: usize, start: &PooledStart) {
        if *start == PooledStart::Boot {
            return;
        }
        let mut removed = Vec::new();
        {
            let mut state = self.lock();
            let Some(t) = state.targets.get_mut(target) else { return };
            t.snapshot_failures += 1;
            if let PooledStart::Save(dir) = start {
                removed.push(dir.clone());
                t.snapshot = Snapshot::Wanted;
            }
            if t.snapshot_failures >= SNAPSHOT_ATTEMPTS {
                if let Snapshot::Ready(dir) = &t.snapshot {
                    removed.push(dir.clone());
                }
                eprintln!(
                    "vm-driver: warm pool: snapshots failed {SNAPSHOT_ATTEMPTS} times in a row; booting pooled VMs"
                );
                t.snapshot = Snapshot::Off;
            }
        }
        // Outside the lock: a snapshot is about 100 MB.
        for dir in removed {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    fn boot_failed(&self, target: usize) {
        let mut state = self.lock();
        let Some(t) = state.targets.get_mut(target) else { return };
        let backoff = FIRST_BACKOFF.saturating_mul(1 << t.failures.min(5)).min(MAX_BACKOFF);
        t.failures += 1;
        t.retry_at = Some(tokio::time::Instant::now() + backoff);
    }

    /// The slot's VM is ready to be claimed.
    fn slot_ready(&self, id: &SandboxId, vmm_pid: u32) {
        let mut state = self.lock();
        let State { targets, slots, .. } = &mut *state;
        if let Some(slot) = slots.iter_mut().find(|s| s.id == *id) {
            slot.state = SlotState::Ready { vmm_pid };
            if let Some(t) = targets.get_mut(slot.target) {
                (t.failures, t.retry_at) = (0, None);
                if matches!(slot.start, PooledStart::Restore(_)) {
                    t.snapshot_failures = 0;
                }
            }
        }
        drop(state);
        self.wake.notify_one();
    }

    /// The slot ended unclaimed (its VM failed, died or was stopped); its share is already given back.
    fn slot_gone(&self, id: &SandboxId, booted: bool) {
        let mut state = self.lock();
        let slot = state.slots.iter().position(|s| s.id == *id).map(|i| state.slots.remove(i));
        drop(state);
        if let (Some(slot), false) = (slot, booted) {
            self.snapshot_failed(slot.target, &slot.start);
            self.boot_failed(slot.target);
        }
        self.wake.notify_one();
    }
}

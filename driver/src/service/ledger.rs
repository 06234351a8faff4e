//! The admission ledger: what the sandboxes and pooled VMs hold of the host. Each holder keeps a [`Share`],
//! which gives its room back when dropped, so no path can forget to; a VM that boots holds a [`BootTurn`]
//! until its guest answers.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use vm_contract::shape::SandboxShape;

use super::admission::{self, Limits, Refused, Usage};

/// What is held, against the limits.
#[derive(Debug)]
pub struct Ledger {
    limits: Limits,
    used: Mutex<Usage>,
    /// Turns to boot, in the order they were asked for.
    boots: Arc<Semaphore>,
}

/// A turn to boot. At most [`Limits::boots`] VMs boot at once: ten boots started together on a two-core host
/// would each get a fifth of a core and all miss their boot timeout, where taking turns boots every one.
/// Dropping it lets the next boot begin.
#[derive(Debug)]
#[must_use = "dropping a turn lets the next boot begin at once"]
pub struct BootTurn(#[allow(dead_code, reason = "held, not read")] Option<OwnedSemaphorePermit>);

/// One sandbox's or pooled VM's room on the host, held until dropped.
#[derive(Debug)]
#[must_use = "dropping a share gives its room back at once"]
pub struct Share {
    ledger: Arc<Ledger>,
    shape: SandboxShape,
    pooled: bool,
}

impl Ledger {
    /// Nothing held yet.
    pub fn new(limits: Limits) -> Arc<Self> {
        let boots = Arc::new(Semaphore::new(limits.boots.max(1) as usize));
        Arc::new(Self { limits, used: Mutex::new(Usage::default()), boots })
    }

    /// A turn to boot if one is free now and nobody waits for one.
    pub fn try_boot_turn(&self) -> Option<BootTurn> {
        Arc::clone(&self.boots).try_acquire_owned().ok().map(|permit| BootTurn(Some(permit)))
    }

    /// Waits for a turn to boot (first asked, first served). Safe to cancel; a kept future keeps its place.
    pub fn boot_turn(&self) -> impl std::future::Future<Output = BootTurn> + Send + 'static {
        let boots = Arc::clone(&self.boots);
        // The semaphore is never closed; were it, the boot would go ahead without a turn.
        async move { BootTurn(boots.acquire_owned().await.ok()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Usage> {
        self.used.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What is held now.
    pub fn usage(&self) -> Usage {
        *self.lock()
    }

    /// A sandbox's share, if `shape` fits beside everything held.
    ///
    /// # Errors
    /// [`Refused`]: the first limit it would pass.
    pub fn admit(self: &Arc<Self>, shape: SandboxShape) -> Result<Share, Refused> {
        self.take(shape, false)
    }

    /// A pooled VM's share, if `shape` fits beside everything held.
    ///
    /// # Errors
    /// [`Refused`].
    pub fn admit_pooled(self: &Arc<Self>, shape: SandboxShape) -> Result<Share, Refused> {
        self.take(shape, true)
    }

    /// A share held already: a sandbox restored at start-up was admitted before, and is not refused now.
    pub fn hold(self: &Arc<Self>, shape: SandboxShape) -> Share {
        let mut used = self.lock();
        used.add(shape);
        Share { ledger: Arc::clone(self), shape, pooled: false }
    }

    fn take(self: &Arc<Self>, shape: SandboxShape, pooled: bool) -> Result<Share, Refused> {
        let mut used = self.lock();
        admission::admit(*used, &self.limits, shape)?;
        used.add(shape);
        used.pooled += u32::from(pooled);
        Ok(Share { ledger: Arc::clone(self), shape, pooled })
    }
}

impl Share {
    /// A pooled VM's share, taken over by the sandbox that claimed it: a claim never needs room a cold boot
    /// would.
    pub fn claimed(mut self) -> Self {
        if self.pooled {
            let mut used = self.ledger.lock();
            used.pooled = used.pooled.saturating_sub(1);
            self.pooled = false;
        }
        self
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut used = self.ledger.lock();
        used.remove(self.shape);
        if self.pooled {
            used.pooled = used.pooled.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::admission::AdmissionConfig;

    fn shape(cpus: u32, mib: u32) -> SandboxShape {
        SandboxShape::new(cpus, mib).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn shares_are_refused_past_a_limit_and_give_back_on_drop() {
        let config = AdmissionConfig { max_sandboxes: 2, ..Default::default() };
        let ledger = Ledger::new(Limits::new(&config, 4, 8192));
        let first = ledger.admit(shape(1, 128));
        let pooled = ledger.admit_pooled(shape(1, 128));
        assert!(first.is_ok() && pooled.is_ok());
        assert_eq!(ledger.usage().pooled, 1);
        assert!(matches!(ledger.admit(shape(1, 128)), Err(Refused::Sandboxes { limit: 2 })));
        drop(first);
        assert_eq!(ledger.usage().sandboxes, 1);
        let claimed = pooled.map(Share::claimed);
        assert_eq!((ledger.usage().sandboxes, ledger.usage().pooled), (1, 0));
        drop(claimed);
        assert_eq!(ledger.usage(), Usage::default());
    }

    #[tokio::test]
    async fn boots_take_turns_in_the_order_asked() {
        let config = AdmissionConfig { max_boots: 2, ..Default::default() };
        let ledger = Ledger::new(Limits::new(&config, 4, 8192));
        let (first, second) = (ledger.boot_turn().await, ledger.boot_turn().await);
        assert!(ledger.try_boot_turn().is_none(), "two boot already");
        let mut third = Box::pin(ledger.boot_turn());
        let mut fourth = Box::pin(ledger.boot_turn());
        assert!(futures_poll_once(&mut third).await.is_none(), "two boot already");
        drop(first);
        let third = futures_poll_once(&mut third).await;
        assert!(third.is_some(), "the first turn given back goes to the first waiting");
        assert!(futures_poll_once(&mut fourth).await.is_none());
        drop(second);
        assert!(ledger.try_boot_turn().is_none(), "the one waiting comes first");
        let fourth = futures_poll_once(&mut fourth).await;
        assert!(fourth.is_some());
        drop((third, fourth));
        assert!(ledger.try_boot_turn().is_some());
    }

    /// Polls `f` once: `Some` if it was ready.
    async fn futures_poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        tokio::select! {
            biased;
            out = f => Some(out),
            () = std::future::ready(()) => None,
        }
    }

    #[test]
    fn a_held_share_is_never_refused_but_counts() {
        let config = AdmissionConfig { max_sandboxes: 1, ..Default::default() };
        let ledger = Ledger::new(Limits::new(&config, 4, 8192));
        let _a = ledger.hold(shape(1, 128));
        let _b = ledger.hold(shape(1, 128));
        assert_eq!(ledger.usage().sandboxes, 2);
        assert!(matches!(ledger.admit(shape(1, 128)), Err(Refused::Sandboxes { limit: 1 })));
    }
}

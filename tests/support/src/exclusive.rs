//! Tests that must have the machine to themselves.
//!
//! The tests of an area share one test binary, run two at a time (`scripts/test`: `--test-threads 2`). A
//! test that brings its own load (CPU hogs, dozens of VMs) or that times what it sees to the millisecond
//! would measure its neighbour too, and its load would break the neighbour's bounds. Such a test calls
//! [`alone`] first thing: it waits until no other test of the process holds a [`Scratch`], and no other
//! test can make one until it is done. Every other test shares the machine through its [`Scratch`], which
//! takes its share when it is made and gives it back when it is dropped.
//!
//! A test makes its scratch directories on its own thread (the one the test harness runs it on), and a
//! test that runs alone makes them after [`alone`] returns; they take no share from itself.
//!
//! [`Scratch`]: crate::Scratch

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

#[derive(Debug)]
struct Gate {
    /// The test running alone.
    alone: Option<ThreadId>,
    /// Tests waiting to run alone: new shares wait behind them, so that they are not starved.
    waiting: usize,
    /// The shares held, by the thread that took them.
    shares: Vec<(ThreadId, usize)>,
}

static GATE: Mutex<Gate> = Mutex::new(Gate { alone: None, waiting: 0, shares: Vec::new() });
static CHANGED: Condvar = Condvar::new();

fn gate() -> MutexGuard<'static, Gate> {
    GATE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn wait(guard: MutexGuard<'static, Gate>) -> MutexGuard<'static, Gate> {
    CHANGED.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

/// A test's share of the machine, held by its [`Scratch`](crate::Scratch).
#[derive(Debug)]
pub(crate) struct Share {
    owner: ThreadId,
}

/// Takes a share, waiting while another test runs alone; and while one waits to, unless this thread holds a
/// share already (the test that waits, waits for it: it must be let finish).
pub(crate) fn share() -> Share {
    let me = std::thread::current().id();
    let mut gate = gate();
    loop {
        let holds = gate.shares.iter().any(|(t, _)| *t == me);
        let blocked = match gate.alone {
            Some(t) => t != me,
            None => gate.waiting > 0 && !holds,
        };
        if !blocked {
            break;
        }
        gate = wait(gate);
    }
    match gate.shares.iter_mut().find(|(t, _)| *t == me) {
        Some((_, n)) => *n += 1,
        None => gate.shares.push((me, 1)),
    }
    Share { owner: me }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut gate = gate();
        if let Some(at) = gate.shares.iter().position(|(t, _)| *t == self.owner) {
            gate.shares[at].1 -= 1;
            if gate.shares[at].1 == 0 {
                gate.shares.swap_remove(at);
            }
        }
        drop(gate);
        CHANGED.notify_all();
    }
}

/// The machine, held by one test until dropped.
#[derive(Debug)]
#[must_use = "the test runs alone only while this is held"]
pub struct Alone(());

/// Waits until no other test of this process holds a scratch directory, then keeps every other test from
/// making one until the returned guard is dropped.
///
/// # Panics
///
/// If this thread already holds a scratch directory: it would wait for itself.
pub fn alone() -> Alone {
    let me = std::thread::current().id();
    let mut gate = gate();
    assert!(
        !gate.shares.iter().any(|(t, _)| *t == me),
        "exclusive::alone() must come before the test makes its Scratch"
    );
    gate.waiting += 1;
    while gate.alone.is_some() || !gate.shares.is_empty() {
        gate = wait(gate);
    }
    gate.waiting -= 1;
    gate.alone = Some(me);
    Alone(())
}

impl Drop for Alone {
    fn drop(&mut self) {
        gate().alone = None;
        CHANGED.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_test_alone_waits_for_the_shares_and_holds_off_new_ones() {
        let first = share();
        let running_alone = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&running_alone);
        let lone = std::thread::spawn(move || {
            let held = alone();
            flag.store(true, Ordering::SeqCst);
            // Its own scratch directories take no share from it.
            let own = share();
            std::thread::sleep(Duration::from_millis(200));
            flag.store(false, Ordering::SeqCst);
            drop(own);
            drop(held);
        });
        std::thread::sleep(Duration::from_millis(100));
        assert!(!running_alone.load(Ordering::SeqCst), "alone() waited for the share held");
        drop(first);
        // A new share waits behind the test that runs alone, however soon it asks.
        while !running_alone.load(Ordering::SeqCst) && !lone.is_finished() {
            std::thread::yield_now();
        }
        let late = share();
        assert!(!running_alone.load(Ordering::SeqCst), "a share was taken while a test ran alone");
        drop(late);
        lone.join().unwrap();
    }

    #[test]
    fn a_test_that_holds_a_share_gets_another_while_one_waits_to_run_alone() {
        let first = share();
        let waiting = std::thread::spawn(|| drop(alone()));
        while gate().waiting == 0 {
            std::thread::yield_now();
        }
        // Its second scratch directory: waiting behind the test that waits for it would never end.
        let second = share();
        drop((first, second));
        waiting.join().unwrap();
    }
}

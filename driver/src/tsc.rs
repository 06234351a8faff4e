//! The host's TSC rate, for guests under TCG.
//!
//! QEMU's emulated TSC runs at the host's rate, while a TCG guest's kernel must be told a rate up front
//! (`tsc_early_khz`: without it the boot stalls calibrating). Told a wrong one, the guest keeps time that much
//! too fast or too slow: 1.3 times too fast on a 2.6 GHz host told 2 GHz, measured (`launch.rs`
//! `a_guest_keeps_the_hosts_time`). So the driver measures the rate once and hands it to every supervisor.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long the measure takes: a 2 GHz TSC counts 20 million ticks, against a bracket of a microsecond.
const SPAN: Duration = Duration::from_millis(10);

/// The host's TSC rate in kHz, measured once per process; `None` where the TSC is not invariant (its
/// rate would change under the guest) or the host is not x86-64.
pub fn khz() -> Option<u32> {
    static KHZ: OnceLock<Option<u32>> = OnceLock::new();
    *KHZ.get_or_init(measure)
}

fn measure() -> Option<u32> {
    if !invariant(&std::fs::read_to_string("/proc/cpuinfo").ok()?) {
        return None;
    }
    let (start, ticks0) = paired()?;
    std::thread::sleep(SPAN);
    let (end, ticks1) = paired()?;
    let khz = ticks1.checked_sub(ticks0)? as f64 / end.duration_since(start).as_secs_f64() / 1e3;
    // Plausible TSCs only (0.1 to 100 GHz): anything else is a broken measure, and the guest keeps its default.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "within 1e5..1e8")]
    let khz = (1e5..1e8).contains(&khz).then(|| khz.round() as u32);
    khz
}

/// Whether `/proc/cpuinfo` says the TSC runs at one rate, whatever the CPU's frequency or sleep state.
fn invariant(cpuinfo: &str) -> bool {
    let Some(flags) = cpuinfo.lines().find(|l| l.starts_with("flags")) else { return false };
    ["constant_tsc", "nonstop_tsc"].iter().all(|f| flags.split_whitespace().any(|w| w == *f))
}

/// An instant and the TSC at it: the reading of the clock bracketed most tightly by two TSC reads of five.
fn paired() -> Option<(Instant, u64)> {
    (0..5)
        .filter_map(|_| {
            let before = rdtsc()?;
            let now = Instant::now();
            let after = rdtsc()?;
            Some((after.checked_sub(before)?, now, before + (after - before) / 2))
        })
        .min_by_key(|(bracket, ..)| *bracket)
        .map(|(_, now, ticks)| (now, ticks))
}

#[cfg(target_arch = "x86_64")]
fn rdtsc() -> Option<u64> {
    // SAFETY: RDTSC reads a counter into registers and touches no memory; every x86-64 CPU has it. The
    // intrinsic is an `unsafe fn` and no safe crate in the tree wraps it.
    Some(unsafe { core::arch::x86_64::_rdtsc() })
}

#[cfg(not(target_arch = "x86_64"))]
fn rdtsc() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_invariant_tsc_counts() {
        assert!(invariant("processor : 0\nflags\t\t: fpu tsc constant_tsc nonstop_tsc rdtscp\n"));
        assert!(!invariant("flags\t\t: fpu tsc constant_tsc\n"), "stops in deep sleep");
        assert!(!invariant("flags\t\t: fpu tsc nonstop_tsc_s3 constant_tsc\n"), "whole words only");
        assert!(!invariant("processor : 0\n"));
    }

    #[test]
    fn this_host_is_measured_when_its_tsc_is_invariant_and_the_measure_is_stable() {
        let here = invariant(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default());
        let first = measure();
        assert_eq!(first.is_some(), here && cfg!(target_arch = "x86_64"), "{first:?}");
        if let (Some(first), Some(again)) = (first, measure()) {
            let drift = (f64::from(first) - f64::from(again)).abs() / f64::from(first);
            assert!(drift < 0.01, "{first} kHz, then {again} kHz");
            eprintln!("host TSC: {first} kHz");
        }
        assert_eq!(khz(), khz(), "measured once");
    }
}

//! Switches that turn a safety mechanism off, for the causal tests' controls. Compiled only with the
//! `test-controls` feature, which `scripts/test` enables and release builds never do.

/// Comma-separated switch names.
pub const VAR: &str = "VM_TEST_CONTROL";

/// Whether switch `name` is on.
pub fn enabled(name: &str) -> bool {
    std::env::var(VAR).is_ok_and(|v| v.split(',').any(|s| s == name))
}

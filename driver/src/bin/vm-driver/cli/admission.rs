//! `serve`'s admission limits: what it may hand out of this host.

use clap::Args;
use vm_driver::service::admission::AdmissionConfig;

/// How much of the host `serve` may hand out, and how many VMs boot at once.
#[derive(Debug, Args)]
pub struct AdmissionArgs {
    /// Most sandboxes holding resources at once.
    #[arg(long, value_name = "N", default_value_t = AdmissionConfig::default().max_sandboxes)]
    pub max_sandboxes: u32,
    /// vCPUs admitted per host core.
    #[arg(long, value_name = "RATIO", value_parser = positive_ratio, default_value_t = AdmissionConfig::default().cpu_overcommit)]
    pub cpu_overcommit: f64,
    /// Guest memory (plus a fixed overhead per sandbox) admitted per byte of host memory.
    #[arg(long, value_name = "RATIO", value_parser = positive_ratio, default_value_t = AdmissionConfig::default().memory_overcommit)]
    pub memory_overcommit: f64,
    /// Most Exec streams open at once, in all.
    #[arg(long, value_name = "N", default_value_t = AdmissionConfig::default().max_exec_streams)]
    pub max_exec_streams: u32,
    /// Most Exec streams open at once into one sandbox.
    #[arg(long, value_name = "N", default_value_t = AdmissionConfig::default().max_exec_per_sandbox)]
    pub max_exec_per_sandbox: u32,
    /// Most VMs booting at once, cold or pooled; the others wait their turn, so that each boot has the CPU
    /// its --boot-timeout assumes (0: two per host core).
    #[arg(long, value_name = "N", default_value_t = AdmissionConfig::default().max_boots)]
    pub max_boots: u32,
}

impl AdmissionArgs {
    /// What `serve` may admit.
    pub fn config(&self) -> AdmissionConfig {
        AdmissionConfig {
            max_sandboxes: self.max_sandboxes,
            cpu_overcommit: self.cpu_overcommit,
            memory_overcommit: self.memory_overcommit,
            max_exec_streams: self.max_exec_streams,
            max_exec_per_sandbox: self.max_exec_per_sandbox,
            max_boots: self.max_boots,
        }
    }
}

/// A ratio above zero (an overcommit of 0 would refuse everything).
fn positive_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err("a number above 0 (1.0 means no overcommit)".into()),
    }
}

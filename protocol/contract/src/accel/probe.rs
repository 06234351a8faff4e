//! Choosing the accelerator honestly: the supervisor's choice, and `vm-driver doctor`'s report of it.
//!
//! `auto` uses KVM only where KVM can boot a stock guest kernel. A host whose `/dev/kvm` comes from the
//! `kvm_pvm` module (pagetable-based nested virtualization) runs only PVM-built guest kernels: a stock
//! kernel spins in firmware forever. There, and wherever `/dev/kvm` is missing or not ours to open, `auto`
//! falls back to TCG and says why. `kvm` never falls back: it fails with the same reason.

use std::fs::OpenOptions;
use std::io;
use std::path::PathBuf;

use super::{AccelChoice, Accelerator};

/// Why KVM cannot be used here.
#[derive(Debug, thiserror::Error)]
pub enum KvmUnusable {
    /// No device node.
    #[error("{} does not exist (no KVM on this host)", path.display())]
    Missing {
        /// The device path probed.
        path: PathBuf,
    },
    /// The node exists but cannot be opened read-write.
    #[error("cannot open {} read-write", path.display())]
    NoAccess {
        /// The device path probed.
        path: PathBuf,
        /// The open error.
        #[source]
        source: io::Error,
    },
    /// KVM is the PVM flavour, which boots only PVM guest kernels.
    #[error("/dev/kvm is provided by kvm_pvm, which cannot boot a stock guest kernel")]
    PvmOnly,
}

/// Where the probe looks; tests point it at a fake tree.
#[derive(Debug, Clone)]
pub struct Host {
    /// The KVM device node.
    pub kvm_device: PathBuf,
    /// `/sys/module`.
    pub sys_module: PathBuf,
}

impl Default for Host {
    fn default() -> Self {
        Self { kvm_device: "/dev/kvm".into(), sys_module: "/sys/module".into() }
    }
}

impl Host {
    /// Whether KVM here can boot a stock guest, and if not, why.
    ///
    /// # Errors
    /// The reason KVM is unusable.
    pub fn probe_kvm(&self) -> Result<(), KvmUnusable> {
        if !self.kvm_device.exists() {
            return Err(KvmUnusable::Missing { path: self.kvm_device.clone() });
        }
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.kvm_device)
            .map_err(|source| KvmUnusable::NoAccess { path: self.kvm_device.clone(), source })?;
        let loaded = |m: &str| self.sys_module.join(m).exists();
        if loaded("kvm_pvm") && !loaded("kvm_intel") && !loaded("kvm_amd") {
            return Err(KvmUnusable::PvmOnly);
        }
        Ok(())
    }

    /// Resolves a choice to an accelerator. `Ok((Tcg, Some(reason)))` is `auto` falling back.
    ///
    /// # Errors
    /// `kvm` was asked for and cannot be used.
    pub fn choose(&self, choice: AccelChoice) -> Result<(Accelerator, Option<KvmUnusable>), KvmUnusable> {
        match choice {
            AccelChoice::Tcg => Ok((Accelerator::Tcg, None)),
            AccelChoice::Kvm => self.probe_kvm().map(|()| (Accelerator::Kvm, None)),
            AccelChoice::Auto => match self.probe_kvm() {
                Ok(()) => Ok((Accelerator::Kvm, None)),
                Err(why) => Ok((Accelerator::Tcg, Some(why))),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn fake(name: &str, modules: &[&str], device: bool) -> Host {
        let root = std::env::temp_dir().join(format!("accel-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("module")).unwrap();
        for m in modules {
            fs::create_dir_all(root.join("module").join(m)).unwrap();
        }
        if device {
            fs::write(root.join("kvm"), b"").unwrap();
        }
        Host { kvm_device: root.join("kvm"), sys_module: root.join("module") }
    }

    #[test]
    fn auto_falls_back_on_a_pvm_only_host() {
        let host = fake("pvm", &["kvm", "kvm_pvm"], true);
        let (accel, why) = host.choose(AccelChoice::Auto).unwrap();
        assert_eq!(accel, Accelerator::Tcg);
        assert!(matches!(why, Some(KvmUnusable::PvmOnly)));
        assert!(matches!(host.choose(AccelChoice::Kvm), Err(KvmUnusable::PvmOnly)));
    }

    #[test]
    fn auto_uses_real_kvm() {
        let host = fake("vmx", &["kvm", "kvm_intel"], true);
        assert_eq!(host.choose(AccelChoice::Auto).unwrap().0, Accelerator::Kvm);
        let host = fake("both", &["kvm", "kvm_amd", "kvm_pvm"], true);
        assert_eq!(host.choose(AccelChoice::Kvm).unwrap().0, Accelerator::Kvm);
    }

    #[test]
    fn no_device_means_tcg_or_a_clear_error() {
        let host = fake("none", &[], false);
        assert!(matches!(host.choose(AccelChoice::Auto).unwrap().1, Some(KvmUnusable::Missing { .. })));
        assert!(matches!(host.choose(AccelChoice::Kvm), Err(KvmUnusable::Missing { .. })));
        assert!(matches!(host.choose(AccelChoice::Tcg), Ok((Accelerator::Tcg, None))));
    }
}

//! Where the binaries and the guest image are, and which accelerator the tests ask for.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use vm_contract::test_control::TestControl;

/// The binaries of one build.
#[derive(Debug)]
pub struct Binaries {
    pub driver: PathBuf,
    pub supervisor: PathBuf,
}

impl Binaries {
    fn at(dir: &Path, what: &str) -> Self {
        let bins = Self { driver: dir.join("vm-driver"), supervisor: dir.join("vm-supervisor") };
        for bin in [&bins.driver, &bins.supervisor, &dir.join("vm-watchdog"), &dir.join("vm-jailer")] {
            assert!(bin.is_file(), "{} ({what}) is missing: run scripts/test, which builds it first", bin.display());
        }
        bins
    }

    /// A copy of this build in `dir` (created, mode 0755 like the binaries), for a test that runs it as
    /// another user: the build may lie where that user cannot reach it (root's home is 0700). The driver
    /// finds its supervisor, and the supervisor its watchdog and jailer, next to itself, so all four go.
    pub fn copied_to(&self, dir: &Path) -> Self {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let from = self.driver.parent().unwrap();
        for name in ["vm-driver", "vm-supervisor", "vm-watchdog", "vm-jailer"] {
            std::fs::copy(from.join(name), dir.join(name)).unwrap();
            std::fs::set_permissions(dir.join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        Self { driver: dir.join("vm-driver"), supervisor: dir.join("vm-supervisor") }
    }
}

/// Where the binaries and the image are, and which accelerator the tests ask for.
#[derive(Debug)]
pub struct Harness {
    /// `cargo build --release`: exactly what `scripts/install` ships. Every test runs these, unless it is
    /// a control or injects a fault.
    pub shipped: Binaries,
    /// The debug build with the `test-controls` features (`target/debug`), which announces itself at every
    /// start: only for the causal tests' controls and for fault injection.
    pub controls: Binaries,
    pub image: PathBuf,
    /// `auto`, `kvm` or `tcg`, from `VM_TEST_ACCEL` (default `auto`). CI on KVM runners sets `kvm`.
    pub accel: String,
}

impl Harness {
    /// The build that runs with `controls` set: the shipped one when there are none.
    pub fn build(&self, controls: &[TestControl]) -> &Binaries {
        if controls.is_empty() {
            &self.shipped
        } else {
            &self.controls
        }
    }
}

/// The shared harness; the first call checks that everything exists. It reads the environment the test
/// run was started with (`VM_TEST_ACCEL`, `VM_DRIVER_IMAGE`), never anything a test sets.
pub fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        // target/<profile>/deps/<test-binary> -> target/
        let exe = std::env::current_exe().unwrap();
        let target = exe.ancestors().nth(3).unwrap().to_owned();
        let shipped = Binaries::at(&target.join("release"), "the release build");
        let controls = Binaries::at(&target.join("debug"), "the test-controls build");
        // Where the driver itself looks by default (VM_DRIVER_IMAGE, else the build-image cache).
        let image = vm_driver::image::default_dir().expect("no default image directory: set HOME or VM_DRIVER_IMAGE");
        for file in ["vmlinuz", "initramfs.cpio"] {
            assert!(
                image.join(file).is_file(),
                "guest image {} is missing {file}: run scripts/build-image (scripts/test does)",
                image.display()
            );
        }
        let accel = std::env::var("VM_TEST_ACCEL").unwrap_or_else(|_| "auto".into());
        assert!(["auto", "kvm", "tcg"].contains(&accel.as_str()), "VM_TEST_ACCEL must be auto, kvm or tcg");
        Harness { shipped, controls, image, accel }
    })
}

/// The environment that switches `controls` on.
pub fn control_env(controls: &[TestControl]) -> Option<(&'static str, String)> {
    (!controls.is_empty())
        .then(|| (vm_contract::test_control::VAR, controls.iter().map(|c| c.name()).collect::<Vec<_>>().join(",")))
}

/// The repository's root: scripts (`scripts/test-image`), the tests' Python servers (`tests/python/`), the
/// OCSF extract (`tests/ocsf-1.8.0/`), the guest build (`target/guest/`).
pub fn repo() -> &'static Path {
    // This crate is tests/support/.
    Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2).expect("tests/support/ lies in the repository")
}

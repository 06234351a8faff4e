//! The Debian test image (`scripts/test-image`: python3, pip, curl and git; built by mmdebstrap, made an OCI
//! layout by umoci), and one image store per test process with it imported once.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use crate::registry::run;

/// The image's OCI layout (tag `py`), built once per cache key.
pub fn layout() -> &'static Path {
    static LAYOUT: OnceLock<PathBuf> = OnceLock::new();
    LAYOUT.get_or_init(|| {
        let script = crate::repo().join("scripts/test-image");
        PathBuf::from(run(&mut Command::new(script)).trim().lines().last().unwrap())
    })
}

/// `oci:LAYOUT:py`.
pub fn layout_ref() -> String {
    format!("oci:{}:py", layout().display())
}

/// One store for the tests of this process that boot the image, the image imported into it once.
pub fn shared_store() -> &'static Path {
    static STORE: OnceLock<PathBuf> = OnceLock::new();
    STORE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("e2e-image-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        import_into(&dir);
        dir
    })
}

/// Imports the image into the store at `dir` with the shipped driver.
pub fn import_into(dir: &Path) {
    let started = Instant::now();
    let out = Command::new(&crate::harness().shipped.driver)
        .args(["image", "import", "--image-cache"])
        .arg(dir)
        .arg(layout_ref())
        .output()
        .unwrap();
    assert!(out.status.success(), "import {}: {}", layout().display(), String::from_utf8_lossy(&out.stderr));
    eprintln!("e2e: imported the Debian test image in {:.1} s", started.elapsed().as_secs_f64());
}

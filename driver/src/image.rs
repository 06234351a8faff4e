//! Which guest image to boot: a directory with `vmlinuz` and `initramfs.cpio` (what `scripts/build-image`
//! produces), or an explicit kernel and initramfs.

use std::path::{Path, PathBuf};

/// File names inside an image directory.
pub const KERNEL_FILE: &str = "vmlinuz";
/// The initramfs inside an image directory.
pub const INITRD_FILE: &str = "initramfs.cpio";

/// A kernel and an initramfs that exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// Guest kernel.
    pub kernel: PathBuf,
    /// Guest initramfs.
    pub initrd: PathBuf,
}

/// Why no image could be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A file is missing.
    #[error("guest {what} not found at {}{hint}", path.display())]
    Missing {
        /// `kernel` or `initramfs`.
        what: &'static str,
        /// Where it should be.
        path: PathBuf,
        /// How to get one, when the default image is missing.
        hint: &'static str,
    },
    /// No default location could be worked out.
    #[error("no default image location: neither XDG_CACHE_HOME nor HOME is set; pass --image")]
    NoDefault,
}

const BUILD_HINT: &str = " (build the default image with scripts/build-image, or pass --image DIR)";

/// The default image directory: `$VM_DRIVER_IMAGE`, else `$XDG_CACHE_HOME/vm-driver/images/default`, else
/// `$HOME/.cache/vm-driver/images/default`.
///
/// # Errors
/// [`ImageError::NoDefault`] when none of those variables is set.
pub fn default_dir() -> Result<PathBuf, ImageError> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("VM_DRIVER_IMAGE") {
        return Ok(dir);
    }
    let cache = var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache"))).ok_or(ImageError::NoDefault)?;
    Ok(cache.join("vm-driver/images/default"))
}

/// Resolves `--image`, `--kernel` and `--initrd` (the last two win) and checks the files exist.
///
/// # Errors
/// [`ImageError`] naming the missing file.
pub fn resolve(dir: Option<&Path>, kernel: Option<&Path>, initrd: Option<&Path>) -> Result<Image, ImageError> {
    let is_default = dir.is_none();
    let dir = match dir {
        Some(d) => d.to_owned(),
        None if kernel.is_some() && initrd.is_some() => PathBuf::new(),
        None => default_dir()?,
    };
    let hint = if is_default { BUILD_HINT } else { "" };
    let kernel = kernel.map_or_else(|| dir.join(KERNEL_FILE), Path::to_owned);
    let initrd = initrd.map_or_else(|| dir.join(INITRD_FILE), Path::to_owned);
    for (what, path) in [("kernel", &kernel), ("initramfs", &initrd)] {
        if !path.is_file() {
            return Err(ImageError::Missing { what, path: path.clone(), hint });
        }
    }
    Ok(Image { kernel, initrd })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_image_names_the_file() {
        let err = resolve(Some(Path::new("/nonexistent/img")), None, None).unwrap_err();
        assert!(
            matches!(&err, ImageError::Missing { what: "kernel", path, .. } if path == Path::new("/nonexistent/img/vmlinuz"))
        );
    }

    #[test]
    fn explicit_files_win_over_the_directory() {
        let dir = std::env::temp_dir().join(format!("image-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let k = dir.join("k");
        let i = dir.join("i");
        std::fs::write(&k, b"").unwrap();
        std::fs::write(&i, b"").unwrap();
        let image = resolve(None, Some(&k), Some(&i)).unwrap();
        assert_eq!(image, Image { kernel: k, initrd: i });
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

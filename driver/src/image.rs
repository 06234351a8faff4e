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
    match std::env::var_os("VM_DRIVER_IMAGE").filter(|v| !v.is_empty()) {
        Some(dir) => Ok(PathBuf::from(dir)),
        None => Ok(cache_dir().ok_or(ImageError::NoDefault)?.join("images/default")),
    }
}

/// The driver's cache (images, the image store): `$XDG_CACHE_HOME/vm-driver`, else
/// `$HOME/.cache/vm-driver`; `None` when neither variable is set.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    Some(var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache")))?.join("vm-driver"))
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

/// The images `serve` offers: a default one, and named ones as subdirectories of a root (`<root>/<name>/`,
/// each with `vmlinuz` and `initramfs.cpio`). A sandbox names its image in its spec; an empty name is the
/// default. Names follow the sandbox-id rules, so a name is always one path component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSet {
    /// The image of a sandbox that names none.
    pub default: Image,
    /// Where named images live.
    pub root: Option<PathBuf>,
}

/// Why a named image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NamedImageError {
    /// The name is not one safe path component.
    #[error("image name: {0}")]
    Name(#[from] vm_contract::ids::SandboxIdError),
    /// No image root was configured.
    #[error("no image directory is configured (serve --images DIR), so only the default image is offered")]
    NoRoot,
    /// The image is missing or incomplete.
    #[error(transparent)]
    Missing(#[from] ImageError),
}

impl ImageSet {
    /// The image called `name` (empty: the default), checked to exist.
    ///
    /// # Errors
    /// [`NamedImageError`].
    pub fn resolve(&self, name: &str) -> Result<Image, NamedImageError> {
        if name.is_empty() {
            return Ok(self.default.clone());
        }
        let name = vm_contract::ids::SandboxId::parse(name)?;
        let root = self.root.as_ref().ok_or(NamedImageError::NoRoot)?;
        Ok(resolve(Some(&root.join(name.as_str())), None, None)?)
    }
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

    #[test]
    fn named_images_resolve_under_the_root_and_only_there() {
        let root = std::env::temp_dir().join(format!("images-test-{}", std::process::id()));
        let named = root.join("rogue");
        std::fs::create_dir_all(&named).unwrap();
        std::fs::write(named.join("vmlinuz"), b"").unwrap();
        std::fs::write(named.join("initramfs.cpio"), b"").unwrap();
        let default = Image { kernel: "/k".into(), initrd: "/i".into() };
        let set = ImageSet { default: default.clone(), root: Some(root.clone()) };
        assert_eq!(set.resolve("").unwrap(), default);
        assert_eq!(set.resolve("rogue").unwrap().kernel, named.join("vmlinuz"));
        assert!(matches!(set.resolve("../etc"), Err(NamedImageError::Name(_))));
        assert!(matches!(set.resolve("absent"), Err(NamedImageError::Missing(_))));
        let without_root = ImageSet { default, root: None };
        assert!(matches!(without_root.resolve("rogue"), Err(NamedImageError::NoRoot)));
        std::fs::remove_dir_all(&root).unwrap();
    }
}

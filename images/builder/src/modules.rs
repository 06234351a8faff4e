//! Kernel module selection: from the modules the channel needs to every module they depend on, in load
//! order. Dependencies come from each module's own `.modinfo` (`depends=a,b`), so no `modules.dep` and no
//! `modprobe` are needed in the guest.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// Why modules could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    /// No `.ko` file of that name under the kernel's module tree.
    #[error("module {name} not found under {}", tree.display())]
    NotFound {
        /// Module name.
        name: String,
        /// Where we looked.
        tree: PathBuf,
    },
    /// Reading the module tree failed.
    #[error("cannot read {}", path.display())]
    Read {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Dependencies form a cycle.
    #[error("module dependencies form a cycle at {name}")]
    Cycle {
        /// A module on the cycle.
        name: String,
    },
}

/// One module to load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// Its name (`virtio_console`).
    pub name: String,
    /// The `.ko` file.
    pub path: PathBuf,
}

/// The `depends=` list of a module file's `.modinfo`.
pub fn depends(ko: &[u8]) -> Vec<String> {
    ko.split(|b| *b == 0)
        .find_map(|field| field.strip_prefix(b"depends="))
        .map(|list| String::from_utf8_lossy(list).split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Resolves `roots` and their dependencies under `tree` (`lib/modules/<release>`), dependencies first.
///
/// # Errors
/// A missing module, an unreadable file, or a dependency cycle.
pub fn resolve(tree: &Path, roots: &[String]) -> Result<Vec<Module>, ModuleError> {
    let index = index(tree)?;
    let mut order = Vec::new();
    let mut state = BTreeMap::new();
    for root in roots {
        visit(tree, &index, root, &mut state, &mut order)?;
    }
    Ok(order)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mark {
    Visiting,
    Done,
}

fn visit(
    tree: &Path,
    index: &BTreeMap<String, PathBuf>,
    name: &str,
    state: &mut BTreeMap<String, Mark>,
    order: &mut Vec<Module>,
) -> Result<(), ModuleError> {
    match state.get(name) {
        Some(Mark::Done) => return Ok(()),
        Some(Mark::Visiting) => return Err(ModuleError::Cycle { name: name.into() }),
        None => {}
    }
    state.insert(name.into(), Mark::Visiting);
    let path =
        index.get(name).ok_or_else(|| ModuleError::NotFound { name: name.into(), tree: tree.to_owned() })?.clone();
    let bytes = fs::read(&path).map_err(|source| ModuleError::Read { path: path.clone(), source })?;
    for dep in depends(&bytes) {
        visit(tree, index, &dep, state, order)?;
    }
    state.insert(name.into(), Mark::Done);
    order.push(Module { name: name.into(), path });
    Ok(())
}

/// Module name (with `-` and `_` equivalent, as the kernel treats them) to file, for every `.ko` in `tree`.
fn index(tree: &Path) -> Result<BTreeMap<String, PathBuf>, ModuleError> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![tree.to_owned()];
    while let Some(dir) = dirs.pop() {
        let entries = fs::read_dir(&dir).map_err(|source| ModuleError::Read { path: dir.clone(), source })?;
        for entry in entries {
            let entry = entry.map_err(|source| ModuleError::Read { path: dir.clone(), source })?;
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if let Some(stem) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".ko")) {
                found.insert(stem.replace('-', "_"), path);
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_depends_from_modinfo() {
        let ko = b"\x7fELF...\0license=GPL\0depends=virtio,virtio_ring\0retpoline=Y\0name=virtio_mmio\0";
        assert_eq!(depends(ko), ["virtio", "virtio_ring"]);
        assert!(depends(b"\0depends=\0name=virtio\0").is_empty());
        assert!(depends(b"no modinfo here").is_empty());
    }

    #[test]
    fn resolves_dependencies_first_and_once() {
        let dir = std::env::temp_dir().join(format!("vm-image-modules-{}", std::process::id()));
        let sub = dir.join("kernel/drivers");
        fs::create_dir_all(&sub).unwrap();
        fs::write(sub.join("a.ko"), b"\0depends=b,c\0").unwrap();
        fs::write(sub.join("b.ko"), b"\0depends=c\0").unwrap();
        fs::write(sub.join("c.ko"), b"\0depends=\0").unwrap();
        fs::write(sub.join("d-e.ko"), b"\0depends=a\0").unwrap();
        let order = resolve(&dir, &["d_e".into(), "b".into()]).unwrap();
        let names: Vec<_> = order.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["c", "b", "a", "d_e"]);
        fs::write(sub.join("c.ko"), b"\0depends=a\0").unwrap();
        assert!(matches!(resolve(&dir, &["a".into()]), Err(ModuleError::Cycle { .. })));
        assert!(matches!(resolve(&dir, &["zzz".into()]), Err(ModuleError::NotFound { .. })));
        fs::remove_dir_all(&dir).unwrap();
    }
}

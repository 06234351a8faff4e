//! The files of one sandbox directory (`vm_contract::layout::SandboxFile`), as a test reads them from the
//! outside; `events.jsonl` has a module of its own ([`crate::events`]).

use std::path::Path;

use vm_contract::layout::SandboxFile;

/// The text of `file` in the sandbox directory `dir` (lossy UTF-8); empty while there is none.
pub fn read(dir: &Path, file: SandboxFile) -> String {
    std::fs::read(dir.join(file.name())).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
}

/// The size of `file` in the sandbox directory `dir`, in bytes; 0 while there is none.
pub fn size(dir: &Path, file: SandboxFile) -> u64 {
    std::fs::metadata(dir.join(file.name())).map_or(0, |m| m.len())
}

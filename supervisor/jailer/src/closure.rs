//! What a jailed program loads: the objects of its ELF dependency closure, read from the ELF headers
//! (never by running `ldd`, which executes what it inspects), each found where the dynamic loader will
//! look inside the jail. The jail has no `/etc`, so no `ld.so.cache`: the loader searches the object's
//! `RUNPATH` (or `RPATH`), then its built-in system directories, and so does this.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use goblin::container::Ctx;
use goblin::elf::dynamic::{Dynamic, DT_NEEDED, DT_RPATH, DT_RUNPATH};
use goblin::elf::program_header::{ProgramHeader, PT_INTERP};
use goblin::elf::Elf;
use goblin::strtab::Strtab;

/// The loader's built-in search path on Debian-style multiarch and on lib64 hosts.
const SYSTEM_DIRS: [&str; 6] =
    ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"];

/// More objects than any real program loads: a cycle or a crafted file stops here.
const MAX_OBJECTS: usize = 512;

/// Bigger than any shared object on a host; the file is never read whole, only its headers.
const MAX_FILE_BYTES: u64 = 1 << 30;

/// Why a closure could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ClosureError {
    /// A file could not be read.
    #[error("cannot read {0}")]
    Read(PathBuf, #[source] std::io::Error),
    /// A file is not an ELF object this loader understands.
    #[error("{0} is not a loadable ELF object")]
    NotElf(PathBuf),
    /// A needed library is nowhere the loader would look.
    #[error("{needed} (needed by {by}) is not in the loader's search path")]
    Missing { needed: String, by: PathBuf },
    /// More objects than [`MAX_OBJECTS`].
    #[error("more than {MAX_OBJECTS} objects in the dependency closure")]
    TooMany,
}

/// The paths the loader opens to run `program`: the program, its interpreter and every needed library,
/// as the loader names them (symlinks unresolved).
pub fn closure(program: &Path) -> Result<BTreeSet<PathBuf>, ClosureError> {
    let mut found = BTreeSet::from([program.to_path_buf()]);
    let mut names = HashSet::new();
    let mut queue = VecDeque::from([program.to_path_buf()]);
    while let Some(object) = queue.pop_front() {
        let links = Links::read(&object)?;
        let mut next = Vec::new();
        if let Some(interp) = links.interpreter {
            next.push(PathBuf::from(interp));
        }
        for needed in links.needed {
            // The loader loads a name once; a second object needing it gets the first one found.
            if !names.insert(needed.clone()) {
                continue;
            }
            let origin = object.parent().unwrap_or(Path::new("/"));
            let path = resolve(&needed, &links.search, origin)
                .ok_or_else(|| ClosureError::Missing { needed: needed.clone(), by: object.clone() })?;
            next.push(path);
        }
        for path in next {
            if found.insert(path.clone()) {
                if found.len() > MAX_OBJECTS {
                    return Err(ClosureError::TooMany);
                }
                queue.push_back(path);
            }
        }
    }
    Ok(found)
}

/// Where the loader finds `needed`: a path as given, else the first of the object's own search
/// directories (`$ORIGIN` expanded) and the system ones that holds it.
fn resolve(needed: &str, search: &[String], origin: &Path) -> Option<PathBuf> {
    if needed.contains('/') {
        return Some(PathBuf::from(needed));
    }
    let origin = origin.to_string_lossy();
    let own = search.iter().map(|dir| PathBuf::from(dir.replace("${ORIGIN}", &origin).replace("$ORIGIN", &origin)));
    own.chain(SYSTEM_DIRS.iter().map(PathBuf::from)).map(|dir| dir.join(needed)).find(|path| path.is_file())
}

/// What one object asks of the loader.
struct Links {
    interpreter: Option<String>,
    needed: Vec<String>,
    search: Vec<String>,
}

impl Links {
    /// Reads the header, program headers, interpreter, dynamic section and string table of `path`, and
    /// nothing else: into a buffer as long as the file whose other pages stay untouched zeroes.
    fn read(path: &Path) -> Result<Self, ClosureError> {
        let not_elf = || ClosureError::NotElf(path.to_path_buf());
        let file = File::open(path).map_err(|e| ClosureError::Read(path.to_path_buf(), e))?;
        let len = file.metadata().map_err(|e| ClosureError::Read(path.to_path_buf(), e))?.len();
        if len > MAX_FILE_BYTES {
            return Err(not_elf());
        }
        let mut image = Image { file: &file, path, bytes: vec![0; usize::try_from(len).map_err(|_| not_elf())?] };
        image.load(0, 64)?;
        let header = Elf::parse_header(&image.bytes).map_err(|_| not_elf())?;
        let ctx = Ctx::new(header.container().map_err(|_| not_elf())?, header.endianness().map_err(|_| not_elf())?);
        let phoff = usize::try_from(header.e_phoff).map_err(|_| not_elf())?;
        image.load(phoff, usize::from(header.e_phnum) * usize::from(header.e_phentsize))?;
        let phdrs =
            ProgramHeader::parse(&image.bytes, phoff, usize::from(header.e_phnum), ctx).map_err(|_| not_elf())?;
        let mut interpreter = None;
        for ph in &phdrs {
            let (offset, size) = range(ph.p_offset, ph.p_filesz).ok_or_else(not_elf)?;
            if ph.p_type == PT_INTERP || ph.p_type == goblin::elf::program_header::PT_DYNAMIC {
                image.load(offset, size)?;
            }
            if ph.p_type == PT_INTERP {
                let text = image.bytes.get(offset..offset + size).ok_or_else(not_elf)?;
                let text = text.split(|b| *b == 0).next().unwrap_or_default();
                interpreter = Some(std::str::from_utf8(text).map_err(|_| not_elf())?.to_owned());
            }
        }
        let Some(dynamic) = Dynamic::parse(&image.bytes, &phdrs, ctx).map_err(|_| not_elf())? else {
            // Static: nothing to load.
            return Ok(Self { interpreter, needed: Vec::new(), search: Vec::new() });
        };
        image.load(dynamic.info.strtab, dynamic.info.strsz)?;
        let strtab = Strtab::parse(&image.bytes, dynamic.info.strtab, dynamic.info.strsz, 0).map_err(|_| not_elf())?;
        let string = |value: u64| {
            let at = usize::try_from(value).map_err(|_| not_elf())?;
            strtab.get_at(at).map(str::to_owned).ok_or_else(not_elf)
        };
        let (mut needed, mut runpath, mut rpath) = (Vec::new(), Vec::new(), Vec::new());
        for entry in &dynamic.dyns {
            match entry.d_tag {
                DT_NEEDED => needed.push(string(entry.d_val)?),
                DT_RUNPATH => runpath.extend(string(entry.d_val)?.split(':').map(str::to_owned)),
                DT_RPATH => rpath.extend(string(entry.d_val)?.split(':').map(str::to_owned)),
                _ => {}
            }
        }
        // The loader ignores RPATH when RUNPATH is present.
        let search = if runpath.is_empty() { rpath } else { runpath };
        Ok(Self { interpreter, needed, search })
    }
}

/// A file's bytes, read only where asked.
struct Image<'a> {
    file: &'a File,
    path: &'a Path,
    bytes: Vec<u8>,
}

impl Image<'_> {
    fn load(&mut self, offset: usize, size: usize) -> Result<(), ClosureError> {
        let slice = offset
            .checked_add(size)
            .and_then(|end| self.bytes.get_mut(offset..end))
            .ok_or_else(|| ClosureError::NotElf(self.path.to_path_buf()))?;
        self.file.read_exact_at(slice, offset as u64).map_err(|e| ClosureError::Read(self.path.to_path_buf(), e))
    }
}

fn range(offset: u64, size: u64) -> Option<(usize, usize)> {
    Some((usize::try_from(offset).ok()?, usize::try_from(size).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The jailer's own closure, against the loader's answer for the same file (this host's `ldd`, run
    /// here on a trusted binary of the build).
    #[test]
    fn the_closure_of_a_real_binary_matches_the_loaders() {
        let program = std::env::current_exe().unwrap();
        let mine: BTreeSet<PathBuf> =
            closure(&program).unwrap().iter().map(|p| std::fs::canonicalize(p).unwrap()).collect();
        let out = std::process::Command::new("ldd").arg(&program).output().unwrap();
        let mut theirs = BTreeSet::from([std::fs::canonicalize(&program).unwrap()]);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let path = line.split("=>").nth(1).unwrap_or(line).trim().split(' ').next().unwrap_or("");
            if path.starts_with('/') {
                theirs.insert(std::fs::canonicalize(path).unwrap());
            }
        }
        assert!(theirs.len() >= 3, "a dynamic binary: {theirs:?}");
        assert_eq!(mine, theirs);
    }

    #[test]
    fn a_file_that_is_not_elf_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for bytes in [&b""[..], b"#!/bin/sh\n", b"\x7fELF\x02\x01\x01garbage"] {
            let path = dir.path().join("x");
            std::fs::write(&path, bytes).unwrap();
            assert!(matches!(closure(&path), Err(ClosureError::NotElf(_))), "{bytes:?}");
        }
    }

    #[test]
    fn a_library_nowhere_in_the_search_path_is_named() {
        let e = resolve("libvm-driver-nonexistent.so.1", &[], Path::new("/"));
        assert!(e.is_none());
    }

    proptest::proptest! {
        /// A real ELF with bytes of its headers overwritten: an error or an answer, never a panic or a
        /// read past the file.
        #[test]
        fn corrupted_headers_never_panic(edits in proptest::collection::vec((0usize..8192, proptest::num::u8::ANY), 1..16)) {
            let mut bytes = std::fs::read("/bin/true").unwrap();
            for (at, byte) in edits {
                let len = bytes.len();
                bytes[at % len] = byte;
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("object");
            std::fs::write(&path, bytes).unwrap();
            let _ = Links::read(&path);
        }
    }
}

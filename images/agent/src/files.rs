//! The files mode: the agent's own binary, started by the agent like any workload process (as the workload
//! identity, in the sandbox's root), runs one [`FileOp`] on its stdin and stdout and exits. Being a process
//! of the workload's, it can reach exactly what the workload can, and every byte it moves travels on the
//! stream machinery (credit both ways) that `exec` uses.
//!
//! Exit status 0 is success; 1 is a failure, with one line on stderr.

use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use vm_protocol::files::{FileOp, TarLayout};

/// Mode bits a written or copied file may keep: no set-id bits.
const KEPT_MODE: u32 = 0o1777;

/// Runs the op encoded in `arg` ([`FileOp::to_arg`]).
pub fn run(arg: &str) -> ExitCode {
    let Some(op) = FileOp::from_arg(arg).filter(|op| op.validate().is_ok()) else {
        eprintln!("vm-agent-files: not a valid file operation");
        return ExitCode::from(2);
    };
    match apply(&op) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let path = op.paths().first().copied().unwrap_or_default();
            eprintln!("vm-agent-files: {} {path}: {}", op.name(), describe(&e));
            ExitCode::from(1)
        }
    }
}

/// The error as `ls` would put it (no "(os error 2)").
fn describe(e: &io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(cut) => text[..cut].to_owned(),
        None => text,
    }
}

fn apply(op: &FileOp) -> io::Result<()> {
    let stdout = io::stdout();
    match op {
        FileOp::Read { path } => {
            let mut file = File::open(path)?;
            if file.metadata()?.is_dir() {
                return Err(io::Error::from(io::ErrorKind::IsADirectory));
            }
            io::copy(&mut file, &mut stdout.lock())?;
        }
        FileOp::Write { path, mode } => write(Path::new(path), *mode & KEPT_MODE, &mut io::stdin().lock())?,
        FileOp::List { path } => {
            let mut out = BufWriter::new(stdout.lock());
            let mut entries: Vec<_> = fs::read_dir(path)?.collect::<io::Result<_>>()?;
            entries.sort_by_key(fs::DirEntry::file_name);
            for entry in entries {
                let info = describe_entry(&entry.file_name().to_string_lossy(), &entry.path())?;
                writeln!(out, "{info}")?;
            }
            out.flush()?;
        }
        FileOp::Stat { path } => println!("{}", describe_entry(path, Path::new(path))?),
        FileOp::MakeDir { path, parents: true } => fs::create_dir_all(path)?,
        FileOp::MakeDir { path, parents: false } => fs::create_dir(path)?,
        FileOp::Remove { path, recursive } => {
            let meta = fs::symlink_metadata(path)?;
            match (meta.is_dir(), recursive) {
                (true, true) => fs::remove_dir_all(path)?,
                (true, false) => fs::remove_dir(path)?,
                (false, _) => fs::remove_file(path)?,
            }
        }
        FileOp::Rename { from, to } => fs::rename(from, to)?,
        FileOp::CopyIn { path, layout: TarLayout::Into } => {
            if !fs::metadata(path)?.is_dir() {
                return Err(io::Error::from(io::ErrorKind::NotADirectory));
            }
            unpack(&mut io::stdin().lock(), Path::new(path))?;
        }
        FileOp::CopyIn { path, layout: TarLayout::Named } => copy_in_named(Path::new(path))?,
        FileOp::CopyOut { path } => copy_out(Path::new(path), stdout.lock())?,
    }
    Ok(())
}

/// One path as a line of JSON: name, type, size, mode, mtime, and a symlink's target.
fn describe_entry(name: &str, path: &Path) -> io::Result<String> {
    let meta = fs::symlink_metadata(path)?;
    let kind = kind(&meta);
    let mut info = serde_json::json!({
        "name": name,
        "type": kind,
        "size": meta.len(),
        "mode": format!("{:o}", meta.mode() & 0o7777),
        "mtime": meta.mtime(),
    });
    if kind == "symlink" {
        info["target"] = fs::read_link(path)?.to_string_lossy().into();
    }
    Ok(info.to_string())
}

fn kind(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_symlink() {
        "symlink"
    } else if t.is_dir() {
        "dir"
    } else if t.is_file() {
        "file"
    } else {
        "other"
    }
}

/// Writes beside `path`, then renames over it: a reader sees the old file or the whole new one.
fn write(path: &Path, mode: u32, input: &mut impl Read) -> io::Result<()> {
    let temp = beside(path, "write")?;
    let result = (|| {
        let mut file = OpenOptions::new().write(true).create_new(true).mode(mode).open(&temp)?;
        io::copy(input, &mut file)?;
        // The mode as asked, whatever the umask took.
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        fs::rename(&temp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

/// A name next to `path` for a temporary of this process.
fn beside(path: &Path, what: &str) -> io::Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
    Ok(path.with_file_name(format!(".{}.vm-{what}-{}", name.to_string_lossy(), std::process::id())))
}

/// What [`unpack`] reads its input in (a pipe's whole default capacity and more).
const UNPACK_BUFFER: usize = 1 << 20;

/// Unpacks a tar into `dir`: no entry outside it (the tar crate refuses `..`, absolute names and paths
/// through symlinks), modes kept without set-id bits, owned by whoever runs this (the workload identity).
fn unpack(input: &mut impl Read, dir: &Path) -> io::Result<()> {
    // The tar crate copies each file in 8 KiB reads: from memory here, not one pipe read each.
    let mut archive = tar::Archive::new(BufReader::with_capacity(UNPACK_BUFFER, input));
    archive.set_preserve_permissions(false);
    archive.set_preserve_ownerships(false);
    archive.set_overwrite(true);
    archive.unpack(dir)
}

/// `cp SRC SANDBOX:PATH`: the tar's one top-level entry becomes `PATH/NAME` when `PATH` is a directory and
/// `PATH` otherwise; it is unpacked beside its destination and moved there only once complete.
fn copy_in_named(path: &Path) -> io::Result<()> {
    let into_dir = fs::metadata(path).is_ok_and(|m| m.is_dir());
    let parent = if into_dir { path.to_path_buf() } else { parent_of(path) };
    let staging = parent.join(format!(".vm-copy-{}", std::process::id()));
    fs::create_dir(&staging)?;
    let result = (|| {
        unpack(&mut io::stdin().lock(), &staging)?;
        let mut top = fs::read_dir(&staging)?.collect::<io::Result<Vec<_>>>()?;
        let (Some(entry), true) = (top.pop(), top.is_empty()) else {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "the tar must hold exactly one top-level entry"));
        };
        let target = if into_dir { path.join(entry.file_name()) } else { path.to_path_buf() };
        place(&entry.path(), &target)
    })();
    let _ = fs::remove_dir_all(&staging);
    result
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Moves `from` to `to`; a directory onto an existing directory merges into it, as `docker cp` does.
fn place(from: &Path, to: &Path) -> io::Result<()> {
    let (new, old) = (fs::symlink_metadata(from)?, fs::symlink_metadata(to));
    match old {
        Ok(old) if old.is_dir() && new.is_dir() => {
            for entry in fs::read_dir(from)? {
                let entry = entry?;
                place(&entry.path(), &to.join(entry.file_name()))?;
            }
            Ok(())
        }
        Ok(old) if old.is_dir() => {
            Err(io::Error::new(io::ErrorKind::IsADirectory, "cannot put a file over a directory"))
        }
        _ => fs::rename(from, to),
    }
}

/// Packs `path` as a tar on `out`, its entries named from `path`'s last component; symlinks stay links.
fn copy_out(path: &Path, out: impl Write) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    let name = path.file_name().map_or_else(|| "root".into(), |n| n.to_string_lossy().into_owned());
    let mut builder = tar::Builder::new(BufWriter::with_capacity(256 * 1024, out));
    builder.follow_symlinks(false);
    if meta.is_dir() {
        builder.append_dir_all(&name, path)?;
    } else {
        builder.append_path_with_name(path, &name)?;
    }
    builder.into_inner()?.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("vm-agent-files-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_tree_copied_out_and_in_again_is_the_same_tree() {
        let dir = scratch("round");
        fs::create_dir_all(dir.join("src/sub")).unwrap();
        fs::write(dir.join("src/sub/a"), b"alpha").unwrap();
        fs::set_permissions(dir.join("src/sub/a"), fs::Permissions::from_mode(0o4751)).unwrap();
        std::os::unix::fs::symlink("sub/a", dir.join("src/link")).unwrap();
        let mut tar = Vec::new();
        copy_out(&dir.join("src"), &mut tar).unwrap();
        fs::create_dir(dir.join("dst")).unwrap();
        unpack(&mut tar.as_slice(), &dir.join("dst")).unwrap();
        assert_eq!(fs::read(dir.join("dst/src/sub/a")).unwrap(), b"alpha");
        let mode = fs::metadata(dir.join("dst/src/sub/a")).unwrap().mode() & 0o7777;
        assert_eq!(mode & 0o777, 0o751, "the mode is kept");
        assert_eq!(mode & 0o6000, 0, "no set-id bit: {mode:o}");
        assert_eq!(fs::read_link(dir.join("dst/src/link")).unwrap(), Path::new("sub/a"));
    }

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = scratch("write");
        let file = dir.join("f");
        fs::write(&file, b"old").unwrap();
        write(&file, 0o640, &mut &b"new bytes"[..]).unwrap();
        assert_eq!(fs::read(&file).unwrap(), b"new bytes");
        assert_eq!(fs::metadata(&file).unwrap().mode() & 0o777, 0o640);
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "no temporary left");
    }

    #[test]
    fn a_directory_placed_onto_one_merges_and_a_file_cannot_replace_a_directory() {
        let dir = scratch("place");
        fs::create_dir_all(dir.join("new/d")).unwrap();
        fs::write(dir.join("new/d/x"), b"x").unwrap();
        fs::create_dir_all(dir.join("old/d")).unwrap();
        fs::write(dir.join("old/d/y"), b"y").unwrap();
        place(&dir.join("new"), &dir.join("old")).unwrap();
        assert!(dir.join("old/d/x").is_file() && dir.join("old/d/y").is_file());
        fs::write(dir.join("file"), b"f").unwrap();
        assert!(place(&dir.join("file"), &dir.join("old")).is_err());
    }
}

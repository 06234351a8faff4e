//! `vm-image`: builds the default guest image reproducibly from pinned Debian packages.
//!
//! ```text
//! vm-image build --agent target/guest/.../vm-agent [--out DIR] [--cache DIR] [--pins FILE]
//! ```
//!
//! Output, in `DIR` (default `$XDG_CACHE_HOME/vm-driver/images/default`): `vmlinuz`, `initramfs.cpio` and
//! `manifest.json` (versions and hashes). Same inputs, same bytes: the archive is sorted, owned by root,
//! and every mtime is `--mtime` (default 0). `scripts/build-image` builds the agent and calls this.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use serde::{Deserialize, Serialize};

use vm_image::debian::{self, Pin};
use vm_image::{cpio, modules, rootfs};

/// The pins compiled in; `--pins` overrides them.
const DEFAULT_PINS: &str = include_str!("../../pins.json");

#[derive(Debug, Parser)]
#[command(version, about = "Builds the guest image for vm-driver from pinned Debian packages")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Fetch the pinned packages, check them, and assemble kernel, initramfs and manifest.
    Build {
        /// The guest agent, built static (scripts/build-image does this).
        #[arg(long)]
        agent: PathBuf,
        /// Output directory; replaced atomically.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Cache for downloaded packages.
        #[arg(long)]
        cache: Option<PathBuf>,
        /// A pins file other than the built-in images/pins.json.
        #[arg(long)]
        pins: Option<PathBuf>,
        /// The mtime of every archive member (seconds since the epoch).
        #[arg(long, default_value_t = 0)]
        mtime: u32,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pins {
    #[serde(default, rename = "comment")]
    _comment: String,
    kernel: Pin,
    busybox: Pin,
    modules: Vec<String>,
    root_modules: Vec<String>,
    mount_modules: Vec<String>,
    mirrors: Vec<String>,
}

/// What was built from what. Two builds from the same inputs give the same manifest.
#[derive(Debug, Serialize)]
struct Manifest {
    format: u32,
    kernel: Part,
    kernel_release: String,
    busybox: Part,
    agent_sha256: String,
    modules: Vec<String>,
    root_modules: Vec<String>,
    mount_modules: Vec<String>,
    initramfs: Part,
    mtime: u32,
}

#[derive(Debug, Serialize)]
struct Part {
    #[serde(skip_serializing_if = "Option::is_none")]
    package: Option<Pin>,
    file: String,
    sha256: String,
    bytes: u64,
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vm-image: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let Cmd::Build { agent, out, cache, pins, mtime } = cli.command;
    let cache = match cache {
        Some(c) => c,
        None => default_cache()?,
    };
    let out = out.unwrap_or_else(|| cache.join("images/default"));
    let pins: Pins = match &pins {
        Some(p) => {
            serde_json::from_str(&fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?)
        }
        None => serde_json::from_str(DEFAULT_PINS),
    }
    .context("pins file is not valid")?;
    build(&agent, &out, &cache, &pins, mtime)?;
    println!("{}", out.display());
    Ok(())
}

fn default_cache() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("vm-driver"));
    }
    let home = std::env::var_os("HOME").context("neither XDG_CACHE_HOME nor HOME is set; pass --cache")?;
    Ok(PathBuf::from(home).join(".cache/vm-driver"))
}

fn build(agent: &Path, out: &Path, cache: &Path, pins: &Pins, mtime: u32) -> Result<()> {
    let agent_bytes = fs::read(agent).with_context(|| format!("cannot read the agent {}", agent.display()))?;
    let kernel_deb = debian::fetch(&pins.kernel, &pins.mirrors, cache)?;
    let busybox_deb = debian::fetch(&pins.busybox, &pins.mirrors, cache)?;

    let parent = out.parent().context("output directory has no parent")?;
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let work = parent.join(format!(".build-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    let result = assemble(&work, &agent_bytes, &kernel_deb, &busybox_deb, pins, mtime);
    if result.is_ok() {
        let _ = fs::remove_dir_all(out);
        fs::rename(work.join("image"), out).with_context(|| format!("cannot move the image to {}", out.display()))?;
    }
    let _ = fs::remove_dir_all(&work);
    result
}

fn assemble(work: &Path, agent: &[u8], kernel_deb: &Path, busybox_deb: &Path, pins: &Pins, mtime: u32) -> Result<()> {
    let kernel_root = work.join("kernel");
    let busybox_root = work.join("busybox");
    let image = work.join("image");
    debian::extract(kernel_deb, &kernel_root)?;
    debian::extract(busybox_deb, &busybox_root)?;
    fs::create_dir_all(&image)?;

    let (vmlinuz, release) = find_kernel(&kernel_root)?;
    fs::copy(&vmlinuz, image.join("vmlinuz")).context("cannot copy the kernel")?;
    let tree = kernel_root.join("lib/modules").join(&release);
    let modules = modules::resolve(&tree, &pins.modules)?;
    // What an image root needs beyond them, in load order.
    let every: Vec<String> = pins.modules.iter().chain(&pins.root_modules).cloned().collect();
    let root_modules: Vec<modules::Module> =
        modules::resolve(&tree, &every)?.into_iter().filter(|m| !modules.iter().any(|b| b.name == m.name)).collect();
    // What host directories need beyond the modules of every boot (an image root's are loaded before).
    let every: Vec<String> = pins.modules.iter().chain(&pins.mount_modules).cloned().collect();
    let mount_modules: Vec<modules::Module> =
        modules::resolve(&tree, &every)?.into_iter().filter(|m| !modules.iter().any(|b| b.name == m.name)).collect();
    let read = |list: &[modules::Module]| -> Result<Vec<(String, Vec<u8>)>> {
        list.iter()
            .map(|m| {
                Ok((m.name.clone(), fs::read(&m.path).with_context(|| format!("cannot read {}", m.path.display()))?))
            })
            .collect()
    };

    let busybox_bin = busybox_root.join("bin/busybox");
    let listed = Command::new(&busybox_bin).arg("--list-full").output().context("cannot run busybox --list-full")?;
    if !listed.status.success() {
        bail!("busybox --list-full failed ({})", listed.status);
    }
    let contents = rootfs::Contents {
        agent: agent.to_vec(),
        busybox: fs::read(&busybox_bin).context("cannot read busybox")?,
        applets: String::from_utf8_lossy(&listed.stdout).lines().map(str::to_owned).collect(),
        modules: read(&modules)?,
        root_modules: read(&root_modules)?,
        mount_modules: read(&mount_modules)?,
    };
    let mut archive = Vec::new();
    cpio::write(&mut archive, &rootfs::entries(contents), mtime)?;
    fs::write(image.join("initramfs.cpio"), &archive).context("cannot write the initramfs")?;

    let part = |pin: Option<&Pin>, file: &str| -> Result<Part> {
        let path = image.join(file);
        Ok(Part {
            package: pin.cloned(),
            file: file.into(),
            sha256: debian::sha256_file(&path)?,
            bytes: fs::metadata(&path)?.len(),
        })
    };
    let manifest = Manifest {
        format: 1,
        kernel: part(Some(&pins.kernel), "vmlinuz")?,
        kernel_release: release,
        busybox: Part {
            package: Some(pins.busybox.clone()),
            file: "bin/busybox".into(),
            sha256: debian::sha256_file(&busybox_bin)?,
            bytes: fs::metadata(&busybox_bin)?.len(),
        },
        agent_sha256: debian::sha256(agent),
        modules: modules.into_iter().map(|m| m.name).collect(),
        root_modules: root_modules.into_iter().map(|m| m.name).collect(),
        mount_modules: mount_modules.into_iter().map(|m| m.name).collect(),
        initramfs: part(None, "initramfs.cpio")?,
        mtime,
    };
    let mut json = serde_json::to_string_pretty(&manifest)?;
    json.push('\n');
    fs::write(image.join("manifest.json"), json).context("cannot write the manifest")
}

/// The `vmlinuz-<release>` in the kernel package, and its release.
fn find_kernel(root: &Path) -> Result<(PathBuf, String)> {
    for entry in fs::read_dir(root.join("boot")).context("kernel package has no /boot")?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(release) = name.strip_prefix("vmlinuz-") {
            return Ok((entry.path(), release.to_owned()));
        }
    }
    bail!("kernel package has no /boot/vmlinuz-*")
}

//! `vm-driver image pull|import|ls|rm`: OCI images in the local store (docs/images.md). The pull itself is
//! `vm_oci::obtain`, the path every entry point takes.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use vm_contract::root::RootImage;
use vm_oci::obtain::{obtain, Freshness};
use vm_oci::pull::{Image, Progress};
use vm_oci::registry::Options;
use vm_oci::source::Source;
use vm_oci::store::Store;
use vm_oci::unpack::tree::Limits;

/// `vm-driver image ...`.
#[derive(Debug, Args)]
pub struct ImageArgs {
    #[command(subcommand)]
    pub command: ImageCommand,
    #[command(flatten)]
    pub store: StoreArgs,
}

/// What to do with images.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Pull an image from a registry (REGISTRY/NAME[:TAG|@sha256:DIGEST]; short names are Docker Hub's).
    Pull {
        /// The reference.
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Import an image from an OCI layout (oci:DIR[:TAG]) or a `docker save` archive (docker-archive:FILE).
    Import {
        /// The source.
        source: String,
    },
    /// List the images in the store: reference, digest, size, last used.
    Ls,
    /// Remove an image from the store (its name, its disk, the blobs no other image uses).
    Rm {
        /// A name as listed, or the manifest digest.
        reference: String,
    },
}

/// Where the store is.
#[derive(Debug, Args)]
pub struct StoreArgs {
    /// The image store (default: $XDG_CACHE_HOME/vm-driver/oci, else ~/.cache/vm-driver/oci).
    #[arg(long, value_name = "DIR", global = true)]
    pub image_cache: Option<PathBuf>,
}

/// How to reach registries.
#[derive(Debug, Args, Clone, Default)]
pub struct RegistryArgs {
    /// Trust only this CA bundle (PEM) for registries, not the system's roots.
    #[arg(long, value_name = "FILE")]
    pub registry_ca: Option<PathBuf>,
    /// Speak plain http to this registry (HOST:PORT); repeatable.
    #[arg(long, value_name = "HOST:PORT")]
    pub insecure_registry: Vec<String>,
    /// Registry logins, a Docker config.json (default: ~/.docker/config.json if it exists).
    #[arg(long, value_name = "FILE")]
    pub registry_auth_file: Option<PathBuf>,
}

impl RegistryArgs {
    /// The client's options.
    pub fn options(&self) -> Options {
        Options {
            ca_file: self.registry_ca.clone(),
            insecure: self.insecure_registry.clone(),
            auth_file: self.registry_auth_file.clone(),
            read_timeout: None,
        }
    }
}

impl StoreArgs {
    /// The store, opened.
    pub fn open(&self) -> Result<Store> {
        let dir = match &self.image_cache {
            Some(dir) => dir.clone(),
            None => {
                let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
                let cache = var("XDG_CACHE_HOME")
                    .or_else(|| var("HOME").map(|h| h.join(".cache")))
                    .context("no image store location: neither XDG_CACHE_HOME nor HOME is set; pass --image-cache")?;
                cache.join("vm-driver/oci")
            }
        };
        Ok(Store::open(&dir)?)
    }
}

/// Progress on stderr: on a terminal a bar per layer, redrawn in place; otherwise a line per layer done.
struct Lines {
    terminal: bool,
    /// The last (layer, percent) shown.
    shown: Option<(usize, u64)>,
}

impl Progress for Lines {
    fn layer(&mut self, index: usize, count: usize, layer: &vm_oci::manifest::Layer, done: u64) {
        let percent = done.saturating_mul(100).checked_div(layer.size).unwrap_or(100);
        if self.shown == Some((index, percent)) {
            return;
        }
        self.shown = Some((index, percent));
        let short = &layer.digest.hex()[..12];
        if self.terminal {
            let bar = "#".repeat(usize::try_from(percent / 5).unwrap_or(20));
            eprint!("\r\x1b[2Klayer {}/{count} {short} [{bar:<20}] {percent:>3}% of {} bytes", index + 1, layer.size);
            if percent == 100 {
                eprintln!();
            }
        } else if percent == 100 {
            eprintln!("vm-driver: layer {}/{count} {short}: {} bytes", index + 1, layer.size);
        }
    }
}

/// Runs an `image` command.
pub fn run(args: ImageArgs) -> Result<u8> {
    let store = args.store.open()?;
    match args.command {
        ImageCommand::Pull { reference, registry } => {
            let source: Source = reference.parse()?;
            if !matches!(source, Source::Registry(_)) {
                bail!("{reference} is not a registry reference: use `vm-driver image import` for oci: and docker-archive:");
            }
            pull(&store, &source, &registry.options(), Freshness::Refresh)
        }
        ImageCommand::Import { source: text } => {
            let source: Source = text.parse()?;
            if matches!(source, Source::Registry(_)) {
                bail!("{text} is a registry reference: use `vm-driver image pull`");
            }
            pull(&store, &source, &Options::default(), Freshness::Refresh)
        }
        ImageCommand::Ls => {
            println!("{:<50} {:<19} {:>12}  LAST USED", "REFERENCE", "DIGEST", "SIZE");
            for entry in vm_oci::catalog::list(&store) {
                let ago = entry.used.elapsed().map_or(0, |d| d.as_secs());
                let names = if entry.names.is_empty() { vec!["<none>".to_owned()] } else { entry.names.clone() };
                for name in names {
                    println!(
                        "{name:<50} {:<19} {:>12}  {ago} s ago",
                        &entry.image.manifest.as_str()[..19],
                        entry.bytes
                    );
                }
            }
            Ok(0)
        }
        ImageCommand::Rm { reference } => {
            let entries = vm_oci::catalog::list(&store);
            let canonical = reference.parse::<Source>().map(|s| s.to_string()).unwrap_or(reference.clone());
            let Some(entry) = entries.iter().find(|e| {
                e.image.manifest.as_str() == reference || e.names.iter().any(|n| *n == canonical || *n == reference)
            }) else {
                bail!("no image {reference} in the store");
            };
            vm_oci::catalog::remove(&store, &entry.image.manifest)?;
            println!("removed {}", entry.image.manifest);
            Ok(0)
        }
    }
}

fn pull(store: &Store, source: &Source, options: &Options, freshness: Freshness) -> Result<u8> {
    let (image, _) = get(store, source, options, freshness)?;
    println!("{source} {}", image.manifest);
    Ok(0)
}

/// `launch --image`: the image `reference` names, pulled on first use, as a sandbox's root with a writable
/// layer of `disk_mib`.
pub fn root(store: &StoreArgs, registry: &RegistryArgs, reference: &str, disk_mib: u32) -> Result<RootImage> {
    let source: Source = reference.parse()?;
    let (image, dir) = get(&store.open()?, &source, &registry.options(), Freshness::Cached)?;
    Ok(RootImage {
        manifest: image.manifest.to_string(),
        disk: std::path::absolute(dir.join(vm_oci::disk::DISK_FILE))?,
        disk_mib,
        run: image.run,
    })
}

/// The one path to an image for every command, with progress on stderr.
fn get(store: &Store, source: &Source, options: &Options, freshness: Freshness) -> Result<(Image, PathBuf)> {
    let mut progress = Lines { terminal: std::io::stderr().is_terminal(), shown: None };
    let got = obtain(source, store, options, Limits::default(), freshness, &mut progress)
        .with_context(|| format!("cannot get the image {source}"))?;
    if let Some(user) = &got.0.run.user {
        eprintln!(
            "vm-driver: the image asks for user {user:?}; workloads run as the fixed sandbox user (docs/policy.md)"
        );
    }
    Ok(got)
}

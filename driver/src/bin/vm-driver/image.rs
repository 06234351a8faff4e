//! `vm-driver image pull|import|ls|rm`: OCI images in the local store (docs/images.md). The pull itself is
//! `vm_oci::obtain`, the path every entry point takes.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use vm_contract::root::RootImage;
use vm_driver::oci::ImageRoots;
use vm_oci::obtain::Freshness;
use vm_oci::pull::{Image, Progress};
use vm_oci::registry::Options;
use vm_oci::source::Source;
use vm_oci::store::Store;

/// `vm-driver image ...`.
#[derive(Debug, Args)]
pub struct ImageArgs {
    #[command(subcommand)]
    pub command: ImageCommand,
    #[command(flatten)]
    pub store: StoreArgs,
    /// The state directory whose sandboxes' images are in use (default: as `launch` and `serve` choose it).
    #[arg(long, value_name = "DIR", global = true)]
    pub state_dir: Option<PathBuf>,
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
    #[command(visible_alias = "list")]
    Ls,
    /// Remove an image from the store (its name, its disk, the blobs no other image uses); refused while a
    /// sandbox uses it.
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
    /// Cap the store at this size (bytes, or with K, M, G or T): past it, the least recently used images
    /// that no sandbox uses are removed after each pull.
    #[arg(long, value_name = "SIZE", global = true, value_parser = parse_size)]
    pub image_cache_max: Option<u64>,
}

/// `1048576`, `512M`, `10G`: binary multiples.
fn parse_size(text: &str) -> Result<u64, String> {
    let (digits, shift) = match text.as_bytes().last().map(u8::to_ascii_uppercase) {
        Some(b'K') => (&text[..text.len() - 1], 10),
        Some(b'M') => (&text[..text.len() - 1], 20),
        Some(b'G') => (&text[..text.len() - 1], 30),
        Some(b'T') => (&text[..text.len() - 1], 40),
        _ => (text, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("{text:?} is not a size (bytes, or a number with K, M, G or T)"))
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
    /// Where images come from and are kept, for sandboxes under the state directory `state`.
    pub fn roots(&self, registry: Options, state: &std::path::Path) -> Result<ImageRoots> {
        Ok(ImageRoots {
            store: self.open()?,
            registry,
            max_bytes: self.image_cache_max,
            sandboxes: state.join("sandboxes"),
        })
    }

    /// The store, opened.
    fn open(&self) -> Result<Store> {
        let dir = match &self.image_cache {
            Some(dir) => dir.clone(),
            None => vm_driver::image::cache_dir()
                .context("no image store location: neither XDG_CACHE_HOME nor HOME is set; pass --image-cache")?
                .join("oci"),
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
    let state = args.state_dir.unwrap_or_else(vm_driver::state::default_root);
    let roots = |registry: Options| args.store.roots(registry, &state);
    match args.command {
        ImageCommand::Pull { reference, registry } => {
            let source: Source = reference.parse()?;
            if !matches!(source, Source::Registry(_)) {
                bail!("{reference} is not a registry reference: use `vm-driver image import` for oci: and docker-archive:");
            }
            pull(&roots(registry.options())?, &source, Freshness::Refresh)
        }
        ImageCommand::Import { source: text } => {
            let source: Source = text.parse()?;
            if matches!(source, Source::Registry(_)) {
                bail!("{text} is a registry reference: use `vm-driver image pull`");
            }
            pull(&roots(Options::default())?, &source, Freshness::Refresh)
        }
        ImageCommand::Ls => {
            let roots = roots(Options::default())?;
            let used = vm_driver::oci::in_use(&roots.sandboxes);
            println!("{:<50} {:<19} {:>12}  {:<6} LAST USED", "REFERENCE", "DIGEST", "SIZE", "IN USE");
            for entry in vm_oci::catalog::list(&roots.store) {
                let ago = entry.used.elapsed().map_or(0, |d| d.as_secs());
                let in_use = if used.contains(entry.image.manifest.as_str()) { "yes" } else { "no" };
                let names = if entry.names.is_empty() { vec!["<none>".to_owned()] } else { entry.names.clone() };
                for name in names {
                    println!(
                        "{name:<50} {:<19} {:>12}  {in_use:<6} {ago} s ago",
                        &entry.image.manifest.as_str()[..19],
                        entry.bytes
                    );
                }
            }
            Ok(0)
        }
        ImageCommand::Rm { reference } => {
            println!("removed {}", roots(Options::default())?.remove(&reference)?);
            Ok(0)
        }
    }
}

fn pull(roots: &ImageRoots, source: &Source, freshness: Freshness) -> Result<u8> {
    let (image, _) = get(roots, &source.to_string(), freshness)?;
    println!("{source} {}", image.manifest);
    Ok(0)
}

/// `launch --image`: the image `reference` names, pulled on first use, as a sandbox's root with a writable
/// layer of `disk_mib`.
pub fn root(roots: &ImageRoots, reference: &str, disk_mib: u32) -> Result<RootImage> {
    let root = roots.root(reference, disk_mib, &mut lines())?;
    if let Some(user) = &root.run.user {
        user_note(user);
    }
    Ok(root)
}

fn get(roots: &ImageRoots, reference: &str, freshness: Freshness) -> Result<(Image, PathBuf)> {
    let got = roots.obtain(reference, freshness, &mut lines())?;
    if let Some(user) = &got.0.run.user {
        user_note(user);
    }
    Ok(got)
}

/// Progress on stderr.
fn lines() -> Lines {
    Lines { terminal: std::io::stderr().is_terminal(), shown: None }
}

fn user_note(user: &str) {
    eprintln!("vm-driver: the image asks for user {user:?}; workloads run as the fixed sandbox user (docs/policy.md)");
}

//! Layers applied in order into one tree, then written out as a directory for the disk builder.
//!
//! - [`path`]: an entry's name cleaned into components; absolute names and `..` are refused.
//! - [`tree`]: the merged tree, kept in memory: whiteouts, opaque directories, hardlinks and replacements
//!   follow the OCI layer rules, and an entry whose parent is a symlink is refused, so no later entry is ever
//!   placed through a link. Contents go to a [`Spool`] as they stream by.
//! - [`write`]: the tree as a directory, created entry by entry under a fresh root, so no path the layers
//!   chose is ever resolved on the host.

pub mod path;
pub mod tree;
pub mod write;

pub use tree::{Limits, Spool, Tree, UnpackError};

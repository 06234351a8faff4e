//! OCI images as sandbox roots.
//!
//! - [`digest`]: a validated `sha256:` digest, and a reader that checks a blob against its descriptor's
//!   digest and size as it streams (never reading past the size).
//! - [`reference`]: `REGISTRY/NAME[:TAG|@DIGEST]`, with Docker Hub's short names resolved as Docker does.
//! - [`layer`]: a layer blob as its tar stream: decompressed, bounded, its `diff_id` checked.
//! - [`manifest`]: manifests, indexes and configs (OCI and Docker schema 2), bounded, `linux/amd64` only.
//! - [`store`]: blobs by digest, written under a temporary name and renamed once verified.
//! - [`source`], [`registry`], [`fetch`]: where an image comes from (a registry, an OCI layout, a
//!   `docker save` archive), and getting its manifest and blobs into the store the same way for each.
//! - [`pull`]: manifest, config and layers of one image into the store.
//! - [`catalog`]: names to images, their last use, removal and least-recently-used eviction.
//! - [`disk`]: an image's layers merged into one read-only EROFS disk, byte-identical when rebuilt.
//! - [`obtain`]: the one path from a source's name to a built disk, for every entry point.
//! - [`unpack`]: layers applied in order into one tree (OCI whiteouts, hardlinks, symlinks), every entry's
//!   path checked first: nothing a layer names can reach outside the tree.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod bounded;
pub mod catalog;
pub mod digest;
pub mod disk;
pub mod fetch;
pub mod layer;
pub mod manifest;
pub mod obtain;
pub mod pull;
pub mod reference;
pub mod registry;
pub mod source;
pub mod store;
pub mod unpack;

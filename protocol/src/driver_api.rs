//! The driver API (`vmdriver.v1`), generated from `proto/vmdriver/v1/driver.proto`.
#![allow(missing_docs, unused_qualifications, clippy::all, reason = "generated code")]

tonic::include_proto!("vmdriver.v1");

/// The encoded file descriptor set, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/driver_descriptor.bin"));

impl std::fmt::Debug for CollectorHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectorHeader").field("name", &self.name).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential").field("name", &self.name).field("hosts", &self.hosts).finish_non_exhaustive()
    }
}

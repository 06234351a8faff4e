//! Host entropy and the host's clock for the guest kernel ([`vm_protocol::link::VmRequest::Reseed`]).
//!
//! A VM restored from a snapshot is one of many clones: everything in guest memory, the kernel's RNG state
//! included, is the same in each, and the kernel reseeds on a schedule that runs on guest time, which a
//! restore does not advance. So the agent adds the host's bytes to the kernel's input pool, crediting them
//! (`RNDADDENTROPY`), and makes the RNG reseed from that pool at once (`RNDRESEEDCRNG`); writing to
//! `/dev/urandom` alone would only mix the pool. Then it sets the wall clock, which a restored guest has from
//! the moment it was saved. Both need `CAP_SYS_ADMIN` (PID 1 has it).
// Unsafe: the two ioctls have no safe wrapper in nix or rustix (nix's macros generate `unsafe fn`s).
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::fs::File;
use std::os::fd::AsRawFd;

use nix::sys::time::TimeSpec;
use nix::time::{clock_settime, ClockId};
use vm_protocol::link::RESEED_BYTES;

/// [`RESEED_BYTES`] as the kernel's `int`.
#[allow(clippy::cast_possible_truncation, reason = "64")]
const POOL_BYTES: i32 = RESEED_BYTES as i32;

/// The kernel's `struct rand_pool_info` with its buffer: two `int`s, then the bytes.
#[repr(C)]
struct PoolInfo {
    entropy_count: i32,
    buf_size: i32,
    buf: [u8; RESEED_BYTES],
}

// RNDADDENTROPY is `_IOW('R', 0x03, int[2])`: its size field covers the header only, not `PoolInfo`.
nix::ioctl_write_ptr_bad!(add_entropy, nix::request_code_write!(b'R', 0x03, 2 * size_of::<c_int>()), PoolInfo);
nix::ioctl_none!(reseed_crng, b'R', 0x07);

/// The Debug of the host's entropy would be the secret itself.
impl std::fmt::Debug for PoolInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PoolInfo { .. }")
    }
}

/// Which step failed.
#[derive(Debug, thiserror::Error)]
pub enum ReseedError {
    /// `/dev/urandom` could not be opened.
    #[error("cannot open /dev/urandom: {0}")]
    Open(std::io::Error),
    /// `RNDADDENTROPY` failed.
    #[error("cannot add entropy: {0}")]
    Add(nix::Error),
    /// `RNDRESEEDCRNG` failed.
    #[error("cannot reseed the RNG: {0}")]
    Reseed(nix::Error),
    /// The clock could not be set.
    #[error("cannot set the clock: {0}")]
    Clock(nix::Error),
}

/// Adds `entropy` to the kernel's pool, credited in full, reseeds the kernel RNG from it, and sets the wall
/// clock to `unix_nanos`.
///
/// # Errors
/// The step that failed; the ones before it took effect.
pub(crate) fn reseed(entropy: &[u8; RESEED_BYTES], unix_nanos: u64) -> Result<(), ReseedError> {
    let info = PoolInfo { entropy_count: 8 * POOL_BYTES, buf_size: POOL_BYTES, buf: *entropy };
    let random = File::open("/dev/urandom").map_err(ReseedError::Open)?;
    // SAFETY: `info` is a live `rand_pool_info` whose `buf_size` bytes follow its header; the kernel only
    // reads it, during the call.
    unsafe { add_entropy(random.as_raw_fd(), &info) }.map_err(ReseedError::Add)?;
    // SAFETY: an ioctl with no argument on a file this function owns.
    unsafe { reseed_crng(random.as_raw_fd()) }.map_err(ReseedError::Reseed)?;
    let secs = i64::try_from(unix_nanos / 1_000_000_000).unwrap_or(i64::MAX);
    let nanos = i64::try_from(unix_nanos % 1_000_000_000).unwrap_or(0);
    clock_settime(ClockId::CLOCK_REALTIME, TimeSpec::new(secs, nanos)).map_err(ReseedError::Clock)
}

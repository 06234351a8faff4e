//! Brings up the guest's loopback interface, the only one it has: the proxy listeners and port forwards
//! live on it. The kernel creates `lo` down.
// Unsafe: SIOCGIFFLAGS and SIOCSIFFLAGS have no safe wrapper in nix or rustix.
#![allow(unsafe_code)]

use std::net::UdpSocket;
use std::os::fd::AsRawFd;

use nix::libc;

nix::ioctl_read_bad!(get_flags, libc::SIOCGIFFLAGS, libc::ifreq);
nix::ioctl_write_ptr_bad!(set_flags, libc::SIOCSIFFLAGS, libc::ifreq);

/// Sets `lo` up (it keeps its kernel-assigned 127.0.0.1/8 and ::1).
///
/// # Errors
/// The socket or an ioctl failed.
pub(crate) fn up() -> std::io::Result<()> {
    // Any socket of the family carries interface ioctls.
    let socket = UdpSocket::bind("127.0.0.1:0").or_else(|_| UdpSocket::bind("0.0.0.0:0"))?;
    // SAFETY: `ifreq` is plain old data for which all-zero bytes are a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = libc::c_char::from_ne_bytes([*src]);
    }
    // SAFETY: the fd is an open socket and `req` a valid, named `ifreq` the kernel fills.
    unsafe { get_flags(socket.as_raw_fd(), &mut req) }?;
    // SAFETY: the kernel just filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | libc::c_short::try_from(libc::IFF_UP).unwrap_or(1);
    // SAFETY: as above; the kernel only reads `req`.
    unsafe { set_flags(socket.as_raw_fd(), &req) }?;
    Ok(())
}

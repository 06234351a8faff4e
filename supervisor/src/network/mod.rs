//! Network streams on the supervisor's side (`docs/network.md`): egress from the guest's loopback proxies,
//! decided, resolved and dialed here, and port forwards into the guest.
//!
//! - [`address`]: which addresses are never reached unless a rule lists them.
//! - [`resolve`]: names resolved on the host (the system resolver, or `--egress-resolver`'s DNS server).
//! - [`request`] and [`socks`]: reading a proxy request from a stream's first bytes, bounded.
//! - [`pipe`]: what an egress stream shares with its task; [`egress`]: that task (read the request, answer,
//!   relay, close); [`dial`]: its decision, address checks and dial; [`upstream`]: the operator's proxy.
//!
//! The link's streams and their rules are the boundary's stream router (`crate::boundary::stream`): this
//! module is the I/O of the streams it accepts.

pub mod address;
pub mod dial;
mod dns;
pub mod egress;
pub mod intercept;
pub mod pipe;
pub mod request;
pub mod resolve;
pub mod socks;
pub mod upstream;

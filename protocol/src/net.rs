//! Network streams: byte streams that cross the boundary, one per TCP connection. The guest has no NIC; every
//! connection a workload makes, or a port forward brings in, is one of these.
//!
//! - **Egress.** The agent's loopback proxy listeners accept a connection and announce it with
//!   [`NetToHost::Opened`]. The agent does not parse it: the supervisor reads the proxy request from the
//!   stream's bytes, decides, dials, answers on the stream (the proxy reply) and relays.
//! - **Port forwards.** A client asks the supervisor with [`ForwardRequest::Connect`]; the supervisor, once the
//!   policy admits it, asks the guest with [`NetToGuest::Connect`], and the agent dials the guest's
//!   `127.0.0.1:port`.
//!
//! Each side of a stream grants the other a receive window when the stream opens (`window` in `Opened`,
//! `Accept`, `Connect`, `Connected`) and returns credit as it hands bytes on ([`crate::flow`]). `Eof` closes
//! one direction (the sender's), so half-closed connections work; `Close` aborts both, and nothing more follows
//! for that id from its sender. A stream ends when both directions saw `Eof`, or on either `Close`.
//!
//! Tags: the link's enums and the attach socket's share their first two (`Connect`/`Connected`, `Stream`), which
//! mean the same on both; the rest are each channel's own.
//!
//! Ids: the side that opens a stream numbers it, strictly increasing; the guest's ids are below
//! [`HOST_OPENED`], the host's at or above it, so the two never collide and a stream's opener is in its id.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::message::Refusal;

/// One stream on one channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct StreamId(pub u32);

/// The first id of the host's range: ids the guest opens are below it.
pub const HOST_OPENED: u32 = 1 << 31;

impl StreamId {
    /// Whether the host (supervisor or client) opened it.
    pub fn host_opened(self) -> bool {
        self.0 >= HOST_OPENED
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Which of the agent's loopback listeners accepted a connection: how the supervisor reads its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Listener {
    /// The HTTP proxy: `CONNECT host:port` or an absolute-form request (`GET http://host/...`).
    Http,
    /// The SOCKS5 proxy (CONNECT only, names resolved by the host).
    Socks,
}

impl Listener {
    /// The guest loopback port it listens on.
    pub fn port(self) -> u16 {
        match self {
            Self::Http => HTTP_PROXY_PORT,
            Self::Socks => SOCKS_PROXY_PORT,
        }
    }
}

/// The guest loopback port of the HTTP proxy listener.
pub const HTTP_PROXY_PORT: u16 = 3128;
/// The guest loopback port of the SOCKS5 proxy listener.
pub const SOCKS_PROXY_PORT: u16 = 1080;

/// Where the agent writes the sandbox's CA certificate ([`crate::link::VmRequest::Trust`]), alone.
pub const TRUST_CA_FILE: &str = "/run/vm-driver/ca.pem";
/// Where it writes the image's system bundle with the sandbox's CA after it; the system bundle's path, where
/// the image has one, shows this file.
pub const TRUST_BUNDLE_FILE: &str = "/run/vm-driver/ca-certificates.crt";
/// Where images keep their system bundle, in the order looked for: Debian, Ubuntu, Alpine, Arch; Fedora
/// and RHEL; openSUSE; Alpine's and the BSDs' other name. The first that is a file is the one used.
pub const SYSTEM_BUNDLE_FILES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// Receive window each side grants a stream when it opens, but the agent's for an egress stream
/// ([`EGRESS_DOWNLOAD_WINDOW_BYTES`]): what the supervisor holds of a workload's uploads, so 64 streams cost
/// it 16 MiB at most.
pub const NET_WINDOW_BYTES: u32 = 256 * 1024;

/// Receive window the agent grants an egress stream it opens: what the host may send ahead towards the
/// workload. Larger than [`NET_WINDOW_BYTES`] because a download under emulation otherwise waits on the credit
/// round trip; the host's memory does not grow with it, since what the supervisor holds of every download
/// together is bounded apart from the windows (its download budget). Port forwards keep [`NET_WINDOW_BYTES`]
/// both ways: a forward's client sends within the guest's window, and the supervisor queues what it sends.
pub const EGRESS_DOWNLOAD_WINDOW_BYTES: u32 = 2 * 1024 * 1024;

/// What flows on an open stream, the same in both directions and on both channels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StreamFrame {
    /// Bytes, within the receiver's credit. Never empty; at most [`crate::frame::MAX_DATA_BYTES`].
    Data {
        /// The stream.
        id: StreamId,
        /// The bytes.
        data: ByteBuf,
    },
    /// The sender will send no more bytes (its direction is closed; the other may go on).
    Eof {
        /// The stream.
        id: StreamId,
    },
    /// The receiver handed `bytes` on: the sender may send that many more. Never zero.
    Credit {
        /// The stream.
        id: StreamId,
        /// Bytes of additional credit.
        bytes: u32,
    },
    /// Abort both directions: nothing more follows from the sender, and the receiver drops the connection.
    Close {
        /// The stream.
        id: StreamId,
    },
}

impl StreamFrame {
    /// The stream it is about.
    pub fn id(&self) -> StreamId {
        match self {
            Self::Data { id, .. } | Self::Eof { id } | Self::Credit { id, .. } | Self::Close { id } => *id,
        }
    }
}

/// Supervisor to guest, on the link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetToGuest {
    /// Dial the guest's `127.0.0.1:port` (a port forward) as stream `id` (host range), granting `window`.
    /// Answered by `Connected`, or by `Close` when nothing listens there.
    Connect {
        /// The new stream.
        id: StreamId,
        /// Guest loopback port.
        port: u16,
        /// The host's receive window.
        window: u32,
    },
    /// On an open stream.
    Stream(StreamFrame),
    /// The supervisor takes the stream the guest opened, granting `window`. A refused one gets `Close` instead.
    Accept {
        /// The guest's stream.
        id: StreamId,
        /// The host's receive window.
        window: u32,
    },
}

/// Guest to supervisor, on the link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetToHost {
    /// The answer to `Connect`: the guest's port accepted.
    Connected {
        /// The stream.
        id: StreamId,
        /// The guest's receive window.
        window: u32,
    },
    /// On an open stream.
    Stream(StreamFrame),
    /// A workload connected to a proxy listener: stream `id` (guest range), granting `window`. The guest
    /// may send the connection's first bytes (the proxy request) at once, within the window it will be
    /// granted: it waits for `Accept` first.
    Opened {
        /// The new stream.
        id: StreamId,
        /// Which listener.
        listener: Listener,
        /// The guest's receive window.
        window: u32,
    },
}

/// Attach client to supervisor: a port forward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardRequest {
    /// Open stream `id` (this connection's numbering, strictly increasing) to the guest's `127.0.0.1:port`,
    /// granting `window`. Answered by `Connected` or `Refused`.
    Connect {
        /// The new stream.
        id: StreamId,
        /// Guest loopback port.
        port: u16,
        /// The client's receive window.
        window: u32,
    },
    /// On an open stream.
    Stream(StreamFrame),
}

/// Supervisor to attach client: a port forward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardEvent {
    /// The guest's port accepted.
    Connected {
        /// The stream.
        id: StreamId,
        /// The guest's receive window.
        window: u32,
    },
    /// On an open stream. `Close` before `Connected` means nothing listened on the guest's port.
    Stream(StreamFrame),
    /// Tag 2 is the link's `Opened`: never on the attach socket.
    #[doc(hidden)]
    LinkOnly(crate::message::Never),
    /// The forward was refused before it reached the guest; nothing else follows for `id`.
    Refused {
        /// The stream.
        id: StreamId,
        /// Why.
        reason: Refusal,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_id_ranges_never_meet() {
        assert!(!StreamId(HOST_OPENED - 1).host_opened());
        assert!(StreamId(HOST_OPENED).host_opened());
        assert_eq!((Listener::Http.port(), Listener::Socks.port()), (3128, 1080));
    }
}

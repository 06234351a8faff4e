//! The guest link: what the supervisor and the guest agent say to each other over the boundary channel.
//!
//! The supervisor is the only host on this channel. Besides the process messages it carries what only the
//! supervisor may ask of the guest as a whole ([`VmRequest`]); what only attach clients may ask
//! ([`crate::attach`]) has no tag here, so the agent's decoder refuses it. Tags: [`crate::message`].

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::handshake::Hello;
use crate::message::{Never, ProcessEvent, ProcessRequest};
use crate::net::{NetToGuest, NetToHost};
use crate::process::SignalName;

/// Supervisor to guest agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToGuest {
    /// Tag 0, never valid: an all-zero frame is not a message.
    #[doc(hidden)]
    Reserved(Never),
    /// Opens the connection (the supervisor's reply to the guest's hello).
    Hello(Hello),
    /// About one process.
    Process(ProcessRequest),
    /// Answer with `Pong` carrying the same nonce.
    Ping {
        /// Echoed back.
        nonce: u64,
    },
    /// About the guest as a whole.
    Vm(VmRequest),
    /// Tag 5 is the attach socket's: never on the link.
    #[doc(hidden)]
    AttachOnly(Never),
    /// About one network stream.
    Net(NetToGuest),
}

/// What the supervisor alone asks of the guest as a whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum VmRequest {
    /// Stop every process (`signal`, then SIGKILL after `grace_ms`) and power the VM off.
    Shutdown {
        /// Milliseconds between `signal` and SIGKILL.
        grace_ms: u32,
        /// What asks the processes to stop: SIGTERM, or the image's `StopSignal`.
        signal: SignalName,
    },
    /// Sent by the supervisor right after every hello, before any process: fresh host entropy and the host's
    /// wall clock. The agent adds the bytes to the kernel's pool, forces the kernel RNG to reseed from it,
    /// and sets the clock. A VM restored from a snapshot would otherwise serve every clone the RNG state and
    /// the stale time it was saved with.
    Reseed {
        /// [`RESEED_BYTES`] bytes from the host's RNG (more or fewer is a violation).
        entropy: HostEntropy,
        /// The host's wall clock: nanoseconds since the Unix epoch.
        unix_nanos: u64,
    },
    /// Whether the agent's loopback proxy listeners should exist: sent after the reseed when the policy
    /// allows some egress, and again whenever a policy update changes that. The listeners are a convenience,
    /// not a control: every connection is still decided by the supervisor.
    Egress {
        /// Listen (true) or close the listeners (false).
        listen: bool,
    },
    /// The sandbox's certificate authority, for the trust the workload sees (`docs/network.md`,
    /// Interception): sent after the reseed when some rule intercepts TLS. The agent writes it beside the
    /// system bundle; it is public, its key never leaves the supervisor.
    Trust {
        /// One PEM certificate, at most [`MAX_CA_PEM_BYTES`].
        ca_pem: String,
    },
}

/// Longest CA certificate a [`VmRequest::Trust`] carries.
pub const MAX_CA_PEM_BYTES: usize = 8 * 1024;

/// Seed material: its `Debug` shows the length only, so no log line can carry it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostEntropy(pub ByteBuf);

impl std::fmt::Debug for HostEntropy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostEntropy({} bytes)", self.0.len())
    }
}

/// Bytes of host entropy in a [`VmRequest::Reseed`]: 512 bits, twice what the kernel needs to call its RNG
/// initialized.
pub const RESEED_BYTES: usize = 64;

/// Guest agent to supervisor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToHost {
    /// Tag 0, never valid.
    #[doc(hidden)]
    Reserved(Never),
    /// Opens the connection; the guest speaks first.
    Hello(Hello),
    /// About one process.
    Process(ProcessEvent),
    /// Answer to `Ping`.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// Tag 4: the guest has no link-only answer yet.
    #[doc(hidden)]
    LinkReserved(Never),
    /// Tag 5 is the attach socket's: never on the link.
    #[doc(hidden)]
    AttachOnly(Never),
    /// About one network stream.
    Net(NetToHost),
}

impl From<ProcessRequest> for ToGuest {
    fn from(msg: ProcessRequest) -> Self {
        Self::Process(msg)
    }
}

impl From<VmRequest> for ToGuest {
    fn from(msg: VmRequest) -> Self {
        Self::Vm(msg)
    }
}

impl From<ProcessEvent> for ToHost {
    fn from(msg: ProcessEvent) -> Self {
        Self::Process(msg)
    }
}

impl From<NetToGuest> for ToGuest {
    fn from(msg: NetToGuest) -> Self {
        Self::Net(msg)
    }
}

impl From<NetToHost> for ToHost {
    fn from(msg: NetToHost) -> Self {
        Self::Net(msg)
    }
}

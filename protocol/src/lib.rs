//! The boundary protocol between the host (supervisor, driver) and the guest agent.
//!
//! One byte stream (a virtio-serial port today, vsock elsewhere) carries length-prefixed frames, each
//! holding one bincode-encoded message. The same framing travels on the supervisor's attach socket, with a
//! message type of its own per channel and direction, so each decoder accepts only what its channel carries.
//!
//! - [`frame`]: the wire format, its hard size limit, and a decoder that never panics on hostile bytes.
//! - [`link`]: supervisor and guest agent ([`link::ToGuest`], [`link::ToHost`]).
//! - [`attach`]: attach client and supervisor ([`attach::ToSupervisor`], [`attach::ToClient`]).
//! - [`message`]: what both channels share, the process messages ([`ProcessRequest`], [`ProcessEvent`]), and
//!   the tag table of all four types.
//! - [`handshake`]: the versioned hello that opens every connection.
//! - [`identity`]: the fixed user and group workload processes run as in the guest.
//! - [`net`]: network streams (egress through the guest's loopback proxies, port forwards in).
//! - [`policy`]: which boundary operations a sandbox's clients may use, and live updates of it.
//! - [`process`]: process ids, exit statuses, named signals, output streams.
//! - [`rlimit`]: the resource limits a spawned process starts with.
//! - [`container`]: a container's own root in a pod's VM, which a spawned process may run in.
//! - [`mounts`], [`tmpfs`]: host directories shared into the guest, and memory file systems of its own.
//! - [`files`]: the files API (read, write, list, copy a tree in and out), run as processes of the agent.
//! - [`flow`]: credit windows that bound buffering on both sides.
//! - `arbitrary` (feature `proptest`): generators of every channel's messages, for property tests on all sides.
//! - `driver_api` (feature `grpc`): the gRPC API of `vm-driver serve`, generated from `proto/`.
//! - `openshell` (feature `openshell`): OpenShell's ComputeDriver and supervisor contracts, from the protos
//!   vendored in `proto/openshell/`.
//!
//! The wire format is documented in `docs/protocol.md`.
//!
//! ```
//! use vm_protocol::{attach, frame, link, ProcId, ProcessEvent, Stream};
//!
//! let output = ProcessEvent::Output { id: ProcId(1), stream: Stream::Stdout, data: b"hi".to_vec().into() };
//! let msg = link::ToHost::Process(output);
//! let mut wire = Vec::new();
//! frame::encode(&msg, &mut wire).unwrap();
//! let (back, used) = frame::decode::<link::ToHost>(&wire).unwrap().unwrap();
//! assert_eq!(back, msg);
//! assert_eq!(used, wire.len());
//!
//! // A message of the attach socket only never decodes on the guest link.
//! let mut wire = Vec::new();
//! frame::encode(&attach::ToSupervisor::Supervisor(attach::SupervisorRequest::ListProcesses), &mut wire).unwrap();
//! assert!(frame::decode::<link::ToGuest>(&wire).is_err());
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "proptest")]
pub mod arbitrary;
pub mod attach;
#[cfg(feature = "tokio")]
pub mod codec;
pub mod container;
pub mod credentials;
#[cfg(feature = "grpc")]
pub mod driver_api;
pub mod files;
pub mod flow;
pub mod frame;
pub mod handshake;
pub mod identity;
pub mod link;
pub mod message;
pub mod mounts;
pub mod net;
#[cfg(feature = "openshell")]
pub mod openshell;
pub mod policy;
pub mod process;
pub mod rlimit;
pub mod root;
pub mod tmpfs;

/// Name of the virtio-serial port that carries the boundary channel (`/sys/class/virtio-ports/*/name`).
pub const CHANNEL_PORT_NAME: &str = "vm.boundary";

pub use flow::{CreditError, Window};
pub use frame::{FrameError, FrameViolation};
pub use handshake::{Capabilities, HandshakeError, Hello, PROTOCOL_VERSION};
pub use message::{ProcessEvent, ProcessRequest, Spawn};
pub use process::{ExitStatus, ProcId, PtySize, SignalName, Stream};

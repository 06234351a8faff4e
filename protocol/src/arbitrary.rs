//! Generators of every channel's messages, for property tests on every side of both channels (feature
//! `proptest`): the guest link's [`link_to_guest`] and [`link_to_host`], the attach socket's
//! [`attach_to_supervisor`] and [`attach_to_client`], and the process messages they share.
//!
//! Ids come from a range the caller picks: the decoder's tests want any `u32`, the stateful tests of the
//! supervisor's multiplexer and the agent's link want a few ids so that messages collide with live
//! processes. Sizes and windows mix the edges (0, 1, the caps, `u32::MAX`) with ordinary values.

use std::ops::Range;

use proptest::prelude::*;

use crate::attach::{Disconnect, ProcessSummary, SupervisorReply, SupervisorRequest, ToClient, ToSupervisor};
use crate::container::ContainerRoot;
use crate::credentials::{CredentialRotation, RotationOutcome};
use crate::files::{FileOp, FileSpawn, TarLayout, TarRefusal};
use crate::flow::MAX_WINDOW_BYTES;
use crate::handshake::{Capabilities, Hello, HELLO_MAGIC, PROTOCOL_VERSION};
use crate::identity::{IdSelector, RunAs};
use crate::link::{self, HostEntropy, VmRequest, RESEED_BYTES};
use crate::message::{EnvVar, ProcessEvent, ProcessRequest, Refusal, Spawn, MAX_FAILURE_MESSAGE_BYTES};
use crate::net::{ForwardEvent, ForwardRequest, Listener, NetToGuest, NetToHost, StreamFrame, StreamId, HOST_OPENED};
use crate::policy::network::{HttpRule, IpRange, NetRule, TlsMode};
use crate::policy::{Operation, PolicyUpdate, UpdateOutcome};
use crate::process::{ExitStatus, ProcId, PtySize, SignalName, Stream};
use crate::rlimit::{Rlimit, RESOURCES, UNLIMITED};

fn text() -> impl Strategy<Value = String> {
    "[ -~]{0,24}"
}

/// A byte count or window: the edges the rules are about, and ordinary sizes.
pub fn amount() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0), Just(1), Just(MAX_WINDOW_BYTES), Just(MAX_WINDOW_BYTES + 1), Just(u32::MAX), 1..65_536u32,]
}

/// Data for `Output` or `Stdin`: often empty (a rule), usually small.
fn data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![1 => Just(Vec::new()), 4 => prop::collection::vec(any::<u8>(), 1..256)]
}

/// An exit status: plausible ones, and the forged numbers a rogue guest sends.
pub fn exit_status() -> impl Strategy<Value = ExitStatus> {
    prop_oneof![
        (0..256i32).prop_map(ExitStatus::Code),
        (1..65i32).prop_map(ExitStatus::Signaled),
        any::<i32>().prop_map(ExitStatus::Code),
        prop_oneof![Just(i32::MAX), Just(i32::MIN), Just(-128), Just(0), Just(65)].prop_map(ExitStatus::Signaled),
    ]
}

/// A hello, ours or with another magic or version.
pub fn hello() -> impl Strategy<Value = Hello> {
    (any::<bool>(), any::<u64>(), text()).prop_map(|(ours, caps, software)| {
        let mut hello = Hello::ours(Capabilities(caps), software);
        if !ours {
            hello.magic = HELLO_MAGIC ^ 1;
            hello.version = PROTOCOL_VERSION.wrapping_add(1);
        }
        hello
    })
}

/// A `Spawn` with an id from `ids` and an argv drawn from `commands` (never empty lists unless given).
pub fn spawn(ids: Range<u32>, commands: Vec<Vec<String>>) -> impl Strategy<Value = Spawn> {
    (
        ids,
        prop::sample::select(commands),
        prop::collection::vec((text(), text()), 0..3),
        prop::option::of(prop_oneof![Just("/".to_owned()), Just("/no/such/dir".to_owned())]),
        prop::option::weighted(0.1, (any::<u16>(), any::<u16>()).prop_map(|(rows, cols)| PtySize { rows, cols })),
        amount(),
        prop::collection::vec(rlimit(), 0..3),
        prop::option::weighted(0.1, container_root()),
    )
        .prop_map(|(id, argv, env, cwd, pty, output_window, rlimits, root)| Spawn {
            id: ProcId(id),
            argv,
            env: env.into_iter().map(|(key, value)| EnvVar { key, value }).collect(),
            cwd,
            pty,
            output_window,
            rlimits,
            root,
        })
}

/// A container root, valid or not (a name or target that would leave the pod directory).
fn container_root() -> impl Strategy<Value = ContainerRoot> {
    let name = prop_oneof![Just("web".to_owned()), Just("../x".to_owned()), text()];
    let target = prop_oneof![Just("/etc/hosts".to_owned()), Just("/proc/x".to_owned()), text()];
    (name, prop::collection::vec(target, 0..3)).prop_map(|(name, files)| ContainerRoot { name, files })
}

/// A resource limit, valid or not (soft above hard, a resource twice in a list).
fn rlimit() -> impl Strategy<Value = Rlimit> {
    let value = prop_oneof![Just(UNLIMITED), 0..4096_u64, any::<u64>()];
    (prop::sample::select(RESOURCES.to_vec()), value.clone(), value).prop_map(|(resource, soft, hard)| Rlimit {
        resource,
        soft,
        hard,
    })
}

/// Every process request, `Spawn`s of `commands`.
pub fn process_request(ids: Range<u32>, commands: Vec<Vec<String>>) -> BoxedStrategy<ProcessRequest> {
    let id = ids.clone().prop_map(ProcId);
    prop_oneof![
        4 => spawn(ids, commands).prop_map(ProcessRequest::Spawn),
        3 => (id.clone(), data()).prop_map(|(id, d)| ProcessRequest::Stdin { id, data: d.into() }),
        2 => id.clone().prop_map(|id| ProcessRequest::StdinEof { id }),
        2 => (id.clone(), prop::sample::select(SignalName::ALL.to_vec()))
            .prop_map(|(id, signal)| ProcessRequest::Signal { id, signal }),
        1 => (id.clone(), any::<u16>(), any::<u16>())
            .prop_map(|(id, rows, cols)| ProcessRequest::Resize { id, size: PtySize { rows, cols } }),
        3 => (id.clone(), amount()).prop_map(|(id, bytes)| ProcessRequest::Credit { id, bytes }),
        2 => (id, file_op(), amount())
            .prop_map(|(id, op, output_window)| ProcessRequest::Files(FileSpawn { id, op, output_window })),
    ]
    .boxed()
}

/// Every file operation, with short paths that may be empty, hold a NUL or climb with `..`.
pub fn file_op() -> BoxedStrategy<FileOp> {
    let path = || "[a-z/.\\x00]{0,12}";
    prop_oneof![
        path().prop_map(|path| FileOp::Read { path }),
        (path(), 0u32..0o20000).prop_map(|(path, mode)| FileOp::Write { path, mode }),
        path().prop_map(|path| FileOp::List { path }),
        path().prop_map(|path| FileOp::Stat { path }),
        (path(), any::<bool>()).prop_map(|(path, parents)| FileOp::MakeDir { path, parents }),
        (path(), any::<bool>()).prop_map(|(path, recursive)| FileOp::Remove { path, recursive }),
        (path(), path()).prop_map(|(from, to)| FileOp::Rename { from, to }),
        (path(), prop::sample::select(vec![TarLayout::Into, TarLayout::Named]))
            .prop_map(|(path, layout)| FileOp::CopyIn { path, layout }),
        path().prop_map(|path| FileOp::CopyOut { path }),
    ]
    .boxed()
}

/// Every message of the supervisor to the guest agent.
pub fn link_to_guest(ids: Range<u32>, commands: Vec<Vec<String>>) -> BoxedStrategy<link::ToGuest> {
    prop_oneof![
        1 => hello().prop_map(link::ToGuest::Hello),
        14 => process_request(ids.clone(), commands).prop_map(link::ToGuest::Process),
        1 => any::<u64>().prop_map(|nonce| link::ToGuest::Ping { nonce }),
        2 => vm_request().prop_map(link::ToGuest::Vm),
        6 => net_to_guest(ids).prop_map(link::ToGuest::Net),
    ]
    .boxed()
}

/// A stream id: from `ids` in the guest's range or the host's (so messages meet live streams), or any.
pub fn stream_id(ids: Range<u32>) -> impl Strategy<Value = StreamId> + Clone {
    let host = ids.start.saturating_add(HOST_OPENED)..ids.end.saturating_add(HOST_OPENED);
    prop_oneof![4 => ids.prop_map(StreamId), 4 => host.prop_map(StreamId), 1 => any::<u32>().prop_map(StreamId)]
}

/// What flows on an open stream.
pub fn stream_frame(ids: Range<u32>) -> BoxedStrategy<StreamFrame> {
    let id = stream_id(ids);
    prop_oneof![
        5 => (id.clone(), data()).prop_map(|(id, d)| StreamFrame::Data { id, data: d.into() }),
        1 => id.clone().prop_map(|id| StreamFrame::Eof { id }),
        3 => (id.clone(), amount()).prop_map(|(id, bytes)| StreamFrame::Credit { id, bytes }),
        1 => id.prop_map(|id| StreamFrame::Close { id }),
    ]
    .boxed()
}

/// Every network message of the supervisor to the guest.
pub fn net_to_guest(ids: Range<u32>) -> BoxedStrategy<NetToGuest> {
    let id = stream_id(ids.clone());
    prop_oneof![
        1 => (id.clone(), any::<u16>(), amount()).prop_map(|(id, port, window)| NetToGuest::Connect { id, port, window }),
        1 => (id, amount()).prop_map(|(id, window)| NetToGuest::Accept { id, window }),
        6 => stream_frame(ids).prop_map(NetToGuest::Stream),
    ]
    .boxed()
}

/// Every network message of the guest to the supervisor.
pub fn net_to_host(ids: Range<u32>) -> BoxedStrategy<NetToHost> {
    let id = stream_id(ids.clone());
    let listener = prop::sample::select(vec![Listener::Http, Listener::Socks]);
    prop_oneof![
        2 => (id.clone(), listener, amount()).prop_map(|(id, listener, window)| NetToHost::Opened { id, listener, window }),
        1 => (id, amount()).prop_map(|(id, window)| NetToHost::Connected { id, window }),
        6 => stream_frame(ids).prop_map(NetToHost::Stream),
    ]
    .boxed()
}

/// Every port-forward message of a client to the supervisor.
pub fn forward_request(ids: Range<u32>) -> BoxedStrategy<ForwardRequest> {
    let id = stream_id(ids.clone());
    prop_oneof![
        1 => (id, any::<u16>(), amount()).prop_map(|(id, port, window)| ForwardRequest::Connect { id, port, window }),
        4 => stream_frame(ids).prop_map(ForwardRequest::Stream),
    ]
    .boxed()
}

/// Every port-forward message of the supervisor to a client.
pub fn forward_event(ids: Range<u32>) -> BoxedStrategy<ForwardEvent> {
    let id = stream_id(ids.clone());
    prop_oneof![
        1 => (id.clone(), amount()).prop_map(|(id, window)| ForwardEvent::Connected { id, window }),
        1 => (id, refusal()).prop_map(|(id, reason)| ForwardEvent::Refused { id, reason }),
        4 => stream_frame(ids).prop_map(ForwardEvent::Stream),
    ]
    .boxed()
}

/// A network rule of a few shapes.
fn net_rule() -> BoxedStrategy<NetRule> {
    let host = prop::sample::select(vec!["pypi.org", "*.example.com", "host.vm-driver.internal", "10.0.0.1"]);
    let range = IpRange(ipnet::IpNet::from(std::net::IpAddr::from([10, 0, 0, 1])));
    let http = HttpRule { methods: vec!["POST".into()], paths: vec!["/v1/*".into()] };
    let tls = prop::sample::select(vec![TlsMode::Passthrough, TlsMode::Intercept]);
    (
        host,
        prop::collection::vec(any::<u16>(), 0..3),
        prop::collection::vec(Just(range), 0..2),
        tls,
        prop::collection::vec(Just(http), 0..2),
    )
        .prop_map(|(host, ports, allowed_ips, tls, http)| NetRule {
            host: host.parse().unwrap_or_else(|_| unreachable!()),
            ports,
            allowed_ips,
            tls,
            http,
        })
        .boxed()
}

/// A shutdown, or a reseed with the right number of bytes or another.
pub fn vm_request() -> impl Strategy<Value = VmRequest> {
    prop_oneof![
        (0..2000u32, prop::sample::select(SignalName::ALL.to_vec()))
            .prop_map(|(grace_ms, signal)| VmRequest::Shutdown { grace_ms, signal }),
        (prop_oneof![Just(RESEED_BYTES), 0..2 * RESEED_BYTES], any::<u64>())
            .prop_flat_map(|(n, unix_nanos)| (prop::collection::vec(any::<u8>(), n), Just(unix_nanos)))
            .prop_map(|(e, unix_nanos)| VmRequest::Reseed { entropy: HostEntropy(e.into()), unix_nanos }),
        any::<bool>().prop_map(|listen| VmRequest::Egress { listen }),
        prop::sample::select(vec![
            String::new(),
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n".into()
        ])
        .prop_map(|ca_pem| VmRequest::Trust { ca_pem }),
    ]
}

/// Every message of an attach client to the supervisor.
pub fn attach_to_supervisor(ids: Range<u32>, commands: Vec<Vec<String>>) -> BoxedStrategy<ToSupervisor> {
    prop_oneof![
        1 => hello().prop_map(ToSupervisor::Hello),
        14 => process_request(ids.clone(), commands).prop_map(ToSupervisor::Process),
        1 => any::<u64>().prop_map(|nonce| ToSupervisor::Ping { nonce }),
        5 => supervisor_request(ids.clone()).prop_map(ToSupervisor::Supervisor),
        4 => forward_request(ids).prop_map(ToSupervisor::Forward),
    ]
    .boxed()
}

/// Every request an attach client may make of the supervisor itself.
pub fn supervisor_request(ids: Range<u32>) -> BoxedStrategy<SupervisorRequest> {
    let id = ids.prop_map(ProcId);
    prop_oneof![
        (id.clone(), any::<u32>()).prop_map(|(id, pid)| SupervisorRequest::Reattach { id, pid }),
        id.clone().prop_map(|id| SupervisorRequest::Detach { id }),
        (id, text(), prop::sample::select(TarRefusal::ALL.to_vec()))
            .prop_map(|(id, path, reason)| SupervisorRequest::TarRefused { id, path, reason }),
        Just(SupervisorRequest::ListProcesses),
        (
            any::<u64>(),
            prop::collection::vec(prop::sample::select(Operation::ALL.to_vec()), 0..8),
            run_as(),
            prop::option::of(prop::collection::vec(net_rule(), 0..3))
        )
            .prop_map(|(revision, allow, run_as, network)| {
                SupervisorRequest::UpdatePolicy(PolicyUpdate { revision, allow, run_as, network })
            }),
        (prop::option::of(prop::collection::vec((text(), text()), 0..3)), prop::option::of(text())).prop_map(
            |(headers, ca_path)| SupervisorRequest::RotateCredentials(CredentialRotation {
                headers,
                ca_path,
                secrets: None
            })
        ),
    ]
    .boxed()
}

fn run_as() -> impl Strategy<Value = Option<RunAs>> {
    let selector = || prop::option::of(text().prop_map(IdSelector));
    prop::option::of((selector(), selector()).prop_map(|(user, group)| RunAs { user, group }))
}

fn refusal() -> impl Strategy<Value = Refusal> {
    prop::sample::select(vec![
        Refusal::ShuttingDown,
        Refusal::IdNotIncreasing,
        Refusal::TooManyProcesses,
        Refusal::Invalid,
        Refusal::NoSuchProcess,
        Refusal::Denied,
    ])
}

/// Every process event.
pub fn process_event(ids: Range<u32>) -> BoxedStrategy<ProcessEvent> {
    let id = ids.prop_map(ProcId);
    prop_oneof![
        3 => (id.clone(), any::<u32>(), amount(), amount()).prop_map(|(id, pid, stdin_window, output_window)| {
            ProcessEvent::Started { id, pid, stdin_window, output_window }
        }),
        5 => (id.clone(), any::<bool>(), data()).prop_map(|(id, err, d)| ProcessEvent::Output {
            id,
            stream: if err { Stream::Stderr } else { Stream::Stdout },
            data: d.into(),
        }),
        2 => (id.clone(), amount()).prop_map(|(id, bytes)| ProcessEvent::StdinCredit { id, bytes }),
        2 => (id.clone(), exit_status()).prop_map(|(id, status)| ProcessEvent::Exited { id, status }),
        1 => (id.clone(), refusal()).prop_map(|(id, reason)| ProcessEvent::Refused { id, reason }),
        1 => (id, exit_status(), prop_oneof![text(), Just("x".repeat(MAX_FAILURE_MESSAGE_BYTES + 1))])
            .prop_map(|(id, status, message)| ProcessEvent::SpawnFailed { id, status, message }),
    ]
    .boxed()
}

/// Every message of the guest agent to the supervisor.
pub fn link_to_host(ids: Range<u32>) -> BoxedStrategy<link::ToHost> {
    prop_oneof![
        1 => hello().prop_map(link::ToHost::Hello),
        14 => process_event(ids.clone()).prop_map(link::ToHost::Process),
        1 => any::<u64>().prop_map(|nonce| link::ToHost::Pong { nonce }),
        6 => net_to_host(ids).prop_map(link::ToHost::Net),
    ]
    .boxed()
}

/// Every message of the supervisor to an attach client.
pub fn attach_to_client(ids: Range<u32>) -> BoxedStrategy<ToClient> {
    prop_oneof![
        1 => hello().prop_map(ToClient::Hello),
        14 => process_event(ids.clone()).prop_map(ToClient::Process),
        1 => any::<u64>().prop_map(|nonce| ToClient::Pong { nonce }),
        3 => supervisor_reply().prop_map(ToClient::Supervisor),
        4 => forward_event(ids).prop_map(ToClient::Forward),
    ]
    .boxed()
}

/// Every answer of the supervisor to such a request.
pub fn supervisor_reply() -> impl Strategy<Value = SupervisorReply> {
    let summary = (any::<u32>(), prop::collection::vec(text(), 0..3), any::<bool>(), any::<bool>())
        .prop_map(|(pid, argv, attached, tty)| ProcessSummary { pid, argv, attached, tty });
    prop_oneof![
        prop::collection::vec(summary, 0..3).prop_map(|list| SupervisorReply::Processes { list }),
        (
            any::<u64>(),
            prop::sample::select(vec![
                UpdateOutcome::Applied,
                UpdateOutcome::Stale,
                UpdateOutcome::NotApproved,
                UpdateOutcome::IdentityConflict,
            ])
        )
            .prop_map(|(revision, outcome)| SupervisorReply::PolicyAck { revision, outcome }),
        prop::sample::select(vec![
            RotationOutcome::Applied,
            RotationOutcome::NoCollector,
            RotationOutcome::BadHeader,
            RotationOutcome::CaUnreadable,
            RotationOutcome::Empty,
        ])
        .prop_map(|outcome| SupervisorReply::CredentialsAck { outcome }),
        Just(SupervisorReply::Disconnected { reason: Disconnect::NotReading }),
    ]
}

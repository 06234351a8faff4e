//! Generators of every message, for property tests on both sides of the boundary (feature `proptest`).
//!
//! Ids come from a range the caller picks: the decoder's tests want any `u32`, the stateful tests of the
//! supervisor's multiplexer and the agent's link want a few ids so that messages collide with live
//! processes. Sizes and windows mix the edges (0, 1, the caps, `u32::MAX`) with ordinary values.

use std::ops::Range;

use proptest::prelude::*;

use crate::credentials::{CredentialRotation, RotationOutcome};
use crate::flow::MAX_WINDOW_BYTES;
use crate::handshake::{Capabilities, Hello, HELLO_MAGIC, PROTOCOL_VERSION};
use crate::identity::{IdSelector, RunAs};
use crate::message::{
    EnvVar, HostEntropy, ProcessSummary, Refusal, Spawn, ToGuest, ToHost, MAX_FAILURE_MESSAGE_BYTES, RESEED_BYTES,
};
use crate::policy::{Operation, PolicyUpdate, UpdateOutcome};
use crate::process::{ExitStatus, ProcId, PtySize, SignalName, Stream};

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
    )
        .prop_map(|(id, argv, env, cwd, pty, output_window)| Spawn {
            id: ProcId(id),
            argv,
            env: env.into_iter().map(|(key, value)| EnvVar { key, value }).collect(),
            cwd,
            pty,
            output_window,
        })
}

/// Every host-to-guest message, `Spawn`s of `commands`.
pub fn to_guest(ids: Range<u32>, commands: Vec<Vec<String>>) -> impl Strategy<Value = ToGuest> {
    let id = ids.clone().prop_map(ProcId);
    prop_oneof![
        1 => Just(ToGuest::Reserved),
        1 => hello().prop_map(ToGuest::Hello),
        4 => spawn(ids, commands).prop_map(ToGuest::Spawn),
        3 => (id.clone(), data()).prop_map(|(id, d)| ToGuest::Stdin { id, data: d.into() }),
        2 => id.clone().prop_map(|id| ToGuest::StdinEof { id }),
        2 => (id.clone(), prop::sample::select(SignalName::ALL.to_vec()))
            .prop_map(|(id, signal)| ToGuest::Signal { id, signal }),
        1 => (id.clone(), any::<u16>(), any::<u16>())
            .prop_map(|(id, rows, cols)| ToGuest::Resize { id, size: PtySize { rows, cols } }),
        3 => (id.clone(), amount()).prop_map(|(id, bytes)| ToGuest::Credit { id, bytes }),
        1 => any::<u64>().prop_map(|nonce| ToGuest::Ping { nonce }),
        1 => (0..2000u32).prop_map(|grace_ms| ToGuest::Shutdown { grace_ms }),
        1 => (id.clone(), any::<u32>()).prop_map(|(id, pid)| ToGuest::Reattach { id, pid }),
        1 => id.prop_map(|id| ToGuest::Detach { id }),
        1 => Just(ToGuest::ListProcesses),
        1 => (prop_oneof![Just(RESEED_BYTES), 0..2 * RESEED_BYTES], any::<u64>())
            .prop_flat_map(|(n, unix_nanos)| (prop::collection::vec(any::<u8>(), n), Just(unix_nanos)))
            .prop_map(|(e, unix_nanos)| ToGuest::Reseed { entropy: HostEntropy(e.into()), unix_nanos }),
        1 => (any::<u64>(), prop::collection::vec(prop::sample::select(Operation::ALL.to_vec()), 0..7), run_as())
            .prop_map(|(revision, allow, run_as)| ToGuest::UpdatePolicy(PolicyUpdate { revision, allow, run_as })),
        1 => (prop::option::of(prop::collection::vec((text(), text()), 0..3)), prop::option::of(text()))
            .prop_map(|(headers, ca_path)| ToGuest::RotateCredentials(CredentialRotation { headers, ca_path })),
    ]
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

/// Every guest-to-host message.
pub fn to_host(ids: Range<u32>) -> impl Strategy<Value = ToHost> {
    let id = ids.prop_map(ProcId);
    let summary = (any::<u32>(), prop::collection::vec(text(), 0..3), any::<bool>(), any::<bool>())
        .prop_map(|(pid, argv, attached, tty)| ProcessSummary { pid, argv, attached, tty });
    prop_oneof![
        1 => Just(ToHost::Reserved),
        1 => hello().prop_map(ToHost::Hello),
        3 => (id.clone(), any::<u32>(), amount(), amount()).prop_map(|(id, pid, stdin_window, output_window)| {
            ToHost::Started { id, pid, stdin_window, output_window }
        }),
        5 => (id.clone(), any::<bool>(), data()).prop_map(|(id, err, d)| ToHost::Output {
            id,
            stream: if err { Stream::Stderr } else { Stream::Stdout },
            data: d.into(),
        }),
        2 => (id.clone(), amount()).prop_map(|(id, bytes)| ToHost::StdinCredit { id, bytes }),
        2 => (id.clone(), exit_status()).prop_map(|(id, status)| ToHost::Exited { id, status }),
        1 => any::<u64>().prop_map(|nonce| ToHost::Pong { nonce }),
        1 => (id.clone(), refusal()).prop_map(|(id, reason)| ToHost::Refused { id, reason }),
        1 => prop::collection::vec(summary, 0..3).prop_map(|list| ToHost::Processes { list }),
        1 => (id, exit_status(), prop_oneof![text(), Just("x".repeat(MAX_FAILURE_MESSAGE_BYTES + 1))])
            .prop_map(|(id, status, message)| ToHost::SpawnFailed { id, status, message }),
        1 => (any::<u64>(), prop::sample::select(vec![
            UpdateOutcome::Applied,
            UpdateOutcome::Stale,
            UpdateOutcome::NotApproved,
            UpdateOutcome::IdentityConflict,
        ]))
            .prop_map(|(revision, outcome)| ToHost::PolicyAck { revision, outcome }),
        1 => prop::sample::select(vec![RotationOutcome::Applied, RotationOutcome::NoCollector, RotationOutcome::BadHeader, RotationOutcome::CaUnreadable, RotationOutcome::Empty])
            .prop_map(|outcome| ToHost::CredentialsAck { outcome }),
        1 => Just(ToHost::Disconnected { reason: crate::message::Disconnect::NotReading }),
    ]
}

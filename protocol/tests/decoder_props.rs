//! Property tests for the frame decoder, on both channels and in both directions: hostile bytes never panic
//! it, and never make it allocate beyond the frame limit; a message of one channel never decodes on the
//! other unless it means the same there. A counting allocator measures the largest single allocation made
//! while decoding.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::BytesMut;
use proptest::prelude::*;
use tokio_util::codec::Decoder;
use vm_protocol::attach::{ToClient, ToSupervisor};
use vm_protocol::codec::{FrameCodec, HostFrameReader};
use vm_protocol::frame::{self, FrameError, HEADER_BYTES, MAX_FRAME_BYTES};
use vm_protocol::link::{ToGuest, ToHost};
use vm_protocol::net::{ForwardEvent, ForwardRequest, NetToGuest, NetToHost};
use vm_protocol::{arbitrary, ProcessEvent};

#[expect(clippy::cast_possible_truncation, reason = "128 KiB fits in u32")]
const MAX_FRAME_BYTES_U32: u32 = MAX_FRAME_BYTES as u32;

/// Wraps the system allocator and records, per thread, the largest allocation requested.
struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so `System`'s
// guarantees carry over; the only extra work is a thread-local `Cell` update, which never allocates
// (const-initialized) and never unwinds.
unsafe impl GlobalAlloc for Counting {
    // SAFETY: `GlobalAlloc::alloc`'s contract (non-zero-size layout) is the caller's; nothing is added.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.with(|l| l.set(l.get().max(layout.size())));
        // SAFETY: same contract as our caller's; forwarded unchanged.
        unsafe { System.alloc(layout) }
    }

    // SAFETY: `GlobalAlloc::dealloc`'s contract (a pointer from this allocator, its layout) is the caller's.
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` via this wrapper with this `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    // SAFETY: `GlobalAlloc::realloc`'s contract (a pointer from this allocator, its layout, a valid new
    // size) is the caller's.
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.with(|l| l.set(l.get().max(new_size)));
        // SAFETY: `ptr` came from `System` with `layout`; forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns the largest allocation it requested on this thread.
fn largest_allocation(f: impl FnOnce()) -> usize {
    LARGEST.with(|l| l.set(0));
    f();
    LARGEST.with(Cell::get)
}

/// Every decoder of one message type: one frame, the blocking reader, the async codec.
fn decode_as<M: serde::de::DeserializeOwned>(bytes: &[u8]) {
    let _ = frame::decode::<M>(bytes);
    let mut reader = bytes;
    let mut scratch = Vec::new();
    while let Ok(Some(_)) = frame::read::<M, _>(&mut reader, &mut scratch) {}
    let mut codec = FrameCodec::<M, ()>::new();
    let mut buf = BytesMut::from(bytes);
    while let Ok(Some(_)) = codec.decode(&mut buf) {}
    let _ = codec.decode_eof(&mut buf);
}

/// Every decoder of every channel and direction.
fn decode_everything(bytes: &[u8]) {
    decode_as::<ToGuest>(bytes);
    decode_as::<ToHost>(bytes);
    decode_as::<ToSupervisor>(bytes);
    decode_as::<ToClient>(bytes);
}

/// How a stream of frames towards a host read: the messages, then a clean end (`None`) or the error's
/// violation (`Some(None)` for a truncation or I/O error).
type Reading<M> = (Vec<M>, Option<Option<frame::FrameViolation>>);

fn read_with_codec<M: serde::de::DeserializeOwned>(bytes: &[u8]) -> Reading<M> {
    let mut codec = FrameCodec::<M, ()>::new();
    let mut buf = BytesMut::from(bytes);
    let mut msgs = Vec::new();
    loop {
        match codec.decode(&mut buf) {
            Ok(Some(m)) => msgs.push(m),
            Ok(None) => break,
            Err(e) => return (msgs, Some(e.violation())),
        }
    }
    match codec.decode_eof(&mut buf) {
        Ok(Some(m)) => {
            msgs.push(m);
            (msgs, None)
        }
        Ok(None) => (msgs, None),
        Err(e) => (msgs, Some(e.violation())),
    }
}

fn read_with_host_reader<M: serde::de::DeserializeOwned + From<ProcessEvent>>(bytes: &[u8]) -> Reading<M> {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    runtime.block_on(async {
        let mut reader = HostFrameReader::<_, M>::new(bytes);
        let mut msgs = Vec::new();
        loop {
            match reader.next().await {
                Some(Ok(m)) => msgs.push(m),
                Some(Err(e)) => return (msgs, Some(e.violation())),
                None => return (msgs, None),
            }
        }
    })
}

fn encoded(msg: &impl serde::Serialize) -> Vec<u8> {
    let mut wire = Vec::new();
    frame::encode(msg, &mut wire).unwrap();
    wire
}

fn with_header(body: &[u8]) -> Vec<u8> {
    let mut wire = u32::try_from(body.len()).unwrap().to_le_bytes().to_vec();
    wire.extend_from_slice(body);
    wire
}

/// Argv of any printable text.
fn commands() -> impl Strategy<Value = Vec<Vec<String>>> {
    prop::collection::vec(prop::collection::vec("[ -~]{0,16}", 0..4), 1..4)
}

/// Any id.
fn to_guest() -> impl Strategy<Value = ToGuest> {
    commands().prop_flat_map(|commands| arbitrary::link_to_guest(0..u32::MAX, commands))
}

fn to_host() -> impl Strategy<Value = ToHost> {
    arbitrary::link_to_host(0..u32::MAX)
}

fn to_supervisor() -> impl Strategy<Value = ToSupervisor> {
    commands().prop_flat_map(|commands| arbitrary::attach_to_supervisor(0..u32::MAX, commands))
}

fn to_client() -> impl Strategy<Value = ToClient> {
    arbitrary::attach_to_client(0..u32::MAX)
}

/// The guest link's message that means what `msg` means on the attach socket, if the link has one.
fn on_the_link(msg: &ToSupervisor) -> Option<ToGuest> {
    match msg {
        ToSupervisor::Hello(h) => Some(ToGuest::Hello(h.clone())),
        ToSupervisor::Process(p) => Some(ToGuest::Process(p.clone())),
        ToSupervisor::Ping { nonce } => Some(ToGuest::Ping { nonce: *nonce }),
        ToSupervisor::Supervisor(_) => None,
        ToSupervisor::Forward(ForwardRequest::Connect { id, port, window }) => {
            Some(ToGuest::Net(NetToGuest::Connect { id: *id, port: *port, window: *window }))
        }
        ToSupervisor::Forward(ForwardRequest::Stream(f)) => Some(ToGuest::Net(NetToGuest::Stream(f.clone()))),
        ToSupervisor::Reserved(never) | ToSupervisor::LinkOnly(never) => match *never {},
    }
}

/// The attach socket's message that means what `msg` means on the guest link, if the socket has one.
fn on_the_socket(msg: &ToGuest) -> Option<ToSupervisor> {
    match msg {
        ToGuest::Hello(h) => Some(ToSupervisor::Hello(h.clone())),
        ToGuest::Process(p) => Some(ToSupervisor::Process(p.clone())),
        ToGuest::Ping { nonce } => Some(ToSupervisor::Ping { nonce: *nonce }),
        ToGuest::Vm(_) | ToGuest::Net(NetToGuest::Accept { .. }) => None,
        ToGuest::Net(NetToGuest::Connect { id, port, window }) => {
            Some(ToSupervisor::Forward(ForwardRequest::Connect { id: *id, port: *port, window: *window }))
        }
        ToGuest::Net(NetToGuest::Stream(f)) => Some(ToSupervisor::Forward(ForwardRequest::Stream(f.clone()))),
        ToGuest::Reserved(never) | ToGuest::AttachOnly(never) => match *never {},
    }
}

/// The same for answers: the guest link's equivalent of a client's message.
fn answer_on_the_link(msg: &ToClient) -> Option<ToHost> {
    match msg {
        ToClient::Hello(h) => Some(ToHost::Hello(h.clone())),
        ToClient::Process(p) => Some(ToHost::Process(p.clone())),
        ToClient::Pong { nonce } => Some(ToHost::Pong { nonce: *nonce }),
        ToClient::Supervisor(_) | ToClient::Forward(ForwardEvent::Refused { .. }) => None,
        ToClient::Forward(ForwardEvent::Connected { id, window }) => {
            Some(ToHost::Net(NetToHost::Connected { id: *id, window: *window }))
        }
        ToClient::Forward(ForwardEvent::Stream(f)) => Some(ToHost::Net(NetToHost::Stream(f.clone()))),
        ToClient::Reserved(never) | ToClient::LinkOnly(never) | ToClient::Forward(ForwardEvent::LinkOnly(never)) => {
            match *never {}
        }
    }
}

fn answer_on_the_socket(msg: &ToHost) -> Option<ToClient> {
    match msg {
        ToHost::Hello(h) => Some(ToClient::Hello(h.clone())),
        ToHost::Process(p) => Some(ToClient::Process(p.clone())),
        ToHost::Pong { nonce } => Some(ToClient::Pong { nonce: *nonce }),
        ToHost::Net(NetToHost::Connected { id, window }) => {
            Some(ToClient::Forward(ForwardEvent::Connected { id: *id, window: *window }))
        }
        ToHost::Net(NetToHost::Stream(f)) => Some(ToClient::Forward(ForwardEvent::Stream(f.clone()))),
        ToHost::Net(NetToHost::Opened { .. }) => None,
        ToHost::Reserved(never) | ToHost::LinkReserved(never) | ToHost::AttachOnly(never) => match *never {},
    }
}

/// Decodes a whole frame as `M`: the message, or `None` for any error.
fn decoded<M: serde::de::DeserializeOwned>(wire: &[u8]) -> Option<M> {
    frame::decode::<M>(wire).ok().flatten().map(|(m, used)| {
        assert_eq!(used, wire.len());
        m
    })
}

/// A structured mutation of an encoded frame: the kinds of damage a hostile peer would try.
#[derive(Debug, Clone)]
enum Mutation {
    /// Overwrite a body byte.
    Flip(prop::sample::Index, u8),
    /// Change the message tag.
    Tag(u32),
    /// Overwrite a length-sized field (8 bytes) somewhere in the body with a large count.
    Count(prop::sample::Index, u64),
    /// Cut the body short and fix the header to match.
    Truncate(prop::sample::Index),
    /// Append bytes to the body and fix the header to match.
    Extend(Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        prop_oneof![0..16u32, Just(u32::MAX)].prop_map(Mutation::Tag),
        (any::<prop::sample::Index>(), prop_oneof![Just(u64::MAX), Just(1 << 32), 0..100_000u64])
            .prop_map(|(i, n)| Mutation::Count(i, n)),
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Extend),
    ]
}

/// Applies `m` to an encoded frame (header and body), keeping the header consistent where the mutation
/// says so.
fn mutate(wire: &mut Vec<u8>, m: &Mutation) {
    let body = wire.len() - HEADER_BYTES;
    let fix_header = |wire: &mut Vec<u8>| {
        let len = u32::try_from(wire.len() - HEADER_BYTES).unwrap();
        wire[..HEADER_BYTES].copy_from_slice(&len.to_le_bytes());
    };
    match m {
        Mutation::Flip(at, byte) if body > 0 => wire[HEADER_BYTES + at.index(body)] = *byte,
        Mutation::Tag(tag) if body >= 4 => wire[HEADER_BYTES..HEADER_BYTES + 4].copy_from_slice(&tag.to_le_bytes()),
        Mutation::Count(at, n) if body >= 8 => {
            let i = HEADER_BYTES + at.index(body - 7);
            wire[i..i + 8].copy_from_slice(&n.to_le_bytes());
        }
        Mutation::Flip(..) | Mutation::Tag(_) | Mutation::Count(..) => {}
        Mutation::Truncate(at) if body > 0 => {
            wire.truncate(HEADER_BYTES + at.index(body));
            fix_header(wire);
        }
        Mutation::Truncate(_) => {}
        Mutation::Extend(tail) => {
            wire.extend_from_slice(tail);
            fix_header(wire);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic_or_overallocate(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        let largest = largest_allocation(|| decode_everything(&bytes));
        prop_assert!(largest <= MAX_FRAME_BYTES, "largest allocation {largest}");
    }

    #[test]
    fn random_bodies_behind_a_valid_header_never_panic(body in prop::collection::vec(any::<u8>(), 1..4096)) {
        let wire = with_header(&body);
        let largest = largest_allocation(|| decode_everything(&wire));
        prop_assert!(largest <= MAX_FRAME_BYTES, "largest allocation {largest}");
    }

    #[test]
    fn valid_frames_round_trip_and_every_truncation_asks_for_more(msg in to_guest()) {
        let mut wire = Vec::new();
        frame::encode(&msg, &mut wire).unwrap();
        prop_assert_eq!(frame::decode::<ToGuest>(&wire).unwrap(), Some((msg, wire.len())));
        for cut in 0..wire.len() {
            prop_assert!(frame::decode::<ToGuest>(&wire[..cut]).unwrap().is_none());
            let mut reader = &wire[..cut];
            let mut scratch = Vec::new();
            let got = frame::read::<ToGuest, _>(&mut reader, &mut scratch);
            prop_assert!(matches!(got, Ok(None) | Err(FrameError::Truncated)), "cut {}: {:?}", cut, got);
        }
    }

    #[test]
    fn mutated_frames_never_panic_or_overallocate(
        to_host_msg in to_host(),
        to_guest_msg in to_guest(),
        to_client_msg in to_client(),
        to_supervisor_msg in to_supervisor(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let frames = [encoded(&to_host_msg), encoded(&to_guest_msg), encoded(&to_client_msg), encoded(&to_supervisor_msg)];
        for mut wire in frames {
            for m in &mutations {
                mutate(&mut wire, m);
            }
            let largest = largest_allocation(|| decode_everything(&wire));
            prop_assert!(largest <= MAX_FRAME_BYTES, "largest allocation {largest}");
        }
    }

    #[test]
    fn the_host_reader_reads_what_the_codec_reads(
        link in prop::collection::vec(to_host(), 1..4),
        socket in prop::collection::vec(to_client(), 1..4),
        mutations in prop::collection::vec(mutation(), 0..3),
        cut in any::<prop::sample::Index>(),
        whole in any::<bool>(),
    ) {
        let stream = |frames: Vec<Vec<u8>>| {
            let mut wire = Vec::new();
            let last = frames.len() - 1;
            for (i, mut one) in frames.into_iter().enumerate() {
                if i == last {
                    for m in &mutations {
                        mutate(&mut one, m);
                    }
                }
                wire.extend_from_slice(&one);
            }
            if !whole {
                wire.truncate(cut.index(wire.len() + 1));
            }
            wire
        };
        let link = stream(link.iter().map(encoded).collect());
        let socket = stream(socket.iter().map(encoded).collect());
        let largest = largest_allocation(|| {
            let _ = read_with_host_reader::<ToHost>(&link);
            let _ = read_with_host_reader::<ToClient>(&socket);
        });
        prop_assert!(largest <= MAX_FRAME_BYTES + 64 * 1024, "largest allocation {largest}");
        prop_assert_eq!(read_with_host_reader::<ToHost>(&link), read_with_codec::<ToHost>(&link));
        prop_assert_eq!(read_with_host_reader::<ToClient>(&socket), read_with_codec::<ToClient>(&socket));
    }

    #[test]
    fn the_host_reader_reads_random_bytes_as_the_codec_does(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        prop_assert_eq!(read_with_host_reader::<ToHost>(&bytes), read_with_codec::<ToHost>(&bytes));
        prop_assert_eq!(read_with_host_reader::<ToClient>(&bytes), read_with_codec::<ToClient>(&bytes));
    }

    #[test]
    fn every_message_round_trips_on_both_channels_both_ways(
        to_host_msg in to_host(),
        to_guest_msg in to_guest(),
        to_client_msg in to_client(),
        to_supervisor_msg in to_supervisor(),
    ) {
        let wire = encoded(&to_host_msg);
        prop_assert_eq!(frame::decode::<ToHost>(&wire).unwrap(), Some((to_host_msg, wire.len())));
        let wire = encoded(&to_guest_msg);
        prop_assert_eq!(frame::decode::<ToGuest>(&wire).unwrap(), Some((to_guest_msg, wire.len())));
        let wire = encoded(&to_client_msg);
        prop_assert_eq!(frame::decode::<ToClient>(&wire).unwrap(), Some((to_client_msg, wire.len())));
        let wire = encoded(&to_supervisor_msg);
        prop_assert_eq!(frame::decode::<ToSupervisor>(&wire).unwrap(), Some((to_supervisor_msg, wire.len())));
    }

    #[test]
    fn a_message_of_one_channel_never_decodes_on_the_other_as_something_else(
        to_host_msg in to_host(),
        to_guest_msg in to_guest(),
        to_client_msg in to_client(),
        to_supervisor_msg in to_supervisor(),
    ) {
        // A shared tag means the same on both channels; a tag of one channel only never decodes on the other.
        prop_assert_eq!(decoded::<ToGuest>(&encoded(&to_supervisor_msg)), on_the_link(&to_supervisor_msg));
        prop_assert_eq!(decoded::<ToSupervisor>(&encoded(&to_guest_msg)), on_the_socket(&to_guest_msg));
        prop_assert_eq!(decoded::<ToHost>(&encoded(&to_client_msg)), answer_on_the_link(&to_client_msg));
        prop_assert_eq!(decoded::<ToClient>(&encoded(&to_host_msg)), answer_on_the_socket(&to_host_msg));
    }

    #[test]
    fn oversized_lengths_are_refused_without_allocating(len in (MAX_FRAME_BYTES_U32 + 1)..=u32::MAX, tail in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut wire = len.to_le_bytes().to_vec();
        wire.extend_from_slice(&tail);
        let mut result = None;
        let largest = largest_allocation(|| result = Some(frame::decode::<ToGuest>(&wire).map(|_| ())));
        let refused = matches!(result, Some(Err(FrameError::TooLarge { .. })));
        prop_assert!(refused, "oversized length was not refused");
        prop_assert!(largest < 1024, "largest allocation {largest}");
    }
}

#[test]
fn huge_announced_sequence_lengths_do_not_preallocate() {
    // A Spawn whose argv claims u64::MAX entries: the tags of `Process` and `Spawn`, id, then the length.
    let mut body = [2u32.to_le_bytes(), 0u32.to_le_bytes()].concat();
    body.extend_from_slice(&7u32.to_le_bytes());
    body.extend_from_slice(&u64::MAX.to_le_bytes());
    let wire = with_header(&body);
    let largest = largest_allocation(|| decode_everything(&wire));
    assert!(largest < 1024, "largest allocation {largest}");
}

#[test]
fn a_frame_of_many_empty_strings_stays_within_the_limit() {
    // The densest argv a frame can hold: as many empty strings as fit (8 bytes each).
    let count = (MAX_FRAME_BYTES - 64) / 8;
    let mut body = [2u32.to_le_bytes(), 0u32.to_le_bytes()].concat();
    body.extend_from_slice(&7u32.to_le_bytes());
    body.extend_from_slice(&(count as u64).to_le_bytes());
    body.extend(std::iter::repeat_n(0u8, count * 8));
    let wire = with_header(&body);
    let mut result = None;
    let largest = largest_allocation(|| result = Some(frame::decode::<ToSupervisor>(&wire).map(|_| ())));
    assert!(matches!(result, Some(Err(FrameError::Malformed(_)))), "more than MAX_SEQ_ITEMS entries");
    assert!(largest <= MAX_FRAME_BYTES, "largest allocation {largest}");
}

#[test]
fn the_tags_of_one_channel_only_are_refused_on_the_other_whatever_follows() {
    // Tag 4 is the guest link's, tag 5 the attach socket's, tag 0 nobody's: behind each, the bodies of every
    // sub-message (and nothing, and zeros) decode on neither wrong channel.
    let tails: Vec<Vec<u8>> = (0..8u32)
        .flat_map(|inner| [inner.to_le_bytes().to_vec(), [inner.to_le_bytes(), [0; 4]].concat(), vec![0; 64]])
        .chain([Vec::new()])
        .collect();
    for tail in &tails {
        let body = |tag: u32| with_header(&[tag.to_le_bytes().as_slice(), tail].concat());
        for tag in [0, 5] {
            assert!(decoded::<ToGuest>(&body(tag)).is_none(), "tag {tag} on the link, {tail:?}");
            assert!(decoded::<ToHost>(&body(tag)).is_none(), "tag {tag} towards the supervisor, {tail:?}");
        }
        for tag in [0, 4] {
            assert!(decoded::<ToSupervisor>(&body(tag)).is_none(), "tag {tag} on the socket, {tail:?}");
            assert!(decoded::<ToClient>(&body(tag)).is_none(), "tag {tag} towards the client, {tail:?}");
        }
        assert!(decoded::<ToHost>(&body(4)).is_none(), "the link has no answer at tag 4 yet");
    }
}

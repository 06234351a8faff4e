//! Property tests for the frame decoder: hostile bytes never panic it, and never make it allocate beyond
//! the frame limit. A counting allocator measures the largest single allocation made while decoding.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]
#![allow(clippy::tests_outside_test_module, reason = "an integration test crate is test-only as a whole")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use bytes::BytesMut;
use proptest::prelude::*;
use tokio_util::codec::Decoder;
use vm_protocol::codec::{FrameCodec, HostFrameReader};
use vm_protocol::frame::{self, FrameError, HEADER_BYTES, MAX_FRAME_BYTES};
use vm_protocol::{arbitrary, ToGuest, ToHost};

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

fn decode_everything(bytes: &[u8]) {
    let _ = frame::decode::<ToGuest>(bytes);
    let _ = frame::decode::<ToHost>(bytes);
    let mut reader = bytes;
    let mut scratch = Vec::new();
    while let Ok(Some(_)) = frame::read::<ToGuest, _>(&mut reader, &mut scratch) {}
    let mut codec = FrameCodec::<ToHost, ToGuest>::new();
    let mut buf = BytesMut::from(bytes);
    while let Ok(Some(_)) = codec.decode(&mut buf) {}
    let _ = codec.decode_eof(&mut buf);
}

/// How a stream of `ToHost` frames read: the messages, then a clean end (`None`) or the error's violation
/// (`Some(None)` for a truncation or I/O error).
type Reading = (Vec<ToHost>, Option<Option<frame::FrameViolation>>);

fn read_with_codec(bytes: &[u8]) -> Reading {
    let mut codec = FrameCodec::<ToHost, ToGuest>::new();
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

fn read_with_host_reader(bytes: &[u8]) -> Reading {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    runtime.block_on(async {
        let mut reader = HostFrameReader::new(bytes);
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

/// Any id, and argv of any printable text.
fn to_guest() -> impl Strategy<Value = ToGuest> {
    let argv = prop::collection::vec(prop::collection::vec("[ -~]{0,16}", 0..4), 1..4);
    argv.prop_flat_map(|commands| arbitrary::to_guest(0..u32::MAX, commands))
}

fn to_host() -> impl Strategy<Value = ToHost> {
    arbitrary::to_host(0..u32::MAX)
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
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        for mut wire in [encoded(&to_host_msg), encoded(&to_guest_msg)] {
            for m in &mutations {
                mutate(&mut wire, m);
            }
            let largest = largest_allocation(|| decode_everything(&wire));
            prop_assert!(largest <= MAX_FRAME_BYTES, "largest allocation {largest}");
        }
    }

    #[test]
    fn the_host_reader_reads_what_the_codec_reads(
        msgs in prop::collection::vec(to_host(), 1..4),
        mutations in prop::collection::vec(mutation(), 0..3),
        cut in any::<prop::sample::Index>(),
        whole in any::<bool>(),
    ) {
        let mut wire = Vec::new();
        for (i, msg) in msgs.iter().enumerate() {
            let mut one = encoded(msg);
            if i == msgs.len() - 1 {
                for m in &mutations {
                    mutate(&mut one, m);
                }
            }
            wire.extend_from_slice(&one);
        }
        if !whole {
            wire.truncate(cut.index(wire.len() + 1));
        }
        let largest = largest_allocation(|| {
            let _ = read_with_host_reader(&wire);
        });
        prop_assert!(largest <= MAX_FRAME_BYTES + 64 * 1024, "largest allocation {largest}");
        prop_assert_eq!(read_with_host_reader(&wire), read_with_codec(&wire));
    }

    #[test]
    fn the_host_reader_reads_random_bytes_as_the_codec_does(bytes in prop::collection::vec(any::<u8>(), 0..4096)) {
        prop_assert_eq!(read_with_host_reader(&bytes), read_with_codec(&bytes));
    }

    #[test]
    fn every_message_round_trips_both_ways(to_host_msg in to_host(), to_guest_msg in to_guest()) {
        let wire = encoded(&to_host_msg);
        prop_assert_eq!(frame::decode::<ToHost>(&wire).unwrap(), Some((to_host_msg, wire.len())));
        let wire = encoded(&to_guest_msg);
        prop_assert_eq!(frame::decode::<ToGuest>(&wire).unwrap(), Some((to_guest_msg, wire.len())));
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
    // A Spawn whose argv claims u64::MAX entries: tag, id, then the length.
    let mut body = 2u32.to_le_bytes().to_vec();
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
    let mut body = 2u32.to_le_bytes().to_vec();
    body.extend_from_slice(&7u32.to_le_bytes());
    body.extend_from_slice(&(count as u64).to_le_bytes());
    body.extend(std::iter::repeat_n(0u8, count * 8));
    let wire = with_header(&body);
    let mut result = None;
    let largest = largest_allocation(|| result = Some(frame::decode::<ToGuest>(&wire).map(|_| ())));
    assert!(matches!(result, Some(Err(FrameError::Malformed(_)))), "more than MAX_SEQ_ITEMS entries");
    assert!(largest <= MAX_FRAME_BYTES, "largest allocation {largest}");
}

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
use vm_protocol::codec::FrameCodec;
use vm_protocol::frame::{self, FrameError, HEADER_BYTES, MAX_FRAME_BYTES};
use vm_protocol::message::EnvVar;
use vm_protocol::{Capabilities, ExitStatus, Hello, ProcId, Spawn, Stream, ToGuest, ToHost};

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

fn with_header(body: &[u8]) -> Vec<u8> {
    let mut wire = u32::try_from(body.len()).unwrap().to_le_bytes().to_vec();
    wire.extend_from_slice(body);
    wire
}

fn text() -> impl Strategy<Value = String> {
    "[ -~]{0,24}"
}

fn to_guest() -> impl Strategy<Value = ToGuest> {
    prop_oneof![
        (
            any::<u32>(),
            prop::collection::vec(text(), 0..8),
            prop::collection::vec((text(), text()), 0..8),
            prop::option::of(text()),
            any::<u32>()
        )
            .prop_map(|(id, argv, env, cwd, window)| ToGuest::Spawn(Spawn {
                id: ProcId(id),
                argv,
                env: env.into_iter().map(|(key, value)| EnvVar { key, value }).collect(),
                cwd,
                pty: None,
                output_window: window,
            })),
        (any::<u32>(), prop::collection::vec(any::<u8>(), 0..512))
            .prop_map(|(id, d)| { ToGuest::Stdin { id: ProcId(id), data: d.into() } }),
        any::<u32>().prop_map(|id| ToGuest::StdinEof { id: ProcId(id) }),
        (any::<u32>(), any::<u32>()).prop_map(|(id, bytes)| ToGuest::Credit { id: ProcId(id), bytes }),
        any::<u64>().prop_map(|nonce| ToGuest::Ping { nonce }),
        text().prop_map(|s| ToGuest::Hello(Hello::ours(Capabilities::EXEC, s))),
    ]
}

fn to_host() -> impl Strategy<Value = ToHost> {
    prop_oneof![
        (any::<u32>(), any::<bool>(), prop::collection::vec(any::<u8>(), 0..512)).prop_map(|(id, err, d)| {
            ToHost::Output { id: ProcId(id), stream: if err { Stream::Stderr } else { Stream::Stdout }, data: d.into() }
        }),
        (any::<u32>(), any::<i32>()).prop_map(|(id, c)| ToHost::Exited { id: ProcId(id), status: ExitStatus::Code(c) }),
        (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(id, pid, w)| ToHost::Started {
            id: ProcId(id),
            pid,
            stdin_window: w,
            output_window: w,
        }),
    ]
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
        msg in to_host(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut wire = Vec::new();
        frame::encode(&msg, &mut wire).unwrap();
        for (at, byte) in flips {
            let i = at.index(wire.len() - HEADER_BYTES) + HEADER_BYTES;
            wire[i] = byte;
        }
        let largest = largest_allocation(|| decode_everything(&wire));
        prop_assert!(largest <= MAX_FRAME_BYTES, "largest allocation {largest}");
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

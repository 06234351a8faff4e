use vm_protocol::net::{ForwardEvent, ForwardRequest, Listener, NetToGuest, NetToHost, StreamFrame, StreamId};

use super::{ForwardNote, Out, StreamRouter, HOST_OPENED};
use crate::boundary::violation::{ClientViolation, GuestViolation};
use crate::boundary::ClientId;

const C: ClientId = ClientId(1);

fn open(streams: &mut StreamRouter, id: u32) -> Vec<Out> {
    streams.from_guest(NetToHost::Opened { id: StreamId(id), listener: Listener::Http, window: 8 }, 2, true).unwrap()
}

fn data(id: u32, n: usize) -> StreamFrame {
    StreamFrame::Data { id: StreamId(id), data: vec![7; n].into() }
}

#[test]
fn egress_streams_are_accepted_within_the_cap_and_bounded_by_their_windows() {
    let mut s = StreamRouter::default();
    assert!(matches!(open(&mut s, 1).as_slice(), [Out::Guest(NetToGuest::Accept { .. }), Out::Egress(..)]));
    assert!(matches!(open(&mut s, 2).as_slice(), [Out::Guest(_), Out::Egress(..)]));
    // The cap: the third is refused, and closed at once.
    let third = open(&mut s, 3);
    assert!(matches!(third.as_slice(), [Out::Guest(NetToGuest::Stream(StreamFrame::Close { .. })), Out::Refused(_)]));
    let again = s.from_guest(NetToHost::Opened { id: StreamId(3), listener: Listener::Socks, window: 8 }, 9, true);
    assert!(matches!(again, Err(GuestViolation::Stream(..))), "ids increase");
    let no_egress = s.from_guest(NetToHost::Opened { id: StreamId(4), listener: Listener::Http, window: 8 }, 9, false);
    assert!(matches!(no_egress.unwrap().as_slice(), [_, Out::Refused(r)] if r.reason.contains("no egress")));
    s.from_guest(NetToHost::Stream(data(1, 100)), 2, true).unwrap();
    let over = s.from_guest(NetToHost::Stream(data(1, 1024 * 1024)), 2, true);
    assert!(matches!(over, Err(GuestViolation::Stream(_, "data past the window"))));
    let forged = s.from_guest(NetToHost::Stream(data(99, 1)), 2, true);
    assert!(matches!(forged, Err(GuestViolation::Stream(_, "a message for a stream that was never opened"))));
    // A refused stream took nothing: data on it is a violation, credit a late race.
    assert!(s.from_guest(NetToHost::Stream(data(3, 1)), 2, true).is_err());
    assert!(s.from_guest(NetToHost::Stream(StreamFrame::Credit { id: StreamId(3), bytes: 1 }), 2, true).is_ok());
}

#[test]
fn a_closed_stream_takes_only_what_was_in_flight() {
    let mut s = StreamRouter::default();
    open(&mut s, 1);
    s.egress_ended(StreamId(1));
    // The guest could still have had its whole window (256 KiB) in flight.
    assert!(s.from_guest(NetToHost::Stream(data(1, 1000)), 2, true).is_ok());
    let flood = s.from_guest(NetToHost::Stream(data(1, 300 * 1024)), 2, true);
    assert!(matches!(flood, Err(GuestViolation::Stream(_, "data on a closed stream past its window"))));
}

#[test]
fn port_forwards_route_both_ways_under_link_ids_within_both_windows() {
    let mut s = StreamRouter::default();
    let connect = ForwardRequest::Connect { id: StreamId(5), port: 8080, window: 16 };
    let out = s.from_client(C, connect, 4).unwrap();
    let [Out::Guest(NetToGuest::Connect { id: link, port: 8080, window: 16 })] = out.as_slice() else {
        panic!("{out:?}")
    };
    let link = *link;
    assert!(link.0 >= HOST_OPENED);
    let early = s.from_client(C, ForwardRequest::Stream(data(5, 1)), 4);
    assert!(matches!(early, Err(ClientViolation::Stream(..))), "no data before Connected");
    let out = s.from_guest(NetToHost::Connected { id: link, window: 4 }, 4, true).unwrap();
    let connected = ForwardEvent::Connected { id: StreamId(5), window: 4 };
    assert!(matches!(out.as_slice(), [Out::Client(C, e), Out::Forward(_)] if *e == connected));
    s.from_client(C, ForwardRequest::Stream(data(5, 4)), 4).unwrap();
    let over = s.from_client(C, ForwardRequest::Stream(data(5, 1)), 4);
    assert!(matches!(over, Err(ClientViolation::Stream(_, "data past the window"))), "the guest's window");
    let back = s.from_guest(NetToHost::Stream(StreamFrame::Data { id: link, data: vec![1; 16].into() }), 4, true);
    let back = back.unwrap();
    assert!(matches!(back.as_slice(), [Out::Client(C, ForwardEvent::Stream(f))] if f.id() == StreamId(5)));
    let over = s.from_guest(NetToHost::Stream(StreamFrame::Data { id: link, data: vec![1].into() }), 4, true);
    assert!(matches!(over, Err(GuestViolation::Stream(_, "data past the window"))), "the client's window");
    // Both eofs end it, with its bytes for the close event.
    s.from_client(C, ForwardRequest::Stream(StreamFrame::Eof { id: StreamId(5) }), 4).unwrap();
    let out = s.from_guest(NetToHost::Stream(StreamFrame::Eof { id: link }), 4, true).unwrap();
    assert!(matches!(out.last(), Some(Out::Forward(ForwardNote::Closed { to_guest: 4, from_guest: 16, .. }))));
    assert_eq!(s.open(), 0);
}

#[test]
fn a_client_that_goes_away_closes_its_forwards() {
    let mut s = StreamRouter::default();
    s.from_client(C, ForwardRequest::Connect { id: StreamId(1), port: 22, window: 16 }, 4).unwrap();
    let out = s.remove_client(C);
    assert!(matches!(out.as_slice(), [Out::Guest(NetToGuest::Stream(StreamFrame::Close { .. }))]));
    assert_eq!(s.open(), 0);
}

#[test]
fn the_guests_connected_for_a_forward_its_client_closed_is_a_late_race() {
    let mut s = StreamRouter::default();
    let out = s.from_client(C, ForwardRequest::Connect { id: StreamId(1), port: 22, window: 16 }, 4).unwrap();
    let [Out::Guest(NetToGuest::Connect { id: link, .. })] = out.as_slice() else { panic!("{out:?}") };
    let link = *link;
    s.remove_client(C);
    assert!(s.from_guest(NetToHost::Connected { id: link, window: 16 }, 4, true).unwrap().is_empty());
    // Never opened: still a violation.
    let forged = s.from_guest(NetToHost::Connected { id: StreamId(link.0 + 1), window: 16 }, 4, true);
    assert!(forged.is_err());
}

#[test]
fn a_window_past_its_bound_is_refused() {
    use vm_protocol::net::{EGRESS_DOWNLOAD_WINDOW_BYTES, NET_WINDOW_BYTES};
    let mut s = StreamRouter::default();
    let opened = |id, window| NetToHost::Opened { id: StreamId(id), listener: Listener::Http, window };
    // An egress stream's download window may be larger than what the host grants (the budget bounds it).
    assert!(s.from_guest(opened(1, EGRESS_DOWNLOAD_WINDOW_BYTES), 4, true).is_ok());
    let past = s.from_guest(opened(2, EGRESS_DOWNLOAD_WINDOW_BYTES + 1), 4, true);
    assert!(matches!(past, Err(GuestViolation::Stream(_, "a window out of range"))));
    // A forward's, from its client, no larger than the host's own.
    let big = NET_WINDOW_BYTES + 1;
    let connect = s.from_client(C, ForwardRequest::Connect { id: StreamId(1), port: 22, window: big }, 4).unwrap();
    assert!(matches!(connect.as_slice(), [Out::Client(C, ForwardEvent::Refused { .. })]));
}

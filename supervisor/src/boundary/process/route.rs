//! One process as the multiplexer sees it: who drives it, what was granted both ways, and the output sent
//! towards a client but not yet credited by it.
//!
//! Output is **retained until credited**: the copy a client was sent stays here until the client credits it
//! (credit means "delivered"), and the guest's window only reopens then. So the retained bytes are exactly
//! the window's outstanding bytes, bounded by the window; and when a client leaves, everything it never
//! credited is still here, in order, for the client that re-attaches. Small pieces of one stream are kept
//! joined (up to [`RETAIN_JOIN_BYTES`]), so a guest writing byte by byte to one stream costs the window, not
//! a chunk a byte. (Pieces of two streams taking turns cannot be joined without losing their order: each
//! still costs a chunk.)

use std::collections::VecDeque;

use serde_bytes::ByteBuf;
use vm_protocol::attach::ToClient;
use vm_protocol::files::FileOp;
use vm_protocol::{CreditError, ExitStatus, ProcId, ProcessEvent, Stream, Window};

use super::ClientId;

/// Most bytes of argv kept per process (for listings and events); the rest is cut.
pub const MAX_KEPT_ARGV_BYTES: usize = 4096;

/// Retained output of one stream is joined into pieces of up to this much: few enough pieces for a 1-byte
/// flood, and small enough that a client crediting byte by byte moves little at each credit.
pub const RETAIN_JOIN_BYTES: usize = 4096;

/// Where a process is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Phase {
    /// Spawn forwarded; no answer yet.
    Spawned,
    /// `Started` came.
    Running,
    /// `Exited` came, with this status.
    Exited(ExitStatus),
}

#[derive(Debug)]
pub(super) struct Route {
    pub(super) client: ClientId,
    pub(super) client_id: ProcId,
    pub(super) argv: Vec<String>,
    pub(super) pid: Option<u32>,
    pub(super) tty: bool,
    pub(super) phase: Phase,
    /// No client: output (and the exit) wait here for the next one.
    pub(super) detached: bool,
    /// Stdin EOF reached the guest; a re-attached client's EOF is then a no-op, its data a violation.
    pub(super) stdin_closed: bool,
    /// The guest's output credit.
    output: Window,
    /// Output sent towards the client and not credited yet, with its bytes counted.
    unacked: VecDeque<(Stream, ByteBuf)>,
    /// What clients may still send to the process's stdin, as the guest granted it.
    stdin: Window,
    /// Stdin credit the guest still owes for bytes an earlier client sent; absorbed, not forwarded, so the
    /// current client's window never grows past what it was told.
    absorb_stdin: u64,
    /// A file operation's, not a workload's: its events are File System Activity.
    pub(super) file: Option<FileOp>,
    /// Bytes in on stdin and out on stdout, for a file operation's event.
    pub(super) moved: u64,
}

impl Route {
    pub(super) fn new(client: ClientId, client_id: ProcId, argv: &[String], output_window: u32, tty: bool) -> Self {
        Self::opened(client, client_id, argv, output_window, tty, None)
    }

    /// A route for a file operation: listed as `files OP PATH...`.
    pub(super) fn for_file(client: ClientId, client_id: ProcId, op: FileOp, output_window: u32) -> Self {
        let argv: Vec<String> = ["files", op.name()].into_iter().chain(op.paths()).map(str::to_owned).collect();
        Self::opened(client, client_id, &argv, output_window, false, Some(op))
    }

    fn opened(
        client: ClientId,
        client_id: ProcId,
        argv: &[String],
        output_window: u32,
        tty: bool,
        file: Option<FileOp>,
    ) -> Self {
        Self {
            client,
            client_id,
            argv: kept_argv(argv),
            pid: None,
            tty,
            phase: Phase::Spawned,
            detached: false,
            stdin_closed: false,
            output: Window::new(output_window),
            unacked: VecDeque::new(),
            stdin: Window::new(0),
            absorb_stdin: 0,
            file,
            moved: 0,
        }
    }

    /// The telemetry action for its end: a process's exit, or a file operation's outcome.
    pub(super) fn ended(&self, guest_id: ProcId, status: ExitStatus) -> super::Action {
        match &self.file {
            Some(op) => super::Action::FileDone { op: op.clone(), bytes: self.moved, status },
            None => super::Action::Exited { guest_id, pid: self.pid, argv: self.argv.clone(), status },
        }
    }

    pub(super) fn window(&self) -> u64 {
        self.output.available() + self.output.outstanding()
    }

    /// The output window, as the `Spawn` (possibly made smaller) set it.
    pub(super) fn output_window(&self) -> u32 {
        u32::try_from(self.window()).unwrap_or(u32::MAX)
    }

    pub(super) fn started(&mut self, pid: u32, stdin_window: u32) {
        self.phase = Phase::Running;
        self.pid = Some(pid);
        self.stdin = Window::new(stdin_window);
    }

    /// Output from the guest: within credit, kept until credited.
    pub(super) fn output(&mut self, stream: Stream, data: ByteBuf) -> Result<(), CreditError> {
        self.output.consume(data.len())?;
        if stream == Stream::Stdout {
            self.moved = self.moved.saturating_add(data.len() as u64);
        }
        match self.unacked.back_mut() {
            // An empty piece (only with the guest's rules off) stays its own, as the control measures.
            Some((last, kept))
                if *last == stream && !data.is_empty() && kept.len() + data.len() <= RETAIN_JOIN_BYTES =>
            {
                kept.extend_from_slice(&data);
            }
            _ => self.unacked.push_back((stream, data)),
        }
        Ok(())
    }

    /// The client credited `bytes` it received: they leave the retained output, and the guest may send as
    /// much again.
    pub(super) fn acked(&mut self, bytes: u32) -> Result<(), CreditError> {
        self.output.grant(bytes)?;
        let mut left = u64::from(bytes);
        while left > 0 {
            let Some((_, front)) = self.unacked.front_mut() else { break };
            let len = front.len() as u64;
            if len <= left {
                left -= len;
                self.unacked.pop_front();
            } else {
                let cut = usize::try_from(left).unwrap_or(usize::MAX);
                front.drain(..cut);
                left = 0;
            }
        }
        Ok(())
    }

    /// Bytes retained (sent and not credited, or held while detached).
    pub(super) fn retained(&self) -> u64 {
        self.output.outstanding()
    }

    /// Everything retained, for a client that re-attaches.
    pub(super) fn replay(&self, id: ProcId) -> impl Iterator<Item = ToClient> + '_ {
        self.unacked
            .iter()
            .map(move |(stream, data)| ProcessEvent::Output { id, stream: *stream, data: data.clone() }.into())
    }

    /// Stdin from the client, within the guest's credit.
    pub(super) fn stdin(&mut self, bytes: usize) -> Result<(), CreditError> {
        self.stdin.consume(bytes)?;
        self.moved = self.moved.saturating_add(bytes as u64);
        Ok(())
    }

    /// Stdin credit from the guest; returns how much of it the current client learns of.
    pub(super) fn stdin_credit(&mut self, bytes: u32) -> Result<u32, CreditError> {
        self.stdin.grant(bytes)?;
        let absorbed = self.absorb_stdin.min(u64::from(bytes));
        self.absorb_stdin -= absorbed;
        Ok(u32::try_from(u64::from(bytes) - absorbed).unwrap_or(0))
    }

    /// A new client takes the process over as `id`; returns the stdin window it starts with.
    pub(super) fn reattach(&mut self, client: ClientId, id: ProcId) -> u32 {
        self.client = client;
        self.client_id = id;
        self.detached = false;
        if self.stdin_closed {
            return 0;
        }
        self.absorb_stdin = self.stdin.outstanding();
        u32::try_from(self.stdin.available()).unwrap_or(u32::MAX)
    }

    /// Whether everything about it has been delivered and it can be forgotten.
    pub(super) fn delivered(&self) -> bool {
        matches!(self.phase, Phase::Exited(_)) && self.unacked.is_empty()
    }
}

/// A bounded copy of `argv`: at most [`MAX_KEPT_ARGV_BYTES`] in all, the last argument cut on a character
/// boundary.
fn kept_argv(argv: &[String]) -> Vec<String> {
    let mut left = MAX_KEPT_ARGV_BYTES;
    let mut kept = Vec::new();
    for arg in argv {
        if left == 0 {
            break;
        }
        let mut end = arg.len().min(left);
        while !arg.is_char_boundary(end) {
            end -= 1;
        }
        kept.push(arg[..end].to_owned());
        left -= end;
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_argv_is_bounded_on_character_boundaries() {
        let huge = vec!["é".repeat(5000), "x".into()];
        let kept = kept_argv(&huge);
        assert!(kept.iter().map(String::len).sum::<usize>() <= MAX_KEPT_ARGV_BYTES);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept_argv(&["a".into(), "b".into()]), ["a", "b"]);
    }

    #[test]
    fn credit_frees_retained_output_in_order_and_never_more() {
        let mut r = Route::new(ClientId(1), ProcId(1), &["cat".into()], 10, false);
        r.started(9, 0);
        r.output(Stream::Stdout, b"abcd".to_vec().into()).unwrap();
        r.output(Stream::Stderr, b"ef".to_vec().into()).unwrap();
        r.acked(3).unwrap();
        let left: Vec<ToClient> = r.replay(ProcId(1)).collect();
        assert_eq!(left.len(), 2);
        assert!(matches!(&left[0], ToClient::Process(ProcessEvent::Output { data, .. }) if data.as_ref() == b"d"));
        assert_eq!(r.retained(), 3);
        assert!(r.acked(4).is_err(), "more than was sent");
    }

    #[test]
    fn a_one_byte_flood_is_retained_in_few_pieces_and_replayed_whole() {
        let window = 4 * RETAIN_JOIN_BYTES + 2;
        let mut r = Route::new(ClientId(1), ProcId(1), &["flood".into()], u32::try_from(window).unwrap(), false);
        r.started(9, 0);
        for i in 0..window {
            let stream = if i == window - 1 { Stream::Stderr } else { Stream::Stdout };
            r.output(stream, vec![u8::try_from(i % 251).unwrap()].into()).unwrap();
        }
        assert_eq!(r.unacked.len(), 6, "four full pieces, one of one byte, and the other stream's");
        r.acked(1).unwrap();
        let replay: Vec<ToClient> = r.replay(ProcId(1)).collect();
        let bytes: Vec<u8> = replay
            .iter()
            .flat_map(|m| match m {
                ToClient::Process(ProcessEvent::Output { data, .. }) => data.to_vec(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(bytes.len(), window - 1);
        assert!(
            bytes.iter().enumerate().all(|(i, b)| usize::from(*b) == (i + 1) % 251),
            "in order, from the credit on"
        );
        assert!(matches!(replay.last(), Some(ToClient::Process(ProcessEvent::Output { stream: Stream::Stderr, .. }))));
    }
}

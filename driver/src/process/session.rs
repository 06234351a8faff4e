//! The I/O-free core of one process session: every message from the sandbox or the client comes in, what
//! to send either way goes out. Flow control is the [`ProcessRelay`]'s; this adds the order of the end: the
//! exit, then (for a copy out) the client's verdict on the tar, then the last credit once every byte was
//! delivered, which tells the supervisor it may forget the process.

use std::time::Duration;

use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest, Stream};

use super::relay::{ProcessRelay, RelayError};
use super::{Ended, Failure, FromClient, Lost, Outcome, ToClient, ToSandbox, REFUSAL_DELIVERY, VERDICT_TIMEOUT};

/// One thing to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Act {
    /// Towards the sandbox.
    Sandbox(ToSandbox),
    /// Towards the client.
    Client(ToClient),
}

/// What the session waits for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Either side: the process runs.
    Both,
    /// The client refused a running copy's tar: the sandbox's end of the copy (and the client's
    /// deliveries), within the duration.
    Refusal(Duration),
    /// The client's verdict on a copy's tar, within the duration.
    Verdict(Duration),
    /// The client's deliveries of what was sent: the process ended.
    Delivery,
    /// Nothing: the session is over.
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Running,
    Refused,
    Verdict,
    Delivery,
    Done(Outcome),
}

/// One process, between a client and a sandbox.
#[derive(Debug)]
pub struct ProcessSession {
    relay: ProcessRelay,
    reattached: bool,
    /// The guest path of a copy out: the client's extractor may refuse its tar.
    copy_out: Option<String>,
    refused: bool,
    status: Option<ExitStatus>,
    /// Output bytes sent to the client, and of those, delivered.
    sent: u64,
    delivered: u64,
    phase: Phase,
}

impl ProcessSession {
    /// A process known on its connection as `id`: a new one, a re-attached one, or a file operation (a copy
    /// out names its guest path).
    pub fn new(id: ProcId, reattached: bool, copy_out: Option<String>) -> Self {
        Self {
            relay: ProcessRelay::new(id),
            reattached,
            copy_out,
            refused: false,
            status: None,
            sent: 0,
            delivered: 0,
            phase: Phase::Running,
        }
    }

    /// What to wait for.
    pub fn wait(&self) -> Wait {
        match self.phase {
            Phase::Running => Wait::Both,
            Phase::Refused => Wait::Refusal(REFUSAL_DELIVERY),
            Phase::Verdict => Wait::Verdict(VERDICT_TIMEOUT),
            Phase::Delivery => Wait::Delivery,
            Phase::Done(_) => Wait::Done,
        }
    }

    /// Whether the client's requests are read: while the process runs, only as long as the stdin buffer the
    /// guest's credit drains has room; while a verdict or a refused copy's end is awaited, always.
    pub fn listening(&self) -> bool {
        match self.phase {
            Phase::Running => !self.relay.stdin_full(),
            Phase::Refused | Phase::Verdict => true,
            Phase::Delivery | Phase::Done(_) => false,
        }
    }

    /// How it ended, once [`Wait::Done`].
    pub fn outcome(&self) -> Option<&Outcome> {
        match &self.phase {
            Phase::Done(outcome) => Some(outcome),
            _ => None,
        }
    }

    /// A message from the sandbox about the process, or why there will be none.
    pub fn from_sandbox(&mut self, msg: Result<ProcessEvent, Lost>) -> Vec<Act> {
        if matches!(self.phase, Phase::Done(_)) {
            return Vec::new();
        }
        let msg = match msg {
            Ok(msg) => msg,
            Err(lost) => {
                let ended = if lost == Lost::Overflow { Ended::Detach } else { Ended::Lost };
                return self.fail(Failure::Lost(lost), ended);
            }
        };
        let mut acts = match msg {
            ProcessEvent::Started { pid, stdin_window, output_window, .. } => {
                self.relay.started(stdin_window, output_window);
                vec![Act::Client(ToClient::Started { pid, reattached: self.reattached })]
            }
            ProcessEvent::Output { stream, data, .. } => vec![self.output(stream, data.into_vec())],
            ProcessEvent::StdinCredit { bytes, .. } => match self.relay.stdin_credit(bytes) {
                Ok(()) => Vec::new(),
                Err(_) => return self.fail(Failure::Credit, Ended::Detach),
            },
            ProcessEvent::Exited { status, .. } => self.exited(status, Vec::new()),
            // As a shell shows it: the message on stderr, then the status.
            ProcessEvent::SpawnFailed { status, message, .. } => {
                self.exited(status, vec![Act::Client(ToClient::Message(format!("{message}\n")))])
            }
            ProcessEvent::Refused { reason, .. } => return self.fail(Failure::Refused(reason), Ended::Delivered),
        };
        self.stdin(&mut acts);
        acts
    }

    /// A message from the client.
    pub fn from_client(&mut self, msg: FromClient) -> Vec<Act> {
        if matches!(self.phase, Phase::Done(_)) {
            return Vec::new();
        }
        let id = self.relay.id();
        let running = matches!(self.phase, Phase::Running | Phase::Refused);
        let mut acts = match msg {
            FromClient::Stdin(bytes) => match self.relay.push_stdin(&bytes) {
                Ok(()) => Vec::new(),
                Err(RelayError::StdinAfterEof | RelayError::Credit(_)) => {
                    return self.fail(Failure::BadRequest("stdin after stdin EOF"), Ended::Detach);
                }
            },
            FromClient::StdinEof => {
                self.relay.stdin_eof();
                Vec::new()
            }
            FromClient::Signal(signal) if running => {
                vec![Act::Sandbox(ToSandbox::Process(ProcessRequest::Signal { id, signal }))]
            }
            FromClient::Resize(size) if running => {
                vec![Act::Sandbox(ToSandbox::Process(ProcessRequest::Resize { id, size }))]
            }
            FromClient::Signal(_) | FromClient::Resize(_) => Vec::new(),
            FromClient::TarRefused(reason) => {
                let Some(path) = self.copy_out.clone() else {
                    return self
                        .fail(Failure::BadRequest("tar_refused on a stream that is no copy_out"), Ended::Detach);
                };
                if self.refused {
                    return Vec::new();
                }
                self.refused = true;
                self.phase = match self.phase {
                    // The sandbox kills the copy it refused: its end is awaited.
                    Phase::Running => Phase::Refused,
                    _ => Phase::Delivery,
                };
                vec![Act::Sandbox(ToSandbox::TarRefused { id, path, reason })]
            }
            FromClient::Delivered(bytes) => self.delivered(bytes),
            FromClient::Invalid(why) => return self.fail(Failure::BadRequest(why), Ended::Detach),
            FromClient::Closed => {
                if self.phase == Phase::Verdict {
                    self.phase = Phase::Delivery;
                }
                Vec::new()
            }
            FromClient::Gone => return self.client_gone(),
        };
        self.settle(&mut acts);
        acts
    }

    /// The wait of [`Wait::Refusal`] or [`Wait::Verdict`] ran out.
    pub fn timed_out(&mut self) -> Vec<Act> {
        let mut acts = Vec::new();
        match self.phase {
            // The refused copy did not end: the client's refusal is its failure; the sandbox keeps the rest.
            Phase::Refused => self.phase = Phase::Done(Outcome { ended: Ended::Detach, status: None, failure: None }),
            // No verdict: the tar is taken as accepted.
            Phase::Verdict => {
                self.phase = Phase::Delivery;
                self.settle(&mut acts);
            }
            _ => {}
        }
        acts
    }

    fn output(&mut self, stream: Stream, data: Vec<u8>) -> Act {
        self.sent += data.len() as u64;
        Act::Client(ToClient::Output(stream, data))
    }

    fn exited(&mut self, status: ExitStatus, mut acts: Vec<Act>) -> Vec<Act> {
        self.status = Some(status);
        acts.push(Act::Client(ToClient::Exited(status)));
        self.phase = if self.copy_out.is_some() && !self.refused { Phase::Verdict } else { Phase::Delivery };
        self.settle(&mut acts);
        acts
    }

    fn delivered(&mut self, bytes: usize) -> Vec<Act> {
        self.delivered += bytes as u64;
        if !matches!(self.phase, Phase::Running | Phase::Refused) {
            // After the exit the last credit waits for the verdict and the rest of the deliveries.
            self.relay.output_held(bytes);
            return Vec::new();
        }
        self.relay.output_handed_on(bytes).map(|credit| Act::Sandbox(ToSandbox::Process(credit))).into_iter().collect()
    }

    /// Ends the session once everything the process wrote was delivered: the last credit goes back.
    fn settle(&mut self, acts: &mut Vec<Act>) {
        if self.phase == Phase::Delivery && self.delivered >= self.sent {
            acts.extend(self.relay.finish().map(|credit| Act::Sandbox(ToSandbox::Process(credit))));
            self.phase = Phase::Done(Outcome { ended: Ended::Delivered, status: self.status, failure: None });
        }
        self.stdin(acts);
    }

    fn stdin(&mut self, acts: &mut Vec<Act>) {
        if matches!(self.phase, Phase::Running) {
            acts.extend(std::iter::from_fn(|| self.relay.next_stdin()).map(|m| Act::Sandbox(ToSandbox::Process(m))));
        }
    }

    /// The client is gone: what it took is credited; the sandbox keeps the rest for a re-attach.
    fn client_gone(&mut self) -> Vec<Act> {
        let acts = self.relay.finish().map(|credit| Act::Sandbox(ToSandbox::Process(credit))).into_iter().collect();
        self.phase = Phase::Done(Outcome { ended: Ended::Detach, status: self.status, failure: None });
        acts
    }

    fn fail(&mut self, failure: Failure, ended: Ended) -> Vec<Act> {
        self.phase = Phase::Done(Outcome { ended, status: None, failure: Some(failure.clone()) });
        vec![Act::Client(ToClient::Failed(failure))]
    }
}

#[cfg(test)]
mod tests {
    use vm_protocol::files::TarRefusal;
    use vm_protocol::SignalName;

    use super::*;

    const ID: ProcId = ProcId(3);

    fn started() -> ProcessEvent {
        ProcessEvent::Started { id: ID, pid: 40, stdin_window: 4, output_window: 1 << 20 }
    }

    fn out(data: &[u8]) -> ProcessEvent {
        ProcessEvent::Output { id: ID, stream: Stream::Stdout, data: data.to_vec().into() }
    }

    fn credit(bytes: u32) -> Act {
        Act::Sandbox(ToSandbox::Process(ProcessRequest::Credit { id: ID, bytes }))
    }

    #[test]
    fn the_last_credit_waits_until_every_byte_was_delivered() {
        let mut s = ProcessSession::new(ID, false, None);
        assert_eq!(s.from_sandbox(Ok(started())), [Act::Client(ToClient::Started { pid: 40, reattached: false })]);
        assert_eq!(s.from_sandbox(Ok(out(b"abc"))), [Act::Client(ToClient::Output(Stream::Stdout, b"abc".to_vec()))]);
        let exited = s.from_sandbox(Ok(ProcessEvent::Exited { id: ID, status: ExitStatus::Code(2) }));
        assert_eq!(exited, [Act::Client(ToClient::Exited(ExitStatus::Code(2)))]);
        assert_eq!(s.wait(), Wait::Delivery, "three bytes not delivered yet");
        assert_eq!(s.from_client(FromClient::Delivered(3)), [credit(3)]);
        assert_eq!(s.outcome().map(|o| (o.ended, o.status)), Some((Ended::Delivered, Some(ExitStatus::Code(2)))));
    }

    #[test]
    fn stdin_goes_out_within_the_credit_and_eof_after_it() {
        let mut s = ProcessSession::new(ID, false, None);
        assert!(s.from_client(FromClient::Stdin(b"hello".to_vec())).is_empty(), "nothing before Started");
        s.from_client(FromClient::StdinEof);
        let acts = s.from_sandbox(Ok(started()));
        assert_eq!(
            acts[1],
            Act::Sandbox(ToSandbox::Process(ProcessRequest::Stdin { id: ID, data: b"hell".to_vec().into() }))
        );
        let acts = s.from_sandbox(Ok(ProcessEvent::StdinCredit { id: ID, bytes: 4 }));
        assert_eq!(
            acts,
            [
                Act::Sandbox(ToSandbox::Process(ProcessRequest::Stdin { id: ID, data: b"o".to_vec().into() })),
                Act::Sandbox(ToSandbox::Process(ProcessRequest::StdinEof { id: ID })),
            ]
        );
        let late = s.from_client(FromClient::Stdin(b"late".to_vec()));
        assert_eq!(late, [Act::Client(ToClient::Failed(Failure::BadRequest("stdin after stdin EOF")))]);
        assert_eq!(s.wait(), Wait::Done);
    }

    #[test]
    fn a_copys_verdict_comes_before_the_last_credit() {
        let mut s = ProcessSession::new(ID, false, Some("/out".into()));
        s.from_sandbox(Ok(started()));
        s.from_sandbox(Ok(out(b"tar")));
        assert_eq!(s.from_client(FromClient::Delivered(3)), [], "a batch is not full yet");
        s.from_sandbox(Ok(ProcessEvent::Exited { id: ID, status: ExitStatus::Code(0) }));
        assert_eq!(s.wait(), Wait::Verdict(VERDICT_TIMEOUT));
        let refused = s.from_client(FromClient::TarRefused(TarRefusal::ThroughSymlink));
        assert_eq!(
            refused,
            [
                Act::Sandbox(ToSandbox::TarRefused { id: ID, path: "/out".into(), reason: TarRefusal::ThroughSymlink }),
                credit(3),
            ]
        );
        assert_eq!(s.wait(), Wait::Done);
    }

    #[test]
    fn a_refusal_while_the_copy_runs_waits_for_its_end() {
        let mut s = ProcessSession::new(ID, false, Some("/out".into()));
        s.from_sandbox(Ok(started()));
        s.from_client(FromClient::TarRefused(TarRefusal::Malformed));
        assert_eq!(s.wait(), Wait::Refusal(REFUSAL_DELIVERY));
        s.from_sandbox(Ok(ProcessEvent::Exited { id: ID, status: ExitStatus::Signaled(9) }));
        assert_eq!(s.wait(), Wait::Done, "no second verdict");
        let mut stalled = ProcessSession::new(ID, false, Some("/out".into()));
        stalled.from_client(FromClient::TarRefused(TarRefusal::Malformed));
        stalled.timed_out();
        assert_eq!(stalled.outcome().map(|o| o.ended), Some(Ended::Detach));
    }

    #[test]
    fn a_refusal_of_what_is_no_copy_and_a_gone_client_end_the_session() {
        let mut s = ProcessSession::new(ID, false, None);
        let acts = s.from_client(FromClient::TarRefused(TarRefusal::Malformed));
        assert!(matches!(acts[..], [Act::Client(ToClient::Failed(Failure::BadRequest(_)))]));
        let mut s = ProcessSession::new(ID, true, None);
        s.from_sandbox(Ok(started()));
        s.from_sandbox(Ok(out(b"xy")));
        s.from_client(FromClient::Delivered(1));
        assert_eq!(s.from_client(FromClient::Gone), [credit(1)], "what it took is credited");
        assert_eq!(s.outcome().map(|o| o.ended), Some(Ended::Detach));
    }

    #[test]
    fn a_failed_spawns_message_is_shown_and_never_credited() {
        let mut s = ProcessSession::new(ID, false, None);
        s.from_sandbox(Ok(started()));
        let failed = s.from_sandbox(Ok(ProcessEvent::SpawnFailed {
            id: ID,
            status: ExitStatus::Code(127),
            message: "no such command".into(),
        }));
        assert_eq!(
            failed,
            [
                Act::Client(ToClient::Message("no such command\n".into())),
                Act::Client(ToClient::Exited(ExitStatus::Code(127)))
            ]
        );
        assert_eq!(s.outcome().map(|o| o.status), Some(Some(ExitStatus::Code(127))), "nothing to wait for");
    }

    #[test]
    fn signals_pass_while_it_runs_and_loss_ends_it() {
        let mut s = ProcessSession::new(ID, false, None);
        let sig = s.from_client(FromClient::Signal(SignalName::Int));
        assert_eq!(sig, [Act::Sandbox(ToSandbox::Process(ProcessRequest::Signal { id: ID, signal: SignalName::Int }))]);
        s.from_sandbox(Err(Lost::Overflow));
        assert_eq!(s.outcome().map(|o| o.ended), Some(Ended::Detach), "an overflowed process keeps running");
        let mut s = ProcessSession::new(ID, false, None);
        s.from_sandbox(Err(Lost::Connection));
        assert_eq!(s.outcome().map(|o| o.ended), Some(Ended::Lost));
    }
}

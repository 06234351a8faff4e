//! The service's `Exec` stream as a sandbox end, for the CLI (`vm-driver exec`, `cp`): the same session
//! drives a process whether the attach connection is here (`launch`) or behind `vm-driver serve`.
//!
//! The service runs the guest's flow control itself, so this end grants the session stdin credit for every
//! chunk the stream took (the stream's own queue bounds what is in flight) and drops output credit.

use std::collections::VecDeque;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::Streaming;
use vm_protocol::driver_api::driver_client::DriverClient;
use vm_protocol::driver_api::{
    exec_request, exec_response, ExecExited, ExecRequest, ExecResponse, StdinEof, TarRefused, TerminalSize,
};
use vm_protocol::flow::DEFAULT_WINDOW_BYTES;
use vm_protocol::{ExitStatus, ProcId, ProcessEvent, ProcessRequest};

use super::relay::OUTPUT_WINDOW;
use super::{Lost, SandboxEnd, ToSandbox, REFUSAL_DELIVERY};

/// Requests queued towards the service.
const REQUEST_QUEUE: usize = 16;

/// One process behind `vm-driver serve`.
#[derive(Debug)]
pub struct RemoteProcess {
    id: ProcId,
    tx: Option<mpsc::Sender<ExecRequest>>,
    responses: Streaming<ExecResponse>,
    /// Stdin credit for chunks the stream took.
    credit: VecDeque<ProcessEvent>,
    /// The service's reason, when the stream ended without an exit.
    why: Option<String>,
}

/// The session's id for the process (the stream is the process: the service never sees it).
pub const REMOTE_ID: ProcId = ProcId(1);

impl RemoteProcess {
    /// Opens an `Exec` stream with its first message.
    ///
    /// # Errors
    /// The service refused the stream (its status says why).
    pub async fn open(
        client: &mut DriverClient<Channel>,
        opening: exec_request::Request,
    ) -> Result<Self, tonic::Status> {
        let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
        tx.send(ExecRequest { request: Some(opening) })
            .await
            .map_err(|_| tonic::Status::internal("the request queue closed"))?;
        let responses = client.exec(ReceiverStream::new(rx)).await?.into_inner();
        Ok(Self { id: REMOTE_ID, tx: Some(tx), responses, credit: VecDeque::new(), why: None })
    }

    /// Why the stream ended without an exit, as the service said it.
    pub fn why(&self) -> Option<String> {
        self.why.clone()
    }

    /// Sends one request. The service stops reading requests only once it ended the stream, whose responses
    /// then say how (an exit, or why not): a request it no longer takes is dropped, not a loss.
    async fn request(&mut self, r: exec_request::Request) {
        if let Some(tx) = &self.tx {
            if tx.send(ExecRequest { request: Some(r) }).await.is_err() {
                self.tx = None;
            }
        }
    }

    fn event(&self, r: exec_response::Response) -> ProcessEvent {
        let id = self.id;
        match r {
            exec_response::Response::Started(s) => ProcessEvent::Started {
                id,
                pid: s.process_id,
                stdin_window: DEFAULT_WINDOW_BYTES,
                output_window: OUTPUT_WINDOW,
            },
            exec_response::Response::Stdout(data) => {
                ProcessEvent::Output { id, stream: vm_protocol::Stream::Stdout, data: data.into() }
            }
            exec_response::Response::Stderr(data) => {
                ProcessEvent::Output { id, stream: vm_protocol::Stream::Stderr, data: data.into() }
            }
            exec_response::Response::Exited(exited) => ProcessEvent::Exited { id, status: status(&exited) },
        }
    }
}

fn status(exited: &ExecExited) -> ExitStatus {
    if exited.signal != 0 {
        ExitStatus::Signaled(exited.signal)
    } else {
        ExitStatus::Code(exited.code)
    }
}

impl SandboxEnd for RemoteProcess {
    async fn send(&mut self, msg: ToSandbox) -> Result<(), Lost> {
        let r = match msg {
            ToSandbox::Process(ProcessRequest::Stdin { data, .. }) => {
                let bytes = u32::try_from(data.len()).unwrap_or(u32::MAX);
                self.request(exec_request::Request::Stdin(data.into_vec())).await;
                self.credit.push_back(ProcessEvent::StdinCredit { id: self.id, bytes });
                return Ok(());
            }
            ToSandbox::Process(ProcessRequest::StdinEof { .. }) => exec_request::Request::StdinEof(StdinEof {}),
            ToSandbox::Process(ProcessRequest::Signal { signal, .. }) => {
                exec_request::Request::Signal(signal.name().to_owned())
            }
            ToSandbox::Process(ProcessRequest::Resize { size, .. }) => {
                exec_request::Request::Resize(TerminalSize { rows: u32::from(size.rows), cols: u32::from(size.cols) })
            }
            ToSandbox::TarRefused { reason, .. } => {
                exec_request::Request::TarRefused(TarRefused { reason: reason.name().to_owned() })
            }
            // The service credits the guest itself; openings went with the stream's first message.
            ToSandbox::Process(_) => return Ok(()),
        };
        self.request(r).await;
        Ok(())
    }

    async fn recv(&mut self) -> Result<ProcessEvent, Lost> {
        if let Some(credit) = self.credit.pop_front() {
            return Ok(credit);
        }
        loop {
            match self.responses.next().await {
                Some(Ok(ExecResponse { response: Some(r) })) => return Ok(self.event(r)),
                Some(Ok(ExecResponse { response: None })) => {}
                Some(Err(status)) => {
                    self.why = Some(status.message().to_owned());
                    return Err(Lost::Connection);
                }
                None => {
                    self.why = Some("the stream ended before the process exited".to_owned());
                    return Err(Lost::Connection);
                }
            }
        }
    }

    async fn close(&mut self) {
        // Half-closes the request stream (the service awaits it after a copy's exit), then lets the service
        // finish, so a refusal sent last is delivered before this process exits.
        self.tx = None;
        let ended = async { while let Some(Ok(_)) = self.responses.next().await {} };
        let _ = tokio::time::timeout(REFUSAL_DELIVERY, ended).await;
    }
}

//! One process of a task, the init's or an exec's: what it is, its run through the driver's process session
//! with containerd's FIFOs as its client, its exit (kept for `Wait`, `State` and `Delete`, and published as
//! a `TaskExit` event), and the client requests (signals, resizes, stdin's end) handed to its session.

use std::sync::Arc;
use std::time::SystemTime;

use containerd_shim::api;
use containerd_shim::protos::events::task::TaskExit;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::Code;
use containerd_shim::TtrpcResult;
use tokio::sync::{mpsc, oneshot, watch};
use vm_driver::process::{self, Ended, FromClient, ProcessSession};
use vm_protocol::{ProcessRequest, Spawn};

use super::{error, TaskService};
use crate::fifo::{FifoClient, Stdio};
use crate::spec;

/// A process's output the driver holds for a client that does not read (as `serve`'s Exec streams).
pub(super) const OUTPUT_WINDOW: u32 = 256 * 1024;
/// Requests (signals, resizes) queued for one process before more are refused.
const REQUEST_QUEUE: usize = 16;
/// What a process that the VM took with it exited with: as if SIGKILLed.
pub(super) const LOST_STATUS: u32 = 128 + 9;

/// One exit.
#[derive(Debug, Clone, Copy)]
pub(super) struct Exit {
    pub(super) status: u32,
    pub(super) at: SystemTime,
}

/// One process of the task: the init (exec id `""`) or an exec.
#[derive(Debug)]
pub(super) struct Proc {
    pub(super) workload: spec::Workload,
    pub(super) stdio: Stdio,
    pub(super) pid: u32,
    pub(super) started: bool,
    pub(super) requests: Option<mpsc::Sender<FromClient>>,
    pub(super) exit: watch::Sender<Option<Exit>>,
}

impl Proc {
    pub(super) fn new(workload: spec::Workload, stdio: Stdio) -> Self {
        Self { workload, stdio, pid: 0, started: false, requests: None, exit: watch::channel(None).0 }
    }

    pub(super) fn exited(&self) -> Option<Exit> {
        *self.exit.borrow()
    }
}

pub(super) fn timestamp(at: SystemTime) -> Timestamp {
    let since = at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let mut ts = Timestamp::new();
    ts.seconds = i64::try_from(since.as_secs()).unwrap_or(i64::MAX);
    ts.nanos = i32::try_from(since.subsec_nanos()).unwrap_or_default();
    ts
}

impl TaskService {
    /// Runs one process to its end: the session between its FIFOs and the guest, then its exit recorded and
    /// published; the init's exit stops the VM when the VM is the task's own.
    pub(super) fn run_process(
        &self,
        id: String,
        exec_id: String,
        spawn: Spawn,
        stdio: Stdio,
    ) -> oneshot::Receiver<Result<u32, String>> {
        let (started_tx, started_rx) = oneshot::channel();
        let (requests_tx, requests_rx) = mpsc::channel(REQUEST_QUEUE);
        let service = self.clone();
        let pod = self.with(&id, |c| {
            if let Some(p) = c.procs.get_mut(&exec_id) {
                p.requests = Some(requests_tx);
            }
            Ok(Arc::clone(&c.pod))
        });
        tokio::spawn(async move {
            let status = async {
                let pod = pod.map_err(|_| "the task is gone".to_owned())?;
                let conn = pod.conn().await.map_err(|_| "the sandbox's supervisor is not reachable".to_owned())?;
                let window = spawn.output_window;
                let mut process = conn
                    .open(window, |pid| ProcessRequest::Spawn(Spawn { id: pid, ..spawn }).into())
                    .await
                    .map_err(|_| "the sandbox's supervisor is not reachable".to_owned())?;
                let mut client = FifoClient::open(&stdio, requests_rx, started_tx)
                    .map_err(|_| "cannot open the process's stdio FIFOs".to_owned())?;
                let session = ProcessSession::new(process.id(), false, None);
                let outcome = process::run(session, &mut process, &mut client).await;
                process.release(outcome.ended == Ended::Detach).await;
                Ok::<_, String>(outcome.status.map_or(LOST_STATUS, |s| u32::from(s.exit_code())))
            }
            .await
            .unwrap_or(LOST_STATUS);
            service.exited(&id, &exec_id, status).await;
        });
        started_rx
    }

    pub(super) async fn exited(&self, id: &str, exec_id: &str, status: u32) {
        let exit = Exit { status, at: SystemTime::now() };
        let found = self.with(id, |c| {
            let owns_vm = c.owns_vm();
            let p = c.procs.get_mut(exec_id).ok_or_else(|| error(Code::NOT_FOUND, "gone"))?;
            p.requests = None;
            p.exit.send_replace(Some(exit));
            if exec_id.is_empty() && owns_vm {
                c.pod.stop();
            }
            Ok(p.pid)
        });
        if let Ok(pid) = found {
            let event = TaskExit {
                container_id: id.to_owned(),
                id: if exec_id.is_empty() { id.to_owned() } else { exec_id.to_owned() },
                pid,
                exit_status: status,
                exited_at: Some(timestamp(exit.at)).into(),
                ..Default::default()
            };
            self.publish(topics::TASK_EXIT_EVENT_TOPIC, Box::new(event)).await;
        }
    }
    /// Hands a running process's session one client request.
    pub(super) fn request(&self, id: &str, exec_id: &str, request: FromClient) -> TtrpcResult<api::Empty> {
        self.with(id, |c| {
            let p = c.procs.get(exec_id).ok_or_else(|| error(Code::NOT_FOUND, "no such process"))?;
            let requests =
                p.requests.as_ref().ok_or_else(|| error(Code::FAILED_PRECONDITION, "the process is not running"))?;
            requests
                .try_send(request)
                .map_err(|_| error(Code::RESOURCE_EXHAUSTED, "the process has too many requests queued"))?;
            Ok(api::Empty::new())
        })
    }
}

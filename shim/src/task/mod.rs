//! containerd's task service (`containerd.task.v2.Task`) on one task's VM, or on one CRI pod's VM and its
//! containers: `Create` makes the root disk and boots the VM (a pod's sandbox: with the pod's directory
//! shared, [`crate::poddir`]; a pod's container: its disk put in that directory instead, for a root of its
//! own in the running VM), `Start` runs the init process (or an exec) through the driver's process session
//! with containerd's FIFOs as its client, `Kill`, `ResizePty` and `CloseIO` become the session's client
//! requests, `Wait` and `State` read the exit the session reported, `Delete` stops the VM and removes the
//! disk. Every process is the guest agent's, under the supervisor's policy and OCSF record, as any other.
//!
//! The init process's exit stops the VM (as a container's pid 1 exiting ends its namespace; in a pod, the
//! sandbox's); execs may not outlive it. Each exit is published as a `TaskExit` event and kept for `Wait`,
//! `State` and `Delete`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use containerd_shim::api::{self, Status as TaskStatus};
use containerd_shim::protos::events::task::{TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskStart};
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::protos::topics;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Context, ExitSignal, Task, TtrpcContext, TtrpcResult};
use tokio::sync::watch;
use vm_contract::root::{RootImage, RunConfig};
use vm_driver::process::FromClient;
use vm_protocol::container::{ContainerRoot, MAX_ROOTS};
use vm_protocol::message::EnvVar;
use vm_protocol::{ProcId, PtySize, SignalName, Spawn};

use self::process::{timestamp, Exit, Proc, LOST_STATUS, OUTPUT_WINDOW};
use crate::fifo::Stdio;
use crate::pod::Pod;
use crate::poddir::PodDir;
use crate::settings::Settings;
use crate::spec::Role;
use crate::{rootfs, spec};

mod process;

/// Execs one task may hold at once.
const MAX_EXECS: usize = 64;
/// How long a failed start waits for its exit to be recorded (it follows at once: the session just ended).
const EXIT_RECORD_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A task: its bundle, its VM, its processes.
#[derive(Debug)]
struct Container {
    bundle: PathBuf,
    role: Role,
    pod: Arc<Pod>,
    /// A pod's sandbox or container: the directory the containers' roots come through.
    pod_dir: Option<PodDir>,
    /// A pod's container: the root its processes run in.
    root: Option<ContainerRoot>,
    procs: HashMap<String, Proc>,
}

impl Container {
    /// Whether the VM is this task's own (alone, or a pod's sandbox): its init's exit and its `Delete`
    /// stop it.
    fn owns_vm(&self) -> bool {
        !matches!(self.role, Role::Member(_))
    }
}

/// The service.
#[derive(Clone)]
pub struct TaskService {
    /// The node's settings, or why they are unusable (said at every `Create`).
    settings: Arc<Result<Settings, String>>,
    namespace: String,
    /// One task, or a pod's sandbox and its containers.
    containers: Arc<Mutex<HashMap<String, Container>>>,
    publisher: Arc<RemotePublisher>,
    exit: Arc<ExitSignal>,
}

impl std::fmt::Debug for TaskService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskService").field("namespace", &self.namespace).finish_non_exhaustive()
    }
}

fn error(code: Code, message: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message.into()))
}

impl TaskService {
    /// A service with no task yet.
    pub fn new(
        settings: Result<Settings, String>,
        namespace: String,
        publisher: RemotePublisher,
        exit: Arc<ExitSignal>,
    ) -> Self {
        Self {
            settings: Arc::new(settings),
            namespace,
            containers: Arc::new(Mutex::new(HashMap::new())),
            publisher: Arc::new(publisher),
            exit,
        }
    }

    /// A watch on one process's exit record.
    fn exit_watch(&self, id: &str, exec_id: &str) -> TtrpcResult<watch::Receiver<Option<Exit>>> {
        self.with(id, |c| {
            let p = c.procs.get(exec_id).ok_or_else(|| error(Code::NOT_FOUND, "no such process"))?;
            Ok(p.exit.subscribe())
        })
    }

    fn with<T>(&self, id: &str, f: impl FnOnce(&mut Container) -> TtrpcResult<T>) -> TtrpcResult<T> {
        let mut held = self.held()?;
        match held.get_mut(id) {
            Some(c) => f(c),
            None => Err(error(Code::NOT_FOUND, format!("no task {id} in this shim"))),
        }
    }

    fn held(&self) -> TtrpcResult<std::sync::MutexGuard<'_, HashMap<String, Container>>> {
        self.containers.lock().map_err(|_| error(Code::INTERNAL, "the shim's state is poisoned"))
    }

    /// The VM of the pod `sandbox` and its directory, for a container joining it.
    fn pod_of(&self, sandbox: &str) -> TtrpcResult<(Arc<Pod>, PodDir)> {
        let held = self.held()?;
        if held.len() >= MAX_ROOTS {
            return Err(error(Code::RESOURCE_EXHAUSTED, format!("a pod's VM holds at most {MAX_ROOTS} containers")));
        }
        let found = held.values().find(|c| c.role == Role::Sandbox(sandbox.to_owned()));
        match found.and_then(|c| Some((Arc::clone(&c.pod), c.pod_dir.clone()?))) {
            Some((pod, _)) if pod.is_ended() => Err(error(Code::FAILED_PRECONDITION, "the pod's VM has stopped")),
            Some(found) => Ok(found),
            None => Err(error(Code::FAILED_PRECONDITION, format!("the pod's sandbox {sandbox} is not in this shim"))),
        }
    }

    async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        // Best effort: containerd also learns each exit from Wait.
        let _ = self.publisher.publish(Context::default(), topic, &self.namespace, event).await;
    }
}

#[async_trait::async_trait]
impl Task for TaskService {
    async fn create(&self, _ctx: &TtrpcContext, req: api::CreateTaskRequest) -> TtrpcResult<api::CreateTaskResponse> {
        if self.held()?.contains_key(&req.id) {
            return Err(error(Code::ALREADY_EXISTS, format!("task {} exists", req.id)));
        }
        let settings = self.settings.as_ref().as_ref().map_err(|why| error(Code::FAILED_PRECONDITION, why.clone()))?;
        let bundle = PathBuf::from(&req.bundle);
        let mut container = spec::read(&bundle).map_err(|e| error(Code::INVALID_ARGUMENT, e.to_string()))?;
        let joining = match &container.role {
            Role::Member(sandbox) => Some(self.pod_of(sandbox)?),
            Role::Alone if !self.held()?.is_empty() => {
                return Err(error(Code::ALREADY_EXISTS, "this shim already runs a task"));
            }
            Role::Alone | Role::Sandbox(_) => None,
        };
        let seed = format!("{}/{}", self.namespace, req.id);
        let kept = settings.state_dir.join(rootfs::KEPT_DIR);
        let disk = rootfs::make_disk(&bundle, &req.rootfs, &seed, &kept)
            .await
            .map_err(|e| error(Code::FAILED_PRECONDITION, format!("{e:#}")))?;
        let (pod, pod_dir, root) = if let Some((pod, pod_dir)) = joining {
            let added = pod_dir.add(&req.id, &disk, &container.files);
            let root = added.map_err(|e| {
                rootfs::clean(&bundle);
                error(Code::FAILED_PRECONDITION, e.to_string())
            })?;
            (pod, Some(pod_dir), Some(root))
        } else {
            let pod_dir = match container.role {
                Role::Sandbox(_) => {
                    let made = PodDir::make(&bundle).map_err(|_| {
                        rootfs::clean(&bundle);
                        error(Code::FAILED_PRECONDITION, "cannot make the pod's directory")
                    })?;
                    container.mounts.push(made.share());
                    Some(made)
                }
                _ => None,
            };
            let image = RootImage {
                manifest: format!("containerd:{seed}"),
                disk,
                disk_mib: settings.disk_mib,
                // The spec's process is complete (containerd merged the image's config into it).
                run: RunConfig::default(),
            };
            let sandbox =
                vm_driver::state::random_id("ctr").map_err(|_| error(Code::INTERNAL, "cannot make a sandbox id"))?;
            match Pod::boot(settings, sandbox, image, &container).await {
                Ok(pod) => (Arc::new(pod), pod_dir, None),
                Err(e) => {
                    rootfs::clean(&bundle);
                    return Err(error(Code::FAILED_PRECONDITION, e.to_string()));
                }
            }
        };
        let pid = pod.pid;
        let stdio = Stdio { stdin: req.stdin.clone(), stdout: req.stdout.clone(), stderr: req.stderr.clone() };
        let mut procs = HashMap::new();
        procs.insert(String::new(), Proc::new(container.init, stdio));
        let task = Container { bundle, role: container.role, pod, pod_dir, root, procs };
        self.held()?.insert(req.id.clone(), task);
        let event = TaskCreate { container_id: req.id.clone(), bundle: req.bundle.clone(), pid, ..Default::default() };
        self.publish(topics::TASK_CREATE_EVENT_TOPIC, Box::new(event)).await;
        Ok(api::CreateTaskResponse { pid, ..Default::default() })
    }

    async fn start(&self, _ctx: &TtrpcContext, req: api::StartRequest) -> TtrpcResult<api::StartResponse> {
        let (workload, stdio, root) = self.with(&req.id, |c| {
            if c.pod.is_ended() {
                return Err(error(Code::FAILED_PRECONDITION, "the task's VM has stopped"));
            }
            let p = c.procs.get_mut(&req.exec_id).ok_or_else(|| error(Code::NOT_FOUND, "no such process"))?;
            if p.started {
                return Err(error(Code::FAILED_PRECONDITION, "the process was started already"));
            }
            p.started = true;
            Ok((p.workload.clone(), p.stdio.clone(), c.root.clone()))
        })?;
        let spawn = Spawn {
            id: ProcId(0),
            argv: workload.argv,
            env: workload.env.into_iter().map(|(key, value)| EnvVar { key, value }).collect(),
            cwd: workload.cwd,
            pty: workload.terminal.then_some(PtySize { rows: 24, cols: 80 }),
            output_window: OUTPUT_WINDOW,
            rlimits: workload.rlimits,
            root,
        };
        let mut exit = self.exit_watch(&req.id, &req.exec_id)?;
        let started = self.run_process(req.id.clone(), req.exec_id.clone(), spawn, stdio);
        let why = match started.await {
            Ok(Ok(pid)) => Ok(pid),
            Ok(Err(why)) => Err(format!("the process did not start: {why}")),
            Err(_) => Err("the process did not start".to_owned()),
        };
        let pid = match why {
            Ok(pid) => pid,
            Err(why) => {
                // Its exit is recorded before the answer: a client that deletes the task at once (`ctr run
                // --rm`) finds it stopped, not still created.
                let _ = tokio::time::timeout(EXIT_RECORD_WAIT, exit.wait_for(Option::is_some)).await;
                return Err(error(Code::FAILED_PRECONDITION, why));
            }
        };
        self.with(&req.id, |c| {
            if let Some(p) = c.procs.get_mut(&req.exec_id) {
                p.pid = pid;
            }
            Ok(())
        })?;
        if req.exec_id.is_empty() {
            let event = TaskStart { container_id: req.id.clone(), pid, ..Default::default() };
            self.publish(topics::TASK_START_EVENT_TOPIC, Box::new(event)).await;
        } else {
            let event = TaskExecStarted {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                pid,
                ..Default::default()
            };
            self.publish(topics::TASK_EXEC_STARTED_EVENT_TOPIC, Box::new(event)).await;
        }
        Ok(api::StartResponse { pid, ..Default::default() })
    }

    async fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        let bytes = req.spec.as_ref().map(|any| any.value.clone()).unwrap_or_default();
        let process: oci_spec::runtime::Process = serde_json::from_slice(&bytes)
            .map_err(|_| error(Code::INVALID_ARGUMENT, "the exec's spec is not an OCI process"))?;
        let workload = spec::workload(&process).map_err(|e| error(Code::INVALID_ARGUMENT, e.to_string()))?;
        self.with(&req.id, |c| {
            if c.procs.contains_key(&req.exec_id) {
                return Err(error(Code::ALREADY_EXISTS, format!("exec {} exists", req.exec_id)));
            }
            if c.procs.len() > MAX_EXECS {
                return Err(error(Code::RESOURCE_EXHAUSTED, format!("a task holds at most {MAX_EXECS} execs")));
            }
            if c.procs.get("").and_then(Proc::exited).is_some() {
                return Err(error(Code::FAILED_PRECONDITION, "the task's init process has exited"));
            }
            let stdio = Stdio { stdin: req.stdin.clone(), stdout: req.stdout.clone(), stderr: req.stderr.clone() };
            c.procs.insert(req.exec_id.clone(), Proc::new(workload, stdio));
            Ok(())
        })?;
        let event = TaskExecAdded { container_id: req.id.clone(), exec_id: req.exec_id.clone(), ..Default::default() };
        self.publish(topics::TASK_EXEC_ADDED_EVENT_TOPIC, Box::new(event)).await;
        Ok(api::Empty::new())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let signal = i32::try_from(req.signal)
            .ok()
            .and_then(|n| SignalName::ALL.into_iter().find(|s| s.number() == n))
            .ok_or_else(|| {
                error(Code::INVALID_ARGUMENT, format!("signal {} is not one a sandbox takes", req.signal))
            })?;
        let never_started = self.with(&req.id, |c| {
            let targets: Vec<&Proc> = if req.all && req.exec_id.is_empty() {
                c.procs.values().collect()
            } else {
                vec![c.procs.get(&req.exec_id).ok_or_else(|| error(Code::NOT_FOUND, "no such process"))?]
            };
            let target = c.procs.get(&req.exec_id).ok_or_else(|| error(Code::NOT_FOUND, "no such process"))?;
            if target.exited().is_some() {
                return Err(error(Code::NOT_FOUND, "process already finished"));
            }
            for p in targets {
                if let Some(requests) = &p.requests {
                    let _ = requests.try_send(FromClient::Signal(signal));
                }
            }
            Ok(!target.started)
        })?;
        if never_started {
            // Nothing runs to take the signal: it ends the process as the signal would.
            let status = 128 + u32::try_from(signal.number()).unwrap_or_default();
            self.exited(&req.id, &req.exec_id, status).await;
        }
        Ok(api::Empty::new())
    }

    async fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let mut exit = self.exit_watch(&req.id, &req.exec_id)?;
        let exited =
            *exit.wait_for(Option::is_some).await.map_err(|_| error(Code::NOT_FOUND, "the process is gone"))?;
        let exited = exited.ok_or_else(|| error(Code::INTERNAL, "no exit"))?;
        Ok(api::WaitResponse {
            exit_status: exited.status,
            exited_at: Some(timestamp(exited.at)).into(),
            ..Default::default()
        })
    }

    async fn delete(&self, _ctx: &TtrpcContext, req: api::DeleteRequest) -> TtrpcResult<api::DeleteResponse> {
        if !req.exec_id.is_empty() {
            let (pid, exit) = self.with(&req.id, |c| {
                let p = c.procs.get(&req.exec_id).ok_or_else(|| error(Code::NOT_FOUND, "no such process"))?;
                let exit = match p.exited() {
                    Some(exit) => exit,
                    None if !p.started => Exit { status: 0, at: SystemTime::now() },
                    None => return Err(error(Code::FAILED_PRECONDITION, "the process is still running")),
                };
                let pid = p.pid;
                c.procs.remove(&req.exec_id);
                Ok((pid, exit))
            })?;
            return Ok(api::DeleteResponse {
                pid,
                exit_status: exit.status,
                exited_at: Some(timestamp(exit.at)).into(),
                ..Default::default()
            });
        }
        let (pod, bundle, pid, owns_vm) = self.with(&req.id, |c| {
            let init = c.procs.get("");
            if !c.owns_vm() && init.is_some_and(|p| p.started && p.exited().is_none()) {
                return Err(error(Code::FAILED_PRECONDITION, "the container's init process is still running"));
            }
            Ok((Arc::clone(&c.pod), c.bundle.clone(), init.map_or(0, |p| p.pid), c.owns_vm()))
        })?;
        if owns_vm {
            pod.stop();
            pod.ended().await;
        } else {
            // A pod's container: its execs end, the pod's VM stays. (The guest keeps its root mounted.)
            self.with(&req.id, |c| {
                for p in c.procs.values().filter(|p| p.exited().is_none()) {
                    if let Some(requests) = &p.requests {
                        let _ = requests.try_send(FromClient::Signal(SignalName::Kill));
                    }
                }
                if let (Some(dir), Some(root)) = (&c.pod_dir, &c.root) {
                    dir.remove(root);
                }
                Ok(())
            })?;
        }
        rootfs::clean(&bundle);
        // Every process ended with the VM (or was killed); one that had not reported its exit yet is lost.
        let exits: Vec<(String, Option<Exit>)> =
            self.with(&req.id, |c| Ok(c.procs.iter().map(|(id, p)| (id.clone(), p.exited())).collect()))?;
        for (exec_id, exit) in &exits {
            if exit.is_none() {
                self.exited(&req.id, exec_id, LOST_STATUS).await;
            }
        }
        let exit = self
            .with(&req.id, |c| Ok(c.procs.get("").and_then(Proc::exited)))?
            .unwrap_or(Exit { status: LOST_STATUS, at: SystemTime::now() });
        self.held()?.remove(&req.id);
        let event = TaskDelete {
            container_id: req.id.clone(),
            pid,
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        };
        self.publish(topics::TASK_DELETE_EVENT_TOPIC, Box::new(event)).await;
        Ok(api::DeleteResponse {
            pid,
            exit_status: exit.status,
            exited_at: Some(timestamp(exit.at)).into(),
            ..Default::default()
        })
    }

    async fn state(&self, _ctx: &TtrpcContext, req: api::StateRequest) -> TtrpcResult<api::StateResponse> {
        self.with(&req.id, |c| {
            let p = c.procs.get(&req.exec_id).ok_or_else(|| error(Code::NOT_FOUND, "no such process"))?;
            let exit = p.exited();
            let status = match (p.started, exit) {
                (_, Some(_)) => TaskStatus::STOPPED,
                (true, None) => TaskStatus::RUNNING,
                (false, None) => TaskStatus::CREATED,
            };
            let mut state = api::StateResponse {
                id: req.id.clone(),
                bundle: c.bundle.display().to_string(),
                pid: if req.exec_id.is_empty() && p.pid == 0 { c.pod.pid } else { p.pid },
                stdin: p.stdio.stdin.clone(),
                stdout: p.stdio.stdout.clone(),
                stderr: p.stdio.stderr.clone(),
                terminal: p.workload.terminal,
                exec_id: req.exec_id.clone(),
                ..Default::default()
            };
            state.status = status.into();
            if let Some(exit) = exit {
                state.exit_status = exit.status;
                state.exited_at = Some(timestamp(exit.at)).into();
            }
            Ok(state)
        })
    }

    async fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        self.with(&req.id, |c| {
            let processes = c
                .procs
                .values()
                .filter(|p| p.started && p.exited().is_none())
                .map(|p| containerd_shim::protos::api::ProcessInfo { pid: p.pid, ..Default::default() })
                .collect();
            Ok(api::PidsResponse { processes, ..Default::default() })
        })
    }

    async fn resize_pty(&self, _ctx: &TtrpcContext, req: api::ResizePtyRequest) -> TtrpcResult<api::Empty> {
        let size = PtySize::from_client(req.height, req.width);
        self.request(&req.id, &req.exec_id, FromClient::Resize(size))
    }

    async fn close_io(&self, _ctx: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        if !req.stdin {
            return Ok(api::Empty::new());
        }
        self.request(&req.id, &req.exec_id, FromClient::StdinEof)
    }

    async fn stats(&self, _ctx: &TtrpcContext, req: api::StatsRequest) -> TtrpcResult<api::StatsResponse> {
        let pod = self.with(&req.id, |c| Ok(Arc::clone(&c.pod)))?;
        let metrics = pod.metrics().ok_or_else(|| error(Code::FAILED_PRECONDITION, "the task's VM is not running"))?;
        let any = containerd_shim::util::convert_to_any(Box::new(metrics))
            .map_err(|_| error(Code::INTERNAL, "the metrics cannot be encoded"))?;
        Ok(api::StatsResponse { stats: Some(any).into(), ..Default::default() })
    }

    async fn update(&self, _ctx: &TtrpcContext, _req: api::UpdateTaskRequest) -> TtrpcResult<api::Empty> {
        Err(error(Code::UNIMPLEMENTED, "a task's VM is not resized while it runs"))
    }

    async fn connect(&self, _ctx: &TtrpcContext, req: api::ConnectRequest) -> TtrpcResult<api::ConnectResponse> {
        let task_pid = self.with(&req.id, |c| Ok(c.pod.pid)).unwrap_or_default();
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _ctx: &TtrpcContext, req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        // `now`: containerd gives up on the task; the shim's exit takes its VM along (the liveness pipe).
        let idle = self.held().map(|held| held.is_empty()).unwrap_or(true);
        if idle || req.now {
            self.exit.signal();
        }
        Ok(api::Empty::new())
    }
}

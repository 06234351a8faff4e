//! The gRPC service: validates requests (ids before any path is built) and hands them to the sandboxes'
//! actors.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use vm_contract::ids::SandboxId;
use vm_contract::layout::SandboxFile;
use vm_contract::shape::{SandboxShape, MAX_CPUS, MAX_MEMORY_MIB};
use vm_protocol::attach::{SupervisorReply, SupervisorRequest, ToClient};
use vm_protocol::credentials::RotationOutcome;
use vm_protocol::driver_api::driver_server::Driver;
use vm_protocol::driver_api::{
    watch_event, AdmissionLimits, AdmissionUsage, AuditHead, Capabilities, CreateSandboxRequest, DeleteSandboxResponse,
    ExecRequest, ForwardPortRequest, GetCapabilitiesRequest, ListImagesRequest, ListImagesResponse, ListPoolRequest,
    ListPoolResponse, ListProcessesResponse, ListSandboxesRequest, ListSandboxesResponse, ProcessInfo,
    PullImageRequest, ReadinessKind, RemoveImageRequest, RemoveImageResponse, RotateCredentialsRequest,
    RotateCredentialsResponse, Sandbox, SandboxRef, UpdatePolicyRequest, UpdatePolicyResponse, ValidateCreateResponse,
    WatchEvent, WatchRequest,
};
use vm_protocol::identity::{IdSelector, RunAs};
use vm_protocol::policy::{Operation, PolicyUpdate, UpdateOutcome};
use vm_protocol::{ProcessEvent, SignalName};

mod convert;
mod forward;
mod images;

use super::actor::Command;
use super::exec::{self, ExecStream};
use super::hub::Hub;

/// The service.
#[derive(Debug, Clone)]
pub struct Api {
    /// Everything the requests reach, through one façade.
    reg: Arc<Hub>,
    accelerator: (String, String),
}

impl Api {
    /// A service over `hub`; `accelerator` is what `auto` resolves to here, and why.
    pub fn new(hub: Arc<Hub>, accelerator: (String, String)) -> Self {
        Self { reg: hub, accelerator }
    }
}

pub(super) fn sandbox_id(text: &str) -> Result<SandboxId, Status> {
    SandboxId::parse(text).map_err(|e| Status::invalid_argument(e.to_string()))
}

/// What this driver cannot offer, though the request is well formed.
const UNIX_READINESS: &str = "unix readiness endpoints are not offered on this host; use READINESS_TCP";

/// Problems with a create request, in words; empty when it is fine.
fn problems(reg: &Hub, req: &CreateSandboxRequest) -> Vec<String> {
    let mut out = Vec::new();
    match SandboxId::parse(&req.sandbox_id) {
        Ok(id) if reg.registry.contains(&id) => out.push(format!("sandbox {id} exists")),
        Ok(_) => {}
        Err(e) => out.push(e.to_string()),
    }
    let spec = req.spec.clone().unwrap_or_default();
    if let Err(e) = SandboxShape::with_defaults(spec.cpus, spec.memory_mib) {
        out.push(e.to_string());
    }
    if let Err(e) = reg.ctx.images.resolve(&spec.boot_image) {
        out.push(e.to_string());
    }
    if !spec.image.is_empty() {
        if let Err(e) = spec.image.parse::<vm_oci::source::Source>() {
            out.push(format!("image: {e}"));
        }
        if spec.disk_mib > vm_contract::root::MAX_DISK_MIB {
            out.push(format!("disk_mib: at most {}", vm_contract::root::MAX_DISK_MIB));
        }
    }
    if spec.readiness == i32::from(ReadinessKind::ReadinessUnix) {
        out.push(UNIX_READINESS.into());
    }
    if !spec.policy.is_empty() {
        if let Err(e) = vm_protocol::policy::SandboxPolicy::parse(&spec.policy, &vm_protocol::identity::WORKLOAD) {
            out.push(e.to_string());
        }
    }
    if let Err(e) = convert::host_mounts(&spec, reg.ctx.jail.confinement) {
        out.push(e.to_string());
    }
    if spec.env.keys().any(|k| k.is_empty() || k.contains('=') || k.contains('\0')) {
        out.push("environment names must be non-empty and contain no '=' or NUL".into());
    }
    if let Err(status) = convert::credentials(req.credentials.clone()) {
        out.push(status.message().to_owned());
    }
    out
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Driver for Api {
    type PullImageStream = images::PullStream;

    async fn pull_image(&self, req: Request<PullImageRequest>) -> Result<Response<Self::PullImageStream>, Status> {
        images::pull(&self.reg, req.into_inner().reference).map(Response::new)
    }

    async fn list_images(&self, _: Request<ListImagesRequest>) -> Result<Response<ListImagesResponse>, Status> {
        Ok(Response::new(ListImagesResponse { images: images::list(&self.reg).await? }))
    }

    async fn remove_image(&self, req: Request<RemoveImageRequest>) -> Result<Response<RemoveImageResponse>, Status> {
        let manifest = images::remove(&self.reg, req.into_inner().reference).await?;
        Ok(Response::new(RemoveImageResponse { manifest }))
    }

    async fn get_capabilities(&self, _: Request<GetCapabilitiesRequest>) -> Result<Response<Capabilities>, Status> {
        let (limits, usage) = (self.reg.ctx.limits, self.reg.usage());
        Ok(Response::new(Capabilities {
            driver_version: env!("CARGO_PKG_VERSION").into(),
            accelerator: self.accelerator.0.clone(),
            accelerator_note: self.accelerator.1.clone(),
            confinement: self.reg.ctx.jail.confinement.as_str().into(),
            max_cpus: MAX_CPUS,
            max_memory_mib: MAX_MEMORY_MIB,
            signals: SignalName::ALL.iter().map(|s| s.name().to_owned()).collect(),
            tty: true,
            readiness_kinds: vec![ReadinessKind::ReadinessTcp.into()],
            limits: Some(AdmissionLimits {
                sandboxes: limits.sandboxes,
                vcpus: limits.vcpus,
                memory_mib: limits.memory_mib,
                exec_streams: limits.exec_streams,
                exec_per_sandbox: limits.exec_per_sandbox,
            }),
            usage: Some(AdmissionUsage {
                sandboxes: usage.sandboxes,
                vcpus: usage.vcpus,
                memory_mib: usage.memory_mib,
                exec_streams: self.reg.exec_streams.open(),
                pooled: usage.pooled,
            }),
        }))
    }

    async fn validate_create(
        &self,
        req: Request<CreateSandboxRequest>,
    ) -> Result<Response<ValidateCreateResponse>, Status> {
        let problems = problems(&self.reg, req.get_ref());
        Ok(Response::new(ValidateCreateResponse { ok: problems.is_empty(), problems }))
    }

    async fn create_sandbox(&self, req: Request<CreateSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        let req = req.into_inner();
        let id = sandbox_id(&req.sandbox_id)?;
        if self.reg.registry.is_closing() {
            return Err(Status::unavailable("the driver is shutting down"));
        }
        if self.reg.registry.contains(&id) {
            return Err(Status::already_exists(format!("sandbox {id} exists")));
        }
        let problems = problems(&self.reg, &req);
        if problems.iter().any(|p| p == UNIX_READINESS) {
            return Err(Status::failed_precondition(UNIX_READINESS));
        }
        if !problems.is_empty() {
            return Err(Status::invalid_argument(problems.join("; ")));
        }
        let spec = convert::stored_spec(&req.spec.unwrap_or_default(), self.reg.ctx.jail.confinement)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let credentials = convert::credentials(req.credentials)?;
        let secrets = super::hub::CreateSecrets { credentials, gateway_token: None };
        let record = self.reg.create(id, spec, secrets).await?;
        Ok(Response::new(convert::sandbox(&record)))
    }

    async fn get_sandbox(&self, req: Request<SandboxRef>) -> Result<Response<Sandbox>, Status> {
        let id = sandbox_id(&req.get_ref().sandbox_id)?;
        let record = self.reg.registry.get(&id).ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
        Ok(Response::new(convert::sandbox(&record)))
    }

    async fn list_sandboxes(
        &self,
        _: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let sandboxes = self.reg.registry.list().iter().map(convert::sandbox).collect();
        Ok(Response::new(ListSandboxesResponse { sandboxes }))
    }

    async fn list_pool(&self, _: Request<ListPoolRequest>) -> Result<Response<ListPoolResponse>, Status> {
        Ok(Response::new(convert::pool(self.reg.pool.list())))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, req: Request<WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let filter = match req.get_ref().sandbox_id.as_str() {
            "" => None,
            text => Some(sandbox_id(text)?.to_string()),
        };
        let rx = self.reg.events.subscribe();
        let snapshot: Vec<Sandbox> = self
            .reg
            .registry
            .list()
            .iter()
            .map(convert::sandbox)
            .filter(|s| filter.as_ref().is_none_or(|f| *f == s.sandbox_id))
            .collect();
        let matches = move |e: &WatchEvent| match (&filter, &e.event) {
            (None, _) => true,
            (Some(f), Some(watch_event::Event::Changed(s))) => *f == s.sandbox_id,
            (Some(f), Some(watch_event::Event::Platform(p))) => *f == p.sandbox_id,
            (Some(_), None) => false,
        };
        let changes = BroadcastStream::new(rx).filter_map(move |item| match item.map(|e| convert::watch_event(&e)) {
            Ok(e) if matches(&e) => Some(Ok(e)),
            Ok(_) => None,
            Err(_) => Some(Err(Status::data_loss("this watcher fell behind; watch again"))),
        });
        let first = tokio_stream::iter(
            snapshot.into_iter().map(|s| Ok(WatchEvent { event: Some(watch_event::Event::Changed(s)) })),
        );
        let stream: WatchStream = Box::pin(first.chain(changes));
        Ok(Response::new(stream))
    }

    async fn stop_sandbox(&self, req: Request<SandboxRef>) -> Result<Response<Sandbox>, Status> {
        let id = sandbox_id(&req.get_ref().sandbox_id)?;
        let record = self.reg.ask(&id, Command::Stop).await??;
        Ok(Response::new(convert::sandbox(&record)))
    }

    async fn start_sandbox(&self, req: Request<SandboxRef>) -> Result<Response<Sandbox>, Status> {
        let id = sandbox_id(&req.get_ref().sandbox_id)?;
        let record = self.reg.ask(&id, Command::Start).await??;
        Ok(Response::new(convert::sandbox(&record)))
    }

    async fn delete_sandbox(&self, req: Request<SandboxRef>) -> Result<Response<DeleteSandboxResponse>, Status> {
        let id = sandbox_id(&req.get_ref().sandbox_id)?;
        self.reg.ask(&id, Command::Delete).await?;
        Ok(Response::new(DeleteSandboxResponse {}))
    }

    async fn get_audit_head(&self, req: Request<SandboxRef>) -> Result<Response<AuditHead>, Status> {
        let id = sandbox_id(&req.get_ref().sandbox_id)?;
        self.reg.registry.get(&id).ok_or_else(|| Status::not_found(format!("no sandbox {id}")))?;
        let layout = self.reg.ctx.state.layout(&id);
        let dir = layout.dir().to_owned();
        let read = tokio::task::spawn_blocking(move || {
            let head = vm_audit::verify::head(&dir.join(SandboxFile::Audit.name()));
            (head, crate::audit::anchor(&dir))
        });
        let (head, anchor) = read.await.map_err(|_| Status::internal("the audit chain could not be read"))?;
        let (head, sealed) =
            head.map_err(|_| Status::failed_precondition("the sandbox has no readable audit chain"))?;
        Ok(Response::new(AuditHead {
            seq: head.seq,
            hash: vm_audit::hex(&head.hash),
            sealed_seq: sealed.unwrap_or(0),
            anchor_seq: anchor.map(|a| a.seq),
            anchor_hash: anchor.map(|a| vm_audit::hex(&a.hash)),
        }))
    }

    async fn list_processes(&self, req: Request<SandboxRef>) -> Result<Response<ListProcessesResponse>, Status> {
        let id = sandbox_id(&req.get_ref().sandbox_id)?;
        self.reg.serving(&id)?;
        let mut attached = crate::attach_client::connect(&self.reg.ctx.state.layout(&id))
            .await
            .map_err(|_| Status::unavailable("supervisor unreachable"))?;
        attached
            .send(SupervisorRequest::ListProcesses)
            .await
            .map_err(|_| Status::unavailable("supervisor unreachable"))?;
        let answer = async {
            while let Some(Ok(msg)) = attached.recv().await {
                match msg {
                    ToClient::Supervisor(SupervisorReply::Processes { list }) => return Some(Ok(list)),
                    ToClient::Process(ProcessEvent::Refused { .. }) => {
                        return Some(Err(Status::permission_denied("denied by the sandbox policy")));
                    }
                    _ => {}
                }
            }
            None
        };
        // A hung supervisor accepts the connection (the kernel does) and never answers.
        let list = tokio::time::timeout(crate::attach_client::CONNECT_TIMEOUT, answer)
            .await
            .ok()
            .flatten()
            .ok_or_else(|| Status::unavailable("supervisor unreachable"))??;
        let processes = list
            .into_iter()
            .map(|p| ProcessInfo { process_id: p.pid, argv: p.argv, attached: p.attached, tty: p.tty })
            .collect();
        Ok(Response::new(ListProcessesResponse { processes }))
    }

    async fn update_policy(&self, req: Request<UpdatePolicyRequest>) -> Result<Response<UpdatePolicyResponse>, Status> {
        let req = req.into_inner();
        let id = sandbox_id(&req.sandbox_id)?;
        if req.revision == 0 {
            return Err(Status::invalid_argument("revision 0 is the policy approved at create; updates start at 1"));
        }
        let allow = req
            .allow
            .iter()
            .map(|a| a.parse::<Operation>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.reg.serving(&id)?;
        let selector = |s: &str| (!s.is_empty()).then(|| IdSelector(s.to_owned()));
        let run_as = (!req.run_as_user.is_empty() || !req.run_as_group.is_empty())
            .then(|| RunAs { user: selector(&req.run_as_user), group: selector(&req.run_as_group) });
        let network = match req.network.as_str() {
            "" => None,
            json => Some(
                serde_json::from_str(json)
                    .map_err(|e| Status::invalid_argument(format!("network: not a JSON list of network rules: {e}")))?,
            ),
        };
        let update = PolicyUpdate { revision: req.revision, allow, run_as, network };
        let outcome = crate::attach_client::update_policy(&self.reg.ctx.state.layout(&id), update)
            .await
            .map_err(|_| Status::unavailable("supervisor unreachable"))?;
        match outcome {
            UpdateOutcome::Applied => {
                Ok(Response::new(UpdatePolicyResponse { revision: req.revision, outcome: outcome.describe().into() }))
            }
            refused => {
                Err(Status::failed_precondition(format!("policy revision {}: {}", req.revision, refused.describe())))
            }
        }
    }

    async fn rotate_credentials(
        &self,
        req: Request<RotateCredentialsRequest>,
    ) -> Result<Response<RotateCredentialsResponse>, Status> {
        let (id, rotation) = convert::rotation(req.into_inner())?;
        super::credentials::rotate(&self.reg, &id, rotation).await?;
        Ok(Response::new(RotateCredentialsResponse { outcome: RotationOutcome::Applied.describe().into() }))
    }

    type ForwardPortStream = forward::ForwardStream;

    async fn forward_port(
        &self,
        req: Request<Streaming<ForwardPortRequest>>,
    ) -> Result<Response<Self::ForwardPortStream>, Status> {
        forward::forward_port(Arc::clone(&self.reg), req.into_inner()).await.map(Response::new)
    }

    type ExecStream = ExecStream;

    async fn exec(&self, req: Request<Streaming<ExecRequest>>) -> Result<Response<ExecStream>, Status> {
        exec::exec(Arc::clone(&self.reg), req.into_inner()).await.map(Response::new)
    }
}

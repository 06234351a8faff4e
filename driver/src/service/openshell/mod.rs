//! OpenShell's ComputeDriver service (`openshell.compute.v1.ComputeDriver`): a second façade on the same
//! sandboxes, so an unmodified OpenShell gateway drives `vm-driver serve` (`--openshell-socket`).
//!
//! It goes through the [`Hub`] as our own API does: the same admission, actors, state directory and
//! events; only the messages differ. [`spec`] maps a gateway's sandbox onto ours (and refuses what we cannot
//! honour), [`observe`] maps ours back to what the gateway observes. The sandbox's supervisor speaks the
//! gateway's supervisor protocol itself (`vm-supervisor`'s `gateway` module), with the token kept here at
//! create.
//!
//! The socket admits the driver's own uid (`SO_PEERCRED`), and only the gateway's pid when one is given
//! (`--openshell-gateway-pid`), as OpenShell's own VM driver does.

mod observe;
mod spec;

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};
use vm_protocol::openshell::compute::v1::compute_driver_server::ComputeDriver;
use vm_protocol::openshell::compute::v1::{
    watch_sandboxes_event, CreateSandboxRequest, CreateSandboxResponse, DeleteSandboxRequest, DeleteSandboxResponse,
    DeleteWorkspaceRequest, DeleteWorkspaceResponse, EnsureWorkspaceRequest, EnsureWorkspaceResponse,
    GetCapabilitiesRequest, GetCapabilitiesResponse, GetGatewayListenerRequirementsRequest,
    GetGatewayListenerRequirementsResponse, GetSandboxRequest, GetSandboxResponse, ListSandboxesRequest,
    ListSandboxesResponse, StartSandboxRequest, StartSandboxResponse, StopSandboxRequest, StopSandboxResponse,
    ValidateSandboxCreateRequest, ValidateSandboxCreateResponse, WatchSandboxesEvent, WatchSandboxesRequest,
    WatchSandboxesSandboxEvent,
};

use super::actor::Command;
use super::hub::{CreateSecrets, Hub};
use super::record::SandboxRecord;
use vm_contract::ids::SandboxId;

/// What `GetCapabilities` names us.
pub const DRIVER_NAME: &str = "vm-driver";

/// The service.
#[derive(Debug, Clone)]
pub struct OpenShellDriver {
    hub: Arc<Hub>,
}

impl OpenShellDriver {
    /// The service over `hub`.
    pub fn new(hub: Arc<Hub>) -> Self {
        Self { hub }
    }

    /// Sandbox `id` or `name` (the gateway sends both; either finds it), if a gateway created it.
    fn find(&self, id: &str, name: &str) -> Result<SandboxRecord, Status> {
        let by_id = SandboxId::parse(id).ok().and_then(|id| self.hub.registry.get(&id));
        let found = by_id.or_else(|| {
            self.hub
                .registry
                .list()
                .into_iter()
                .find(|r| !name.is_empty() && r.spec.gateway.as_ref().is_some_and(|g| g.sandbox_name == name))
        });
        match found {
            Some(record) if record.spec.gateway.is_some() => Ok(record),
            _ => Err(Status::not_found(format!("no sandbox {id:?} ({name:?}) created through this service"))),
        }
    }

    /// Every sandbox a gateway created, as observed.
    fn observed(&self) -> Vec<vm_protocol::openshell::compute::v1::DriverSandbox> {
        let mut records: Vec<SandboxRecord> =
            self.hub.registry.list().into_iter().filter(|r| r.spec.gateway.is_some()).collect();
        records.sort_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
        records.iter().map(observe::sandbox).collect()
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchSandboxesEvent, Status>> + Send>>;

#[tonic::async_trait]
impl ComputeDriver for OpenShellDriver {
    async fn get_capabilities(
        &self,
        _: Request<GetCapabilitiesRequest>,
    ) -> Result<Response<GetCapabilitiesResponse>, Status> {
        Ok(Response::new(GetCapabilitiesResponse {
            driver_name: DRIVER_NAME.into(),
            driver_version: env!("CARGO_PKG_VERSION").into(),
            // Empty: the built-in root, for a sandbox without an image.
            default_image: String::new(),
            // A driver restart brings back what was running; a gateway going down stops nothing.
            gateway_manages_lifecycle: false,
        }))
    }

    async fn get_gateway_listener_requirements(
        &self,
        _: Request<GetGatewayListenerRequirementsRequest>,
    ) -> Result<Response<GetGatewayListenerRequirementsResponse>, Status> {
        // Our supervisors run on the host and dial the gateway where it already listens.
        Ok(Response::new(GetGatewayListenerRequirementsResponse { requirements: Vec::new() }))
    }

    async fn validate_sandbox_create(
        &self,
        req: Request<ValidateSandboxCreateRequest>,
    ) -> Result<Response<ValidateSandboxCreateResponse>, Status> {
        let accepted =
            spec::accept(req.get_ref().sandbox.as_ref()).map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.hub.ctx.images.resolve(&accepted.spec.boot_image).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if self.hub.ctx.gateway.is_none() {
            return Err(Status::failed_precondition("vm-driver serve was started without --openshell-endpoint"));
        }
        Ok(Response::new(ValidateSandboxCreateResponse {}))
    }

    async fn get_sandbox(&self, req: Request<GetSandboxRequest>) -> Result<Response<GetSandboxResponse>, Status> {
        let req = req.into_inner();
        let record = self.find(&req.sandbox_id, &req.sandbox_name)?;
        if !req.sandbox_id.is_empty() && record.id.as_str() != req.sandbox_id {
            return Err(Status::failed_precondition("the sandbox's name and id name different sandboxes"));
        }
        Ok(Response::new(GetSandboxResponse { sandbox: Some(observe::sandbox(&record)) }))
    }

    async fn list_sandboxes(
        &self,
        _: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        Ok(Response::new(ListSandboxesResponse { sandboxes: self.observed() }))
    }

    async fn create_sandbox(
        &self,
        req: Request<CreateSandboxRequest>,
    ) -> Result<Response<CreateSandboxResponse>, Status> {
        let accepted =
            spec::accept(req.get_ref().sandbox.as_ref()).map_err(|e| Status::invalid_argument(e.to_string()))?;
        if self.hub.ctx.gateway.is_none() {
            return Err(Status::failed_precondition("vm-driver serve was started without --openshell-endpoint"));
        }
        let secrets = CreateSecrets { credentials: Vec::new(), gateway_token: Some(accepted.token) };
        self.hub.create(accepted.id, accepted.spec, secrets).await?;
        Ok(Response::new(CreateSandboxResponse {}))
    }

    async fn stop_sandbox(&self, req: Request<StopSandboxRequest>) -> Result<Response<StopSandboxResponse>, Status> {
        let req = req.into_inner();
        let id = self.find(&req.sandbox_id, &req.sandbox_name)?.id;
        // Answers once the VM is down: the gateway writes Stopped on our answer.
        self.hub.ask(&id, Command::Stop).await??;
        Ok(Response::new(StopSandboxResponse {}))
    }

    async fn start_sandbox(&self, req: Request<StartSandboxRequest>) -> Result<Response<StartSandboxResponse>, Status> {
        let req = req.into_inner();
        let id = self.find(&req.sandbox_id, &req.sandbox_name)?.id;
        self.hub.ask(&id, Command::Start).await??;
        Ok(Response::new(StartSandboxResponse {}))
    }

    async fn delete_sandbox(
        &self,
        req: Request<DeleteSandboxRequest>,
    ) -> Result<Response<DeleteSandboxResponse>, Status> {
        let req = req.into_inner();
        let Ok(record) = self.find(&req.sandbox_id, &req.sandbox_name) else {
            // Nothing of ours: the gateway removes its own record.
            return Ok(Response::new(DeleteSandboxResponse { deleted: false }));
        };
        // Answers once it is gone; watchers then see its `deleted` event.
        self.hub.ask(&record.id, Command::Delete).await?;
        Ok(Response::new(DeleteSandboxResponse { deleted: true }))
    }

    async fn watch_sandboxes(&self, _: Request<WatchSandboxesRequest>) -> Result<Response<WatchStream>, Status> {
        // Subscribed before the snapshot is taken: nothing between the two is missed (a change may come
        // twice, which a watcher takes as the same state).
        let changes = BroadcastStream::new(self.hub.events.subscribe());
        let snapshot = self.observed().into_iter().map(|sandbox| {
            Ok(WatchSandboxesEvent {
                payload: Some(watch_sandboxes_event::Payload::Sandbox(WatchSandboxesSandboxEvent {
                    sandbox: Some(sandbox),
                })),
            })
        });
        let hub = Arc::clone(&self.hub);
        let changes = changes.filter_map(move |item| match item {
            Ok(event) => {
                observe::watch_event(&event, |id| hub.registry.get(id).is_some_and(|r| r.spec.gateway.is_some()))
                    .map(Ok)
            }
            Err(_) => Some(Err(Status::data_loss("this watcher fell behind; watch again"))),
        });
        let stream: WatchStream = Box::pin(tokio_stream::iter(snapshot).chain(changes));
        Ok(Response::new(stream))
    }

    async fn ensure_workspace(
        &self,
        req: Request<EnsureWorkspaceRequest>,
    ) -> Result<Response<EnsureWorkspaceResponse>, Status> {
        workspace_name(&req.get_ref().workspace)?;
        // A workspace holds no platform resource here: each sandbox's writable layer is its own and outlives
        // its stops; the gateway keeps the tenancy.
        Ok(Response::new(EnsureWorkspaceResponse {}))
    }

    async fn delete_workspace(
        &self,
        req: Request<DeleteWorkspaceRequest>,
    ) -> Result<Response<DeleteWorkspaceResponse>, Status> {
        workspace_name(&req.get_ref().workspace)?;
        Ok(Response::new(DeleteWorkspaceResponse {}))
    }
}

/// A workspace name the gateway may send: empty, or a DNS label's characters.
fn workspace_name(name: &str) -> Result<(), Status> {
    let ok = name.len() <= 253 && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(Status::invalid_argument("workspace: letters, digits, '-', '.' and '_', at most 253"))
    }
}

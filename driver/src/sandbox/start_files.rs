//! What a start hands the supervisor in files: the auth bundle, the approved policy, the image root, the
//! gateway binding and the launch descriptor.

use vm_contract::auth::AuthBundle;
use vm_contract::descriptor::{LaunchDescriptor, MicrovmPayload};
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::root::RootImage;
use vm_contract::session::SessionId;
use vm_protocol::policy::SandboxPolicy;

use super::{Identity, StartError, VmSpec};

/// What a start hands the supervisor in files: the auth bundle (0600), the approved policy and the launch
/// descriptor. On failure the caller ends the generation, which takes the bundle back.
pub(super) fn write_start_files(vm: &VmSpec, who: &Identity) -> Result<(), StartError> {
    let dir = vm.layout.dir();
    let bundle = AuthBundle {
        otlp_headers: who.secrets.otlp_headers.clone(),
        session_token: who.session.as_ref().map(|s| s.token.clone()),
        egress_proxy_authorization: who.secrets.egress_proxy_authorization.clone(),
        secrets: who.secrets.credentials.clone(),
        gateway_token: who.secrets.gateway_token.clone(),
    };
    bundle.write(dir)?;
    write_policy(&vm.layout, who.policy.as_ref()).map_err(StartError::Policy)?;
    match &who.gateway {
        Some(binding) => binding.write(dir)?,
        None => {
            let _ = std::fs::remove_file(vm.layout.path(SandboxFile::Gateway));
        }
    }
    RootImage::write(vm.root.as_ref(), &vm.layout).map_err(StartError::Root)?;
    LaunchDescriptor::microvm(&descriptor_payload(vm, who)).write(dir).map_err(StartError::Descriptor)
}

/// What this start's launch descriptor says (or, under fault injection, misstates).
fn descriptor_payload(vm: &VmSpec, who: &Identity) -> MicrovmPayload {
    let mut payload = MicrovmPayload {
        sandbox_id: who.id.to_string(),
        session_id: who.session.as_ref().map(|s| s.id.as_str().to_owned()),
        generation: who.session.as_ref().map_or(0, |s| s.generation.0),
    };
    let faults = vm.controls.lifecycle;
    if faults.descriptor_wrong_sandbox {
        payload.sandbox_id.push_str("-other");
    }
    if faults.descriptor_wrong_session {
        payload.session_id = Some(SessionId::from_bytes([0xee; 16]).as_str().to_owned());
    }
    if faults.descriptor_wrong_generation {
        payload.generation += 1;
    }
    payload
}

/// Writes the approved policy (0600) where the supervisor reads it at start; without one, removes a stale file.
fn write_policy(layout: &SandboxLayout, policy: Option<&SandboxPolicy>) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = layout.path(SandboxFile::Policy);
    let _ = std::fs::remove_file(&path);
    let Some(policy) = policy else { return Ok(()) };
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path)?;
    file.write_all(policy.to_json().as_bytes())
}

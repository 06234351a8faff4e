//! What a start hands the supervisor in files: the auth bundle, the approved policy, the image root and the
//! launch descriptor.

use vm_contract::auth::AuthBundle;
use vm_contract::descriptor::{LaunchDescriptor, MicrovmPayload};
use vm_contract::layout::{SandboxFile, SandboxLayout};
use vm_contract::root::RootImage;
use vm_contract::session::SessionId;
use vm_protocol::policy::SandboxPolicy;

use super::{StartError, StartSpec};

/// What a start hands the supervisor in files: the auth bundle (0600), the approved policy and the launch
/// descriptor. On failure the caller ends the generation, which takes the bundle back.
pub(super) fn write_start_files(spec: &StartSpec) -> Result<(), StartError> {
    let dir = spec.layout.dir();
    let bundle = AuthBundle {
        otlp_headers: spec.otlp_headers.clone(),
        session_token: spec.session.as_ref().map(|s| s.token.clone()),
        egress_proxy_authorization: spec.egress.proxy_authorization.clone(),
        secrets: spec.secrets.clone(),
    };
    bundle.write(dir)?;
    write_policy(&spec.layout, spec.policy.as_ref()).map_err(StartError::Policy)?;
    RootImage::write(spec.root.as_ref(), &spec.layout).map_err(StartError::Root)?;
    LaunchDescriptor::microvm(&descriptor_payload(spec)).write(dir).map_err(StartError::Descriptor)
}

/// What this start's launch descriptor says (or, under fault injection, misstates).
fn descriptor_payload(spec: &StartSpec) -> MicrovmPayload {
    let mut payload = MicrovmPayload {
        sandbox_id: spec.id.to_string(),
        session_id: spec.session.as_ref().map(|s| s.id.as_str().to_owned()),
        generation: spec.session.as_ref().map_or(0, |s| s.generation.0),
    };
    let faults = spec.controls.lifecycle;
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

//! A gateway's `DriverSandbox`, as a sandbox of ours: what maps onto our spec, and a clear refusal, naming
//! the field, for what we cannot honour. Nothing here touches the host.
//!
//! | gateway | ours |
//! |---|---|
//! | `id` | the sandbox id (OpenShell's are UUIDs, which our ids admit) |
//! | `name` | kept, and shown back in observations |
//! | `spec.template.image` | `image` (an OCI reference); empty: the built-in root |
//! | `spec.template.environment`, then `spec.environment` | `env` (the second wins) |
//! | `spec.template.resources` | vCPUs (the limit, else the request, rounded up) and MiB |
//! | `spec.command`, `spec.tty` | the main process ([`MainProcess`]) |
//! | `spec.sandbox_token` | kept host-side (0600) for the supervisor's calls; never in the guest |
//! | `spec.template.driver_config` | `policy` (our policy JSON), `disk_mib` |
//!
//! Refused: a GPU, `platform_config`, unknown `driver_config` keys, an environment variable that would
//! carry the sandbox token or name an OpenShell setting, no token at all.

use std::collections::BTreeMap;

use prost_types::value::Kind;
use vm_contract::gateway::{GatewaySandbox, MainProcess};
use vm_contract::ids::SandboxId;
use vm_contract::shape::SandboxShape;
use vm_protocol::openshell::compute::v1::{DriverResourceRequirements, DriverSandbox};
use vm_protocol::policy::SandboxPolicy;

use crate::service::store::StoredSpec;

/// Longest environment value, bytes.
const MAX_ENV_VALUE_BYTES: usize = 32 * 1024;
/// Most environment variables.
const MAX_ENV: usize = 256;

/// Why a gateway's sandbox cannot be ours. Each names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// No sandbox in the request.
    #[error("sandbox: missing")]
    Missing,
    /// The id is not one of ours.
    #[error("sandbox.id: {0}")]
    Id(String),
    /// No sandbox token: the supervisor could not authenticate to the gateway.
    #[error("spec.sandbox_token: empty; the gateway must be configured with gateway_jwt to drive vm-driver")]
    NoToken,
    /// A GPU was asked for.
    #[error("spec.resource_requirements.gpu: vm-driver sandboxes have no GPU")]
    Gpu,
    /// Platform settings were given.
    #[error("spec.template.platform_config: vm-driver takes no platform config")]
    PlatformConfig,
    /// A driver setting we do not know.
    #[error("spec.template.driver_config.{0}: unknown; vm-driver takes policy and disk_mib")]
    DriverConfigKey(String),
    /// A driver setting of the wrong kind.
    #[error("spec.template.driver_config.{0}: {1}")]
    DriverConfigValue(&'static str, String),
    /// A resource quantity we cannot read.
    #[error("spec.template.resources.{0}: {1:?} is not a quantity (such as 500m, 2, 512Mi or 4Gi)")]
    Quantity(&'static str, String),
    /// vCPUs or memory out of range.
    #[error("spec.template.resources: {0}")]
    Shape(String),
    /// An environment variable we refuse.
    #[error("spec.environment: {0}")]
    Env(String),
    /// The command cannot be run.
    #[error("spec.command: {0}")]
    Command(String),
    /// The image reference cannot be read.
    #[error("spec.template.image: {0}")]
    Image(String),
}

/// A gateway's sandbox, accepted: our id, our spec, and its token.
#[derive(Debug)]
pub struct Accepted {
    /// Its id.
    pub id: SandboxId,
    /// Our spec of it.
    pub spec: StoredSpec,
    /// The gateway's token for it.
    pub token: String,
}

/// Maps `sandbox` onto our spec, or says which field we cannot honour.
///
/// # Errors
/// [`SpecError`].
pub fn accept(sandbox: Option<&DriverSandbox>) -> Result<Accepted, SpecError> {
    let sandbox = sandbox.ok_or(SpecError::Missing)?;
    let id = SandboxId::parse(&sandbox.id).map_err(|e| SpecError::Id(e.to_string()))?;
    let spec = sandbox.spec.clone().unwrap_or_default();
    if spec.sandbox_token.is_empty() {
        return Err(SpecError::NoToken);
    }
    if spec.resource_requirements.as_ref().is_some_and(|r| r.gpu.is_some()) {
        return Err(SpecError::Gpu);
    }
    let template = spec.template.clone().unwrap_or_default();
    if template.platform_config.as_ref().is_some_and(|c| !c.fields.is_empty()) {
        return Err(SpecError::PlatformConfig);
    }
    let (policy, disk_mib) = driver_config(template.driver_config.as_ref())?;
    let shape = shape(template.resources.as_ref())?;
    let env = environment(template.environment.iter().chain(&spec.environment))?;
    let main = MainProcess::new(spec.command.clone(), spec.tty).map_err(|e| SpecError::Command(e.to_string()))?;
    let image = (!template.image.is_empty()).then(|| template.image.clone());
    if let Some(image) = &image {
        image.parse::<vm_oci::source::Source>().map_err(|e| SpecError::Image(e.to_string()))?;
    }
    let spec_ours = StoredSpec {
        shape,
        env,
        boot_image: String::new(),
        image,
        disk_mib: disk_mib.unwrap_or(vm_contract::root::DEFAULT_DISK_MIB),
        policy,
        mounts: Vec::new(),
        gateway: Some(GatewaySandbox { sandbox_name: sandbox.name.clone(), main }),
    };
    Ok(Accepted { id, spec: spec_ours, token: spec.sandbox_token })
}

/// `driver_config`: our policy (a JSON string, or the object itself) and the writable layer's size.
fn driver_config(config: Option<&prost_types::Struct>) -> Result<(Option<SandboxPolicy>, Option<u32>), SpecError> {
    let (mut policy, mut disk) = (None, None);
    for (key, value) in config.map(|c| &c.fields).into_iter().flatten() {
        match (key.as_str(), &value.kind) {
            ("policy", Some(kind)) => {
                let json = match kind {
                    Kind::StringValue(text) => text.clone(),
                    other => json(other).to_string(),
                };
                let parsed = SandboxPolicy::parse(&json, &vm_protocol::identity::WORKLOAD)
                    .map_err(|e| SpecError::DriverConfigValue("policy", e.to_string()))?;
                policy = Some(parsed);
            }
            ("disk_mib", Some(Kind::NumberValue(n)))
                if n.fract() == 0.0 && *n >= 1.0 && *n <= f64::from(vm_contract::root::MAX_DISK_MIB) =>
            {
                disk = Some(number_to_u32(*n));
            }
            ("disk_mib", _) => {
                let max = vm_contract::root::MAX_DISK_MIB;
                return Err(SpecError::DriverConfigValue("disk_mib", format!("a whole number from 1 to {max}")));
            }
            (other, _) => return Err(SpecError::DriverConfigKey(other.to_owned())),
        }
    }
    Ok((policy, disk))
}

/// A whole number already checked to be in range.
fn number_to_u32(n: f64) -> u32 {
    #[expect(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "checked whole and in range")]
    let whole = n as u32;
    whole
}

/// A protobuf value as JSON.
fn json(kind: &Kind) -> serde_json::Value {
    match kind {
        Kind::NullValue(_) => serde_json::Value::Null,
        Kind::NumberValue(n) => serde_json::Number::from_f64(*n).map_or(serde_json::Value::Null, Into::into),
        Kind::StringValue(s) => s.clone().into(),
        Kind::BoolValue(b) => (*b).into(),
        Kind::StructValue(s) => serde_json::Value::Object(
            s.fields.iter().map(|(k, v)| (k.clone(), v.kind.as_ref().map_or(serde_json::Value::Null, json))).collect(),
        ),
        Kind::ListValue(l) => l.values.iter().map(|v| v.kind.as_ref().map_or(serde_json::Value::Null, json)).collect(),
    }
}

/// vCPUs and memory from Kubernetes-style quantities: the limit, else the request; none: our defaults.
fn shape(resources: Option<&DriverResourceRequirements>) -> Result<SandboxShape, SpecError> {
    let Some(r) = resources else { return Ok(SandboxShape::default()) };
    let pick = |limit: &str, request: &str| if limit.is_empty() { request.to_owned() } else { limit.to_owned() };
    let cpu = pick(&r.cpu_limit, &r.cpu_request);
    let memory = pick(&r.memory_limit, &r.memory_request);
    let cpus = if cpu.is_empty() { 0 } else { cpus(&cpu).ok_or(SpecError::Quantity("cpu", cpu))? };
    let mib = if memory.is_empty() { 0 } else { mebibytes(&memory).ok_or(SpecError::Quantity("memory", memory))? };
    SandboxShape::with_defaults(cpus, mib).map_err(|e| SpecError::Shape(e.to_string()))
}

/// Whole vCPUs from a CPU quantity (`500m` is one, `2` two, `1.5` two).
fn cpus(text: &str) -> Option<u32> {
    let millis = match text.strip_suffix('m') {
        Some(m) => m.parse::<u64>().ok()?,
        None => {
            let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
            if frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let frac_millis = format!("{frac:0<3}").parse::<u64>().ok()?;
            whole.parse::<u64>().ok()?.checked_mul(1000)?.checked_add(frac_millis)?
        }
    };
    u32::try_from(millis.div_ceil(1000)).ok().filter(|c| *c > 0)
}

/// Whole MiB from a memory quantity (`512Mi`, `4Gi`, `1G`, `268435456`), rounded up.
fn mebibytes(text: &str) -> Option<u32> {
    const UNITS: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (digits, unit) =
        UNITS.iter().find_map(|(suffix, unit)| text.strip_suffix(suffix).map(|d| (d, *unit))).unwrap_or((text, 1));
    let bytes = digits.parse::<u64>().ok()?.checked_mul(unit)?;
    u32::try_from(bytes.div_ceil(1 << 20)).ok().filter(|m| *m > 0)
}

/// The environment, checked: no OpenShell setting (the gateway reserves them, and the token must never
/// reach the guest), bounded in number and size.
fn environment<'a>(
    vars: impl Iterator<Item = (&'a String, &'a String)>,
) -> Result<BTreeMap<String, String>, SpecError> {
    let mut env = BTreeMap::new();
    for (name, value) in vars {
        let ok_name = !name.is_empty()
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if !ok_name {
            return Err(SpecError::Env(format!("{name:?} is not a variable name")));
        }
        if name.starts_with("OPENSHELL_") {
            return Err(SpecError::Env(format!("{name} is reserved: OpenShell settings never reach the guest")));
        }
        if value.len() > MAX_ENV_VALUE_BYTES || value.contains('\0') {
            return Err(SpecError::Env(format!("{name}: a value of at most {MAX_ENV_VALUE_BYTES} bytes, no NUL")));
        }
        env.insert(name.clone(), value.clone());
    }
    if env.len() > MAX_ENV {
        return Err(SpecError::Env(format!("at most {MAX_ENV} variables")));
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_types::{Struct, Value};
    use vm_protocol::openshell::compute::v1::{
        DriverSandboxSpec, DriverSandboxTemplate, GpuResourceRequirements, ResourceRequirements,
    };

    fn sandbox(spec: DriverSandboxSpec) -> DriverSandbox {
        DriverSandbox {
            id: "0b6d8c2e-7a5f-4f11-9a1e-3c2d1b0a9f8e".into(),
            name: "happy-otter".into(),
            spec: Some(DriverSandboxSpec { sandbox_token: "jwt".into(), ..spec }),
            ..DriverSandbox::default()
        }
    }

    fn template(t: DriverSandboxTemplate) -> DriverSandboxSpec {
        DriverSandboxSpec { template: Some(t), ..DriverSandboxSpec::default() }
    }

    fn config(key: &str, kind: Kind) -> Option<Struct> {
        Some(Struct { fields: [(key.to_owned(), Value { kind: Some(kind) })].into_iter().collect() })
    }

    #[test]
    fn a_plain_sandbox_gets_our_defaults_and_the_default_main_process() {
        let a = accept(Some(&sandbox(DriverSandboxSpec::default()))).unwrap();
        assert_eq!(a.id.as_str(), "0b6d8c2e-7a5f-4f11-9a1e-3c2d1b0a9f8e");
        assert_eq!(a.token, "jwt");
        assert_eq!(a.spec.shape, SandboxShape::default());
        assert_eq!(a.spec.image, None);
        let gateway = a.spec.gateway.unwrap();
        assert_eq!(gateway.sandbox_name, "happy-otter");
        assert_eq!(gateway.main.command, vm_contract::gateway::DEFAULT_MAIN);
    }

    #[test]
    fn image_resources_environment_command_and_config_map_onto_ours() {
        let mut t = DriverSandboxTemplate {
            image: "registry.example/team/agent:1".into(),
            resources: Some(DriverResourceRequirements {
                cpu_request: "500m".into(),
                cpu_limit: "1.5".into(),
                memory_request: "512Mi".into(),
                ..Default::default()
            }),
            driver_config: config("disk_mib", Kind::NumberValue(2048.0)),
            ..Default::default()
        };
        t.environment.insert("A".into(), "template".into());
        t.environment.insert("B".into(), "template".into());
        let mut spec = template(t);
        spec.environment.insert("B".into(), "spec".into());
        spec.command = vec!["python3".into(), "-m".into(), "http.server".into()];
        spec.tty = true;
        let a = accept(Some(&sandbox(spec))).unwrap();
        assert_eq!((a.spec.shape.cpus(), a.spec.shape.memory_mib()), (2, 512));
        assert_eq!(a.spec.image.as_deref(), Some("registry.example/team/agent:1"));
        assert_eq!(a.spec.env["A"], "template");
        assert_eq!(a.spec.env["B"], "spec", "the sandbox's own environment wins");
        assert_eq!(a.spec.disk_mib, 2048);
        let main = a.spec.gateway.unwrap().main;
        assert_eq!(main.command[2], "http.server");
        assert!(main.tty);
    }

    #[test]
    fn a_policy_comes_as_a_string_or_as_the_object_itself() {
        let text = config("policy", Kind::StringValue(r#"{"allow":["exec"]}"#.into()));
        let spec = template(DriverSandboxTemplate { driver_config: text, ..Default::default() });
        assert!(accept(Some(&sandbox(spec))).unwrap().spec.policy.is_some());
        let list = Kind::ListValue(prost_types::ListValue {
            values: vec![Value { kind: Some(Kind::StringValue("exec".into())) }],
        });
        let object = Struct { fields: [("allow".to_owned(), Value { kind: Some(list) })].into_iter().collect() };
        let spec = template(DriverSandboxTemplate {
            driver_config: config("policy", Kind::StructValue(object)),
            ..Default::default()
        });
        assert!(accept(Some(&sandbox(spec))).unwrap().spec.policy.is_some());
    }

    #[test]
    fn what_we_cannot_honour_is_refused_naming_the_field() {
        let refused = |spec: DriverSandboxSpec| accept(Some(&sandbox(spec))).unwrap_err();
        let gpu = DriverSandboxSpec {
            resource_requirements: Some(ResourceRequirements { gpu: Some(GpuResourceRequirements { count: None }) }),
            ..Default::default()
        };
        assert_eq!(refused(gpu), SpecError::Gpu);
        let platform = template(DriverSandboxTemplate {
            platform_config: config("runtimeClassName", Kind::StringValue("kata".into())),
            ..Default::default()
        });
        assert_eq!(refused(platform), SpecError::PlatformConfig);
        let unknown = template(DriverSandboxTemplate {
            driver_config: config("privileged", Kind::BoolValue(true)),
            ..Default::default()
        });
        assert_eq!(refused(unknown), SpecError::DriverConfigKey("privileged".into()));
        let disk = template(DriverSandboxTemplate {
            driver_config: config("disk_mib", Kind::NumberValue(0.5)),
            ..Default::default()
        });
        assert!(matches!(refused(disk), SpecError::DriverConfigValue("disk_mib", _)));
        let cpu = template(DriverSandboxTemplate {
            resources: Some(DriverResourceRequirements { cpu_limit: "lots".into(), ..Default::default() }),
            ..Default::default()
        });
        assert!(matches!(refused(cpu), SpecError::Quantity("cpu", _)));
        let huge = template(DriverSandboxTemplate {
            resources: Some(DriverResourceRequirements { memory_limit: "1Ti".into(), ..Default::default() }),
            ..Default::default()
        });
        assert!(matches!(refused(huge), SpecError::Shape(_)));
        let mut token_env = DriverSandboxSpec::default();
        token_env.environment.insert("OPENSHELL_SANDBOX_TOKEN".into(), "x".into());
        assert!(matches!(refused(token_env), SpecError::Env(_)));
        let mut bad_name = DriverSandboxSpec::default();
        bad_name.environment.insert("A=B".into(), "x".into());
        assert!(matches!(refused(bad_name), SpecError::Env(_)));
        let command = DriverSandboxSpec { command: vec![String::new()], ..Default::default() };
        assert!(matches!(refused(command), SpecError::Command(_)));
        let mut no_token = sandbox(DriverSandboxSpec::default());
        no_token.spec.as_mut().unwrap().sandbox_token.clear();
        assert_eq!(accept(Some(&no_token)).unwrap_err(), SpecError::NoToken);
        let bad_id = DriverSandbox { id: "../etc".into(), ..sandbox(DriverSandboxSpec::default()) };
        assert!(matches!(accept(Some(&bad_id)).unwrap_err(), SpecError::Id(_)));
        assert_eq!(accept(None).unwrap_err(), SpecError::Missing);
    }

    #[test]
    fn quantities_read_as_kubernetes_writes_them() {
        assert_eq!(cpus("500m"), Some(1));
        assert_eq!(cpus("2"), Some(2));
        assert_eq!(cpus("2.001"), Some(3));
        assert_eq!(cpus("0"), None);
        assert_eq!(cpus("1.0001"), None);
        assert_eq!(mebibytes("512Mi"), Some(512));
        assert_eq!(mebibytes("4Gi"), Some(4096));
        assert_eq!(mebibytes("1G"), Some(954));
        assert_eq!(mebibytes("268435456"), Some(256));
        assert_eq!(mebibytes("99999999Ti"), None);
        assert_eq!(mebibytes("-1Mi"), None);
    }
}

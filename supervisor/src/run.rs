//! One sandbox from start to exit: telemetry up, [`boot`](crate::boot), [`serve`](crate::serve), then the
//! lifecycle events and a bounded flush of everything queued.

use std::path::Path;
use std::time::{Duration, Instant};

use vm_contract::args::SupervisorArgs;
use vm_contract::auth::AuthBundle;
use vm_contract::descriptor::{LaunchDescriptor, Mismatch, Trusted};
use vm_contract::jail::Confinement;
use vm_contract::layout::SandboxFile;
use vm_contract::session::SessionHello;
use vm_contract::status::SupervisorStatus;
use vm_ocsf::{AppInfo, Finding, Lifecycle, Status};
use vm_protocol::policy::SandboxPolicy;

use crate::boot::{self, Booted, StartError};
use crate::diagnostics::{chain, tails};
use crate::session::SessionConfig;
use crate::status;
use crate::stop::{self, StopReason};
use crate::telemetry::console::Console;
use crate::telemetry::settings::{SettingsError, TelemetrySettings};
use crate::telemetry::{Telemetry, TelemetryControls};

/// Runs one VM from boot to stop, reporting to `console` and the telemetry sinks.
///
/// # Errors
/// A [`StartError`] if the VM never became ready; the failure is also reported as a status line and an
/// OCSF event.
pub async fn run(args: SupervisorArgs, console: Console) -> Result<StopReason, StartError> {
    if args.pooled {
        return crate::pooled::run(args, console).await;
    }
    if let Err(e) = std::env::set_current_dir(&args.sandbox_dir) {
        let e = StartError::SandboxDir(args.sandbox_dir.clone(), e);
        status::report(&SupervisorStatus::Failed { error: chain(&e) });
        console.shutdown(Instant::now() + Duration::from_secs(1));
        return Err(e);
    }
    admit_and_serve(&args, console, Start::Cold).await
}

/// How the sandbox gets its VM.
pub(crate) enum Start {
    /// Booted for it, after admission.
    Cold,
    /// A pooled VM, booted before this sandbox existed and claimed for it now.
    Claimed(Box<Claimed>),
}

/// A pooled VM at its claim: booted, its stop requests already watched, and the claim's settings.
pub(crate) struct Claimed {
    pub(crate) booted: Booted,
    pub(crate) senders: crate::inbox::Senders,
    pub(crate) inbox: crate::inbox::Inbox,
    pub(crate) claim: vm_contract::claim::Claim,
}

impl Start {
    /// The telemetry settings: a cold start's environment, or the claim's.
    fn settings(&self, headers: Vec<(String, String)>) -> Result<TelemetrySettings, SettingsError> {
        match self {
            Self::Cold => TelemetrySettings::load(headers),
            Self::Claimed(c) => TelemetrySettings::from_lookup(|var| c.claim.setting(var), headers),
        }
    }

    /// A start given up before serving: a claimed VM goes down with it (a cold one was never booted).
    async fn abandon(self) {
        if let Self::Claimed(claimed) = self {
            let Booted { mut vmm, lease, .. } = claimed.booted;
            vmm.kill().await;
            let _ = lease.close().await;
        }
    }
}

/// The sandbox's start in its directory, from the admission of its descriptor on.
pub(crate) async fn admit_and_serve(
    args: &SupervisorArgs,
    console: Console,
    start: Start,
) -> Result<StopReason, StartError> {
    // The admission span (descriptor, then policy) starts here; it is exported once the sinks are up.
    let admission_started = std::time::SystemTime::now();
    let telemetry = admit_descriptor(args).and_then(|()| start_telemetry(args, &console, &start));
    let (mut telemetry, token) = match telemetry {
        Ok(started) => started,
        Err(StartError::Descriptor(mismatch)) => {
            let settings = start.settings(Vec::new());
            start.abandon().await;
            return refuse_descriptor(args, console, mismatch, settings).await;
        }
        Err(e) => {
            start.abandon().await;
            status::report(&SupervisorStatus::Failed { error: chain(&e) });
            console.shutdown(Instant::now() + Duration::from_secs(1));
            return Err(e);
        }
    };
    #[cfg(feature = "test-controls")]
    {
        let event = telemetry.source().config_change(&vm_contract::test_control::announcement("vm-supervisor"));
        telemetry.emit(event);
    }
    // Every sandbox says how its VMM is confined; `none` says it loudly.
    let confinement = match args.confinement {
        Confinement::None => "VMM confinement: none (UNCONFINED: no jail, no separate uid, no namespaces)".to_owned(),
        mode => format!("VMM confinement: {mode}"),
    };
    let event = telemetry.source().config_change(&confinement);
    telemetry.emit(event);
    let outcome = supervise(args, token, admission_started, &mut telemetry, start).await;
    if let Err(e) = &outcome {
        // Logged here, while the console still runs.
        tracing::error!(error = %chain(e), "start-up failed");
    }
    let budget = outcome.as_ref().map_or(stop::FLUSH_BUDGET, StopReason::flush_budget);
    let report = telemetry.shutdown(budget, console).await;
    status::report(&SupervisorStatus::Stopped {
        events: report.events,
        otlp_exported: report.otlp.exported,
        otlp_dropped: report.otlp.dropped,
        limited: report.limited,
        jsonl_dropped: report.jsonl.dropped,
        console_dropped: report.console_dropped,
    });
    outcome
}

/// Admits the launch descriptor against the trusted arguments, before any credential is read or the policy
/// discovered.
fn admit_descriptor(args: &SupervisorArgs) -> Result<(), StartError> {
    if crate::control(vm_contract::test_control::TestControl::DescriptorUnchecked) {
        return Ok(());
    }
    let trusted = Trusted {
        backend: args.backend,
        sandbox_id: args.sandbox_id.as_str(),
        session_id: args.session_id.as_ref(),
        generation: args.generation,
    };
    LaunchDescriptor::read(Path::new(".")).and_then(|d| d.admit(&trusted)).map_err(StartError::Descriptor)
}

/// A start stopped at its descriptor: the finding goes to the sinks that need no credential (console and
/// JSONL), since the auth bundle is never read; the driver takes it back. The failure is reported last: the
/// driver ends the supervisor on it, and no signal handler is installed yet.
async fn refuse_descriptor(
    args: &SupervisorArgs,
    console: Console,
    mismatch: Mismatch,
    settings: Result<TelemetrySettings, SettingsError>,
) -> Result<StopReason, StartError> {
    let error = StartError::Descriptor(mismatch);
    tracing::error!(error = %chain(&error), "start-up refused");
    let failed = SupervisorStatus::Failed { error: chain(&error) };
    let settings = settings.map(|s| TelemetrySettings { otlp: None, ..s });
    let telemetry = settings.ok().and_then(|s| {
        Telemetry::start(console.handle(), args.sandbox_id.as_str(), &s, TelemetryControls::at_start()).ok()
    });
    let Some(mut telemetry) = telemetry else {
        console.shutdown(Instant::now() + Duration::from_secs(1));
        status::report(&failed);
        return Err(error);
    };
    let event = telemetry.source().finding(Finding::DescriptorMismatch, &mismatch.to_string());
    telemetry.emit(event);
    let sandbox = AppInfo { name: "sandbox".into(), version: env!("CARGO_PKG_VERSION").into() };
    let event = telemetry.source().lifecycle(Lifecycle::Start, &sandbox, Status::Failure, Some(chain(&error)));
    telemetry.emit(event);
    telemetry.shutdown(stop::FLUSH_BUDGET, console).await;
    status::report(&failed);
    Err(error)
}

/// The auth bundle (read once, then gone) and the sinks its settings ask for.
fn start_telemetry(
    args: &SupervisorArgs,
    console: &Console,
    start: &Start,
) -> Result<(Telemetry, Option<String>), StartError> {
    let bundle = AuthBundle::take(Path::new(".")).map_err(StartError::Bundle)?;
    let settings = start.settings(bundle.otlp_headers).map_err(StartError::Telemetry)?;
    let telemetry =
        Telemetry::start(console.handle(), args.sandbox_id.as_str(), &settings, TelemetryControls::at_start())
            .map_err(StartError::TelemetrySinks)?;
    Ok((telemetry, bundle.session_token))
}

/// Boot, serve, stop; with the lifecycle events around them.
async fn supervise(
    args: &SupervisorArgs,
    token: Option<String>,
    admission_started: std::time::SystemTime,
    telemetry: &mut Telemetry,
    start: Start,
) -> Result<StopReason, StartError> {
    let session = match (&args.session_socket, &args.session_id, token) {
        (Some(socket), Some(session_id), Some(token)) => Some(SessionConfig {
            socket: socket.clone(),
            hello: SessionHello {
                sandbox_id: args.sandbox_id.to_string(),
                generation: args.generation,
                session_id: session_id.clone(),
                token,
            },
        }),
        (Some(_), _, _) => {
            start.abandon().await;
            return Err(StartError::NoSessionToken);
        }
        (None, _, _) => None,
    };
    // The policy the driver approved, a trusted input like the arguments; without one, everything is allowed.
    // Only a missing file means "no policy": any other failure to read it must not open everything.
    let policy = match std::fs::read_to_string(SandboxFile::Policy.name()) {
        Ok(text) => SandboxPolicy::parse(&text, &vm_protocol::identity::WORKLOAD).map_err(StartError::Policy),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(SandboxPolicy::default()),
        Err(e) => Err(StartError::PolicyUnreadable(e)),
    };
    telemetry.spans().admission(admission_started, policy.is_ok());
    let policy = match policy {
        Ok(policy) => policy,
        Err(e) => {
            start.abandon().await;
            status::report(&SupervisorStatus::Failed { error: chain(&e) });
            return Err(e);
        }
    };
    let allowed: Vec<&str> = policy.allow.iter().map(|o| o.as_str()).collect();
    let event =
        telemetry.source().config_change(&format!("policy revision 0 approved; allowed: {}", allowed.join(", ")));
    telemetry.emit(event);
    let sandbox = AppInfo { name: "sandbox".into(), version: env!("CARGO_PKG_VERSION").into() };
    let booted = match start {
        Start::Cold => boot_cold(args, telemetry, &sandbox).await?,
        Start::Claimed(claimed) => {
            let Claimed { booted, senders, inbox, .. } = *claimed;
            telemetry.spans().boot_origin("pool");
            (booted, senders, inbox)
        }
    };
    let (Booted { mut vmm, vmm_record, mut lease, link, attach, logs, .. }, senders, mut inbox) = booted;
    telemetry.spans().boot_ended(true);
    let vm = AppInfo { name: "microvm".into(), version: link.hello.software_label() };
    crate::attach_server::serve(attach, link.hello.capabilities, senders.clone());
    for app in [&vm, &sandbox] {
        let event = telemetry.source().lifecycle(Lifecycle::Start, app, Status::Success, None);
        telemetry.emit(event);
    }
    status::report(&SupervisorStatus::Ready { vmm_pid: vmm_record.pid.unsigned_abs(), agent: vm.version.clone() });
    tracing::info!(sandbox = %args.sandbox_id, agent = %vm.version, "sandbox ready");
    let session = session.map(|s| tokio::spawn(crate::session::run(s, senders.clone())).abort_handle());
    let boundary = crate::serve::Boundary { guest: link.tx, policy };
    let reason = crate::serve::serve(args, &mut vmm, &mut lease, boundary, &mut inbox, telemetry, session).await;
    if lease.close().await.is_none() {
        tracing::warn!("the lease watchdog did not exit after the VM stopped; killed it");
    }
    let (console, vmm_log) = (logs.console.get(), logs.vmm.get());
    if console > 0 || vmm_log > 0 {
        tracing::warn!(console_bytes = console, vmm_bytes = vmm_log, "guest logs dropped bytes past their caps");
    }
    let (status, detail) = match &reason {
        StopReason::Terminated => (Status::Success, None),
        other => (Status::Failure, Some(other.to_string())),
    };
    for app in [&vm, &sandbox] {
        let event = telemetry.source().lifecycle(Lifecycle::Stop, app, status, detail.clone());
        telemetry.emit(event);
    }
    Ok(reason)
}

/// Boots a VM for this sandbox, reporting a failed boot with its findings.
async fn boot_cold(
    args: &SupervisorArgs,
    telemetry: &mut Telemetry,
    sandbox: &AppInfo,
) -> Result<(Booted, crate::inbox::Senders, crate::inbox::Inbox), StartError> {
    let (senders, mut inbox) = crate::inbox::new();
    stop::watch_signals(senders.clone());
    if args.parent_liveness_stdin {
        // Without the liveness thread the VM could outlive the driver; refuse to run.
        crate::liveness::watch_stdin(senders.clone(), None).map_err(StartError::Liveness)?;
    }
    match boot::boot(args, &senders, &mut inbox.stop).await {
        Ok(booted) => Ok((booted, senders, inbox)),
        Err(e) => {
            telemetry.spans().boot_ended(false);
            let mut error = chain(&e);
            if e.concerns_the_guest() {
                error.push_str(&tails(&[SandboxFile::VmmLog.name(), SandboxFile::Console.name()]));
            }
            if matches!(e, StartError::VmmExitedDuringBoot { .. }) {
                for hit in crate::vmm_limits::hits(&args.vmm_cgroups) {
                    error.push_str(&format!("; {}", hit.describe()));
                    let event = telemetry.source().finding(Finding::VmmLimit, hit.describe());
                    telemetry.emit(event);
                }
            }
            if e.is_bad_handshake() {
                let event =
                    telemetry.source().finding(Finding::GuestProtocolViolation, "the guest agent's handshake failed");
                telemetry.emit(event);
            }
            let event = telemetry.source().lifecycle(Lifecycle::Start, sandbox, Status::Failure, Some(chain(&e)));
            telemetry.emit(event);
            status::report(&SupervisorStatus::Failed { error });
            Err(e)
        }
    }
}

//! The CLI's side of the driver API: `vm-driver create|get|list|stop|start|rm|ps` against a running
//! `vm-driver serve` (`exec` is in `exec.rs`).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use vm_protocol::driver_api::driver_client::DriverClient;
use vm_protocol::driver_api::{
    watch_event, CreateSandboxRequest, ListPoolRequest, ListSandboxesRequest, Sandbox, SandboxRef, SandboxState,
    UpdatePolicyRequest, WatchEvent, WatchRequest,
};
use vm_protocol::identity::{IdSelector, RunAs};
use vm_protocol::policy::Operation;

/// Connects to `serve` over its Unix socket.
///
/// # Errors
/// The socket does not answer.
pub async fn connect(socket: &Path) -> Result<DriverClient<Channel>> {
    vm_driver::service::client::connect(socket)
        .await
        .with_context(|| format!("cannot reach vm-driver serve at {}", socket.display()))
}

/// A state's name, as the CLI prints it.
pub fn state_name(state: i32) -> &'static str {
    match SandboxState::try_from(state).unwrap_or(SandboxState::Unspecified) {
        SandboxState::Unspecified => "unknown",
        SandboxState::Provisioning => "provisioning",
        SandboxState::Ready => "ready",
        SandboxState::Stopping => "stopping",
        SandboxState::Stopped => "stopped",
        SandboxState::Failed => "failed",
    }
}

fn line(s: &Sandbox) -> String {
    let readiness = if s.readiness_endpoint.is_empty() { "-" } else { &s.readiness_endpoint };
    let accel = if s.accelerator.is_empty() { "-" } else { &s.accelerator };
    let confinement = if s.confinement.is_empty() { "-" } else { &s.confinement };
    let origin = if s.origin.is_empty() { "-" } else { &s.origin };
    format!(
        "{:<24} {:<13} {:>4} {:<5} {:<7} {:<22} {:<6} {}",
        s.sandbox_id,
        state_name(s.state),
        s.generation,
        accel,
        confinement,
        readiness,
        origin,
        s.detail
    )
}

/// `--no-wait` and `--wait-timeout`: whether and how long a command that boots a sandbox (`create`,
/// `start`) waits until it is ready.
#[derive(Debug, clap::Args)]
pub struct WaitArgs {
    /// Return as soon as the request is accepted instead of waiting until the sandbox is ready.
    #[arg(long)]
    pub no_wait: bool,
    /// How long to wait for ready, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 120)]
    pub wait_timeout: u64,
}

/// `vm-driver start`'s arguments.
#[derive(Debug, clap::Args)]
pub struct StartArgs {
    #[command(flatten)]
    pub sandbox: crate::cli::IdArgs,
    #[command(flatten)]
    pub wait: WaitArgs,
}

/// A request that boots a sandbox.
#[derive(Debug)]
pub enum Boot {
    /// `vm-driver create`.
    Create(CreateSandboxRequest),
    /// `vm-driver start ID`.
    Start(String),
}

/// `vm-driver create` and `vm-driver start`: the request, then (unless `--no-wait`) Watch followed until
/// the generation it boots is ready or failed.
///
/// # Errors
/// Refused, failed, or not ready within the timeout.
pub async fn boot(socket: &Path, request: Boot, wait: &WaitArgs) -> Result<()> {
    let id = match &request {
        Boot::Create(r) => r.sandbox_id.clone(),
        Boot::Start(id) => id.clone(),
    };
    let mut client = connect(socket).await?;
    // Watched first, so that no change of the generation the request boots is missed.
    let events = client.watch(WatchRequest { sandbox_id: id }).await?.into_inner();
    let booted = match request {
        Boot::Create(r) => client.create_sandbox(r).await?,
        Boot::Start(sandbox_id) => client.start_sandbox(SandboxRef { sandbox_id }).await?,
    }
    .into_inner();
    println!("{}", line(&booted));
    if wait.no_wait {
        return Ok(());
    }
    if let Some(ready) = until_ready(&booted, events, Duration::from_secs(wait.wait_timeout)).await? {
        println!("{}", line(&ready));
    }
    Ok(())
}

/// Follows `events` (a Watch of `booted`'s sandbox, begun before the request) until the generation
/// `booted` names is ready: that state, or `None` when `booted` was ready already.
async fn until_ready<S>(booted: &Sandbox, mut events: S, timeout: Duration) -> Result<Option<Sandbox>>
where
    S: tokio_stream::Stream<Item = Result<WatchEvent, tonic::Status>> + Unpin,
{
    let id = &booted.sandbox_id;
    let is = |s: &Sandbox, state: SandboxState| s.state == i32::from(state);
    if is(booted, SandboxState::Ready) {
        return Ok(None);
    }
    if is(booted, SandboxState::Failed) {
        bail!("sandbox {id} failed: {}", booted.detail);
    }
    let until = tokio::time::Instant::now() + timeout;
    loop {
        let event = match tokio::time::timeout_at(until, events.next()).await {
            Err(_) => bail!("sandbox {id} was not ready within {} s", timeout.as_secs()),
            Ok(None) => bail!("the watch of sandbox {id} ended before it was ready"),
            Ok(Some(event)) => event?,
        };
        match event.event {
            // Watch begins with the state before the request: a start's is the last generation's.
            Some(watch_event::Event::Changed(s)) if s.generation < booted.generation => {}
            Some(watch_event::Event::Changed(s)) if is(&s, SandboxState::Ready) => return Ok(Some(s)),
            Some(watch_event::Event::Changed(s)) if is(&s, SandboxState::Failed) => {
                bail!("sandbox {id} failed: {}", s.detail);
            }
            _ => {}
        }
    }
}

/// `vm-driver get ID` / `vm-driver list`.
///
/// # Errors
/// The request failed.
pub async fn show(socket: &Path, id: Option<&str>) -> Result<()> {
    let mut client = connect(socket).await?;
    let sandboxes = match id {
        Some(id) => vec![client.get_sandbox(SandboxRef { sandbox_id: id.to_owned() }).await?.into_inner()],
        None => client.list_sandboxes(ListSandboxesRequest {}).await?.into_inner().sandboxes,
    };
    println!(
        "{:<24} {:<13} {:>4} {:<5} {:<7} {:<22} {:<6} DETAIL",
        "SANDBOX", "STATE", "GEN", "ACCEL", "JAIL", "READINESS", "ORIGIN"
    );
    for s in &sandboxes {
        println!("{}", line(s));
        // One sandbox: its host directories too.
        for m in s.spec.iter().filter(|_| id.is_some()).flat_map(|spec| &spec.mounts) {
            println!("  mount {} -> {}{}", m.source, m.target, if m.readonly { " (read-only)" } else { "" });
        }
    }
    Ok(())
}

/// `vm-driver pool`: the warm pool's targets and VMs.
///
/// # Errors
/// The request failed.
pub async fn show_pool(socket: &Path) -> Result<()> {
    let pool = connect(socket).await?.list_pool(ListPoolRequest {}).await?.into_inner();
    if pool.targets.is_empty() {
        println!("no warm pool (serve --pool COUNT[:CPUS:MIB[:IMAGE]])");
        return Ok(());
    }
    for t in &pool.targets {
        let image = if t.image.is_empty() { "built-in" } else { &t.image };
        println!("target: {} x {} vCPU, {} MiB, image {image}", t.count, t.cpus, t.memory_mib);
    }
    println!(
        "{:<24} {:<9} {:>4} {:>6} {:<10} {:>10} {:>8}",
        "SLOT", "STATE", "CPUS", "MIB", "IMAGE", "SUPERVISOR", "VMM"
    );
    for vm in &pool.vms {
        let image = if vm.image.is_empty() { "built-in" } else { &vm.image };
        println!(
            "{:<24} {:<9} {:>4} {:>6} {:<10} {:>10} {:>8}",
            vm.slot_id, vm.state, vm.cpus, vm.memory_mib, image, vm.supervisor_pid, vm.vmm_pid
        );
    }
    Ok(())
}

/// What `lifecycle` asks for (`start` is a [`Boot`]).
#[derive(Debug, Clone, Copy)]
pub enum Lifecycle {
    /// `vm-driver stop`.
    Stop,
    /// `vm-driver rm`.
    Delete,
}

/// `vm-driver stop|rm ID`.
///
/// # Errors
/// The request failed.
pub async fn lifecycle(socket: &Path, id: &str, what: Lifecycle) -> Result<()> {
    let mut client = connect(socket).await?;
    let r = SandboxRef { sandbox_id: id.to_owned() };
    match what {
        Lifecycle::Stop => println!("{}", line(client.stop_sandbox(r).await?.get_ref())),
        Lifecycle::Delete => {
            client.delete_sandbox(r).await?;
            println!("{id} deleted");
        }
    }
    Ok(())
}

/// `vm-driver ps ID`.
///
/// # Errors
/// The request failed.
/// `vm-driver policy`: one update, answered once applied (or refused: then admission is closed).
///
/// # Errors
/// Refused, or the driver or sandbox cannot be reached.
pub async fn update_policy(
    socket: &Path,
    id: &str,
    revision: u64,
    allow: &[Operation],
    run_as: RunAs,
    network: Option<String>,
) -> Result<()> {
    let mut client = connect(socket).await?;
    let selector = |s: Option<IdSelector>| s.map(|s| s.0).unwrap_or_default();
    let request = UpdatePolicyRequest {
        sandbox_id: id.to_owned(),
        revision,
        allow: allow.iter().map(|o| o.as_str().to_owned()).collect(),
        run_as_user: selector(run_as.user),
        run_as_group: selector(run_as.group),
        network: network.unwrap_or_default(),
    };
    let answer = client.update_policy(request).await?.into_inner();
    let allowed: Vec<&str> = allow.iter().map(|o| o.as_str()).collect();
    println!("{id}: policy revision {} {}; allowed: {}", answer.revision, answer.outcome, allowed.join(","));
    Ok(())
}

pub async fn ps(socket: &Path, id: &str) -> Result<()> {
    let mut client = connect(socket).await?;
    let list = client.list_processes(SandboxRef { sandbox_id: id.to_owned() }).await?.into_inner().processes;
    println!("{:>7} {:<8} {:<3} COMMAND", "PID", "ATTACHED", "TTY");
    for p in list {
        println!(
            "{:>7} {:<8} {:<3} {}",
            p.process_id,
            if p.attached { "yes" } else { "no" },
            if p.tty { "yes" } else { "no" },
            // The workload chose its argv: no escape or newline of it reaches the terminal.
            vm_contract::logs::printable(&p.argv.join(" "), 1024)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(state: SandboxState, generation: u64) -> Sandbox {
        Sandbox { sandbox_id: "box".into(), state: i32::from(state), generation, ..Sandbox::default() }
    }

    fn changed(s: Sandbox) -> Result<WatchEvent, tonic::Status> {
        Ok(WatchEvent { event: Some(watch_event::Event::Changed(s)) })
    }

    const LONG: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn a_start_waits_past_the_last_generations_state_until_its_own_is_ready() {
        // Watch begins with the stopped (or failed) sandbox as it was before the start.
        let events = tokio_stream::iter([
            changed(sandbox(SandboxState::Failed, 1)),
            changed(sandbox(SandboxState::Stopped, 1)),
            changed(sandbox(SandboxState::Provisioning, 2)),
            changed(sandbox(SandboxState::Ready, 2)),
        ]);
        let started = sandbox(SandboxState::Provisioning, 2);
        let ready = until_ready(&started, events, LONG).await.unwrap().unwrap();
        assert_eq!((ready.state, ready.generation), (i32::from(SandboxState::Ready), 2));
    }

    #[tokio::test]
    async fn a_failed_generation_or_a_silent_watch_is_an_error() {
        let started = sandbox(SandboxState::Provisioning, 2);
        let events = tokio_stream::iter([changed(sandbox(SandboxState::Failed, 2))]);
        assert!(until_ready(&started, events, LONG).await.unwrap_err().to_string().contains("failed"));
        let events = tokio_stream::iter([changed(sandbox(SandboxState::Ready, 1))]);
        assert!(until_ready(&started, events, LONG).await.is_err(), "a ready earlier generation is not this one");
        let pending = tokio_stream::pending::<Result<WatchEvent, tonic::Status>>();
        let late = until_ready(&started, pending, Duration::from_millis(10)).await.unwrap_err();
        assert!(late.to_string().contains("not ready within"), "{late}");
    }

    #[tokio::test]
    async fn a_sandbox_ready_or_failed_at_once_needs_no_event() {
        let none = || tokio_stream::pending::<Result<WatchEvent, tonic::Status>>();
        assert!(until_ready(&sandbox(SandboxState::Ready, 3), none(), LONG).await.unwrap().is_none());
        assert!(until_ready(&sandbox(SandboxState::Failed, 3), none(), LONG).await.is_err());
    }
}

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
    UpdatePolicyRequest, WatchRequest,
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

/// `vm-driver create`: creates, then (unless `wait` is off) follows Watch until ready or failed.
///
/// # Errors
/// Refused, failed, or not ready within `timeout`.
pub async fn create(socket: &Path, request: CreateSandboxRequest, wait: bool, timeout: Duration) -> Result<()> {
    let id = request.sandbox_id.clone();
    let id = id.as_str();
    let mut client = connect(socket).await?;
    let mut events = client.watch(WatchRequest { sandbox_id: id.to_owned() }).await?.into_inner();
    let created = client.create_sandbox(request).await?;
    println!("{}", line(created.get_ref()));
    if !wait {
        return Ok(());
    }
    let until = tokio::time::Instant::now() + timeout;
    while let Ok(Some(event)) = tokio::time::timeout_at(until, events.next()).await {
        match event?.event {
            Some(watch_event::Event::Changed(s)) if s.state == i32::from(SandboxState::Ready) => {
                println!("{}", line(&s));
                return Ok(());
            }
            Some(watch_event::Event::Changed(s)) if s.state == i32::from(SandboxState::Failed) => {
                bail!("sandbox {id} failed: {}", s.detail);
            }
            _ => {}
        }
    }
    bail!("sandbox {id} was not ready within {} s", timeout.as_secs())
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

/// What `lifecycle` asks for.
#[derive(Debug, Clone, Copy)]
pub enum Lifecycle {
    /// `vm-driver stop`.
    Stop,
    /// `vm-driver start`.
    Start,
    /// `vm-driver rm`.
    Delete,
}

/// `vm-driver stop|start|rm ID`.
///
/// # Errors
/// The request failed.
pub async fn lifecycle(socket: &Path, id: &str, what: Lifecycle) -> Result<()> {
    let mut client = connect(socket).await?;
    let r = SandboxRef { sandbox_id: id.to_owned() };
    match what {
        Lifecycle::Stop => println!("{}", line(client.stop_sandbox(r).await?.get_ref())),
        Lifecycle::Start => println!("{}", line(client.start_sandbox(r).await?.get_ref())),
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

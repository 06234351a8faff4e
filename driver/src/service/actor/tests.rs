use std::sync::Arc;
use std::time::Duration;

use vm_contract::ids::SandboxId;
use vm_contract::jail::{Confinement, IdRange};
use vm_contract::layout::SandboxFile;

use super::{spawn, Command, Initial, StopError};
use crate::image::{Image, ImageSet};
use crate::jail::JailConfig;
use crate::service::admission::{AdmissionConfig, Limits};
use crate::service::context::Context;
use crate::service::hub::Hub;
use crate::service::ledger::Ledger;
use crate::service::pool::Pool;
use crate::service::record::State;
use crate::service::store::{self, StoredSpec};
use crate::state::StateDir;

/// A hub over a fresh state directory, with no pool and nothing that can boot.
fn hub(root: &std::path::Path) -> Arc<Hub> {
    hub_booting(root, 0)
}

/// [`hub`], with at most `boots` boots at once (0: two per core of its 4).
fn hub_booting(root: &std::path::Path, boots: u32) -> Arc<Hub> {
    let state = StateDir::open(root).unwrap();
    let ctx = Arc::new(Context {
        sessions_socket: root.join("sessions.sock"),
        supervisor: root.join("no-supervisor"),
        images: ImageSet { default: Image { kernel: root.join("k"), initrd: root.join("i") }, root: None },
        oci: crate::oci::ImageRoots {
            store: vm_oci::store::Store::open(&root.join("oci")).unwrap(),
            registry: vm_oci::registry::Options::default(),
            max_bytes: None,
            sandboxes: root.join("sandboxes"),
        },
        accel: vm_contract::accel::AccelChoice::Auto,
        jail: JailConfig {
            confinement: Confinement::None,
            ids: IdRange { start: 0, count: 0 },
            memory_overhead_mib: 0,
            pids: 0,
            cpu_percent: None,
        },
        telemetry: crate::telemetry::TelemetryConfig::default(),
        otlp_headers: Vec::new(),
        boot_timeout: Duration::from_secs(1),
        stop_timeout: Duration::from_secs(1),
        limits: Limits::new(&AdmissionConfig { max_boots: boots, ..Default::default() }, 4, 8192),
        pool: false,
        gateway: None,
        egress: crate::sandbox::Egress::default(),
        controls: crate::controls::Controls::default(),
        templates: None,
        state,
    });
    let ledger = Ledger::new(ctx.limits);
    let pool = Pool::new(Arc::clone(&ctx), Arc::clone(&ledger), Vec::new(), false).unwrap();
    Hub::new(ctx, ledger, pool)
}

fn spec() -> StoredSpec {
    StoredSpec {
        shape: Default::default(),
        env: Default::default(),
        boot_image: String::new(),
        image: None,
        disk_mib: vm_contract::root::DEFAULT_DISK_MIB,
        policy: None,
        mounts: Vec::new(),
        gateway: None,
    }
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("actor-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[tokio::test]
async fn a_stop_whose_marker_cannot_be_written_is_refused_and_says_so() {
    let root = temp("marker-lost");
    let hub = hub(&root);
    let id = SandboxId::parse("s").unwrap();
    let layout = hub.ctx.state.create_sandbox(&id).unwrap();
    spawn(&hub, id.clone(), layout.clone(), spec(), Initial::Stopped, false).map_err(|(e, _)| e).unwrap();
    // The write fails: its directory is gone.
    std::fs::remove_dir_all(layout.dir()).unwrap();
    let answer = hub.ask(&id, Command::Stop).await.unwrap();
    let Err(StopError::Marker(path, _)) = answer else { panic!("the stop was not refused: {answer:?}") };
    assert_eq!(path, layout.path(SandboxFile::Stopped));
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test]
async fn a_stop_whose_marker_is_written_answers_stopped_control() {
    let root = temp("marker-kept");
    let hub = hub(&root);
    let id = SandboxId::parse("s").unwrap();
    let layout = hub.ctx.state.create_sandbox(&id).unwrap();
    spawn(&hub, id.clone(), layout.clone(), spec(), Initial::Stopped, false).map_err(|(e, _)| e).unwrap();
    let record = hub.ask(&id, Command::Stop).await.unwrap().unwrap();
    assert_eq!((record.state, record.running_intent), (State::Stopped, false));
    assert!(store::is_stopped(&layout));
    let _ = std::fs::remove_dir_all(&root);
}

#[tokio::test]
async fn an_image_that_cannot_be_had_fails_the_start_with_its_cause_and_starts_nothing() {
    let root = temp("no-image");
    let hub = hub(&root);
    let id = SandboxId::parse("s").unwrap();
    let layout = hub.ctx.state.create_sandbox(&id).unwrap();
    let missing = format!("oci:{}:py", root.join("nowhere").display());
    let with_image = StoredSpec { image: Some(missing), ..spec() };
    spawn(&hub, id.clone(), layout.clone(), with_image, Initial::Start, false).map_err(|(e, _)| e).unwrap();
    let mut failed = None;
    for _ in 0..500 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        failed = hub.registry.get(&id).filter(|r| r.state == State::Failed);
        if failed.is_some() {
            break;
        }
    }
    let record = failed.expect("the sandbox did not fail");
    assert!(record.detail.contains("cannot get the image oci:"), "{}", record.detail);
    assert!(!layout.path(SandboxFile::Pids).exists(), "no supervisor was started");
    let _ = std::fs::remove_dir_all(&root);
}

/// The record of `id` once `pred` holds (within 5 s).
async fn record_when(
    hub: &Hub,
    id: &SandboxId,
    pred: impl Fn(&crate::service::record::SandboxRecord) -> bool,
) -> crate::service::record::SandboxRecord {
    for _ in 0..500 {
        if let Some(record) = hub.registry.get(id).filter(&pred) {
            return record;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{id}: not reached: {:?}", hub.registry.get(id));
}

#[tokio::test]
async fn a_start_waits_for_its_turn_to_boot_answering_commands_meanwhile() {
    let root = temp("turns");
    let hub = hub_booting(&root, 1);
    // A boot in progress holds the only turn.
    let booting = hub.ledger.boot_turn().await;
    let (waiting, stopped) = (SandboxId::parse("waiting").unwrap(), SandboxId::parse("stopped").unwrap());
    for id in [&waiting, &stopped] {
        let layout = hub.ctx.state.create_sandbox(id).unwrap();
        spawn(&hub, id.clone(), layout, spec(), Initial::Start, true).map_err(|(e, _)| e).unwrap();
    }
    let queued = record_when(&hub, &waiting, |r| r.detail.starts_with("waiting for a turn")).await;
    assert_eq!(queued.state, State::Provisioning);
    // A stop is answered at once, and its start leaves the queue.
    let record = hub.ask(&stopped, Command::Stop).await.unwrap().unwrap();
    assert_eq!((record.state, record.running_intent), (State::Stopped, false));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let still = hub.registry.get(&waiting).unwrap();
    assert!(still.detail.starts_with("waiting for a turn"), "booted without a turn: {still:?}");
    assert!(!hub.ctx.state.layout(&waiting).path(SandboxFile::Pids).exists(), "no supervisor yet");
    // The turn given back, the boot goes ahead: here it fails, as nothing can boot.
    drop(booting);
    let failed = record_when(&hub, &waiting, |r| r.state == State::Failed).await;
    assert!(failed.detail.starts_with("cannot start"), "{}", failed.detail);
    // Its turn was given back with the failure.
    let _next = tokio::time::timeout(Duration::from_secs(5), hub.ledger.boot_turn()).await.unwrap();
    assert_eq!(hub.registry.get(&stopped).unwrap().state, State::Stopped, "the stopped start never boots");
    let _ = std::fs::remove_dir_all(&root);
}

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
        limits: Limits::new(&AdmissionConfig::default(), 4, 8192),
        pool: false,
        gateway: None,
        egress: crate::sandbox::Egress::default(),
        controls: crate::controls::Controls::default(),
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

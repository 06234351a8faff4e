//! The warm pool (`serve --pool`) on real VMs: a claimed sandbox's telemetry carries only the claimed
//! identity (with a control that reports the boot under the slot's id), a pooled VM is never reused, a
//! pooled VM whose supervisor or VMM dies is replaced, pooled VMs count against capacity, and a create the
//! pool cannot serve cold-boots and says so.

use std::time::Duration;

use nix::sys::signal::Signal;
use vm_contract::pids::SandboxPids;
use vm_protocol::driver_api::{
    CreateSandboxRequest, GetCapabilitiesRequest, ListPoolRequest, PooledVm, Sandbox, SandboxRef, SandboxSpec,
};
use vm_test_support::api::Client;
use vm_test_support::otlp_receiver::{authorization_headers, Behavior, Receiver};
use vm_test_support::output::ok;
use vm_test_support::procs::{exit_after, signal, ProcInfo};
use vm_test_support::serve::Serve;
use vm_test_support::{events, gone_within, wait_until, Scratch, TestControl};

const GATEWAY: &str = "gateway-pool-9";
const HEADER_SECRET: &str = "Bearer pool-hdr-41aa";

struct Api {
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl Api {
    fn new(serve: &Serve) -> Self {
        let (rt, client) = serve.grpc();
        Self { rt, client }
    }

    fn pool(&mut self) -> Vec<PooledVm> {
        self.rt.block_on(self.client.list_pool(ListPoolRequest {})).unwrap().into_inner().vms
    }

    /// The pool's one ready VM, once it is ready and not `except`.
    fn ready_vm(&mut self, except: &[String]) -> PooledVm {
        let mut found = None;
        let ready = wait_until(Duration::from_secs(120), || {
            found = self.pool().into_iter().find(|v| v.state == "ready" && !except.contains(&v.slot_id));
            found.is_some()
        });
        assert!(ready, "no pooled VM became ready: {:?}", self.pool());
        found.unwrap()
    }

    fn create(&mut self, id: &str, cpus: u32, memory_mib: u32) -> Result<Sandbox, tonic::Status> {
        let spec = SandboxSpec { cpus, memory_mib, ..SandboxSpec::default() };
        let req = CreateSandboxRequest { sandbox_id: id.into(), spec: Some(spec), credentials: Vec::new() };
        self.rt.block_on(self.client.create_sandbox(req)).map(tonic::Response::into_inner)
    }

    fn delete(&mut self, id: &str) {
        self.rt.block_on(self.client.delete_sandbox(SandboxRef { sandbox_id: id.into() })).unwrap();
    }

    fn usage(&mut self) -> (u32, u32) {
        let caps = self.rt.block_on(self.client.get_capabilities(GetCapabilitiesRequest {})).unwrap().into_inner();
        let usage = caps.usage.unwrap();
        (usage.sandboxes, usage.pooled)
    }
}

fn serve_with_collector(s: &Scratch, receiver: &Receiver, controls: &[TestControl]) -> Serve {
    let endpoint = receiver.grpc_endpoint();
    let args = ["--pool", "1", "--otlp-ocsf-endpoint", &endpoint, "--gateway-name", GATEWAY];
    let headers = authorization_headers(HEADER_SECRET);
    Serve::with_env(s, controls, &args, &[("OTEL_EXPORTER_OTLP_HEADERS", headers.as_str())], None)
}

#[test]
fn a_claimed_sandbox_reports_only_its_claimed_identity() {
    let s = Scratch::new("pool-identity");
    let receiver = Receiver::start(Behavior::Accept);
    let serve = serve_with_collector(&s, &receiver, &[]);
    let mut api = Api::new(&serve);
    let slot = api.ready_vm(&[]);
    // Booted, leashed and idle for a while: nothing has left it, under any identity.
    std::thread::sleep(Duration::from_secs(2));
    assert!(receiver.records().is_empty() && receiver.spans().is_empty(), "a pooled VM exported before its claim");
    assert!(receiver.requests().is_empty() && receiver.trace_requests().is_empty());

    let created = api.create("claimed-1", 0, 0).unwrap();
    assert_eq!(created.origin, "pool", "{created:?}");
    serve.wait_ready("claimed-1");
    assert_eq!(
        ok(serve.cli("exec", &["claimed-1", "--", "sh", "-c", "id -un; echo marker-31"])),
        "sandbox\nmarker-31\n"
    );
    let events = events::text(&s.sandbox("claimed-1"));
    api.delete("claimed-1");
    assert!(
        wait_until(Duration::from_secs(30), || receiver.spans().iter().any(|sp| sp.name == "sandbox")),
        "the claimed sandbox's spans never arrived"
    );

    let records = receiver.records();
    let kinds: Vec<&str> = records.iter().map(|r| r.body.as_str()).collect();
    for wanted in ["VMM confinement", "policy revision 0 approved", "microvm start", "sandbox start", "marker-31"] {
        assert!(kinds.iter().any(|b| b.contains(wanted)), "no exported event says {wanted:?}: {kinds:#?}");
    }
    for r in &records {
        assert_eq!(r.resource.get("openshell.sandbox.id").map(String::as_str), Some("claimed-1"), "{r:?}");
        assert_eq!(r.resource.get("openshell.gateway.name").map(String::as_str), Some(GATEWAY), "{r:?}");
        assert!(!format!("{r:?}").contains(&slot.slot_id), "the slot's id leaked into {r:?}");
    }
    for sp in receiver.spans() {
        assert_eq!(sp.resource.get("openshell.sandbox.id").map(String::as_str), Some("claimed-1"), "{sp:?}");
    }
    let boot = receiver.spans().into_iter().find(|sp| sp.name == "sandbox.boot").expect("a boot span");
    assert_eq!(boot.attributes.get("openshell.boot.origin").map(String::as_str), Some("pool"));
    // The credentials came with the claim, never before: every export carried them.
    for req in receiver.requests().iter().chain(receiver.trace_requests().iter()) {
        assert_eq!(req.authorization(), Some(HEADER_SECRET));
    }
    for line in events.lines() {
        let event: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(!line.contains(&slot.slot_id), "events.jsonl names the slot: {line}");
        let uid = event.pointer("/device/uid").or_else(|| event.pointer("/app/uid")).and_then(|v| v.as_str());
        assert_eq!(uid, Some("claimed-1"), "{line}");
    }
}

/// Control: a pooled VM that gets its settings at spawn reports its boot under the slot's id, before any
/// claim: what identity at claim keeps out.
#[test]
fn control_identity_at_boot_exports_under_the_slot_id() {
    let s = Scratch::new("pool-identity-ctl");
    let receiver = Receiver::start(Behavior::Accept);
    let serve = serve_with_collector(&s, &receiver, &[TestControl::PoolIdentityAtBoot]);
    let mut api = Api::new(&serve);
    let slot = api.ready_vm(&[]);
    let early = || {
        receiver
            .records()
            .iter()
            .any(|r| r.resource.get("openshell.sandbox.id") == Some(&slot.slot_id) && r.body.contains("microvm start"))
    };
    assert!(wait_until(Duration::from_secs(20), early), "the control did not export under the slot's id");
}

#[test]
fn a_pooled_vm_is_never_reused() {
    let s = Scratch::new("pool-reuse");
    let serve = Serve::with(&s, &[], &["--pool", "1"]);
    let mut api = Api::new(&serve);
    let first = api.ready_vm(&[]);
    let first_vmm = ProcInfo::read(i32::try_from(first.vmm_pid).unwrap()).unwrap();
    // Jailed like any sandbox's VMM: under `jail`, its own uid, not ours.
    let caps = api.rt.block_on(api.client.get_capabilities(GetCapabilitiesRequest {})).unwrap().into_inner();
    let status = std::fs::read_to_string(format!("/proc/{}/status", first.vmm_pid)).unwrap();
    let uid =
        status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap().split_whitespace().next().unwrap().to_owned();
    eprintln!("e2e: pooled VMM confinement {}, uid {uid}", caps.confinement);
    if caps.confinement == "jail" {
        assert_ne!(uid, rustix::process::getuid().as_raw().to_string(), "a jailed pooled VMM runs as its own uid");
    }
    assert_eq!(api.create("a", 1, 256).unwrap().origin, "pool");
    serve.wait_ready("a");
    let boot_a =
        ok(serve
            .cli("exec", &["a", "--", "sh", "-c", "echo left-by-a > $HOME/mark; cat /proc/sys/kernel/random/boot_id"]));
    // The claimed slot left the pool at once and is never listed again.
    assert!(api.pool().iter().all(|v| v.slot_id != first.slot_id));
    let second = api.ready_vm(std::slice::from_ref(&first.slot_id));
    assert_ne!(second.vmm_pid, first.vmm_pid);
    // Deleting the sandbox shuts its VM down; it does not go back to the pool.
    api.delete("a");
    assert!(gone_within(&first_vmm, Duration::from_secs(30)), "a's VMM outlived its sandbox");
    assert_eq!(api.create("b", 1, 256).unwrap().origin, "pool");
    serve.wait_ready("b");
    let boot_b =
        ok(serve
            .cli("exec", &["b", "--", "sh", "-c", "cat $HOME/mark 2>/dev/null; cat /proc/sys/kernel/random/boot_id"]));
    assert!(!boot_b.contains("left-by-a"), "b saw a's file: {boot_b}");
    assert_ne!(boot_a.trim(), boot_b.trim(), "b runs on a VM that booted apart from a's");
    let third = api.ready_vm(&[first.slot_id.clone(), second.slot_id.clone()]);
    assert!(![first.slot_id, second.slot_id].contains(&third.slot_id));
}

#[test]
fn a_pooled_vm_whose_supervisor_or_vmm_dies_is_replaced() {
    let s = Scratch::new("pool-replace");
    let mut serve = Serve::with(&s, &[], &["--pool", "1"]);
    let mut api = Api::new(&serve);
    let first = api.ready_vm(&[]);
    let vmm = ProcInfo::read(i32::try_from(first.vmm_pid).unwrap()).unwrap();
    signal(i32::try_from(first.supervisor_pid).unwrap(), Signal::SIGKILL);
    // The leash holds for pooled VMs too: no VM outlives its supervisor.
    assert!(gone_within(&vmm, Duration::from_secs(5)), "the pooled VMM outlived its supervisor");
    let second = api.ready_vm(std::slice::from_ref(&first.slot_id));
    assert!(!s.state().join("pool").join(&first.slot_id).exists(), "the dead slot's directory was removed");
    // And when the VMM dies under a live supervisor.
    let vmm = ProcInfo::read(i32::try_from(second.vmm_pid).unwrap()).unwrap();
    signal(vmm.pid, Signal::SIGKILL);
    let third = api.ready_vm(&[first.slot_id.clone(), second.slot_id.clone()]);
    assert!(ProcInfo::read(i32::try_from(second.supervisor_pid).unwrap()).is_none(), "its supervisor exited");
    assert_eq!(api.pool().len(), 1, "replaced, not added: {:?}", api.pool());
    assert_eq!(api.create("after", 1, 256).unwrap().origin, "pool");
    serve.wait_ready("after");
    assert_eq!(ok(serve.cli("exec", &["after", "--", "echo", "fine"])), "fine\n");
    assert!(api.pool().iter().all(|v| v.slot_id != third.slot_id));
    // The refill behind the claim is up (its VMM started), so the stop below has a pooled VM to take down.
    api.ready_vm(std::slice::from_ref(&third.slot_id));
    // An orderly stop of `serve` takes the pooled VMs down with the sandboxes, and their slots with them.
    let seen = serve.vmms();
    assert!(seen.len() >= 4, "{seen:?}");
    serve.signal(Signal::SIGTERM);
    assert!(wait_until(Duration::from_secs(30), || serve.child.try_wait().ok().flatten().is_some()));
    assert!(seen.iter().all(|vmm| !vmm.is_alive()), "a VMM outlived serve");
    assert_eq!(std::fs::read_dir(s.state().join("pool")).unwrap().count(), 0, "slots left behind");
}

/// A claimed VM's processes, from the pids file that moved with it into its sandbox's directory.
fn claimed_pids(s: &Scratch, id: &str) -> (ProcInfo, ProcInfo, ProcInfo) {
    let pids = SandboxPids::read(&s.sandbox(id)).expect("a pids file");
    let read = |pid: i32| ProcInfo::read(pid).expect("a live process");
    (read(pids.supervisor.pid), read(pids.watchdog.expect("a watchdog").pid), read(pids.vmm.expect("a VMM").pid))
}

#[test]
fn a_claimed_vm_keeps_the_leash_of_a_cold_one() {
    let s = Scratch::new("pool-leash");
    let serve = Serve::with(&s, &[], &["--pool", "2"]);
    let mut api = Api::new(&serve);
    let first = api.ready_vm(&[]);
    api.ready_vm(std::slice::from_ref(&first.slot_id));
    for id in ["frozen-sup", "frozen-dog"] {
        assert_eq!(api.create(id, 1, 256).unwrap().origin, "pool");
        serve.wait_ready(id);
    }
    // The bounds of load.rs's cold sandboxes: a frozen supervisor loses its VM to the lease (3 s), the
    // sandbox leaves ready, and the hung supervisor is killed.
    let (supervisor, _, vmm) = claimed_pids(&s, "frozen-sup");
    let gone = exit_after(&vmm, Duration::from_secs(3), || signal(supervisor.pid, Signal::SIGSTOP));
    let gone = gone.expect("a claimed VM outlived its frozen supervisor by 3 s");
    let left_ready = wait_until(Duration::from_secs(5), || serve.sandbox_state("frozen-sup") != "ready");
    let killed = gone_within(&supervisor, Duration::from_secs(5));
    if !killed {
        signal(supervisor.pid, Signal::SIGCONT);
    }
    assert!(left_ready, "the claimed sandbox is still ready 5 s after its VM died");
    assert!(killed, "the claimed VM's hung supervisor was not killed");
    // A frozen watchdog stops its VM (2 s).
    let (_, watchdog, vmm) = claimed_pids(&s, "frozen-dog");
    let dog_gone = exit_after(&vmm, Duration::from_secs(2), || signal(watchdog.pid, Signal::SIGSTOP));
    signal(watchdog.pid, Signal::SIGCONT);
    let dog_gone = dog_gone.expect("a claimed VM outlived its frozen watchdog by 2 s");
    eprintln!("e2e: claimed VMs: supervisor SIGSTOP -> VMM gone in {gone:?}; watchdog SIGSTOP -> {dog_gone:?}");
}

#[test]
fn the_pool_counts_against_capacity() {
    let s = Scratch::new("pool-capacity");
    let serve = Serve::with(&s, &[], &["--pool", "1", "--max-sandboxes", "2"]);
    let mut api = Api::new(&serve);
    api.ready_vm(&[]);
    assert_eq!(api.usage(), (1, 1), "the pooled VM holds a share");
    assert_eq!(api.create("a", 1, 256).unwrap().origin, "pool");
    api.ready_vm(&[]);
    assert_eq!(api.usage(), (2, 1), "a and the refilled VM");
    // No room for a cold boot, but a claim needs none: it takes the pooled VM's share.
    let cold = api.create("cold", 2, 512).unwrap_err();
    assert_eq!(cold.code(), tonic::Code::ResourceExhausted, "{cold:?}");
    assert_eq!(api.create("b", 1, 256).unwrap().origin, "pool");
    assert_eq!(api.usage(), (2, 0));
    // Full: the pool stays empty (it rechecks every second) and a further create is refused.
    std::thread::sleep(Duration::from_secs(3));
    assert!(api.pool().is_empty(), "the pool refilled past capacity: {:?}", api.pool());
    assert_eq!(api.create("c", 1, 256).unwrap_err().code(), tonic::Code::ResourceExhausted);
    serve.wait_ready("b");
    // Capacity freed: the pool refills.
    api.delete("a");
    api.ready_vm(&[]);
    assert_eq!(api.usage(), (2, 1));
}

#[test]
fn a_create_the_pool_cannot_serve_cold_boots_and_says_so() {
    let s = Scratch::new("pool-cold");
    let serve = Serve::with(&s, &[], &["--pool", "1:1:256"]);
    let mut api = Api::new(&serve);
    let slot = api.ready_vm(&[]);
    let cold = api.create("bigger", 2, 512).unwrap();
    assert_eq!(cold.origin, "cold", "{cold:?}");
    assert!(cold.detail.contains("cold boot: no free pooled VM"), "{cold:?}");
    serve.wait_ready("bigger");
    assert_eq!(ok(serve.cli("exec", &["bigger", "--", "nproc"])), "2\n");
    // The pooled VM of the other shape was left alone.
    assert_eq!(api.pool().iter().filter(|v| v.slot_id == slot.slot_id && v.state == "ready").count(), 1);
    // An empty pool: its VM claimed, the refill still booting (a boot takes far longer than two requests).
    assert_eq!(api.create("first", 1, 256).unwrap().origin, "pool");
    assert!(api.pool().iter().all(|v| v.state != "ready"), "{:?}", api.pool());
    let next = api.create("second", 1, 256).unwrap();
    assert_eq!(next.origin, "cold", "{next:?}");
    assert!(next.detail.contains("cold boot: no free pooled VM"), "{next:?}");
    serve.wait_ready("second");
    // Without a pool, creates say they boot cold without blaming one.
    let s2 = Scratch::new("pool-none");
    let plain = Serve::start(&s2);
    let mut api2 = Api::new(&plain);
    let none = api2.create("plain", 0, 0).unwrap();
    assert_eq!((none.origin.as_str(), none.detail.as_str()), ("cold", "booting"));
    assert!(api2.pool().is_empty());
}

#[test]
fn a_killed_service_takes_its_pooled_vms_along_and_a_restart_clears_their_slots() {
    let s = Scratch::new("pool-killed");
    let mut serve = Serve::with(&s, &[], &["--pool", "2"]);
    let mut api = Api::new(&serve);
    let first = api.ready_vm(&[]);
    let second = api.ready_vm(std::slice::from_ref(&first.slot_id));
    let slots = [first.slot_id.clone(), second.slot_id.clone()];
    let vmms: Vec<ProcInfo> =
        [&first, &second].iter().map(|v| ProcInfo::read(i32::try_from(v.vmm_pid).unwrap()).unwrap()).collect();
    serve.kill();
    for vmm in &vmms {
        assert!(gone_within(vmm, Duration::from_secs(5)), "a pooled VMM outlived a killed serve");
    }
    serve.restart();
    let mut api = Api::new(&serve);
    let fresh = api.ready_vm(&slots);
    assert!(!slots.contains(&fresh.slot_id));
    // Their supervisors exit after killing their VMs; the refill sweeps the slots once they have.
    for slot in &slots {
        let cleared = wait_until(Duration::from_secs(15), || !s.state().join("pool").join(slot).exists());
        assert!(cleared, "{slot}: the dead slot was not cleared");
    }
}

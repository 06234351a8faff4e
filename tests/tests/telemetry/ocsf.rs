//! OCSF events as the supervisor builds them, validated against the facts extracted from the official 1.8.0
//! definitions (`tests/ocsf-1.8.0/`); and the validator itself, shown able to fail.

use serde_json::Value;
use vm_ocsf::{
    AppInfo, Connection, Direction, FileActivity, Finding, Lifecycle, NetworkActivity, ProcessActivity, ProcessInfo,
    SchemaVersion, Source, Status,
};
use vm_test_support::ocsf_schema::{schema_dir, Schema};

/// An egress stream through the HTTP proxy, allowed by a rule.
fn egress() -> Connection {
    Connection {
        stream: 7,
        direction: Direction::Outbound,
        listener: "http-proxy",
        guest_port: Some(3128),
        hostname: Some("api.example.com".into()),
        ip: Some([192, 0, 2, 1].into()),
        port: 80,
        rule: Some("*.example.com".into()),
        bytes_in: 1200,
        bytes_out: 300,
        duration_ms: Some(52),
    }
}

fn every_kind_of_event() -> Vec<vm_ocsf::Event> {
    let s = Source::new(SchemaVersion::default(), "sandbox-1", "vm-supervisor", "0.1.0");
    let app = AppInfo { name: "sandbox".into(), version: "0.1.0".into() };
    let argv = vec!["/bin/sh".to_string(), "-c".into(), "echo hi".into()];
    let socks_literal = Connection {
        listener: "socks5",
        guest_port: Some(1080),
        hostname: None,
        ip: Some("2001:db8::1".parse().unwrap()),
        port: 443,
        ..egress()
    };
    let forward = Connection {
        direction: Direction::Inbound,
        listener: "port-forward",
        guest_port: Some(8080),
        hostname: None,
        ip: Some([127, 0, 0, 1].into()),
        port: 50_000,
        rule: None,
        ..egress()
    };
    vec![
        s.lifecycle(Lifecycle::Start, &app, Status::Success, None),
        s.lifecycle(Lifecycle::Stop, &app, Status::Failure, Some("the VMM exited".into())),
        s.process(ProcessActivity::Launch, ProcessInfo::new("sandbox-1", 1, Some(79), &argv), None),
        s.process(ProcessActivity::Terminate, ProcessInfo::new("sandbox-1", 1, Some(79), &argv), Some(7)),
        s.finding(Finding::LivenessLost, "liveness pipe closed"),
        s.finding(Finding::LeaseLost, "no echo"),
        s.finding(Finding::WatchdogAction, "watchdog killed the VMM"),
        s.finding(Finding::AdmissionRefused, "peer uid mismatch"),
        s.finding(Finding::GuestProtocolViolation, "bad frame"),
        s.finding(Finding::TelemetryDropped, "3 events dropped"),
        s.finding(Finding::LogCapped, "console.log reached its cap"),
        s.finding(Finding::VmmLimit, "the VMM exceeded its memory limit and was killed"),
        s.finding(Finding::PolicyDenied, "exec denied at policy revision 1: not allowed"),
        s.finding(Finding::DescriptorMismatch, "the launch descriptor names another generation"),
        s.finding(
            Finding::TarRefused,
            "copy_out \"/out\" refused by the host's extractor: an entry passes through a symlink",
        ),
        s.config_change("policy updated"),
        s.api_update("UpdatePolicy", "attach.sock", Status::Success, "revision 1 applied"),
        s.api_update("RotateCredentials", "attach.sock", Status::Failure, "refused: the CA bundle is unreadable"),
        s.network(NetworkActivity::Open, &egress(), None),
        s.network(NetworkActivity::Close, &egress(), Some("closed by the guest")),
        s.network(NetworkActivity::Refuse, &Connection { rule: None, ip: None, ..egress() }, Some("no rule allows it")),
        s.network(NetworkActivity::Open, &socks_literal, None),
        s.network(NetworkActivity::Refuse, &Connection { hostname: None, ip: None, ..egress() }, None),
        s.network(NetworkActivity::Close, &forward, None),
        s.http(&egress(), "GET", "/v1/items?token=s3cret#part", Some(200)),
        s.http(&egress(), "POST", "", None),
        s.http(&Connection { hostname: None, ..egress() }, "PROPFIND", "/dav", Some(207)),
        s.file(FileActivity::Update, "/home/sandbox/a", None, 5, Status::Success),
        s.file(FileActivity::Rename, "/tmp/a", Some("/tmp/b"), 0, Status::Failure),
        s.file(FileActivity::Read, "/out", None, 1 << 20, Status::Success),
    ]
}

#[test]
fn every_event_the_supervisor_builds_is_valid_ocsf_1_8_0() {
    let schema = Schema::load(&schema_dir());
    assert_eq!(schema.version, "1.8.0");
    for event in every_kind_of_event() {
        let json: Value = serde_json::from_str(&event.to_json()).unwrap();
        let problems = schema.validate(&json);
        assert!(problems.is_empty(), "{}: {problems:#?}", event.type_name);
    }
}

/// Every `url` object anywhere in `value`.
fn urls(value: &Value, found: &mut Vec<Value>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                if key == "url" {
                    found.push(v.clone());
                }
                urls(v, found);
            }
        }
        Value::Array(items) => items.iter().for_each(|v| urls(v, found)),
        _ => {}
    }
}

#[test]
fn no_url_carries_a_query() {
    let mut found = Vec::new();
    for event in every_kind_of_event() {
        let json: Value = serde_json::from_str(&event.to_json()).unwrap();
        assert!(!event.to_json().contains("s3cret"), "{json}");
        urls(&json, &mut found);
    }
    assert_eq!(found.len(), 3, "every HTTP event has its url");
    for url in found {
        assert!(url.get("query_string").is_none() && url.get("url_string").is_none(), "{url}");
        assert!(!url["path"].as_str().unwrap().contains(['?', '#']), "{url}");
    }
}

#[test]
fn the_validator_rejects_broken_network_events() {
    let schema = Schema::load(&schema_dir());
    let s = Source::new(SchemaVersion::default(), "sandbox-1", "vm-supervisor", "0.1.0");
    let close: Value = serde_json::from_str(&s.network(NetworkActivity::Close, &egress(), None).to_json()).unwrap();
    let http: Value = serde_json::from_str(&s.http(&egress(), "GET", "/", Some(200)).to_json()).unwrap();
    let broken = |good: &Value, f: &dyn Fn(&mut Value)| {
        let mut e = good.clone();
        f(&mut e);
        schema.validate(&e)
    };
    let undeclared = broken(&close, &|e| {
        e["metadata"].as_object_mut().unwrap().remove("profiles");
    });
    assert!(undeclared.iter().any(|p| p.contains("security_control profile")), "{undeclared:?}");
    let no_direction = broken(&close, &|e| {
        e["connection_info"].as_object_mut().unwrap().remove("direction_id");
    });
    assert!(!no_direction.is_empty(), "connection_info without direction_id");
    assert!(!broken(&close, &|e| e["traffic"]["bytes"] = "many".into()).is_empty(), "traffic bytes not a long");
    assert!(!broken(&close, &|e| e["activity_id"] = 8.into()).is_empty(), "activity outside Network Activity's");
    let no_ends = broken(&close, &|e| {
        let e = e.as_object_mut().unwrap();
        e.remove("src_endpoint");
        e.remove("dst_endpoint");
    });
    assert!(no_ends.iter().any(|p| p.contains("at least one")), "{no_ends:?}");
    let no_code = broken(&http, &|e| {
        e["http_response"].as_object_mut().unwrap().remove("code");
    });
    assert!(no_code.iter().any(|p| p.contains("required attribute code")), "{no_code:?}");
    assert!(
        !broken(&http, &|e| e["http_request"]["http_method"] = "BREW".into()).is_empty(),
        "method outside the enum"
    );
    assert!(!broken(&http, &|e| e["http_request"]["url"]["port"] = "80".into()).is_empty(), "port not an integer");
}

#[test]
fn the_validator_rejects_broken_events() {
    let schema = Schema::load(&schema_dir());
    let good: Value = serde_json::from_str(&every_kind_of_event()[2].to_json()).unwrap();
    let broken = |f: &dyn Fn(&mut Value)| {
        let mut e = good.clone();
        f(&mut e);
        schema.validate(&e)
    };
    assert!(
        !broken(&|e| {
            e.as_object_mut().unwrap().remove("process");
        })
        .is_empty(),
        "missing required object"
    );
    assert!(
        !broken(&|e| e["device"].as_object_mut().unwrap().remove("type_id").map(drop).unwrap_or(())).is_empty(),
        "device without type_id"
    );
    assert!(!broken(&|e| e["type_uid"] = 1.into()).is_empty(), "wrong type_uid");
    assert!(!broken(&|e| e["severity_id"] = 42.into()).is_empty(), "severity outside the enum");
    assert!(!broken(&|e| e["bogus"] = 1.into()).is_empty(), "unknown attribute");
    assert!(!broken(&|e| e["time"] = "yesterday".into()).is_empty(), "wrong type");
    assert!(!broken(&|e| e["class_uid"] = 9999.into()).is_empty(), "unknown class");
    assert!(
        !broken(&|e| {
            e["metadata"].as_object_mut().unwrap().remove("version");
        })
        .is_empty(),
        "metadata without version"
    );
    let module = broken(&|e| e["module"] = serde_json::json!({"type_id": 1}));
    assert!(module.iter().any(|p| p.contains("object module is not in the OCSF 1.8.0 extract")), "{module:?}");
    let cloud = broken(&|e| e["cloud"] = serde_json::json!({"provider": "x"}));
    assert!(cloud.iter().any(|p| p.contains("cloud profile")), "a profile attribute without the profile: {cloud:?}");
}

#[test]
fn every_class_is_the_extracts_and_every_extracted_class_is_emitted() {
    let path = schema_dir().join("schema.json");
    let root: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let extracted = root["classes"].as_object().unwrap();
    for class in vm_ocsf::Class::ALL {
        let schema = &extracted[&class.uid.to_string()];
        assert_eq!(schema["name"], class.name, "{class:?}");
        assert_eq!(schema["category_uid"], class.category.uid, "{class:?}");
    }
    assert_eq!(extracted.len(), vm_ocsf::Class::ALL.len(), "a class of the extract has no vm_ocsf::Class");
    let built: std::collections::HashSet<u32> = every_kind_of_event().iter().map(|e| e.class.uid).collect();
    assert_eq!(built.len(), vm_ocsf::Class::ALL.len(), "every class is validated above");
}

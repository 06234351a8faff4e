//! The event, its builders (one per class and activity), and its two renderings (JSON and a shorthand line).

use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::class::Class;
use crate::finding::Finding;
use crate::network::NetworkFields;
use crate::objects::{Actor, Api, AppInfo, Device, Endpoint, FindingInfo, Metadata, ProcessInfo, Product, Service};
use crate::version::SchemaVersion;

/// OCSF `severity_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// 1
    Informational = 1,
    /// 2
    Low = 2,
    /// 3
    Medium = 3,
    /// 4
    High = 4,
    /// 5
    Critical = 5,
    /// 6
    Fatal = 6,
}

impl Severity {
    /// The caption.
    pub fn name(self) -> &'static str {
        match self {
            Self::Informational => "Informational",
            Self::Low => "Low",
            Self::Medium => "Medium",
            Self::High => "High",
            Self::Critical => "Critical",
            Self::Fatal => "Fatal",
        }
    }
}

/// Outcome, for `status_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// 1
    Success,
    /// 2
    Failure,
}

/// Application Lifecycle activities used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// 3
    Start,
    /// 4
    Stop,
}

/// Process Activity activities used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessActivity {
    /// 1
    Launch,
    /// 2
    Terminate,
}

/// One OCSF event. Fields a class does not have stay `None` and are not serialized.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    /// Class and category: serialized as `class_uid`, `class_name`, `category_uid` and `category_name`.
    #[serde(flatten)]
    pub class: Class,
    /// Activity within the class.
    pub activity_id: u32,
    /// Activity caption; for Other (99), the source's own name for it.
    pub activity_name: Cow<'static, str>,
    /// `class_uid * 100 + activity_id`.
    pub type_uid: u64,
    /// "Class: Activity".
    pub type_name: String,
    /// Severity.
    pub severity_id: u8,
    /// Severity caption.
    pub severity: &'static str,
    /// Milliseconds since the epoch.
    pub time: i64,
    /// Human-readable summary (fixed text plus ids and the workload's own argv).
    pub message: String,
    /// Outcome, where there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_id: Option<u8>,
    /// Outcome caption.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<&'static str>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_detail: Option<String>,
    /// Product and schema.
    pub metadata: Metadata,
    /// The VM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<Device>,
    /// Who acted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actor: Option<Actor>,
    /// The application (Application Lifecycle).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub app: Option<Product>,
    /// The process (Process Activity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessInfo>,
    /// Exit code (Process Activity terminate): the code, or 128 + signal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The finding (Detection Finding).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finding_info: Option<FindingInfo>,
    /// The call (API Activity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api: Option<Api>,
    /// Where the call came from (API Activity), the initiator of a stream (Network and HTTP Activity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub src_endpoint: Option<Endpoint>,
    /// The file (File System Activity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<crate::file::FileObject>,
    /// A rename's new name (File System Activity).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_result: Option<crate::file::FileObject>,
    /// What only Network and HTTP Activity carry, flattened into the event.
    #[serde(flatten)]
    pub network: Option<NetworkFields>,
    /// Whether the event must go out even when the sandbox is over its telemetry limits: lifecycle events
    /// and the reports of what was dropped. Not part of the record.
    #[serde(skip)]
    pub essential: bool,
}

/// Everything constant about one emitter: schema version, product, the sandbox as a device, the actor.
#[derive(Debug, Clone)]
pub struct Source {
    schema: SchemaVersion,
    pub(crate) product: Product,
    pub(crate) sandbox: String,
    sequence: std::cell::Cell<u64>,
}

impl Source {
    /// The events of sandbox `sandbox`, produced by `product_name` `version`, in `schema`.
    pub fn new(schema: SchemaVersion, sandbox: &str, product_name: &str, version: &str) -> Self {
        let product = Product {
            name: product_name.to_owned(),
            vendor_name: "vm-driver".to_owned(),
            version: version.to_owned(),
            uid: None,
        };
        Self { schema, product, sandbox: sandbox.to_owned(), sequence: std::cell::Cell::new(0) }
    }

    pub(crate) fn device(&self) -> Device {
        Device {
            type_id: 6,
            kind: "Virtual",
            name: self.sandbox.clone(),
            uid: self.sandbox.clone(),
            hostname: "sandbox".into(),
        }
    }

    /// An event of `class`, activity `(activity_id, activity_name)`.
    pub(crate) fn base(
        &self,
        class: Class,
        activity: (u32, &'static str),
        severity: Severity,
        message: String,
    ) -> Event {
        let (activity_id, activity_name) = activity;
        let time = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let sequence = self.sequence.get() + 1;
        self.sequence.set(sequence);
        Event {
            class,
            activity_id,
            activity_name: Cow::Borrowed(activity_name),
            type_uid: u64::from(class.uid) * 100 + u64::from(activity_id),
            type_name: format!("{}: {activity_name}", class.caption),
            severity_id: severity as u8,
            severity: severity.name(),
            time,
            message,
            status_id: None,
            status: None,
            status_detail: None,
            metadata: Metadata {
                version: self.schema.as_str().to_owned(),
                product: self.product.clone(),
                sequence,
                profiles: Vec::new(),
            },
            device: None,
            actor: None,
            app: None,
            process: None,
            exit_code: None,
            finding_info: None,
            api: None,
            src_endpoint: None,
            file: None,
            file_result: None,
            network: None,
            essential: false,
        }
    }

    /// Application Lifecycle (6002): the sandbox or its VM started or stopped.
    pub fn lifecycle(&self, activity: Lifecycle, app: &AppInfo, status: Status, detail: Option<String>) -> Event {
        let (id, name) = match activity {
            Lifecycle::Start => (3, "Start"),
            Lifecycle::Stop => (4, "Stop"),
        };
        let severity = if status == Status::Success { Severity::Informational } else { Severity::Medium };
        let outcome = if status == Status::Success { "" } else { " failed" };
        let message = format!("{} {}{outcome}", app.name, name.to_lowercase());
        let mut event = self.base(Class::APPLICATION_LIFECYCLE, (id, name), severity, message);
        event.app = Some(Product {
            name: app.name.clone(),
            vendor_name: self.product.vendor_name.clone(),
            version: app.version.clone(),
            uid: Some(self.sandbox.clone()),
        });
        set_status(&mut event, status, detail);
        event.essential = true;
        event
    }

    /// Process Activity (1007): a workload process launched or terminated.
    pub fn process(&self, activity: ProcessActivity, process: ProcessInfo, exit_code: Option<i32>) -> Event {
        let (id, name) = match activity {
            ProcessActivity::Launch => (1, "Launch"),
            ProcessActivity::Terminate => (2, "Terminate"),
        };
        let message = match exit_code {
            Some(code) => format!("process {} exited {code}: {}", process.uid, process.cmd_line),
            None => format!("process {} launched: {}", process.uid, process.cmd_line),
        };
        let mut event = self.base(Class::PROCESS_ACTIVITY, (id, name), Severity::Informational, message);
        event.actor = Some(Actor { app_name: self.product.name.clone(), app_uid: self.sandbox.clone() });
        event.device = Some(self.device());
        event.process = Some(process);
        event.exit_code = exit_code;
        event
    }

    /// Detection Finding (2004). `detail` must be fixed text plus ids, never payload.
    pub fn finding(&self, finding: Finding, detail: &str) -> Event {
        let sequence = self.sequence.get() + 1;
        let mut event = self.base(Class::DETECTION_FINDING, (1, "Create"), finding.severity(), finding.title().into());
        event.finding_info = Some(FindingInfo {
            uid: format!("{}-{sequence}", self.sandbox),
            title: finding.title().into(),
            desc: detail.to_owned(),
            types: vec![finding.kind().into()],
        });
        event.device = Some(self.device());
        event.essential = matches!(finding, Finding::TelemetryDropped | Finding::LogCapped);
        event
    }

    /// API Activity (6003), Update: a control-plane call that changed (or was refused a change of) the
    /// sandbox's settings, made through the attach socket, or one the supervisor made to an OpenShell gateway
    /// (`endpoint` names which); `outcome` is fixed text.
    pub fn api_update(&self, operation: &str, endpoint: &str, status: Status, outcome: &str) -> Event {
        let message = format!("{operation} {outcome}");
        let mut event = self.base(Class::API_ACTIVITY, (3, "Update"), Severity::Informational, message);
        event.actor = Some(Actor { app_name: "vm-driver".into(), app_uid: self.sandbox.clone() });
        event.api = Some(Api { operation: operation.to_owned(), service: Service { name: self.product.name.clone() } });
        event.src_endpoint = Some(Endpoint { name: Some(endpoint.to_owned()), ..Endpoint::default() });
        set_status(&mut event, status, (status == Status::Failure).then(|| outcome.to_owned()));
        event
    }

    /// Device Config State Change (5019): a configuration or policy change of the sandbox.
    pub fn config_change(&self, what: &str) -> Event {
        let mut event = self.base(Class::DEVICE_CONFIG_STATE_CHANGE, (1, "Log"), Severity::Informational, what.into());
        event.device = Some(self.device());
        event
    }
}

pub(crate) fn set_status(event: &mut Event, status: Status, detail: Option<String>) {
    let (id, name) = match status {
        Status::Success => (1, "Success"),
        Status::Failure => (2, "Failure"),
    };
    event.status_id = Some(id);
    event.status = Some(name);
    event.status_detail = detail;
}

impl Event {
    /// The event as one line of JSON (no newline).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"))
    }

    /// A compact human line: `OCSF <class>:<activity> [severity] message`.
    pub fn shorthand(&self) -> String {
        let (class, activity) = (self.class.shorthand, self.activity_name.to_uppercase());
        format!("OCSF {class}:{activity} [{}] {}", self.severity, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::NetworkActivity;
    use crate::objects::MAX_CMD_LINE_CHARS;

    fn source() -> Source {
        Source::new(SchemaVersion::default(), "sb1", "vm-supervisor", "0.1.0")
    }

    #[test]
    fn type_uid_is_class_times_100_plus_activity() {
        let s = source();
        let e = s.process(ProcessActivity::Terminate, ProcessInfo::new("sb1", 3, Some(7), &["ls".into()]), Some(2));
        assert_eq!((e.class.uid, e.activity_id, e.type_uid), (1007, 2, 100_702));
        let e = s.finding(Finding::LeaseLost, "no echo");
        assert_eq!(e.type_uid, 200_401);
        assert_eq!(e.severity_id, 4);
    }

    #[test]
    fn metadata_carries_product_schema_and_a_sequence() {
        let s = source();
        let a = s.config_change("policy");
        let b = s.config_change("policy");
        assert_eq!(a.metadata.version, "1.8.0");
        assert_eq!(a.metadata.product.vendor_name, "vm-driver");
        assert_eq!((a.metadata.sequence, b.metadata.sequence), (1, 2));
    }

    #[test]
    fn classes_carry_their_required_objects() {
        let s = source();
        let json: serde_json::Value = serde_json::from_str(
            &s.process(ProcessActivity::Launch, ProcessInfo::new("sb1", 1, Some(9), &["/bin/sh".into()]), None)
                .to_json(),
        )
        .unwrap();
        assert_eq!(json["device"]["type_id"], 6);
        assert_eq!(json["process"]["name"], "sh");
        assert!(json.get("actor").is_some());
        assert!(json.get("exit_code").is_none());
        let app = AppInfo { name: "sandbox".into(), version: "0.1.0".into() };
        let json: serde_json::Value =
            serde_json::from_str(&s.lifecycle(Lifecycle::Stop, &app, Status::Failure, Some("x".into())).to_json())
                .unwrap();
        assert_eq!(json["app"]["uid"], "sb1");
        assert_eq!(json["status_id"], 2);
    }

    #[test]
    fn workload_argv_is_bounded_and_printable() {
        let argv = vec!["/bin/ev\u{1b}[2Jil\nname".to_owned(), "x".repeat(5000)];
        let p = ProcessInfo::new("sb", 1, None, &argv);
        assert!(!p.name.chars().chain(p.cmd_line.chars()).any(char::is_control), "{p:?}");
        assert!(p.cmd_line.ends_with("...") && p.cmd_line.chars().count() <= MAX_CMD_LINE_CHARS + 3);
        let line = source().process(ProcessActivity::Launch, p, None).shorthand();
        assert!(!line.contains('\n') && !line.contains('\u{1b}'));
    }

    #[test]
    fn shorthand_is_one_line() {
        let e = source().finding(Finding::GuestProtocolViolation, "bad frame");
        let line = e.shorthand();
        assert!(line.starts_with("OCSF FINDING:CREATE [High]"));
        assert!(!line.contains('\n'));
    }

    /// One event of every builder, so of every class.
    fn one_of_each(s: &Source) -> Vec<Event> {
        let app = AppInfo { name: "sandbox".into(), version: "0.1.0".into() };
        vec![
            s.lifecycle(Lifecycle::Start, &app, Status::Success, None),
            s.process(ProcessActivity::Launch, ProcessInfo::new("sb1", 1, None, &["ls".into()]), None),
            s.finding(Finding::LogCapped, "console.log"),
            s.config_change("policy"),
            s.api_update("UpdatePolicy", "attach.sock", Status::Success, "revision 1 applied"),
            s.network(NetworkActivity::Open, &crate::network::tests::egress(), None),
            s.http(&crate::network::tests::egress(), "GET", "/", Some(200)),
            s.file(crate::FileActivity::Update, "/home/sandbox/f", None, 3, Status::Success),
        ]
    }

    #[test]
    fn every_class_is_built_and_named_by_its_class() {
        let events = one_of_each(&source());
        for class in Class::ALL {
            let event = events.iter().find(|e| e.class == *class).unwrap_or_else(|| panic!("no builder: {class:?}"));
            assert!(event.shorthand().starts_with(&format!("OCSF {}:", class.shorthand)), "{}", event.shorthand());
            let json: serde_json::Value = serde_json::from_str(&event.to_json()).unwrap();
            assert_eq!(json["class_uid"], class.uid);
            assert_eq!(json["class_name"], class.caption);
            assert_eq!(json["category_uid"], class.category.uid);
            assert_eq!(json["category_name"], class.category.caption);
            assert_eq!(json["type_uid"], u64::from(class.uid) * 100 + u64::from(event.activity_id));
        }
    }

    #[test]
    fn api_activity_prints_as_api() {
        let e = source().api_update("RotateCredentials", "attach.sock", Status::Failure, "refused: bad CA");
        assert!(
            e.shorthand().starts_with("OCSF API:UPDATE [Informational] RotateCredentials refused"),
            "{}",
            e.shorthand()
        );
    }

    #[test]
    fn the_classification_leads_the_json_as_before() {
        let json = source().api_update("UpdatePolicy", "attach.sock", Status::Success, "applied").to_json();
        let head = r#"{"class_uid":6003,"class_name":"API Activity","category_uid":6,"category_name":"Application Activity","activity_id":3,"#;
        assert!(json.starts_with(head), "{json}");
        assert!(!json.contains(r#""class":"#), "{json}");
    }
}

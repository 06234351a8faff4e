//! A sandbox's `events.jsonl` as the tests read it: one OCSF event a line, appended by the supervisor's own
//! writer thread a moment after what the test just saw happen.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use vm_contract::layout::SandboxFile;

use crate::sandbox;

/// The events file of the sandbox directory `sandbox_dir`.
pub fn path(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join(SandboxFile::Events.name())
}

/// The file's text so far (empty while there is none).
pub fn text(sandbox_dir: &Path) -> String {
    sandbox::read(sandbox_dir, SandboxFile::Events)
}

/// The events recorded so far. Whole lines only: the writer may be mid-line; a file not there yet holds
/// none.
///
/// # Panics
///
/// If a whole line is not JSON.
pub fn read(sandbox_dir: &Path) -> Vec<Value> {
    parse(&text(sandbox_dir))
}

/// The events once the file has stopped growing for 200 ms (at most 5 s): everything the acts the test
/// just saw answered will record.
pub fn settled(sandbox_dir: &Path) -> Vec<Value> {
    let mut text = text(sandbox_dir);
    for _ in 0..25 {
        std::thread::sleep(Duration::from_millis(200));
        let again = self::text(sandbox_dir);
        if again == text {
            break;
        }
        text = again;
    }
    parse(&text)
}

fn parse(text: &str) -> Vec<Value> {
    let whole = text.rfind('\n').map_or("", |end| &text[..end]);
    whole
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("an events.jsonl line is not JSON ({e}): {l}")))
        .collect()
}

/// The events of OCSF class `class_uid` (1007 Process Activity, 2004 Detection Finding, 4001 Network
/// Activity, 6002 Application Lifecycle, ...).
pub fn of_class(events: &[Value], class_uid: u64) -> Vec<&Value> {
    events.iter().filter(|e| e["class_uid"] == class_uid).collect()
}

/// Whether an event of `class_uid` with `activity_id` is among `events`.
pub fn has(events: &[Value], class_uid: u64, activity_id: u64) -> bool {
    events.iter().any(|e| e["class_uid"] == class_uid && e["activity_id"] == activity_id)
}

/// The type of every Detection Finding (`guest_protocol_violation`, `policy_denied`, ...), in order.
pub fn finding_types(events: &[Value]) -> Vec<&str> {
    of_class(events, 2004).into_iter().filter_map(|e| e["finding_info"]["types"][0].as_str()).collect()
}

/// What every Detection Finding says (its `finding_info.desc`), in order.
pub fn finding_descs(events: &[Value]) -> Vec<String> {
    of_class(events, 2004)
        .into_iter()
        .map(|e| e["finding_info"]["desc"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_whole_lines_only() {
        let events = parse("{\"class_uid\":2004,\"finding_info\":{\"types\":[\"a\"]}}\n{\"class_uid\":10");
        assert_eq!(events.len(), 1);
        assert_eq!(finding_types(&events), ["a"]);
        assert!(parse("").is_empty());
    }
}

//! File System Activity (1001): a file operation of the files API (`cp`, `ReadFile`, ...), with the path and
//! the bytes it moved, never the contents.

use serde::Serialize;
use vm_contract::logs::printable;

use crate::class::Class;
use crate::event::{set_status, Event, Severity, Source, Status};
use crate::objects::Actor;

/// Longest path in an event, in characters.
pub const MAX_FILE_PATH_CHARS: usize = 1024;

/// What a file operation did, as OCSF's activity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileActivity {
    /// A file, directory or tree made (`MakeDir`, `CopyIn`).
    Create,
    /// Contents read (`Read`, `CopyOut`).
    Read,
    /// Contents written (`Write`).
    Update,
    /// Removed.
    Delete,
    /// Renamed.
    Rename,
    /// Attributes read (`Stat`, `List`).
    GetAttributes,
}

impl FileActivity {
    fn id_name(self) -> (u32, &'static str) {
        match self {
            Self::Create => (1, "Create"),
            Self::Read => (2, "Read"),
            Self::Update => (3, "Update"),
            Self::Delete => (4, "Delete"),
            Self::Rename => (5, "Rename"),
            Self::GetAttributes => (8, "Get Attributes"),
        }
    }
}

/// OCSF's `file` object, as far as the host knows it: the guest's path, never its contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileObject {
    /// The last component.
    pub name: String,
    /// The guest path, bounded and printable.
    pub path: String,
    /// OCSF's `type_id`: 0, unknown (the host never looks at the guest's file).
    pub type_id: u8,
    /// Bytes moved in or out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

impl FileObject {
    fn new(path: &str, size: Option<u64>) -> Self {
        let path = printable(path, MAX_FILE_PATH_CHARS);
        let name = path.trim_end_matches('/').rsplit('/').next().filter(|n| !n.is_empty()).unwrap_or("/").to_owned();
        Self { name, path, type_id: 0, size }
    }
}

impl Source {
    /// File System Activity (1001): one file operation on `path` (and, for a rename, its new path
    /// `result`) that moved `bytes`, with its outcome.
    pub fn file(&self, activity: FileActivity, path: &str, result: Option<&str>, bytes: u64, status: Status) -> Event {
        let (id, name) = activity.id_name();
        let file = FileObject::new(path, Some(bytes));
        let outcome = if status == Status::Success { "" } else { " failed" };
        let message = format!("files {}{outcome}: {} ({bytes} bytes)", name.to_lowercase(), file.path);
        let mut event = self.base(Class::FILE_ACTIVITY, (id, name), Severity::Informational, message);
        event.actor = Some(Actor { app_name: self.product.name.clone(), app_uid: self.sandbox.clone() });
        event.device = Some(self.device());
        event.file = Some(file);
        event.file_result = result.map(|r| FileObject::new(r, None));
        set_status(&mut event, status, None);
        event
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SchemaVersion;

    #[test]
    fn a_file_event_names_the_path_and_size_and_nothing_else() {
        let source = Source::new(SchemaVersion::default(), "sb", "vm-supervisor", "0");
        let event = source.file(FileActivity::Rename, "/home/sandbox/a\nb", Some("/tmp/c"), 7, Status::Success);
        let json: serde_json::Value = serde_json::from_str(&event.to_json()).unwrap();
        assert_eq!(json["class_uid"], 1001);
        assert_eq!(json["type_uid"], 100105);
        assert_eq!(json["file"]["name"], "a?b", "printable only");
        assert_eq!(json["file"]["size"], 7);
        assert_eq!(json["file_result"]["path"], "/tmp/c");
        assert_eq!(json["actor"]["app_name"], "vm-supervisor");
    }
}

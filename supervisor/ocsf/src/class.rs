//! The OCSF event classes this crate emits, each defined once: its uid, caption, schema name and category,
//! and the names the sinks give it (the console shorthand and the OTLP event name). A class added to the
//! table below is known to every builder and sink at once.

use serde::ser::{Serialize, SerializeStruct, Serializer};

/// An OCSF category (`category_uid`, `category_name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Category {
    /// `category_uid`.
    pub uid: u32,
    /// `category_name`, the schema's caption.
    pub caption: &'static str,
}

impl Category {
    /// System Activity (1).
    pub const SYSTEM: Self = Self { uid: 1, caption: "System Activity" };
    /// Findings (2).
    pub const FINDINGS: Self = Self { uid: 2, caption: "Findings" };
    /// Network Activity (4).
    pub const NETWORK: Self = Self { uid: 4, caption: "Network Activity" };
    /// Discovery (5).
    pub const DISCOVERY: Self = Self { uid: 5, caption: "Discovery" };
    /// Application Activity (6).
    pub const APPLICATION: Self = Self { uid: 6, caption: "Application Activity" };
}

/// One OCSF event class and every name it goes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Class {
    /// `class_uid`.
    pub uid: u32,
    /// `class_name`, the schema's caption (`API Activity`).
    pub caption: &'static str,
    /// The schema's name for it (`api_activity`), as in its definition file.
    pub name: &'static str,
    /// Its category.
    pub category: Category,
    /// The class in a console shorthand line: `OCSF <shorthand>:<ACTIVITY> ...`.
    pub shorthand: &'static str,
    /// The OTLP log record's event name: `ocsf.<name>`.
    pub event_name: &'static str,
}

macro_rules! classes {
    ($($konst:ident = $uid:literal $caption:literal $name:ident $category:ident $shorthand:literal,)+) => {
        impl Class {
            $(
                #[doc = concat!($caption, " (", $uid, ").")]
                pub const $konst: Self = Self {
                    uid: $uid,
                    caption: $caption,
                    name: stringify!($name),
                    category: Category::$category,
                    shorthand: $shorthand,
                    event_name: concat!("ocsf.", stringify!($name)),
                };
            )+

            /// Every class this crate emits.
            pub const ALL: &'static [Self] = &[$(Self::$konst,)+];
        }
    };
}

classes! {
    APPLICATION_LIFECYCLE = 6002 "Application Lifecycle" application_lifecycle APPLICATION "LIFECYCLE",
    PROCESS_ACTIVITY = 1007 "Process Activity" process_activity SYSTEM "PROCESS",
    DETECTION_FINDING = 2004 "Detection Finding" detection_finding FINDINGS "FINDING",
    DEVICE_CONFIG_STATE_CHANGE = 5019 "Device Config State Change" device_config_state_change DISCOVERY "CONFIG",
    API_ACTIVITY = 6003 "API Activity" api_activity APPLICATION "API",
    NETWORK_ACTIVITY = 4001 "Network Activity" network_activity NETWORK "NETWORK",
    HTTP_ACTIVITY = 4002 "HTTP Activity" http_activity NETWORK "HTTP",
    FILE_ACTIVITY = 1001 "File System Activity" file_activity SYSTEM "FILE",
}

impl Class {
    /// The class with `uid`, if this crate emits it.
    pub fn from_uid(uid: u32) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.uid == uid)
    }
}

/// Serialized as the event's classification fields (`class_uid`, `class_name`, `category_uid`,
/// `category_name`), flattened into it.
impl Serialize for Class {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut fields = serializer.serialize_struct("Class", 4)?;
        fields.serialize_field("class_uid", &self.uid)?;
        fields.serialize_field("class_name", self.caption)?;
        fields.serialize_field("category_uid", &self.category.uid)?;
        fields.serialize_field("category_name", self.category.caption)?;
        fields.end()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// The OCSF 1.8.0 definitions (`events/*/<name>.json` and `categories.json` of the schema release):
    /// uid, caption, name and category uid of each class emitted here.
    const OCSF_1_8_0: &[(u32, &str, &str, u32)] = &[
        (6002, "Application Lifecycle", "application_lifecycle", 6),
        (1007, "Process Activity", "process_activity", 1),
        (2004, "Detection Finding", "detection_finding", 2),
        (5019, "Device Config State Change", "device_config_state_change", 5),
        (6003, "API Activity", "api_activity", 6),
        (4001, "Network Activity", "network_activity", 4),
        (4002, "HTTP Activity", "http_activity", 4),
        (1001, "File System Activity", "file_activity", 1),
    ];

    #[test]
    fn every_class_has_unique_names_and_matches_ocsf_1_8_0() {
        let mut uids = HashSet::new();
        let mut shorthands = HashSet::new();
        let mut event_names = HashSet::new();
        for class in Class::ALL {
            assert!(uids.insert(class.uid), "uid {} twice", class.uid);
            assert!(!class.shorthand.is_empty() && shorthands.insert(class.shorthand), "{class:?}");
            assert!(event_names.insert(class.event_name), "{class:?}");
            assert_eq!(class.event_name, format!("ocsf.{}", class.name));
            assert_ne!(class.event_name, "ocsf.event", "the fallback name is no class's");
            let schema = OCSF_1_8_0.iter().find(|c| c.0 == class.uid);
            assert_eq!(
                schema.copied(),
                Some((class.uid, class.caption, class.name, class.category.uid)),
                "{class:?} is not OCSF 1.8.0's"
            );
            assert_eq!(Class::from_uid(class.uid), Some(*class));
        }
        assert_eq!(Class::ALL.len(), OCSF_1_8_0.len(), "a class of the table is not emitted");
        assert_eq!(Class::from_uid(9999), None);
    }

    #[test]
    fn categories_match_ocsf_1_8_0() {
        let categories = [(Category::SYSTEM, 1, "System Activity"), (Category::FINDINGS, 2, "Findings")];
        let more = [
            (Category::NETWORK, 4, "Network Activity"),
            (Category::DISCOVERY, 5, "Discovery"),
            (Category::APPLICATION, 6, "Application Activity"),
        ];
        for (category, uid, caption) in categories.into_iter().chain(more) {
            assert_eq!((category.uid, category.caption), (uid, caption));
        }
    }

    #[test]
    fn api_activity_is_named_as_such() {
        assert_eq!(Class::API_ACTIVITY.shorthand, "API");
        assert_eq!(Class::API_ACTIVITY.event_name, "ocsf.api_activity");
    }
}

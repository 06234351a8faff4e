//! A validator for OCSF events, built from the facts `scripts/ocsf-extract` took from the official schema
//! sources (`tests/ocsf-1.8.0/`: release v1.8.0, its commit in `SOURCE.md`), independent of the code that
//! emits them.
//!
//! It checks an event for: a `class_uid` the extract holds; the class's `category_uid`;
//! `type_uid = class_uid * 100 + activity_id`; every attribute the class or object marks `required`; no
//! attribute the class or object does not define; attributes that only a profile brings, only when the event
//! declares that profile in `metadata.profiles`; JSON types; enumerated values; and `at_least_one`
//! constraints. An object the extract does not hold is a failure: emitting a new one means extracting it too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// Asserts that every one of `events` is valid OCSF 1.8.0, by the extract the tests ship.
pub fn assert_valid(events: &[Value]) {
    let schema = Schema::load(&schema_dir());
    for event in events {
        let problems = schema.validate(event);
        assert!(problems.is_empty(), "{event}: {problems:#?}");
    }
}

/// The extract the tests ship (`tests/ocsf-1.8.0/`).
pub fn schema_dir() -> PathBuf {
    crate::repo().join("tests/ocsf-1.8.0")
}

#[derive(Debug, Clone, Default)]
struct Definition {
    attributes: Map<String, Value>,
    at_least_one: Vec<String>,
}

/// The extracted schema.
#[derive(Debug)]
pub struct Schema {
    pub version: String,
    classes: BTreeMap<u64, (u64, Definition)>,
    objects: BTreeMap<String, Definition>,
}

fn definition(v: &Value) -> Definition {
    Definition {
        attributes: v["attributes"].as_object().cloned().unwrap_or_default(),
        at_least_one: v["at_least_one"]
            .as_array()
            .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
            .unwrap_or_default(),
    }
}

impl Schema {
    /// Loads `schema.json` from `dir`.
    pub fn load(dir: &Path) -> Self {
        let path = dir.join("schema.json");
        let text = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let root: Value = serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let classes = root["classes"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(uid, c)| (uid.parse().unwrap(), (c["category_uid"].as_u64().unwrap(), definition(c))))
            .collect();
        let objects = root["objects"].as_object().unwrap().iter().map(|(n, o)| (n.clone(), definition(o))).collect();
        Self { version: root["version"].as_str().unwrap().to_owned(), classes, objects }
    }

    /// The classes the extract holds.
    pub fn class_uids(&self) -> Vec<u64> {
        self.classes.keys().copied().collect()
    }

    /// Every problem with `event`; empty when it is valid.
    pub fn validate(&self, event: &Value) -> Vec<String> {
        let mut problems = Vec::new();
        let Some(class_uid) = event.get("class_uid").and_then(Value::as_u64) else {
            return vec!["no integer class_uid".into()];
        };
        let Some((category_uid, class)) = self.classes.get(&class_uid) else {
            return vec![format!(
                "class_uid {class_uid} is not in the OCSF {} extract (scripts/ocsf-extract)",
                self.version
            )];
        };
        if event.get("category_uid").and_then(Value::as_u64) != Some(*category_uid) {
            problems.push(format!("category_uid must be {category_uid}"));
        }
        let activity = event.get("activity_id").and_then(Value::as_u64).unwrap_or(u64::MAX);
        if event.get("type_uid").and_then(Value::as_u64) != Some(class_uid * 100 + activity) {
            problems.push("type_uid must be class_uid * 100 + activity_id".into());
        }
        let profiles: Vec<&str> = event
            .pointer("/metadata/profiles")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        self.check(&format!("class {class_uid}"), class, event, &profiles, &mut problems);
        problems
    }

    fn check(&self, at: &str, def: &Definition, value: &Value, profiles: &[&str], problems: &mut Vec<String>) {
        let Some(obj) = value.as_object() else {
            problems.push(format!("{at}: not an object"));
            return;
        };
        let applies = |attr: &Value| attr.get("profile").and_then(Value::as_str).is_none_or(|p| profiles.contains(&p));
        for (name, attr) in &def.attributes {
            if attr["requirement"] == "required" && applies(attr) && obj.get(name).is_none_or(Value::is_null) {
                problems.push(format!("{at}: required attribute {name} is missing"));
            }
        }
        if !def.at_least_one.is_empty() && !def.at_least_one.iter().any(|k| obj.contains_key(k)) {
            problems.push(format!("{at}: needs at least one of {:?}", def.at_least_one));
        }
        for (name, v) in obj {
            match def.attributes.get(name) {
                None => problems.push(format!("{at}: attribute {name} is not defined here")),
                Some(attr) if !applies(attr) => problems.push(format!(
                    "{at}: attribute {name} belongs to the {} profile, which the event does not declare",
                    attr["profile"].as_str().unwrap_or("?")
                )),
                Some(attr) => self.check_value(&format!("{at}.{name}"), attr, v, profiles, problems),
            }
        }
    }

    fn check_value(&self, at: &str, attr: &Value, v: &Value, profiles: &[&str], problems: &mut Vec<String>) {
        if attr.get("array").and_then(Value::as_bool) == Some(true) {
            match v.as_array() {
                Some(items) => items.iter().for_each(|i| self.check_item(at, attr, i, profiles, problems)),
                None => problems.push(format!("{at}: must be an array")),
            }
        } else {
            self.check_item(at, attr, v, profiles, problems);
        }
    }

    fn check_item(&self, at: &str, attr: &Value, v: &Value, profiles: &[&str], problems: &mut Vec<String>) {
        if let Some(object) = attr.get("object").and_then(Value::as_str) {
            match (object, self.objects.get(object)) {
                ("object", _) => {
                    if !v.is_object() {
                        problems.push(format!("{at}: must be an object"));
                    }
                }
                (_, Some(def)) => self.check(at, def, v, profiles, problems),
                (_, None) => problems.push(format!(
                    "{at}: object {object} is not in the OCSF {} extract (add it to scripts/ocsf-extract)",
                    self.version
                )),
            }
            return;
        }
        let ty = attr.get("type").and_then(Value::as_str).unwrap_or("");
        let ok = match ty {
            "string_t" => v.is_string(),
            "integer_t" | "long_t" => v.is_i64() || v.is_u64(),
            "float_t" => v.is_number(),
            "boolean_t" => v.is_boolean(),
            _ => true,
        };
        if !ok {
            problems.push(format!("{at}: {v} is not a {ty}"));
        }
        if let Some(values) = attr.get("enum").and_then(Value::as_array) {
            let key = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            if !values.iter().any(|e| e.as_str() == Some(key.as_str())) {
                problems.push(format!("{at}: {key} is not one of {values:?}"));
            }
        }
    }
}

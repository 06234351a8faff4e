//! A validator for OCSF events built from the official schema sources (`../shared/ocsf-schema-1.8.0`,
//! release v1.8.0, see its `SOURCE.md`), independent of the code that emits them.
//!
//! It resolves `extends` chains of event classes and objects, takes types from `dictionary.json`, and checks
//! an event for: a known `class_uid`; the right `category_uid`; `type_uid = class_uid * 100 + activity_id`;
//! every attribute the class or object marks `required`; no attribute the class or object does not define;
//! JSON types; enumerated values; and objects' `at_least_one` constraints. Optional profiles (`$include`) are
//! not applied, as no event here declares one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// Where the schema sources are, or a clear failure when they are absent.
pub fn schema_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/ocsf-schema-1.8.0");
    assert!(
        dir.join("dictionary.json").is_file(),
        "the OCSF 1.8.0 schema sources are missing at {} (the shared folder beside the checkout); these tests need them",
        dir.display()
    );
    dir
}

#[derive(Debug, Clone, Default)]
struct Definition {
    attributes: Map<String, Value>,
    at_least_one: Vec<String>,
}

/// The resolved schema.
#[derive(Debug)]
pub struct Schema {
    pub version: String,
    dictionary: Map<String, Value>,
    types: Map<String, Value>,
    classes: BTreeMap<u64, (u64, Definition)>,
    objects: BTreeMap<String, Definition>,
}

fn read(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn json_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            json_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "json") {
            out.push(path);
        }
    }
}

/// Child attribute definitions override the parent's field by field.
fn merge(parent: &Map<String, Value>, child: &Map<String, Value>) -> Map<String, Value> {
    let mut out = parent.clone();
    for (name, def) in child {
        if name == "$include" {
            continue;
        }
        match (out.get_mut(name), def) {
            (Some(Value::Object(base)), Value::Object(over)) => {
                for (k, v) in over {
                    base.insert(k.clone(), v.clone());
                }
            }
            _ => {
                out.insert(name.clone(), def.clone());
            }
        }
    }
    out
}

impl Schema {
    /// Loads and resolves the schema.
    pub fn load(dir: &Path) -> Self {
        let dictionary = read(&dir.join("dictionary.json"));
        let categories = read(&dir.join("categories.json"));
        let version = read(&dir.join("version.json"))["version"].as_str().unwrap().to_owned();

        let mut raw_objects = BTreeMap::new();
        let mut files = Vec::new();
        json_files(&dir.join("objects"), &mut files);
        for f in files {
            let v = read(&f);
            raw_objects.insert(v["name"].as_str().unwrap().to_owned(), v);
        }
        let mut raw_events = BTreeMap::new();
        let mut files = Vec::new();
        json_files(&dir.join("events"), &mut files);
        for f in files {
            let v = read(&f);
            raw_events.insert(v["name"].as_str().unwrap().to_owned(), v);
        }

        let objects = raw_objects.keys().map(|name| (name.clone(), resolve(&raw_objects, name))).collect();
        let mut classes = BTreeMap::new();
        for (name, raw) in &raw_events {
            let Some(uid) = raw.get("uid").and_then(Value::as_u64) else {
                continue;
            };
            let category = category_of(&raw_events, name).unwrap();
            let category_uid = categories["attributes"][&category]["uid"].as_u64().unwrap();
            classes.insert(category_uid * 1000 + uid, (category_uid, resolve(&raw_events, name)));
        }
        Self {
            version,
            types: dictionary["types"]["attributes"].as_object().unwrap().clone(),
            dictionary: dictionary["attributes"].as_object().unwrap().clone(),
            classes,
            objects,
        }
    }

    /// Every problem with `event`; empty when it is valid.
    pub fn validate(&self, event: &Value) -> Vec<String> {
        let mut problems = Vec::new();
        let Some(class_uid) = event.get("class_uid").and_then(Value::as_u64) else {
            return vec!["no integer class_uid".into()];
        };
        let Some((category_uid, class)) = self.classes.get(&class_uid) else {
            return vec![format!("class_uid {class_uid} is not an OCSF {} class", self.version)];
        };
        if event.get("category_uid").and_then(Value::as_u64) != Some(*category_uid) {
            problems.push(format!("category_uid must be {category_uid}"));
        }
        let activity = event.get("activity_id").and_then(Value::as_u64).unwrap_or(u64::MAX);
        if event.get("type_uid").and_then(Value::as_u64) != Some(class_uid * 100 + activity) {
            problems.push("type_uid must be class_uid * 100 + activity_id".into());
        }
        self.check(&format!("class {class_uid}"), class, event, &mut problems);
        problems
    }

    fn check(&self, at: &str, def: &Definition, value: &Value, problems: &mut Vec<String>) {
        let Some(obj) = value.as_object() else {
            problems.push(format!("{at}: not an object"));
            return;
        };
        for (name, attr) in &def.attributes {
            if attr.get("requirement").and_then(Value::as_str) == Some("required")
                && obj.get(name).is_none_or(Value::is_null)
            {
                problems.push(format!("{at}: required attribute {name} is missing"));
            }
        }
        if !def.at_least_one.is_empty() && !def.at_least_one.iter().any(|k| obj.contains_key(k)) {
            problems.push(format!("{at}: needs at least one of {:?}", def.at_least_one));
        }
        for (name, v) in obj {
            let Some(attr) = def.attributes.get(name) else {
                problems.push(format!("{at}: attribute {name} is not defined here"));
                continue;
            };
            self.check_value(&format!("{at}.{name}"), name, attr, v, problems);
        }
    }

    fn check_value(&self, at: &str, name: &str, attr: &Value, v: &Value, problems: &mut Vec<String>) {
        let Some(dict) = self.dictionary.get(name) else {
            problems.push(format!("{at}: {name} is not in the dictionary"));
            return;
        };
        if dict.get("is_array").and_then(Value::as_bool) == Some(true) {
            match v.as_array() {
                Some(items) => items.iter().for_each(|i| self.check_scalar_or_object(at, dict, attr, i, problems)),
                None => problems.push(format!("{at}: must be an array")),
            }
        } else {
            self.check_scalar_or_object(at, dict, attr, v, problems);
        }
    }

    fn check_scalar_or_object(&self, at: &str, dict: &Value, attr: &Value, v: &Value, problems: &mut Vec<String>) {
        let ty = dict.get("type").and_then(Value::as_str).unwrap_or("object");
        if !ty.ends_with("_t") {
            if ty == "object" {
                if !v.is_object() {
                    problems.push(format!("{at}: must be an object"));
                }
            } else if let Some(def) = self.objects.get(ty) {
                self.check(at, def, v, problems);
            } else {
                problems.push(format!("{at}: unknown object type {ty}"));
            }
            return;
        }
        let base = self.base_type(ty);
        let ok = match base {
            "string_t" => v.is_string(),
            "integer_t" | "long_t" => v.is_i64() || v.is_u64(),
            "float_t" => v.is_number(),
            "boolean_t" => v.is_boolean(),
            _ => true,
        };
        if !ok {
            problems.push(format!("{at}: {v} is not a {base}"));
        }
        // The base event's class and category enums are placeholders; those two are checked in `validate`.
        let placeholder = at.ends_with(".class_uid") || at.ends_with(".category_uid");
        if let Some(values) =
            attr.get("enum").or_else(|| dict.get("enum")).and_then(Value::as_object).filter(|_| !placeholder)
        {
            let key = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            if !values.contains_key(&key) {
                problems.push(format!("{at}: {key} is not one of {:?}", values.keys().collect::<Vec<_>>()));
            }
        }
    }

    fn base_type<'a>(&'a self, ty: &'a str) -> &'a str {
        match self.types.get(ty).and_then(|t| t.get("type")).and_then(Value::as_str) {
            Some(parent) if parent != ty => self.base_type(parent),
            _ => ty,
        }
    }
}

fn resolve(raw: &BTreeMap<String, Value>, name: &str) -> Definition {
    let item = &raw[name];
    let mut def = match item.get("extends").and_then(Value::as_str) {
        Some(parent) if raw.contains_key(parent) => resolve(raw, parent),
        _ => Definition::default(),
    };
    if let Some(attrs) = item.get("attributes").and_then(Value::as_object) {
        def.attributes = merge(&def.attributes, attrs);
    }
    if let Some(list) = item.pointer("/constraints/at_least_one").and_then(Value::as_array) {
        def.at_least_one = list.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect();
    }
    def
}

fn category_of(raw: &BTreeMap<String, Value>, name: &str) -> Option<String> {
    let item = raw.get(name)?;
    match item.get("category").and_then(Value::as_str) {
        Some(c) if c != "other" => Some(c.to_owned()),
        _ => category_of(raw, item.get("extends")?.as_str()?),
    }
}

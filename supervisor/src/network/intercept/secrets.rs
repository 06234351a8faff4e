//! The sandbox's secret credentials and their placeholders (`docs/network.md`, Placeholders). The workload's
//! environment holds a random placeholder per credential; only an intercepted request to a host the
//! credential is bound to gets the value, in place of the placeholder or in the credential's inject header.
//! A placeholder on its way anywhere else is a refusal. Values live here, in memory only.

use std::sync::{Arc, PoisonError, RwLock};

use hyper::header::{HeaderName, HeaderValue};
use vm_protocol::credentials::{RotationOutcome, SecretCredential};

/// Bytes of randomness in a placeholder (as hex after [`PLACEHOLDER_PREFIX`]).
const PLACEHOLDER_RANDOM_BYTES: usize = 16;
/// Every placeholder starts so, which makes it recognizable in a finding's reader's eyes, never guessable.
pub const PLACEHOLDER_PREFIX: &str = "vmdrv-placeholder-";

/// One credential and the placeholder that stands for it.
struct Slot {
    credential: SecretCredential,
    placeholder: String,
}

/// The credentials, shared by the egress tasks and the loop (which rotates them). Its `Debug` shows names.
#[derive(Default, Clone)]
pub struct Secrets(Arc<RwLock<Vec<Slot>>>);

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let slots = self.0.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_list().entries(slots.iter().map(|s| &s.credential.name)).finish()
    }
}

/// Why a request may not leave: a placeholder on its way to a host its credential is not bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misplaced {
    /// The credential's name (never its value or placeholder).
    pub name: String,
}

/// A request's parts the proxy may rewrite. No `Debug`: the headers may hold a value.
#[allow(missing_debug_implementations, reason = "its headers may hold a secret")]
pub struct RequestParts<'a> {
    /// Its headers.
    pub headers: &'a mut hyper::HeaderMap,
    /// Its path and query.
    pub path_and_query: &'a mut String,
}

impl Secrets {
    /// Placeholders for `credentials` (checked by the caller).
    ///
    /// # Errors
    /// The system's RNG failed.
    pub fn new(credentials: Vec<SecretCredential>) -> std::io::Result<Self> {
        let mut slots = Vec::with_capacity(credentials.len());
        for credential in credentials {
            let mut random = [0u8; PLACEHOLDER_RANDOM_BYTES];
            let filled = rustix::rand::getrandom(&mut random[..], rustix::rand::GetRandomFlags::empty())?;
            if filled != random.len() {
                return Err(std::io::Error::other("short read from the RNG"));
            }
            let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
            slots.push(Slot { credential, placeholder: format!("{PLACEHOLDER_PREFIX}{hex}") });
        }
        Ok(Self(Arc::new(RwLock::new(slots))))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Slot>> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// The workload's environment: each credential's name and placeholder.
    pub fn env(&self) -> Vec<(String, String)> {
        self.read().iter().map(|s| (s.credential.name.clone(), s.placeholder.clone())).collect()
    }

    /// Whether a credential of each name in `list` is held.
    pub fn holds(&self, list: &[SecretCredential]) -> bool {
        let slots = self.read();
        list.iter().all(|c| slots.iter().any(|s| s.credential.name == c.name))
    }

    /// Replaces the credentials of the same names; nothing changes unless every name is held.
    pub fn rotate(&self, new: &[SecretCredential]) -> RotationOutcome {
        let mut slots = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if !new.iter().all(|c| slots.iter().any(|s| s.credential.name == c.name)) {
            return RotationOutcome::UnknownSecret;
        }
        for credential in new {
            if let Some(slot) = slots.iter_mut().find(|s| s.credential.name == credential.name) {
                slot.credential = credential.clone();
            }
        }
        RotationOutcome::Applied
    }

    /// Swaps the placeholders of the credentials bound to `host` (normalized) for their values, in header
    /// values and (where a credential opts in) the path and query, and sets their inject headers. A
    /// placeholder of a credential not bound to `host` refuses the whole request.
    ///
    /// # Errors
    /// [`Misplaced`], with nothing changed.
    pub fn apply(&self, host: &str, parts: RequestParts<'_>) -> Result<(), Misplaced> {
        let slots = self.read();
        for slot in slots.iter() {
            let in_headers = parts.headers.values().any(|v| contains(v.as_bytes(), &slot.placeholder));
            let in_url = parts.path_and_query.contains(&slot.placeholder);
            let bound = slot.credential.bound_to(host);
            if ((in_headers || in_url) && !bound) || (in_url && !slot.credential.in_url) {
                return Err(Misplaced { name: slot.credential.name.clone() });
            }
        }
        for slot in slots.iter().filter(|s| s.credential.bound_to(host)) {
            let value = &slot.credential.value;
            for header in parts.headers.values_mut() {
                if let Some(swapped) = swap(header.as_bytes(), &slot.placeholder, value) {
                    *header = swapped;
                }
            }
            if slot.credential.in_url {
                *parts.path_and_query = parts.path_and_query.replace(&slot.placeholder, value);
            }
            if let Some(inject) = &slot.credential.inject {
                let name = HeaderName::from_bytes(inject.header.as_bytes());
                let value = HeaderValue::from_str(&inject.format.replacen("{}", value, 1));
                if let (Ok(name), Ok(mut value)) = (name, value) {
                    value.set_sensitive(true);
                    parts.headers.insert(name, value);
                }
            }
        }
        Ok(())
    }

    /// A scanner for placeholders in a stream the proxy does not read as HTTP.
    pub fn scanner(&self) -> Scanner {
        let needles = self.read().iter().map(|s| (s.credential.name.clone(), s.placeholder.clone())).collect();
        Scanner { needles, tail: Vec::new(), found: None }
    }
}

/// Every placeholder's length: the prefix and the random bytes in hex.
const PLACEHOLDER_BYTES: usize = PLACEHOLDER_PREFIX.len() + 2 * PLACEHOLDER_RANDOM_BYTES;

/// Finds placeholders across the chunks of one stream: one pass for their shared prefix, then the
/// candidates compared; only the few bytes at a chunk's end are kept for the next.
#[derive(Debug)]
pub struct Scanner {
    needles: Vec<(String, String)>,
    /// The end of what came before, so a placeholder split across chunks is found.
    tail: Vec<u8>,
    found: Option<String>,
}

impl Scanner {
    /// The name of the credential whose placeholder `chunk` (after what came before) holds, if any.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        if self.needles.is_empty() {
            return None;
        }
        // A placeholder that starts in the tail ends within its length of the chunk's start.
        let mut seam = std::mem::take(&mut self.tail);
        seam.extend_from_slice(&chunk[..chunk.len().min(PLACEHOLDER_BYTES)]);
        let found = self.find(&seam).or_else(|| self.find(chunk));
        let keep = PLACEHOLDER_BYTES - 1;
        self.tail = if chunk.len() >= keep {
            chunk[chunk.len() - keep..].to_vec()
        } else {
            seam.split_off(seam.len().saturating_sub(keep))
        };
        if found.is_some() {
            self.found.clone_from(&found);
        }
        found
    }

    fn find(&self, haystack: &[u8]) -> Option<String> {
        memchr::memmem::find_iter(haystack, PLACEHOLDER_PREFIX.as_bytes()).find_map(|at| {
            let candidate = haystack.get(at..at + PLACEHOLDER_BYTES)?;
            self.needles.iter().find(|(_, p)| p.as_bytes() == candidate).map(|(name, _)| name.clone())
        })
    }

    /// The credential whose placeholder was found, once one was.
    pub fn found(&self) -> Option<&str> {
        self.found.as_deref()
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    memchr::memmem::find(haystack, needle.as_bytes()).is_some()
}

/// `value` with every `placeholder` replaced by `secret`, if it held one.
fn swap(value: &[u8], placeholder: &str, secret: &str) -> Option<HeaderValue> {
    let text = std::str::from_utf8(value).ok()?;
    if !text.contains(placeholder) {
        return None;
    }
    let mut swapped = HeaderValue::from_str(&text.replace(placeholder, secret)).ok()?;
    swapped.set_sensitive(true);
    Some(swapped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_protocol::credentials::Inject;

    fn credential(name: &str, value: &str, host: &str, inject: bool, in_url: bool) -> SecretCredential {
        SecretCredential {
            name: name.into(),
            value: value.into(),
            hosts: vec![host.parse().unwrap()],
            inject: inject.then(|| Inject { header: "Authorization".into(), format: "Bearer {}".into() }),
            in_url,
        }
    }

    fn request(
        secrets: &Secrets,
        host: &str,
        header: &str,
        path: &str,
    ) -> Result<(hyper::HeaderMap, String), Misplaced> {
        let mut headers = hyper::HeaderMap::new();
        headers.insert("x-key", HeaderValue::from_str(header).unwrap());
        let mut path = path.to_owned();
        secrets.apply(host, RequestParts { headers: &mut headers, path_and_query: &mut path })?;
        Ok((headers, path))
    }

    #[test]
    fn placeholders_become_values_only_for_bound_hosts() {
        let secrets = Secrets::new(vec![
            credential("KEY", "sk-real", "api.example.com", false, false),
            credential("TOKEN", "t-real", "*.git.example", true, true),
        ])
        .unwrap();
        let env = secrets.env();
        let (key, token) = (&env[0].1, &env[1].1);
        assert!(key.starts_with(PLACEHOLDER_PREFIX) && key != token && !key.contains("sk-real"));

        let (headers, _) = request(&secrets, "api.example.com", &format!("Bearer {key}"), "/v1").unwrap();
        assert_eq!(headers["x-key"], "Bearer sk-real");
        assert!(headers.get("authorization").is_none(), "KEY injects nothing");

        assert_eq!(request(&secrets, "evil.example", key, "/").unwrap_err(), Misplaced { name: "KEY".into() });
        assert_eq!(request(&secrets, "api.example.com", "x", &format!("/?k={key}")).unwrap_err().name, "KEY");

        let (headers, path) = request(&secrets, "a.git.example", "none", &format!("/r?t={token}")).unwrap();
        assert_eq!(path, "/r?t=t-real");
        assert_eq!(headers["authorization"], "Bearer t-real", "the inject header is set on a bound host");
        let (headers, _) = request(&secrets, "other.example", "none", "/").unwrap();
        assert!(headers.get("authorization").is_none(), "nothing injected elsewhere");
    }

    #[test]
    fn a_rotation_replaces_values_by_name_or_nothing() {
        let secrets = Secrets::new(vec![credential("KEY", "old", "api.example.com", true, false)]).unwrap();
        let unknown = [credential("OTHER", "x", "api.example.com", true, false)];
        assert_eq!(secrets.rotate(&unknown), RotationOutcome::UnknownSecret);
        assert_eq!(
            secrets.rotate(&[credential("KEY", "new", "api.example.com", true, false)]),
            RotationOutcome::Applied
        );
        let (headers, _) = request(&secrets, "api.example.com", "x", "/").unwrap();
        assert_eq!(headers["authorization"], "Bearer new");
    }

    #[test]
    fn a_scanner_finds_a_placeholder_split_across_chunks() {
        let secrets = Secrets::new(vec![credential("KEY", "v", "a.example", false, false)]).unwrap();
        let placeholder = secrets.env()[0].1.clone();
        let stream = format!("GET / HTTP/1.1\r\nX: {placeholder}\r\n\r\n");
        for split in [1, 20, 30, stream.len() - 3] {
            let mut scanner = secrets.scanner();
            let (a, b) = stream.as_bytes().split_at(split);
            let found = scanner.feed(a).or_else(|| scanner.feed(b));
            assert_eq!(found.as_deref(), Some("KEY"), "split at {split}");
        }
        let mut bytewise = secrets.scanner();
        let found: Vec<String> = stream.as_bytes().chunks(1).filter_map(|b| bytewise.feed(b)).collect();
        assert_eq!(found, ["KEY"], "one byte at a time");
        assert_eq!(secrets.scanner().feed(b"nothing here"), None);
        let near = format!("{}{}", PLACEHOLDER_PREFIX, "0".repeat(2 * PLACEHOLDER_RANDOM_BYTES));
        assert_eq!(secrets.scanner().feed(near.as_bytes()), None, "the prefix alone is no placeholder");
        assert_eq!(Secrets::default().scanner().feed(placeholder.as_bytes()), None);
    }
}

//! The operator's secret credentials file (`--credentials-file`, docs/network.md, Placeholders): a JSON
//! list of credentials, in a file only its owner can read. The values go to the supervisor in the 0600 auth
//! bundle and nowhere else: never argv, an environment, the guest or a log; no error here shows one.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use vm_protocol::credentials::{SecretCredential, SecretError};

/// Largest credentials file read.
const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// Why a credentials file was refused (fixed text: the file holds secrets).
#[derive(Debug, thiserror::Error)]
pub enum SecretsFileError {
    /// It cannot be opened or read, or is larger than 1 MiB.
    #[error("cannot read the credentials file")]
    Unreadable,
    /// Someone else can read it, or it is not ours.
    #[error("the credentials file must be owned by this user and not readable by others (chmod 600)")]
    Exposed,
    /// It is not a JSON list of credentials.
    #[error("the credentials file is not a JSON list of {{name, value, hosts, inject?, in_url?}}")]
    Malformed,
    /// A credential in it is not valid.
    #[error("the credentials file: {0}")]
    Invalid(#[from] SecretError),
}

/// The credentials as the driver API carries them.
pub fn to_api(list: Vec<SecretCredential>) -> Vec<vm_protocol::driver_api::Credential> {
    list.into_iter()
        .map(|c| vm_protocol::driver_api::Credential {
            name: c.name,
            value: c.value,
            hosts: c.hosts.iter().map(ToString::to_string).collect(),
            inject: c.inject.map(|i| vm_protocol::driver_api::CredentialInject { header: i.header, format: i.format }),
            in_url: c.in_url,
        })
        .collect()
}

/// Reads and checks the credentials file at `path`.
///
/// # Errors
/// [`SecretsFileError`].
pub fn read_file(path: &Path) -> Result<Vec<SecretCredential>, SecretsFileError> {
    let file = std::fs::File::open(path).map_err(|_| SecretsFileError::Unreadable)?;
    let meta = file.metadata().map_err(|_| SecretsFileError::Unreadable)?;
    if !meta.is_file() {
        return Err(SecretsFileError::Unreadable);
    }
    if meta.mode() & 0o077 != 0 || meta.uid() != rustix::process::geteuid().as_raw() {
        return Err(SecretsFileError::Exposed);
    }
    let mut text = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut text).map_err(|_| SecretsFileError::Unreadable)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(SecretsFileError::Unreadable);
    }
    let list: Vec<SecretCredential> = serde_json::from_slice(&text).map_err(|_| SecretsFileError::Malformed)?;
    SecretCredential::validate_all(&list)?;
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_a_private_valid_file_is_read_and_no_error_shows_a_value() {
        let dir = std::env::temp_dir().join(format!("secrets-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("creds.json");
        let good = r#"[{"name": "KEY", "value": "sk-c4nary", "hosts": ["api.example.com"],
            "inject": {"header": "Authorization", "format": "Bearer {}"}}]"#;
        std::fs::write(&path, good).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(read_file(&path), Err(SecretsFileError::Exposed)));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_file(&path).unwrap()[0].name, "KEY");
        for bad in [r#"{"name": "K"}"#, r#"[{"name": "K", "value": "sk-c4nary", "hosts": []}]"#, "sk-c4nary"] {
            std::fs::write(&path, bad).unwrap();
            let e = read_file(&path).unwrap_err().to_string();
            assert!(!e.contains("sk-c4nary"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

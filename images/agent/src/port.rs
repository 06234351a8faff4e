//! Finding and opening the virtio-serial port that carries the boundary channel.
//!
//! Opening `/dev/vportNpM` right after `virtio_console` loads can fail with ENXIO, so we wait until the
//! port's name shows up in sysfs and retry the open until a deadline.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

const SYSFS_PORTS: &str = "/sys/class/virtio-ports";
const POLL_MS: u64 = 1;

/// Why the channel could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// No port with that name appeared in time.
    #[error("no virtio port named {name} appeared within {waited_ms} ms")]
    NotFound {
        /// The port name we looked for.
        name: String,
        /// How long we waited.
        waited_ms: u128,
    },
    /// The port exists but could not be opened.
    #[error("cannot open {path}")]
    Open {
        /// The device node.
        path: PathBuf,
        /// The last error.
        #[source]
        source: io::Error,
    },
}

/// Waits for the port called `name`, then opens it for reading and writing.
///
/// # Errors
/// [`PortError`] when the port does not appear or open before `timeout`.
pub fn open(name: &str, timeout: Duration) -> Result<File, PortError> {
    let start = Instant::now();
    let deadline = start + timeout;
    let path = loop {
        if let Some(dev) = find(name) {
            break PathBuf::from("/dev").join(dev);
        }
        if Instant::now() >= deadline {
            return Err(PortError::NotFound { name: name.into(), waited_ms: start.elapsed().as_millis() });
        }
        thread::sleep(Duration::from_millis(POLL_MS));
    };
    loop {
        match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => return Ok(file),
            Err(source) if Instant::now() >= deadline => return Err(PortError::Open { path, source }),
            Err(_) => thread::sleep(Duration::from_millis(POLL_MS)),
        }
    }
}

/// The device name (`vport0p1`) of the port called `name`, if it exists yet.
fn find(name: &str) -> Option<String> {
    fs::read_dir(SYSFS_PORTS).ok()?.flatten().find_map(|entry| {
        let found = fs::read_to_string(entry.path().join("name")).ok()?;
        (found.trim_end() == name).then(|| entry.file_name().to_string_lossy().into_owned())
    })
}

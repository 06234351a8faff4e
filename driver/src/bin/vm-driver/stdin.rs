//! This process's stdin, read on a dedicated thread (a blocking read cannot be cancelled, so it must not hold
//! up the runtime) into a small bounded queue.

use tokio::sync::mpsc;
use vm_protocol::frame::MAX_DATA_BYTES;

/// Chunks of stdin; the channel closing is EOF. An unreadable stdin is treated as an empty one.
pub fn chunks() -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(4);
    let spawned = std::thread::Builder::new().name("stdin".into()).spawn(move || {
        use std::io::Read;
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; MAX_DATA_BYTES];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    });
    if spawned.is_err() {
        tracing::warn!("cannot start the stdin thread; the process gets an empty stdin");
    }
    rx
}

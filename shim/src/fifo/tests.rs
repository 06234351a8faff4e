use std::time::Duration;

use super::*;

fn fifo(dir: &std::path::Path, name: &str) -> String {
    let path = dir.join(name);
    let made = std::process::Command::new("mkfifo").arg(&path).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo");
    path.display().to_string()
}

/// A client whose stdin is a new FIFO in `dir`: the client, its requests' sender, the FIFO's path.
fn with_stdin(dir: &std::path::Path) -> (FifoClient, mpsc::Sender<FromClient>, String) {
    let stdio = Stdio { stdin: fifo(dir, "stdin"), ..Stdio::default() };
    let (requests, rx) = mpsc::channel(4);
    let (started, _) = oneshot::channel();
    (FifoClient::open(&stdio, rx, started).unwrap(), requests, stdio.stdin)
}

async fn read_to_end(client: &mut FifoClient) -> Vec<u8> {
    let mut got = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(10), client.next(true)).await {
            Ok(FromClient::Stdin(bytes)) => got.extend(bytes),
            Ok(FromClient::StdinEof) => return got,
            other => panic!("stdin neither data nor its end: {other:?}"),
        }
    }
}

/// ctr writes its last stdin bytes, closes the FIFO, then asks `CloseIO`; the request may be taken before a
/// byte was read (here, by a turn of the session without credit for stdin). The bytes still come first.
#[tokio::test]
async fn stdin_written_before_close_io_is_read_before_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let (mut client, requests, path) = with_stdin(dir.path());
    tokio::task::spawn_blocking(move || std::fs::write(path, b"last words")).await.unwrap().unwrap();
    requests.send(FromClient::StdinEof).await.unwrap();
    // Without credit, only the request is read; the session then gives up this turn.
    let early = tokio::time::timeout(Duration::from_millis(300), client.next(false)).await;
    assert!(early.is_err(), "stdin ended before its bytes were read: {early:?}");
    assert_eq!(read_to_end(&mut client).await, b"last words");
}

/// `CloseIO` for a stdin whose writer never came ends it at once, and lets the blocked open go.
#[tokio::test]
async fn close_io_without_a_writer_ends_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let (mut client, requests, _) = with_stdin(dir.path());
    requests.send(FromClient::StdinEof).await.unwrap();
    assert_eq!(read_to_end(&mut client).await, b"");
}

/// Output is written to its FIFO before it counts as delivered; a terminal's has no stderr.
#[tokio::test]
async fn output_reaches_its_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let stdio = Stdio { stdout: fifo(dir.path(), "stdout"), ..Stdio::default() };
    let mut reader = pipe::OpenOptions::new().open_receiver(&stdio.stdout).unwrap();
    let (_requests, rx) = mpsc::channel(4);
    let (started, pid) = oneshot::channel();
    let mut client = FifoClient::open(&stdio, rx, started).unwrap();
    assert_eq!(client.next(true).await, FromClient::StdinEof, "no stdin FIFO: stdin is empty");
    assert_eq!(client.deliver(ToClient::Started { pid: 7, reattached: false }).await, Ok(0));
    assert_eq!(pid.await, Ok(Ok(7)));
    assert_eq!(client.deliver(ToClient::Output(Stream::Stdout, b"hello".to_vec())).await, Ok(5));
    assert_eq!(client.deliver(ToClient::Output(Stream::Stderr, b"dropped".to_vec())).await, Ok(7));
    let mut got = [0; 5];
    reader.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello");
}

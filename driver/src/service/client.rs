//! How a client reaches `vm-driver serve`: over its Unix socket, with the `localhost` authority stock gRPC
//! servers expect.

use std::path::{Path, PathBuf};

use tonic::transport::{Channel, Endpoint, Uri};
use vm_protocol::driver_api::driver_client::DriverClient;

/// The default API socket: `$VM_DRIVER_SOCKET`, else `driver.sock` in the default state directory.
pub fn default_socket() -> PathBuf {
    std::env::var_os("VM_DRIVER_SOCKET")
        .filter(|v| !v.is_empty())
        .map_or_else(|| crate::state::default_root().join("driver.sock"), PathBuf::from)
}

/// Connects to `serve` over its Unix socket.
///
/// # Errors
/// The socket does not answer.
pub async fn connect(socket: &Path) -> Result<DriverClient<Channel>, tonic::transport::Error> {
    Ok(DriverClient::new(channel(socket).await?))
}

/// A gRPC channel to a Unix socket of `serve` (the API's, or the ComputeDriver's).
///
/// # Errors
/// The socket does not answer.
pub async fn channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = socket.to_owned();
    // The URI is required by the API but unused: the connector always dials the socket.
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
}

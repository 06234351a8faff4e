//! containerd's CRI plugin as kubelet drives it: a client of the CRI API (`runtime.v1`, generated from the
//! vendored `proto/cri/api.proto`) on the socket of a [`Containerd`] started with
//! [`Containerd::start_cri`].

use tonic::transport::Channel;

use crate::containerd::Containerd;

/// The CRI API's messages and clients.
#[allow(
    missing_docs,
    unused_qualifications,
    clippy::all,
    clippy::pedantic,
    reason = "generated from the vendored CRI proto"
)]
pub mod api {
    tonic::include_proto!("runtime.v1");
}

use api::image_service_client::ImageServiceClient;
use api::runtime_service_client::RuntimeServiceClient;

/// A connected CRI client.
#[derive(Debug, Clone)]
pub struct Cri {
    /// Pods, containers, exec.
    pub runtime: RuntimeServiceClient<Channel>,
    /// Image pulls.
    pub images: ImageServiceClient<Channel>,
}

impl Cri {
    /// Connects to `containerd`'s CRI.
    pub async fn connect(containerd: &Containerd) -> Self {
        let channel = vm_driver::service::client::channel(&containerd.socket).await.expect("containerd's socket");
        Self { runtime: RuntimeServiceClient::new(channel.clone()), images: ImageServiceClient::new(channel) }
    }

    /// Pulls `reference` through the CRI (with containerd's registry hosts configuration).
    pub async fn pull(&mut self, reference: &str) {
        let image = api::ImageSpec { image: reference.to_owned(), ..Default::default() };
        let request = api::PullImageRequest { image: Some(image), ..Default::default() };
        let pulled = self.images.pull_image(request).await;
        assert!(pulled.is_ok(), "CRI PullImage {reference}: {pulled:?}");
    }
}

//! The SSH server on the gateway's relays: what arrives on a relay is SSH-2 (the gateway's own exec is a
//! russh client, `openshell sandbox connect|upload|download|forward` is OpenSSH), and this server is bound
//! to nothing else: no socket, no port, only a relay's bytes.
//!
//! Authentication is `none`, as upstream's in-guest server: the relay is the credential (the gateway
//! authorised the user, and only this sandbox's supervisor, with the gateway's token, claims its relays).
//! The host key is made anew at each supervisor start and never stored.
//!
//! | SSH | here |
//! |---|---|
//! | `session` + `pty-req`, `env`, `exec`, `shell` | a boundary process ([`process`]) through the policy gate |
//! | `window-change`, `signal`, `data`, `eof` | resize, signal, stdin, stdin's end |
//! | `subsystem openshell-main` | the main process, replayed then live ([`main_attach`]) |
//! | `direct-tcpip` to the guest's loopback | a port-forward stream (`crate::gateway::forward`) |
//! | anything else | refused |
//!
//! Bounds: [`MAX_CHANNELS`] channels open at once per connection (more are refused); each connection is one
//! attach client, so the boundary's own bounds hold (places, queues, credit).

pub mod main_attach;
pub mod process;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use russh::server::{Auth, ChannelOpenHandle, Msg, Session};
use russh::{Channel, ChannelId, ChannelOpenFailure, Sig};
use vm_protocol::SignalName;

use super::attach::Attach;
use super::main_process::MainSession;

/// The subsystem that attaches to the main process.
pub const MAIN_SUBSYSTEM: &str = "openshell-main";
/// Channels open at once on one connection.
pub const MAX_CHANNELS: usize = 16;
/// How long a relay has to begin speaking SSH.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// A connection with nothing open for this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// What every relayed SSH connection of this sandbox shares.
#[derive(Debug)]
pub struct Shared {
    config: Arc<russh::server::Config>,
    /// The main process, once started.
    pub main: Option<MainSession>,
    /// The sandbox's environment, for every process.
    pub env: Arc<[(String, String)]>,
}

impl Shared {
    /// The server's settings with a fresh Ed25519 host key from `seed` (32 random bytes).
    pub fn new(seed: [u8; 32], main: Option<MainSession>, env: Vec<(String, String)>) -> Self {
        let keypair = russh::keys::ssh_key::private::Ed25519Keypair::from_seed(&seed);
        let config = russh::server::Config {
            keys: vec![russh::keys::PrivateKey::from(keypair)],
            methods: russh::MethodSet::from(&[russh::MethodKind::None][..]),
            auth_rejection_time: Duration::from_millis(100),
            auth_rejection_time_initial: Some(Duration::ZERO),
            inactivity_timeout: Some(IDLE_TIMEOUT),
            keepalive_interval: Some(Duration::from_secs(15)),
            keepalive_max: 4,
            nodelay: true,
            ..Default::default()
        };
        Self { config: Arc::new(config), main, env: env.into() }
    }
}

/// Serves one SSH connection on `stream` (a relay's bytes) until it ends, as the attach client `attach`.
pub async fn serve<S>(shared: Arc<Shared>, attach: Attach, stream: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let handler = Connection { shared: Arc::clone(&shared), attach, open: Arc::new(AtomicUsize::new(0)) };
    // The version exchange has no bound of its own: a relay that never speaks SSH is let go.
    let started =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, russh::server::run_stream(Arc::clone(&shared.config), stream, handler));
    match started.await {
        Ok(Ok(session)) => {
            let _ = session.await;
        }
        Ok(Err(e)) => tracing::debug!(error = %e, "a relayed SSH connection failed at its start"),
        Err(_) => tracing::debug!("a relay never spoke SSH; closed"),
    }
}

/// One connection's handler.
struct Connection {
    shared: Arc<Shared>,
    attach: Attach,
    /// Channels open now.
    open: Arc<AtomicUsize>,
}

impl Connection {
    /// Takes a place for a new channel; `None` when [`MAX_CHANNELS`] are open.
    fn place(&self) -> Option<Place> {
        let taken = self.open.fetch_add(1, Ordering::AcqRel);
        if taken >= MAX_CHANNELS {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Place(Arc::clone(&self.open)))
    }
}

/// A channel's place, given back when its task ends.
struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl russh::server::Handler for Connection {
    type Error = russh::Error;

    async fn auth_none(&mut self, _user: &str) -> Result<Auth, Self::Error> {
        Ok(Auth::Accept)
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(place) = self.place() else {
            reply.reject(ChannelOpenFailure::ResourceShortage).await;
            return Ok(());
        };
        reply.accept().await;
        let (shared, attach) = (Arc::clone(&self.shared), self.attach.clone());
        tokio::spawn(async move {
            session_channel(channel, shared, attach).await;
            drop(place);
        });
        Ok(())
    }

    async fn channel_open_direct_tcpip(
        &mut self,
        channel: Channel<Msg>,
        host_to_connect: &str,
        port_to_connect: u32,
        _originator_address: &str,
        _originator_port: u32,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        let port = u16::try_from(port_to_connect).ok().filter(|p| *p > 0);
        let (Some(port), true) = (port, super::forward::loopback(host_to_connect)) else {
            reply.reject(ChannelOpenFailure::AdministrativelyProhibited).await;
            return Ok(());
        };
        let Some(place) = self.place() else {
            reply.reject(ChannelOpenFailure::ResourceShortage).await;
            return Ok(());
        };
        reply.accept().await;
        let attach = self.attach.clone();
        tokio::spawn(async move {
            // A refusal after the open can only close the channel: the stream's end tells the client.
            let _ = super::forward::forward(&attach, port, channel.into_stream()).await;
            drop(place);
        });
        Ok(())
    }

    async fn pty_request(
        &mut self,
        channel: ChannelId,
        _term: &str,
        _cols: u32,
        _rows: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(russh::Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn env_request(
        &mut self,
        channel: ChannelId,
        _name: &str,
        _value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        // Answered as upstream's server does; the channel applies only the names it may (`process::env_ok`).
        session.channel_success(channel)
    }

    async fn shell_request(&mut self, channel: ChannelId, session: &mut Session) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        _data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn subsystem_request(
        &mut self,
        channel: ChannelId,
        name: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        if name == MAIN_SUBSYSTEM && self.shared.main.is_some() {
            session.channel_success(channel)
        } else {
            session.channel_failure(channel)
        }
    }

    async fn window_change_request(
        &mut self,
        channel: ChannelId,
        _cols: u32,
        _rows: u32,
        _pix_width: u32,
        _pix_height: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }
}

/// A session channel: its setup, then the process or the main process it asked for.
async fn session_channel(mut channel: Channel<Msg>, shared: Arc<Shared>, attach: Attach) {
    let Some((setup, request)) = process::setup(&mut channel).await else {
        let _ = channel.close().await;
        return;
    };
    if let process::Request::Main = request {
        match shared.main.clone() {
            Some(main) => main_attach::run(channel, main, setup).await,
            None => {
                let _ = channel.close().await;
            }
        }
        return;
    }
    let Some((id, route)) = attach.process() else {
        let (_, write) = channel.split();
        let _ = process::end(&write, "the sandbox is gone", 255).await;
        return;
    };
    let spawn = process::spawn(id, &request, &setup, &shared.env);
    process::run(channel, attach, spawn, route).await;
}

/// An SSH signal as one of ours, for those a workload may be sent.
pub fn signal_name(sig: &Sig) -> Option<SignalName> {
    Some(match sig {
        Sig::HUP => SignalName::Hup,
        Sig::INT => SignalName::Int,
        Sig::QUIT => SignalName::Quit,
        Sig::KILL => SignalName::Kill,
        Sig::TERM => SignalName::Term,
        Sig::USR1 => SignalName::Usr1,
        Sig::ALRM => SignalName::Alrm,
        Sig::PIPE => SignalName::Pipe,
        Sig::Custom(name) => return SignalName::ALL.iter().copied().find(|s| s.name().eq_ignore_ascii_case(name)),
        _ => return None,
    })
}

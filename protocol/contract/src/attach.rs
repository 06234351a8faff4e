//! The supervisor's attach socket, as the driver may use it.

/// Clients a supervisor's attach socket admits at once. Every `Exec` stream of `vm-driver serve` is one
/// client, so `serve` never admits more streams into one sandbox than this; one more is refused by the
/// supervisor, and the driver reports its own limit before that can happen.
pub const MAX_CLIENTS: usize = 256;

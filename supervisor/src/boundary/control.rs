//! The requests the supervisor answers itself: pings, policy updates, and credential rotations. Processes'
//! own requests (re-attach, listing, detach, a refused tar) are the process router's.

use vm_protocol::attach::{SupervisorReply, ToClient};
use vm_protocol::credentials::{CredentialRotation, RotationOutcome};
use vm_protocol::policy::{PolicyUpdate, UpdateOutcome};

use super::{Boundary, ClientId, Note, Outgoing, Output};

impl Boundary {
    pub(super) fn ping(client: ClientId, nonce: u64, out: &mut Output) {
        out.sends.push(Outgoing::ToClient(client, ToClient::Pong { nonce }));
    }

    /// A policy update: applied in order with dispatch (every operation handled before it is already
    /// dispatched, so the acknowledgment follows it), then egress follows the new rules. Under the
    /// `unserialized-policy` control it is acknowledged now and applied only after the next message.
    pub(super) fn update_policy(&mut self, client: ClientId, update: PolicyUpdate, out: &mut Output) {
        let revision = update.revision;
        let outcome = if self.rules.serialized_policy {
            self.gate.update(&update)
        } else {
            self.late_update = Some(update);
            UpdateOutcome::Applied
        };
        out.notes.push(Note::PolicyUpdated { revision, outcome, allowed: self.gate.allowed() });
        out.sends.push(Outgoing::ToClient(client, SupervisorReply::PolicyAck { revision, outcome }.into()));
        self.publish_rules(out);
    }

    /// A rotation: the collector's part and the credentials, each all or nothing; the credentials' names are
    /// checked before the collector's part is swapped, so an unknown name changes nothing. The collector's
    /// part belongs to the telemetry (it reads a CA file): the caller does it and hands back its outcome
    /// ([`super::Input::CollectorRotated`]).
    pub(super) fn rotate(&mut self, client: ClientId, rotation: CredentialRotation, out: &mut Output) {
        let secrets = rotation.secrets.as_deref();
        if secrets.is_some_and(|s| !self.secrets.holds(s)) {
            return Self::rotation_answered(client, RotationOutcome::UnknownSecret, out);
        }
        if rotation.headers.is_some() || rotation.ca_path.is_some() || secrets.is_none() {
            out.sends.push(Outgoing::RotateCollector(client, rotation));
            return;
        }
        self.rotate_secrets(client, &rotation, out);
    }

    /// The collector's part of `rotation` ended with `outcome`: the credentials follow if it was applied.
    pub(super) fn collector_rotated(
        &mut self,
        client: ClientId,
        rotation: &CredentialRotation,
        outcome: RotationOutcome,
        out: &mut Output,
    ) {
        if outcome != RotationOutcome::Applied {
            return Self::rotation_answered(client, outcome, out);
        }
        self.rotate_secrets(client, rotation, out);
    }

    fn rotate_secrets(&mut self, client: ClientId, rotation: &CredentialRotation, out: &mut Output) {
        let Some(secrets) = &rotation.secrets else {
            return Self::rotation_answered(client, RotationOutcome::Applied, out);
        };
        let outcome = self.secrets.rotate(secrets);
        let names = secrets.iter().map(|c| c.name.clone()).collect();
        out.notes.push(Note::SecretsRotated { outcome, names });
        Self::rotation_answered(client, outcome, out);
    }

    fn rotation_answered(client: ClientId, outcome: RotationOutcome, out: &mut Output) {
        out.notes.push(Note::RotationAnswered(outcome));
        out.sends.push(Outgoing::ToClient(client, SupervisorReply::CredentialsAck { outcome }.into()));
    }
}

//! How an image root asks its processes be run, applied to every request before the gate
//! (docs/images.md, "What of the image config is honoured").

use vm_contract::root::RunConfig;
use vm_protocol::message::EnvVar;
use vm_protocol::SignalName;

/// An image's defaults under a request, as Docker applies them: its command (the entrypoint, then the
/// request's arguments or the image's `Cmd`), its variables under the request's (the guest lets a later
/// value of a key win) and its working directory when the request names none.
pub(super) fn defaults(run: &RunConfig, spawn: &mut vm_protocol::Spawn) {
    if let Some(argv) = run.command(&spawn.argv) {
        spawn.argv = argv;
    }
    if !run.env.is_empty() {
        let own = std::mem::take(&mut spawn.env);
        spawn.env = run.env_pairs().map(|(key, value)| EnvVar { key: key.into(), value: value.into() }).collect();
        spawn.env.extend(own);
    }
    if spawn.cwd.is_none() {
        spawn.cwd.clone_from(&run.working_dir);
    }
}

/// What asks the workload to stop: the image's `StopSignal`, else SIGTERM (also for one outside the set
/// this product sends).
pub(super) fn stop_signal(run: &RunConfig) -> SignalName {
    run.stop_signal.as_deref().and_then(SignalName::parse_name_or_number).unwrap_or(SignalName::Term)
}

//! `serve`'s templates ([`crate::template`]): one is made in the background when a start of its kind finds
//! none, the saving VM holding a sandbox's share of the host (or none is made while there is no room).

use std::sync::Arc;

use super::context::Context;
use super::ledger::Ledger;
use crate::sandbox::VmSpec;
use crate::template::TemplateKey;

/// Makes the template of `key` from a VM like `vm`, in the background, within the host's capacity.
pub(crate) fn make(ctx: &Context, ledger: &Arc<Ledger>, key: TemplateKey, vm: VmSpec) {
    let (Some(templates), Ok(share)) = (ctx.templates.clone(), ledger.admit(vm.shape)) else { return };
    let state = ctx.state.clone();
    tokio::spawn(async move {
        if let Err(e) = templates.make(&key, &vm, &state).await {
            tracing::warn!(error = %vm_contract::logs::chain(&e), "no template made");
        }
        drop(share);
    });
}

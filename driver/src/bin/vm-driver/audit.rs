//! `vm-driver audit verify|show SANDBOX`: a sandbox's audit chain, recomputed from genesis against the
//! head kept outside its directory and its `events.jsonl` (docs/telemetry.md, "The audit chain").

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context as _, Result};
use vm_audit::verify::{describe, Report};
use vm_driver::audit::Target;

/// `vm-driver audit`.
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    #[command(subcommand)]
    pub action: Action,
}

/// What to do with the chain.
#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Recompute the chain and its seals, compare them with the head kept outside the sandbox directory
    /// and with events.jsonl, and print the first break. Exits 1 on any break; an unsealed chain (a
    /// supervisor that did not stop in order, or one still running) is said, and is not a break.
    Verify(Which),
    /// Print every entry (its event's line from events.jsonl where the file still has it), then verify.
    Show(Which),
}

/// A sandbox id (in the state directory) or a path (a sandbox directory, or an audit.db).
#[derive(Debug, clap::Args)]
pub struct Which {
    /// State directory.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// The sandbox id, or a path.
    pub sandbox: String,
}

impl Which {
    fn target(&self) -> Result<Target> {
        let path = PathBuf::from(&self.sandbox);
        if path.exists() {
            return Ok(Target::at(&path));
        }
        let id = vm_contract::ids::SandboxId::parse(&self.sandbox).context("neither a path nor a sandbox id")?;
        let state = self.state_dir.clone().unwrap_or_else(vm_driver::state::default_root);
        Ok(Target::at(&state.join("sandboxes").join(id.as_str())))
    }
}

/// Runs the action; the exit status is 1 on a break.
pub fn run(args: AuditArgs) -> Result<u8> {
    let (which, show) = match args.action {
        Action::Verify(w) => (w, false),
        Action::Show(w) => (w, true),
    };
    let target = which.target()?;
    if show {
        print!("{}", listing(&target)?);
    }
    let (report, anchor) = target.verify().with_context(|| target.db.display().to_string())?;
    match anchor {
        Some(head) => println!("head kept outside the sandbox directory: {}", head.to_attribute()),
        None => println!("no head kept outside the sandbox directory (never stopped in order, or not found)"),
    }
    print!("{}", describe(&report));
    Ok(exit(&report))
}

fn exit(report: &Report) -> u8 {
    u8::from(!report.intact())
}

/// Every entry, with its event's message where `events.jsonl` has the line.
fn listing(target: &Target) -> Result<String> {
    let entries = vm_audit::verify::entries(&target.db).with_context(|| target.db.display().to_string())?;
    let mut lines: HashMap<vm_audit::Hash, String> = HashMap::new();
    if let Some(dir) = &target.sandbox_dir {
        let events = std::fs::read(dir.join(vm_contract::layout::SandboxFile::Events.name())).unwrap_or_default();
        for line in events.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let message = serde_json::from_slice::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("message").and_then(|m| m.as_str()).map(str::to_owned))
                .unwrap_or_default();
            lines.insert(vm_audit::event_hash(line), message);
        }
    }
    let mut out = String::new();
    for e in entries {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(e.time_ms);
        let message = lines.get(&e.event_hash).map_or("(no line in events.jsonl)", String::as_str);
        let hash = vm_audit::hex(&e.hash);
        out.push_str(&format!(
            "{:>6}  {}  {:>4}  {}  {}\n",
            e.seq,
            humantime::format_rfc3339_millis(at),
            e.class,
            hash.get(..16).unwrap_or(&hash),
            message
        ));
    }
    Ok(out)
}

//! `vm-agent`: PID 1 of the guest. Brings the guest up, serves one boundary link, powers off.
#![forbid(unsafe_code)]

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use vm_agent::{init, link, port, power};
use vm_protocol::CHANNEL_PORT_NAME;

/// How long to wait for the channel's port after the modules loaded.
const PORT_TIMEOUT_MS: u64 = 10_000;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let [_, mode, op] = args.as_slice() {
        if mode == vm_protocol::files::AGENT_FILES_MODE {
            return vm_agent::files::run(op);
        }
    }
    if std::process::id() != 1 {
        eprintln!("vm-agent: must run as PID 1 inside the guest; refusing (it powers the machine off)");
        return ExitCode::from(2);
    }
    power::install_panic_hook();
    if let Err(e) = run() {
        eprintln!("vm-agent: {}", chain(e.as_ref()));
    }
    power::off()
}

fn run() -> Result<(), Box<dyn Error>> {
    init::boot()?;
    let port = port::open(CHANNEL_PORT_NAME, Duration::from_millis(PORT_TIMEOUT_MS))?;
    let writer = port.try_clone()?;
    let end = link::serve(port, writer, &link::Config { own_kernel: true, ..link::Config::default() })?;
    eprintln!("vm-agent: the link ended ({end:?}); powering off");
    Ok(())
}

/// The error and its causes, outermost first.
fn chain(e: &dyn Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

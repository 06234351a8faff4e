//! `vm-supervisor`: runs one microVM for `vm-driver`.
//!
//! Exit status: 0 after an orderly stop (SIGTERM); 1 when the VM never became ready; 2 for a bad command
//! line; 3 when the VM stopped on its own or broke the protocol; 4 when the driver went away (liveness EOF);
//! 5 when the lease with the watchdog was lost; 6 when the driver refused the session. In every case the VMM
//! has exited.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use vm_supervisor::config::SupervisorConfig;
use vm_supervisor::supervisor;
use vm_supervisor::telemetry::console::Console;

fn main() -> ExitCode {
    // `vm-supervisor --probe-accel auto|kvm|tcg`: print the accelerator status line for this host and exit,
    // so the driver reports the same choice the supervisor would make.
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--probe-accel") {
        return probe(args.get(2).map_or("auto", String::as_str));
    }
    let config = SupervisorConfig::parse();
    #[cfg(feature = "test-controls")]
    {
        use vm_contract::test_control::{announcement, TestControl};
        eprintln!("{}", announcement("vm-supervisor"));
        if TestControl::SupervisorExitsAtStart.is_on() {
            return ExitCode::from(1);
        }
    }
    // Everything the supervisor and QEMU create is private to this user.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    let console = Console::start();
    vm_supervisor::diagnostics::init(console.handle());
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vm-supervisor: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(supervisor::run(config, console)) {
        Ok(reason) => {
            if reason != supervisor::StopReason::Terminated {
                tracing::warn!(?reason, "the sandbox ended without an orderly stop");
            }
            ExitCode::from(reason.exit_code())
        }
        Err(_) => ExitCode::from(1),
    }
}

fn probe(choice: &str) -> ExitCode {
    use clap::ValueEnum;
    use vm_protocol::status::SupervisorStatus;
    let Ok(choice) = vm_supervisor::accel::AccelChoice::from_str(choice, true) else { return ExitCode::from(2) };
    match vm_supervisor::accel::Host::default().choose(choice) {
        Ok((accel, fallback)) => {
            let line = SupervisorStatus::Accelerator { accel, fallback: fallback.map(|w| w.to_string()) }.to_line();
            print!("{line}");
            ExitCode::SUCCESS
        }
        Err(why) => {
            print!("{}", SupervisorStatus::Failed { error: why.to_string() }.to_line());
            ExitCode::from(1)
        }
    }
}

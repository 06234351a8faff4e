//! `vm-supervisor`: runs one microVM for `vm-driver`. Its arguments are `vm_contract::args::SupervisorArgs`;
//! its exit status is a `vm_contract::exit::SupervisorExit`. In every case the VMM has exited.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use vm_contract::args::{SupervisorArgs, PROBE_ACCEL};
use vm_contract::exit::SupervisorExit;
use vm_contract::status::SupervisorStatus;
use vm_supervisor::boot::accel::{AccelChoice, Host};
use vm_supervisor::safeguards::Safeguards;
use vm_supervisor::start;
use vm_supervisor::stop::StopReason;
use vm_supervisor::telemetry::console::Console;

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some(PROBE_ACCEL) {
        return probe(argv.get(2).map_or("auto", String::as_str));
    }
    let args = SupervisorArgs::parse();
    // A session of its own: a terminal's Ctrl-C reaches only the driver, and where the host has no CPU
    // cgroup for the sandbox, the kernel's autogroup schedules this sandbox (supervisor and QEMU) as one
    // group beside the host's other sessions; inside it QEMU runs niced, so the leash comes first.
    // (The driver cannot do this at spawn without `pre_exec`, which is unsafe; a Ctrl-C in the instant
    // before this line ends a start that has not booted anything yet, and the driver reports it.)
    if rustix::process::setsid().is_err() {
        eprintln!("vm-supervisor: WARNING: cannot start a session of its own; a terminal's Ctrl-C reaches it");
    }
    // The test controls, read here once: the core takes the safeguards they leave on as input.
    #[cfg(feature = "test-controls")]
    let safeguards = {
        use vm_contract::test_control::{announcement, TestControl};
        eprintln!("{}", announcement("vm-supervisor"));
        let active = TestControl::active();
        if active.contains(&TestControl::SupervisorExitsAtStart) {
            return ExitCode::from(SupervisorExit::StartFailed.code());
        }
        Safeguards::from_controls(&active)
    };
    #[cfg(not(feature = "test-controls"))]
    let safeguards = Safeguards::default();
    // Everything the supervisor and QEMU create is private to this user.
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o077));
    let console = Console::start();
    vm_supervisor::diagnostics::init(console.handle(), safeguards.quiet_failures);
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vm-supervisor: cannot start the runtime: {e}");
            return ExitCode::from(SupervisorExit::StartFailed.code());
        }
    };
    let run = async {
        if args.vm.pooled {
            start::pooled::run(args, &safeguards, console).await
        } else {
            start::cold::run(args, &safeguards, console).await
        }
    };
    let exit = match runtime.block_on(run) {
        Ok(reason) => {
            if reason != StopReason::Terminated {
                tracing::warn!(reason = %reason, "the sandbox ended without an orderly stop");
            }
            reason.exit()
        }
        Err(_) => SupervisorExit::StartFailed,
    };
    ExitCode::from(exit.code())
}

/// `vm-supervisor --probe-accel auto|kvm|tcg`: the accelerator status line for this host.
fn probe(choice: &str) -> ExitCode {
    let Ok(choice) = choice.parse::<AccelChoice>() else { return ExitCode::from(SupervisorExit::Usage.code()) };
    let line = match Host::default().choose(choice) {
        Ok((accel, fallback)) => SupervisorStatus::Accelerator { accel, fallback: fallback.map(|w| w.to_string()) },
        Err(why) => SupervisorStatus::Failed { error: why.to_string(), saved_state_refused: false },
    };
    print!("{}", line.to_line());
    match line {
        SupervisorStatus::Accelerator { .. } => ExitCode::SUCCESS,
        _ => ExitCode::from(SupervisorExit::StartFailed.code()),
    }
}

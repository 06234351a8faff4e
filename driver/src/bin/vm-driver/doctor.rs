//! `vm-driver doctor`: the host's report (`vm_driver::doctor`), for the places this command line names.

use std::path::PathBuf;

/// `vm-driver doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// State directory.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Guest image directory (default: the one `launch` boots).
    #[arg(long, value_name = "DIR")]
    pub image: Option<PathBuf>,
}

/// Prints the report; exits 1 when no sandbox could start here. Blocking.
pub fn run(args: DoctorArgs) -> u8 {
    let places = vm_driver::doctor::Places {
        state: args.state_dir.unwrap_or_else(vm_driver::state::default_root),
        image: args.image.map_or_else(|| vm_driver::image::default_dir().map_err(|e| e.to_string()), Ok),
        supervisor: vm_driver::sandbox::supervisor::locate().map_err(|e| e.to_string()),
        cache: vm_driver::image::cache_dir(),
    };
    let checks = vm_driver::doctor::run(&places);
    print!("{}", vm_driver::doctor::render(&checks));
    vm_driver::doctor::exit_code(&checks)
}

//! What a process that escaped into a VMM's place could do: run by the jail tests through `nsenter` with the
//! VMM's uid, gid, namespaces and root. Each attempt prints `NAME ok` or `NAME denied: ERROR`.
//!
//! Usage: escape-probe API_SOCKET OTHER_ATTACH_SOCKET DRIVER_PID SUPERVISOR_PID OTHER_VMM_PID OUTSIDE_FILE
//! LOOPBACK_TCP_ADDR HOST_LIBRARY_FILE
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::net::UnixStream;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [api, attach, driver, supervisor, vmm, outside, tcp, library] = args.as_slice() else {
        eprintln!("usage: escape-probe API ATTACH DRIVER_PID SUPERVISOR_PID VMM_PID OUTSIDE_FILE TCP_ADDR LIBRARY");
        std::process::exit(2);
    };
    let report = |name: &str, result: Result<(), String>| match result {
        Ok(()) => println!("{name} ok"),
        Err(e) => println!("{name} denied: {e}"),
    };
    report("connect-api", UnixStream::connect(api).map(drop).map_err(|e| e.to_string()));
    report("connect-other-attach", UnixStream::connect(attach).map(drop).map_err(|e| e.to_string()));
    for (name, pid) in [("read-driver-environ", driver), ("read-supervisor-environ", supervisor)] {
        report(name, std::fs::read(format!("/proc/{pid}/environ")).map(drop).map_err(|e| e.to_string()));
    }
    // A /proc (a template clone's jail has one) that lists the driver lists the host's processes.
    report(
        "see-driver-process",
        std::fs::metadata(format!("/proc/{driver}/stat")).map(drop).map_err(|e| e.to_string()),
    );
    let pid = nix::unistd::Pid::from_raw(vmm.parse().expect("a pid"));
    // SIGCONT: a real signal that does no harm to a running VMM.
    report("signal-other-vmm", nix::sys::signal::kill(pid, nix::sys::signal::SIGCONT).map_err(|e| e.to_string()));
    report("read-host-library", std::fs::read(library).map(drop).map_err(|e| e.to_string()));
    report("write-outside", std::fs::write(outside, b"escaped").map_err(|e| e.to_string()));
    let timeout = std::time::Duration::from_secs(2);
    let addr: std::net::SocketAddr = tcp.parse().expect("an address");
    report(
        "connect-loopback-tcp",
        std::net::TcpStream::connect_timeout(&addr, timeout).map(drop).map_err(|e| e.to_string()),
    );
}

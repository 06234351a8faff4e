//! Generates the driver API (gRPC) from `proto/` when the `grpc` feature is on, and OpenShell's vendored
//! contracts (`proto/openshell/`) when the `openshell` feature is. protox compiles the protos in Rust, so no
//! `protoc` is needed on the build machine.

#[cfg(not(feature = "grpc"))]
fn main() {}

#[cfg(feature = "grpc")]
fn main() {
    println!("cargo:rerun-if-changed=proto");
    let fds = match protox::compile(["vmdriver/v1/driver.proto"], ["proto"]) {
        Ok(fds) => fds,
        Err(e) => panic!("proto/vmdriver/v1/driver.proto does not compile: {e}"),
    };
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    if let Err(e) = std::fs::write(out.join("driver_descriptor.bin"), protox::prost::Message::encode_to_vec(&fds)) {
        panic!("cannot write the descriptor set: {e}");
    }
    if let Err(e) = tonic_prost_build::configure()
        // Header values are secrets: `driver_api.rs` gives this message a `Debug` that shows names only.
        .skip_debug([".vmdriver.v1.CollectorHeader", ".vmdriver.v1.Credential"])
        .compile_fds(fds)
    {
        panic!("cannot generate the gRPC code: {e}");
    }
    #[cfg(feature = "openshell")]
    openshell();
}

/// OpenShell's ComputeDriver service and the gateway's own (`openshell.v1.OpenShell`), clients and servers
/// both: the driver serves the first and the supervisor calls the second; the tests play the other ends.
#[cfg(feature = "openshell")]
fn openshell() {
    let files = ["compute_driver.proto", "openshell.proto"];
    let fds = match protox::compile(files, ["proto/openshell"]) {
        Ok(fds) => fds,
        Err(e) => panic!("proto/openshell does not compile: {e}"),
    };
    if let Err(e) = tonic_prost_build::configure()
        // The sandbox token is a secret: `openshell.rs` gives these a `Debug` without it.
        .skip_debug([".openshell.compute.v1.DriverSandboxSpec"])
        // A stand-in gateway (the tests) serves four of the gateway's 67 calls; the rest answer Unimplemented.
        .generate_default_stubs(true)
        .compile_fds(fds)
    {
        panic!("cannot generate OpenShell's gRPC code: {e}");
    }
}

//! Generates the tests' CRI client from the vendored CRI API (`proto/cri/`, see its SOURCE.md). protox
//! compiles the proto in Rust, so no `protoc` is needed.

fn main() {
    println!("cargo:rerun-if-changed=proto/cri");
    let fds = match protox::compile(["api.proto"], ["proto/cri"]) {
        Ok(fds) => fds,
        Err(e) => panic!("proto/cri/api.proto does not compile: {e}"),
    };
    if let Err(e) = tonic_prost_build::configure().build_server(false).compile_fds(fds) {
        panic!("cannot generate the CRI client: {e}");
    }
}

//! Compiles `proto/kvagent.proto` with the pure-Rust `protox` parser, so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/kvagent.proto");
    let fds = protox::compile(["proto/kvagent.proto"], ["proto"])?;
    tonic_prost_build::configure()
        // Payloads are shared between the RAM tier and responses without copying.
        .bytes(".")
        .compile_fds(fds)?;
    Ok(())
}

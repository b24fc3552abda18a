//! Compiles `proto/kiln/v1/*.proto` with `protox` (pure Rust: no system `protoc`) into tonic
//! clients and servers, and keeps the encoded descriptor set for server reflection.

use std::path::PathBuf;

use prost::Message;

const FILES: &[&str] = &[
    "kiln/v1/common.proto",
    "kiln/v1/generate.proto",
    "kiln/v1/tokenize.proto",
    "kiln/v1/models.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    println!("cargo:rerun-if-changed={}", root.display());
    for f in FILES {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    let fds = protox::compile(FILES, [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("kiln_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}

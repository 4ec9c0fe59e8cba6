use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "api/common.proto",
    "api/session.proto",
    "api/harness.proto",
    "api/harness_registry.proto",
    "api/agentvm/guest/v1/guest.proto",
    "api/agentvm/node/v1/node.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // protoc comes from a registry crate so a fresh machine needs no system package.
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let include = protoc_bin_vendored::include_path()?;
    let include = include.to_str().ok_or("protoc include path is not UTF-8")?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", &protoc) };

    // Type names let the canonical-JSON code find each message's descriptor by `prost::Name`.
    let mut config = prost_build::Config::new();
    config.enable_type_names();

    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        // The Harness RPC `Connect` would collide with the transport constructor `connect`;
        // clients are built from a Channel with `new` instead.
        .build_transport(false)
        .include_file("protos.rs")
        .file_descriptor_set_path(out.join("descriptor.bin"))
        .compile_with_config(config, PROTOS, &["api", include])?;
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}

//! Compiles the package `trainyard.v1` (`proto/trainyard/v1/*.proto`: the spec, the two
//! services and the preflight report they share) with the protoc that the `protoc-bin-vendored`
//! crate ships, so a fresh machine needs no system protobuf compiler.

/// Messages that are also JSON records: a diagnosis and a comparison, with their parts.
const JSON_RECORDS: [&str; 10] = [
    "Diagnosis",
    "Finding",
    "Measure",
    "RankScore",
    "NodePace",
    "Comparison",
    "Difference",
    "JobSide",
    "PlacedNode",
    "Distribution",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment here.
    unsafe { std::env::set_var("PROTOC", protoc) };
    // Clients and servers only with the `grpc` feature: the messages alone need prost only.
    // No transport helpers: the `Connect` rpc would clash with the client's `connect` constructor;
    // callers build a `tonic::transport::Channel` and pass it to `XxxClient::new`.
    let grpc = std::env::var_os("CARGO_FEATURE_GRPC").is_some();
    // The analysis records `ctl -o json` and the web view print are these messages, serialised
    // as they are (one type end to end; field names are part of both interfaces).
    let mut config = tonic_prost_build::configure();
    for record in JSON_RECORDS {
        config = config.message_attribute(format!(".trainyard.v1.{record}"), "#[derive(serde::Serialize)]");
    }
    config
        .btree_map(".trainyard.v1.JobSide.provenance")
        .build_client(grpc)
        .build_server(grpc)
        .build_transport(false)
        .compile_protos(
            &[
                "proto/trainyard/v1/spec.proto",
                "proto/trainyard/v1/jobs.proto",
                "proto/trainyard/v1/agents.proto",
                "proto/trainyard/v1/preflight.proto",
            ],
            &["proto"],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}

//! The engine binary must really load `libtorch_cuda.so`: with the linker's default
//! `--as-needed` it is dropped (nothing references its symbols), libtorch never registers its
//! CUDA backend and `Cuda::is_available()` is false even on a GPU host. Takes about a second.
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_trainyard-engine");

fn torch_lib() -> Option<String> {
    let out = Command::new(BIN).arg("info").output().expect("run trainyard-engine info");
    assert!(out.status.success(), "info failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("info prints JSON");
    v["torch_lib"].as_str().map(str::to_string)
}

#[test]
fn binary_lists_libtorch_cuda_as_needed_library() {
    let lib = torch_lib().expect("torch_lib in info");
    if !Path::new(&lib).join("libtorch_cuda.so").exists() {
        eprintln!("libtorch at {lib} is CPU-only; nothing to check");
        return;
    }
    let Ok(out) = Command::new("readelf").args(["-d", BIN]).output() else {
        eprintln!("readelf not installed; the runtime check below still runs");
        return;
    };
    let dynamic = String::from_utf8_lossy(&out.stdout);
    assert!(
        dynamic.contains("[libtorch_cuda.so]"),
        "libtorch_cuda.so is not a NEEDED entry of the engine binary:\n{dynamic}"
    );
    assert!(dynamic.contains(&lib), "rpath does not name {lib}:\n{dynamic}");
}

#[test]
fn binary_loads_libtorch_cuda_and_sees_gpus_when_present() {
    let out = Command::new(BIN).arg("info").output().expect("run info");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("info JSON");
    let lib = v["torch_lib"].as_str().unwrap_or_default();
    if Path::new(lib).join("libtorch_cuda.so").exists() {
        assert_eq!(v["libtorch_cuda_loaded"], true, "libtorch_cuda.so not mapped: {v}");
    }
    // On a GPU host (driver present) CUDA must be usable through the same binary.
    if Path::new("/dev/nvidia0").exists() && Path::new("/dev/nvidiactl").exists() {
        assert_eq!(v["cuda_available"], true, "GPU host but CUDA unavailable: {v}");
        assert!(v["cuda_device_count"].as_i64().unwrap_or(0) > 0, "{v}");
    }
}

//! Link-time set-up for libtorch (see .cargo/config.toml and deploy/setup.sh).
//!
//! 1. `--no-as-needed -ltorch`: nothing in our code references a symbol of `libtorch_cuda.so`,
//!    so with the default `--as-needed` the linker drops it, libtorch never registers its CUDA
//!    backend and `tch::Cuda::is_available()` is false on a GPU host. Flags emitted by torch-sys
//!    do not reach our binaries; they must come from this crate's own build script.
//! 2. rpath: the wheel's `torch/lib` (and `.venv/nccl-lib`, where setup.sh links `libnccl.so` to
//!    the wheel's `libnccl.so.2` for cudarc), so the binaries and tests run without
//!    LD_LIBRARY_PATH. `tests/linking.rs` checks both on the built binary.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os == "linux" {
        if let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
            let lib = PathBuf::from(lib);
            println!("cargo:rustc-link-search=native={}", lib.display());
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
            println!("cargo:rustc-env=TRAINYARD_LIBTORCH_LIB={}", lib.display());
        }
        let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"));
        let nccl = manifest.join("..").join(".venv").join("nccl-lib");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", nccl.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        let cuda = std::env::var_os("DEP_TCH_LIBTORCH_LIB")
            .map(|lib| PathBuf::from(lib).join("libtorch_cuda.so").exists())
            .unwrap_or(false);
        if cuda {
            println!("cargo:rustc-link-arg=-ltorch_cuda");
        }
    }
    // Build revision for the launch receipt.
    let rev = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=TRAINYARD_BUILD_REV={rev}");
    println!("cargo:rerun-if-changed=../.git/logs/HEAD");
}

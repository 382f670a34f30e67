//! Link-time set-up for libtorch (see .cargo/config.toml and deploy/setup.sh).
//!
//! 1. `--no-as-needed -ltorch`: nothing in our code references a symbol of `libtorch_cuda.so`,
//!    so with the default `--as-needed` the linker drops it, libtorch never registers its CUDA
//!    backend and `tch::Cuda::is_available()` is false on a GPU host. Flags emitted by torch-sys
//!    do not reach our binaries; they must come from this crate's own build script.
//! 2. rpath: the wheel's `torch/lib` (and `.venv/nccl-lib`, where setup.sh links `libnccl.so` to
//!    the wheel's `libnccl.so.2` for cudarc), so the binaries and tests run without
//!    LD_LIBRARY_PATH. `tests/linking.rs` checks both on the built binary.
//! 3. `csrc/gpu_memory.cpp`: a small C++17 shim (the `cc` crate) that reads the CUDA caching
//!    allocator's statistics, which tch does not expose (see `src/gpu_memory.rs`); and
//!    `csrc/fused_adamw.cpp`, libtorch's fused AdamW kernel, which tch does not bind either
//!    (see `src/fused_adamw.rs`); and `csrc/window_attention.cpp`, FlashAttention with a
//!    sliding window (see `src/attention.rs`); and `csrc/profiler.cpp`, libtorch's Kineto
//!    profiler (see `src/profiler.rs`); and `csrc/custom_op.cpp`, a libtorch autograd Function
//!    whose forward and backward call back into the engine (see `src/custom_op.rs`). Compiled
//!    against the wheel's c10 headers only (no CUDA toolkit headers: the wheel lacks
//!    `crt/host_config.h`), linked against the wheel's `libc10` and, when present,
//!    `libc10_cuda` (whose static initialiser registers the CUDA allocator). About a second.
use std::path::{Path, PathBuf};

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
        let c10_cuda = std::env::var_os("DEP_TCH_LIBTORCH_LIB")
            .map(|lib| PathBuf::from(lib).join("libc10_cuda.so").exists())
            .unwrap_or(false);
        if c10_cuda {
            println!("cargo:rustc-link-arg=-lc10_cuda");
        }
    }
    build_gpu_memory_shim();
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

/// Compiles the shims (`csrc/gpu_memory.cpp`, `csrc/fused_adamw.cpp`, `csrc/window_attention.cpp`) into a static library of
/// this crate and links `c10` and `torch_cpu`.
fn build_gpu_memory_shim() {
    println!("cargo:rerun-if-changed=csrc/gpu_memory.cpp");
    let lib = std::env::var_os("DEP_TCH_LIBTORCH_LIB")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("LIBTORCH").map(|t| PathBuf::from(t).join("lib")))
        .expect("libtorch location: torch-sys sets DEP_TCH_LIBTORCH_LIB (see .cargo/config.toml)");
    let include = lib.parent().unwrap_or(Path::new("/")).join("include");
    assert!(
        include.join("c10/core/CachingDeviceAllocator.h").exists(),
        "{} lacks c10/core/CachingDeviceAllocator.h: libtorch must be the torch 2.11 wheel \
         (run deploy/setup.sh)",
        include.display()
    );
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    // The wheel's headers as system headers: their own warnings are not ours to print.
    println!("cargo:rerun-if-changed=csrc/fused_adamw.cpp");
    println!("cargo:rerun-if-changed=csrc/window_attention.cpp");
    println!("cargo:rerun-if-changed=csrc/ffi_error.h");
    println!("cargo:rerun-if-changed=csrc/profiler.cpp");
    println!("cargo:rerun-if-changed=csrc/custom_op.cpp");
    cc::Build::new()
        .cpp(true)
        .file("csrc/gpu_memory.cpp")
        .file("csrc/fused_adamw.cpp")
        .file("csrc/window_attention.cpp")
        .file("csrc/profiler.cpp")
        .file("csrc/custom_op.cpp")
        .std("c++17")
        .flag("-isystem")
        .flag(include.to_str().expect("utf-8 libtorch path"))
        .flag("-isystem")
        .flag(include.join("torch/csrc/api/include").to_str().expect("utf-8 libtorch path"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .warnings(true)
        .extra_warnings(true)
        .compile("trainyard_gpu_memory");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=c10");
    // fused_adamw.cpp calls into ATen's operator registry.
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
}

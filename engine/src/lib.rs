//! trainyard's built-in training engine: a nanochat-class GPT on tch.

pub mod collectives;
pub mod config;
pub mod data;
pub mod fused_adamw;
pub mod gpu_memory;
pub mod model;
pub mod optim;
pub mod train;

use serde::Serialize;

/// Facts about the libtorch this process loaded; the `info` subcommand prints them and the
/// launch receipt carries them.
#[derive(Debug, Clone, Serialize)]
pub struct RuntimeInfo {
    pub build_rev: String,
    pub torch_lib: String,
    /// Whether `libtorch_cuda.so` is mapped into this process (the `--as-needed` trap drops it).
    pub libtorch_cuda_loaded: bool,
    pub cuda_available: bool,
    pub cuda_device_count: i64,
    pub cudnn_available: bool,
}

pub fn runtime_info() -> RuntimeInfo {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    RuntimeInfo {
        build_rev: option_env!("TRAINYARD_BUILD_REV").unwrap_or("unknown").to_string(),
        torch_lib: option_env!("TRAINYARD_LIBTORCH_LIB").unwrap_or("").to_string(),
        libtorch_cuda_loaded: maps.contains("libtorch_cuda.so"),
        cuda_available: tch::Cuda::is_available(),
        cuda_device_count: tch::Cuda::device_count(),
        cudnn_available: tch::Cuda::cudnn_is_available(),
    }
}

//! trainyard's built-in training engine: a nanochat-class GPT on tch, one process per rank,
//! writing schema-v1 receipts (docs/engine.md).
//!
//! # Parts
//! - The run: [`train`] (the per-rank loop: steps, evaluation, checkpoints, exact resume),
//!   [`config`] (presets and settings, validated first), [`launch`] (the rank variables, the
//!   receipt writer, the launch receipt), [`data`] (token shards and deterministic batches),
//!   [`checkpoint`] (complete or absent, never half-written), [`clock`] (phase times without
//!   stopping the GPU), [`profiler`] (a Kineto trace of chosen steps), [`gpu_memory`] (the
//!   caching allocator's statistics).
//! - The model and its optimizer: [`model`] (the GPT), [`attention`] (causal, whole or sliding
//!   window), [`optim`] (Muon + AdamW with ZeRO-2), [`fused_adamw`] (libtorch's fused AdamW).
//! - Among ranks: [`collectives`] (TCP on CPU, NCCL on GPU).
//! - Own kernels, on a GPU: [`kernel_source`] (the CUDA C), [`kernels`] (NVRTC compile and
//!   launch), [`fused_loss`] (output layer and cross-entropy in chunks), [`block_kernels`] and
//!   [`fused_ops`] (the block's elementwise chains, forward and backward), [`custom_op`]
//!   (autograd ops whose passes call back into Rust).

pub mod attention;
pub mod block_kernels;
pub mod checkpoint;
pub mod clock;
pub mod collectives;
pub mod config;
pub mod custom_op;
pub mod data;
pub mod fused_adamw;
pub mod fused_loss;
pub mod fused_ops;
pub mod gpu_memory;
pub mod kernel_source;
pub mod kernels;
pub mod launch;
pub mod model;
pub mod optim;
pub mod profiler;
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
    /// The torch release of the loaded libtorch (`2.11.0+cu130`), read from the `version.py`
    /// of the wheel it comes from; `None` when that cannot be found.
    pub torch_version: Option<String>,
    /// The NVIDIA driver, from `/proc/driver/nvidia/version`; `None` without one.
    pub driver_version: Option<String>,
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
        torch_version: torch_version(&maps),
        driver_version: driver_version(),
    }
}

/// The torch version of the libtorch mapped into this process: `libtorch_cpu.so` lives in the
/// wheel's `torch/lib/`, next to `torch/version.py` which holds `__version__ = '...'`.
fn torch_version(maps: &str) -> Option<String> {
    let lib =
        maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.ends_with("/libtorch_cpu.so"))?;
    let torch_dir = std::path::Path::new(lib).parent()?.parent()?;
    version_py(&std::fs::read_to_string(torch_dir.join("version.py")).ok()?)
}

/// `__version__` of a torch `version.py`.
fn version_py(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.trim_start().starts_with("__version__"))?;
    let value = line.split_once('=')?.1.trim().trim_matches(|c| c == '\'' || c == '"');
    (!value.is_empty()).then(|| value.to_string())
}

/// The NVIDIA driver version, from `/proc/driver/nvidia/version`.
pub fn driver_version() -> Option<String> {
    driver_version_of(&std::fs::read_to_string("/proc/driver/nvidia/version").ok()?)
}

/// The first dotted number of the kernel module's version line, which reads "NVRM version:
/// NVIDIA UNIX x86_64 Kernel Module  570.86.15  ..." or, for the open module, "NVRM version:
/// NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  ...".
fn driver_version_of(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    let after = line.split("Kernel Module").nth(1)?;
    after
        .split_whitespace()
        .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

/// An NCCL version code as `ncclGetVersion` returns it (`22805`, or `2403` before 2.9) as
/// "2.28.5".
pub fn nccl_version_string(code: i32) -> String {
    let (major, minor, patch) = if code >= 10_000 {
        (code / 10_000, code / 100 % 100, code % 100)
    } else {
        (code / 1000, code / 100 % 10, code % 100)
    };
    format!("{major}.{minor}.{patch}")
}

/// A CUDA version as `cuDriverGetVersion` returns it (`12080`) as "12.8".
pub fn cuda_version_string(code: i32) -> String {
    format!("{}.{}", code / 1000, code % 1000 / 10)
}

#[cfg(test)]
mod version_tests {
    use super::*;

    #[test]
    fn versions_read_at_run_time() {
        assert_eq!(nccl_version_string(22805), "2.28.5");
        assert_eq!(nccl_version_string(2708), "2.7.8");
        assert_eq!(cuda_version_string(12080), "12.8");
        assert_eq!(cuda_version_string(13000), "13.0");
        assert_eq!(
            version_py("from typing import Optional\n__version__ = '2.11.0+cu130'\n").as_deref(),
            Some("2.11.0+cu130")
        );
        let proprietary = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan  9 2025\nGCC";
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build";
        assert_eq!(driver_version_of(proprietary).as_deref(), Some("570.86.15"));
        assert_eq!(driver_version_of(open).as_deref(), Some("570.86.15"));
        assert_eq!(driver_version_of("garbage"), None);
        // This test binary links the wheel's libtorch: its version is the wheel's.
        let info = runtime_info();
        let torch = info.torch_version.expect("torch version from the loaded libtorch");
        assert!(torch.starts_with("2.11.0"), "{torch}");
    }
}

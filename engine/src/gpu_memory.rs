//! CUDA caching-allocator statistics (allocated / reserved bytes, current and peak), which tch
//! 0.24 does not expose, through the C++ shim `csrc/gpu_memory.cpp` (compiled by `build.rs`).
//!
//! "Allocated" is what live tensors occupy; "reserved" is what the caching allocator holds from
//! the driver (allocated plus cached free blocks). Reserved drifting away from allocated is
//! allocator fragmentation, not model growth. Both are the aggregate pool (small + large) of one
//! device, as `torch.cuda.memory_allocated` / `memory_reserved` / `max_memory_*` report them.
//!
//! [`memory_stats`] and [`reset_peak`] never call into libtorch's CUDA code unless libtorch
//! reports CUDA available; the shim itself is also safe without CUDA (it checks the device count
//! first and returns [`Unavailable::NoCudaBackend`] / [`Unavailable::NoDevice`]), and it catches
//! every C++ exception, so nothing unwinds across the FFI boundary.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int};

use serde::Serialize;

/// Allocator statistics of one CUDA device, in bytes (aggregate pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    /// Highest `allocated_bytes` since the last [`reset_peak`] (or process start).
    pub peak_allocated_bytes: u64,
    /// Highest `reserved_bytes` since the last [`reset_peak`] (or process start).
    pub peak_reserved_bytes: u64,
}

/// Why no statistics could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("libtorch reports no CUDA")]
    CudaUnavailable,
    #[error("libtorch has no CUDA backend registered (CPU-only libtorch)")]
    NoCudaBackend,
    #[error("no CUDA device with index {0}")]
    NoDevice(usize),
    #[error("the CUDA caching allocator is not initialised yet (nothing allocated on the GPU)")]
    NotInitialized,
    #[error("c10 error: {0}")]
    Error(String),
    #[error("unexpected return code {0} from the allocator shim")]
    UnknownCode(i32),
}

/// Return codes of the shim (`enum` in csrc/gpu_memory.cpp).
pub mod code {
    pub const OK: i32 = 0;
    pub const NO_CUDA: i32 = 1;
    pub const NO_DEVICE: i32 = 2;
    pub const NOT_INITIALIZED: i32 = 3;
    pub const ERROR: i32 = 4;
    pub const BAD_ARG: i32 = 5;
}

/// `struct TrainyardMemStats` in csrc/gpu_memory.cpp.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct RawStats {
    allocated_bytes: i64,
    reserved_bytes: i64,
    peak_allocated_bytes: i64,
    peak_reserved_bytes: i64,
}

unsafe extern "C" {
    fn trainyard_cuda_memory_stats(
        device: c_int,
        out: *mut RawStats,
        err_buf: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn trainyard_cuda_memory_reset_peak(device: c_int, err_buf: *mut c_char, err_len: usize) -> c_int;
}

const ERR_LEN: usize = 512;

fn err_message(buf: &[u8; ERR_LEN]) -> String {
    CStr::from_bytes_until_nul(buf).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
}

fn to_unavailable(rc: i32, device: usize, msg: String) -> Unavailable {
    match rc {
        code::NO_CUDA => Unavailable::NoCudaBackend,
        code::NO_DEVICE => Unavailable::NoDevice(device),
        code::NOT_INITIALIZED => Unavailable::NotInitialized,
        code::ERROR => Unavailable::Error(msg),
        other => Unavailable::UnknownCode(other),
    }
}

fn device_index(device: usize) -> c_int {
    // Out-of-range indices map to -1, which the shim reports as "no device".
    c_int::try_from(device).unwrap_or(-1)
}

/// Calls the shim without checking that CUDA is available (it is safe either way; the public
/// functions check first so that CPU runs never enter libtorch's CUDA code). Returns the shim's
/// code and, on success, the statistics.
fn raw_stats(device: usize) -> (i32, RawStats, String) {
    let mut out = RawStats::default();
    let mut err = [0u8; ERR_LEN];
    // SAFETY: `out` and `err` are valid for writes of their sizes for the whole call; the shim
    // writes at most `ERR_LEN` bytes (NUL included) and catches every C++ exception.
    let rc = unsafe {
        trainyard_cuda_memory_stats(device_index(device), &mut out, err.as_mut_ptr().cast(), ERR_LEN)
    };
    (rc, out, err_message(&err))
}

fn raw_reset_peak(device: usize) -> (i32, String) {
    let mut err = [0u8; ERR_LEN];
    // SAFETY: as in `raw_stats`.
    let rc =
        unsafe { trainyard_cuda_memory_reset_peak(device_index(device), err.as_mut_ptr().cast(), ERR_LEN) };
    (rc, err_message(&err))
}

fn bytes(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// Reads the allocator statistics of CUDA device `device`, or says why it cannot.
pub fn read(device: usize) -> Result<MemoryStats, Unavailable> {
    if !tch::Cuda::is_available() {
        return Err(Unavailable::CudaUnavailable);
    }
    let (rc, raw, msg) = raw_stats(device);
    if rc != code::OK {
        return Err(to_unavailable(rc, device, msg));
    }
    Ok(MemoryStats {
        allocated_bytes: bytes(raw.allocated_bytes),
        reserved_bytes: bytes(raw.reserved_bytes),
        peak_allocated_bytes: bytes(raw.peak_allocated_bytes),
        peak_reserved_bytes: bytes(raw.peak_reserved_bytes),
    })
}

/// The allocator statistics of CUDA device `device`; `None` when CUDA is not available (or the
/// allocator cannot answer: see [`read`] for the reason).
pub fn memory_stats(device: usize) -> Option<MemoryStats> {
    read(device).ok()
}

/// Resets the peak counters of device `device` to the current values
/// (`torch.cuda.reset_peak_memory_stats`), so the next read's peaks cover the interval since.
pub fn reset_peak(device: usize) -> Result<(), Unavailable> {
    if !tch::Cuda::is_available() {
        return Err(Unavailable::CudaUnavailable);
    }
    match raw_reset_peak(device) {
        (code::OK, _) => Ok(()),
        (rc, msg) => Err(to_unavailable(rc, device, msg)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn without_cuda_the_wrapper_returns_none() {
        if tch::Cuda::is_available() {
            eprintln!("CUDA available: covered by allocator_counts_a_cuda_tensor");
            return;
        }
        assert_eq!(memory_stats(0), None);
        assert_eq!(read(0), Err(Unavailable::CudaUnavailable));
        assert_eq!(reset_peak(0), Err(Unavailable::CudaUnavailable));
    }

    /// The shim links and, called directly with no CUDA device, answers "unavailable" (no
    /// device, or no CUDA backend for a CPU-only libtorch) instead of crashing: it asks the
    /// device count (0 without a driver) before it touches the allocator.
    #[test]
    fn shim_links_and_reports_unavailable_without_a_device() {
        let count = if tch::Cuda::is_available() { tch::Cuda::device_count() as usize } else { 0 };
        for device in [count, count + 7, usize::MAX] {
            let (rc, raw, msg) = raw_stats(device);
            assert!(rc == code::NO_DEVICE || rc == code::NO_CUDA, "device {device}: rc {rc} ({msg})");
            eprintln!("device {device}: shim code {rc}");
            assert_eq!(raw.allocated_bytes, 0);
            assert_eq!(raw_reset_peak(device).0, rc);
        }
        if count == 0 {
            let (rc, _, msg) = raw_stats(0);
            assert!(rc == code::NO_DEVICE || rc == code::NO_CUDA, "rc {rc} ({msg})");
        }
        // A null output pointer is refused, not written through.
        // SAFETY: the shim checks `out` for null before any write; no error buffer is passed.
        let rc = unsafe { trainyard_cuda_memory_stats(0, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        assert_eq!(rc, code::BAD_ARG);
    }

    /// On a GPU host: a 64 MiB tensor shows up in allocated and reserved, peaks follow, and a
    /// reset brings the peak back to the current value.
    #[test]
    fn allocator_counts_a_cuda_tensor() {
        if !tch::Cuda::is_available() {
            eprintln!("no CUDA: nothing to measure");
            return;
        }
        let dev = Device::Cuda(0);
        let _warm = Tensor::zeros([1], (Kind::Float, dev));
        tch::Cuda::synchronize(0);
        let before = read(0).expect("stats after CUDA init");
        assert!(before.reserved_bytes >= before.allocated_bytes, "{before:?}");
        let n: i64 = 16 << 20; // 16 Mi floats = 64 MiB
        let big = Tensor::ones([n], (Kind::Float, dev));
        tch::Cuda::synchronize(0);
        let with = read(0).expect("stats");
        assert!(with.allocated_bytes >= before.allocated_bytes + (n as u64) * 4, "{before:?} -> {with:?}");
        assert!(with.reserved_bytes >= with.allocated_bytes, "{with:?}");
        assert!(with.peak_allocated_bytes >= with.allocated_bytes, "{with:?}");
        assert!(with.peak_reserved_bytes >= with.reserved_bytes, "{with:?}");
        drop(big);
        tch::Cuda::synchronize(0);
        let after = read(0).expect("stats");
        assert!(after.allocated_bytes + (n as u64) * 4 <= with.allocated_bytes, "{with:?} -> {after:?}");
        // Freed memory stays cached: reserved does not drop, the peak remembers the tensor.
        assert!(after.reserved_bytes >= with.reserved_bytes, "{with:?} -> {after:?}");
        assert!(after.peak_allocated_bytes >= with.allocated_bytes, "{after:?}");
        reset_peak(0).expect("reset peak");
        let reset = read(0).expect("stats");
        assert_eq!(reset.peak_allocated_bytes, reset.allocated_bytes, "{reset:?}");
        assert_eq!(reset.peak_reserved_bytes, reset.reserved_bytes, "{reset:?}");
        assert_eq!(
            read(tch::Cuda::device_count() as usize),
            Err(Unavailable::NoDevice(tch::Cuda::device_count() as usize))
        );
    }
}

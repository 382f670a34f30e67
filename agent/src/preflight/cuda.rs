//! CUDA on every GPU, through cudarc's driver API loaded at run time: `cuInit`, then per GPU a
//! context, an allocation and a round-trip copy. A driver/runtime mismatch shows up here as
//! "CUDA unknown error" in seconds (docs/field-notes.md §2), before any job is placed.

use std::panic::{AssertUnwindSafe, catch_unwind};

use cudarc::driver::{CudaContext, result, sys};

/// What `skipped` says when the driver library is absent.
pub const NOT_FOUND: &str = "CUDA driver (libcuda.so.1) not found";

/// Bytes allocated and copied per GPU: big enough to touch real device memory, small enough to
/// take milliseconds.
const PROBE_BYTES: usize = 16 << 20;

/// The CUDA check's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The check could not run, and why.
    Skipped(String),
    /// `cuInit` (or counting devices) failed: the whole node is unusable.
    InitFailed(String),
    /// Per GPU checked, in the order asked for: `Ok` or the error of the step that failed.
    Ran { driver_version: String, cuda_version: String, devices: usize, gpus: Vec<Result<(), String>> },
}

/// Runs the check on the GPUs `gpus` (NVML indices, which are CUDA ordinals in the agent: it
/// starts with `CUDA_DEVICE_ORDER=PCI_BUS_ID`). Blocking; panics inside cudarc (a missing
/// symbol in an old driver) become failures rather than taking the agent down.
pub fn check(gpus: &[u32]) -> Outcome {
    // SAFETY: only tries to dlopen the library names cudarc would use.
    if !unsafe { sys::is_culib_present() } {
        return Outcome::Skipped(NOT_FOUND.into());
    }
    match catch_unwind(AssertUnwindSafe(|| check_loaded(gpus))) {
        Ok(outcome) => outcome,
        Err(panic) => Outcome::InitFailed(format!("CUDA driver call panicked: {}", panic_text(&panic))),
    }
}

fn check_loaded(wanted: &[u32]) -> Outcome {
    if let Err(e) = result::init() {
        return Outcome::InitFailed(format!("cuInit: {e}"));
    }
    let mut version = 0;
    // SAFETY: writes one int.
    let cuda_version = match unsafe { sys::cuDriverGetVersion(&mut version) } {
        sys::CUresult::CUDA_SUCCESS => format!("{}.{}", version / 1000, (version % 1000) / 10),
        _ => String::new(),
    };
    let devices = match CudaContext::device_count() {
        Ok(count) => count.max(0) as usize,
        Err(e) => return Outcome::InitFailed(format!("cuDeviceGetCount: {e}")),
    };
    let gpus =
        wanted
            .iter()
            .map(|&i| {
                if (i as usize) < devices {
                    probe_gpu(i as usize)
                } else {
                    Err(format!("no CUDA device {i}"))
                }
            })
            .collect();
    Outcome::Ran { driver_version: String::new(), cuda_version, devices, gpus }
}

/// Context, allocation, host-to-device and device-to-host copy, compared.
fn probe_gpu(ordinal: usize) -> Result<(), String> {
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("context: {e}"))?;
    let stream = ctx.default_stream();
    let host: Vec<u8> = (0..PROBE_BYTES).map(|i| (i % 251) as u8).collect();
    let device = stream.clone_htod(&host).map_err(|e| format!("allocation and copy to the GPU: {e}"))?;
    let back = stream.clone_dtoh(&device).map_err(|e| format!("copy from the GPU: {e}"))?;
    stream.synchronize().map_err(|e| format!("synchronize: {e}"))?;
    if back != host {
        return Err("data copied to the GPU and back differs".into());
    }
    Ok(())
}

pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CI has no GPU driver: the not-found branch runs and says so.
    #[test]
    fn without_a_driver_the_check_is_skipped() {
        // SAFETY: see `check`.
        if unsafe { sys::is_culib_present() } {
            return; // a machine with a driver: nothing to assert about absence
        }
        assert_eq!(check(&[0, 1, 2, 3, 4, 5, 6, 7]), Outcome::Skipped(NOT_FOUND.into()));
    }
}

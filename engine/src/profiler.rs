//! `--profile-steps A-B`: libtorch's Kineto profiler over steps A to B (as receipts number them),
//! written as a Chrome trace (`csrc/profiler.cpp`). On a GPU the trace holds every CUDA kernel
//! and copy with the op that launched it; `deploy/gpu/trace_table.py` sums it into a table of
//! where a step's time goes.
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

unsafe extern "C" {
    fn trainyard_profiler_start(cuda: c_int, error: *mut c_char, error_len: usize) -> c_int;
    fn trainyard_profiler_stop(path: *const c_char, error: *mut c_char, error_len: usize) -> c_int;
}

/// Which steps to record and where the trace goes.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileSpec {
    pub first: i64,
    pub last: i64,
    pub out: PathBuf,
}

impl ProfileSpec {
    /// Parses `A-B` or `A` (steps counted from 1, as receipts count them).
    pub fn parse(steps: &str, out: PathBuf) -> Result<Self> {
        let bad = || format!("--profile-steps {steps:?}: expected A-B or A, steps counted from 1");
        let (a, b) = steps.split_once('-').unwrap_or((steps, steps));
        let first: i64 = a.trim().parse().with_context(bad)?;
        let last: i64 = b.trim().parse().with_context(bad)?;
        if first < 1 || last < first {
            bail!("{}", bad());
        }
        Ok(Self { first, last, out })
    }
}

/// The profiler around the steps of a run: [`Profiler::before`] each step starts it at the
/// first step asked for; [`Profiler::after`] each step stops it and writes the trace after the
/// last.
pub struct Profiler {
    spec: Option<ProfileSpec>,
    cuda: bool,
    running: bool,
}

impl Profiler {
    pub fn new(spec: Option<ProfileSpec>, cuda: bool) -> Self {
        Self { spec, cuda, running: false }
    }

    /// Before step `step` (counted from 1).
    pub fn before(&mut self, step: i64) -> Result<()> {
        let Some(spec) = &self.spec else { return Ok(()) };
        if step == spec.first && !self.running {
            start(self.cuda)?;
            self.running = true;
        }
        Ok(())
    }

    /// After step `step` (counted from 1, the device synchronised); returns the trace's path
    /// when it was written.
    pub fn after(&mut self, step: i64) -> Result<Option<PathBuf>> {
        let Some(spec) = &self.spec else { return Ok(None) };
        if self.running && step >= spec.last {
            self.running = false;
            stop(&spec.out)?;
            return Ok(Some(spec.out.clone()));
        }
        Ok(None)
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        // A run that ends (or fails) inside the profiled steps still leaves its trace.
        if let (true, Some(spec)) = (self.running, &self.spec) {
            self.running = false;
            if let Err(e) = stop(&spec.out) {
                eprintln!("trainyard-engine: profile: {e:#}");
            }
        }
    }
}

fn call(what: &str, f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<()> {
    let mut error = [0 as c_char; 512];
    if f(error.as_mut_ptr(), error.len()) != 0 {
        // SAFETY: the shim NUL-terminates the buffer whenever it fails.
        let msg = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
        bail!("{what}: {msg}");
    }
    Ok(())
}

fn start(cuda: bool) -> Result<()> {
    // SAFETY: an error buffer of the length passed; the shim catches every C++ exception.
    call("starting libtorch's profiler", |e, n| unsafe { trainyard_profiler_start(c_int::from(cuda), e, n) })
}

fn stop(out: &Path) -> Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("profile: creating {}", dir.display()))?;
    }
    let path = CString::new(out.as_os_str().as_encoded_bytes())
        .with_context(|| format!("profile: {} holds a NUL byte", out.display()))?;
    // SAFETY: a NUL-terminated path and an error buffer of the length passed; the shim catches
    // every C++ exception.
    call(&format!("writing the profile to {}", out.display()), |e, n| unsafe {
        trainyard_profiler_stop(path.as_ptr(), e, n)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn steps_parse_and_bad_ranges_are_named() {
        let p = ProfileSpec::parse("10-12", "t.json".into()).unwrap();
        assert_eq!((p.first, p.last), (10, 12));
        assert_eq!(ProfileSpec::parse("7", "t.json".into()).unwrap().last, 7);
        for bad in ["0-3", "5-4", "x", "3-"] {
            let e = ProfileSpec::parse(bad, "t.json".into()).unwrap_err().to_string();
            assert!(e.contains("--profile-steps") && e.contains(bad), "{e}");
        }
    }

    /// The CPU trace of a matrix product holds the op, as a Chrome trace.
    #[test]
    fn a_profiled_step_writes_a_chrome_trace_with_its_ops() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("sub").join("trace.json");
        let mut p = Profiler::new(Some(ProfileSpec::parse("2-3", out.clone()).unwrap()), false);
        let a = Tensor::randn([64, 64], (Kind::Float, Device::Cpu));
        for step in 1..=4 {
            p.before(step).unwrap();
            let _ = a.matmul(&a);
            let written = p.after(step).unwrap();
            assert_eq!(written.is_some(), step == 3, "step {step}");
        }
        let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        let events = trace["traceEvents"].as_array().expect("traceEvents");
        let mm = events.iter().filter(|e| e["name"] == "aten::matmul").count();
        assert_eq!(mm, 2, "two profiled steps, one matmul each");
    }
}

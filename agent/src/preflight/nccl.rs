//! NCCL sanity: one process drives all GPUs of the node through cudarc's NCCL bindings
//! (`ncclCommInitAll`, grouped `all_reduce`), over a size sweep, timed as nccl-tests does.
//!
//! The sweep runs in a child process (`trainyard-agent nccl-sweep`), for three reasons: a hung
//! or crashing NCCL must not take the agent with it (the child is killed after [`TIMEOUT`]);
//! the contexts and buffers (2 GiB per GPU at 1 GiB) are freed when the child exits; and the
//! library name. cudarc looks for `libnccl.so` (and `.so.<cuda major>`), but torch wheels and
//! Debian's `libnccl2` ship only `libnccl.so.2`. When only that name resolves, the child gets a
//! private directory with a `libnccl.so` symlink to it on its `LD_LIBRARY_PATH`, which the
//! dynamic loader reads only at process start.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// What `skipped` says when no NCCL library can be found.
pub const NOT_FOUND: &str = "NCCL (libnccl.so.2) not found";
/// Set to the full path of a `libnccl.so.2` to use that one (e.g. torch's wheel copy under
/// `site-packages/nvidia/nccl/lib/`).
pub const LIBRARY_ENV: &str = "TRAINYARD_NCCL_LIBRARY";
/// The whole sweep, at most.
pub const TIMEOUT: Duration = Duration::from_secs(300);
const WARMUP_ITERS: usize = 5;
const TIMED_ITERS: usize = 20;

/// One message size of the sweep, as nccl-tests reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SizeResult {
    pub bytes: u64,
    /// Mean time of one all_reduce, microseconds.
    pub time_us: f64,
    /// bytes / time, GB/s (10^9).
    pub algbw_gbps: f64,
    /// algbw * 2(n-1)/n: the per-link figure comparable across GPU counts.
    pub busbw_gbps: f64,
}

impl SizeResult {
    /// The nccl-tests arithmetic for an all_reduce of `bytes` over `n` GPUs taking `time_us`.
    pub fn new(bytes: u64, n: usize, time_us: f64) -> Self {
        let algbw_gbps = bytes as f64 / (time_us * 1e-6) / 1e9;
        let factor = if n > 0 { 2.0 * (n as f64 - 1.0) / n as f64 } else { 0.0 };
        Self { bytes, time_us, algbw_gbps, busbw_gbps: algbw_gbps * factor }
    }
}

/// The sweep's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    Skipped(String),
    Failed(String),
    Ran { version: String, results: Vec<SizeResult> },
}

/// Where the library is, as far as the loader is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Library {
    /// cudarc's own search finds it.
    Found,
    /// Only at this path (a `libnccl.so.2`): the child needs a `libnccl.so` alias.
    At(PathBuf),
}

/// [`sweep`] with this process's executable as the helper, when it is the agent binary (tests
/// run inside a test harness, which has no `nccl-sweep` subcommand).
pub fn sweep_with_agent_binary(gpus: &[u32], sizes: &[u64]) -> Outcome {
    let exe = std::env::current_exe().unwrap_or_default();
    let is_agent = exe.file_name().is_some_and(|name| name == "trainyard-agent");
    if !gpus.is_empty() && locate().is_some() && !is_agent {
        return Outcome::Skipped(format!(
            "the NCCL sweep runs in the trainyard-agent binary, not {}",
            exe.display()
        ));
    }
    sweep(&exe, gpus, sizes)
}

/// Runs the sweep over the GPUs `gpus` (NVML indices) in a child process of `helper` (the agent
/// binary) that sees only those GPUs (`CUDA_VISIBLE_DEVICES`, in PCI bus order), so a job's
/// launch preflight never touches a GPU other jobs' ranks hold.
///
/// One GPU runs too: the communicator, the all_reduce and the timing path are the same code a
/// multi-GPU node runs, so a broken NCCL install fails here even on a 1-GPU host; only the bus
/// bandwidth means nothing there (no GPU-to-GPU traffic), which [`super::checks::nccl`] says.
pub fn sweep(helper: &Path, gpus: &[u32], sizes: &[u64]) -> Outcome {
    if gpus.is_empty() {
        return Outcome::Skipped("no GPU to run NCCL on".into());
    }
    let library = match locate() {
        Some(library) => library,
        None => return Outcome::Skipped(NOT_FOUND.into()),
    };
    match run_child(helper, &library, gpus, sizes) {
        Ok(outcome) => outcome,
        Err(e) => Outcome::Failed(e),
    }
}

fn locate() -> Option<Library> {
    if let Ok(path) = std::env::var(LIBRARY_ENV) {
        return Path::new(&path).is_file().then(|| Library::At(PathBuf::from(path)));
    }
    // SAFETY: only dlopens the names cudarc would.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Some(Library::Found);
    }
    loaded_path("libnccl.so.2").map(Library::At)
}

/// The file the loader resolves `name` to, found through a symbol's `dladdr`.
fn loaded_path(name: &str) -> Option<PathBuf> {
    let c_name = CString::new(name).ok()?;
    // SAFETY: dlopen/dlsym/dladdr with valid C strings; the handle is closed before returning.
    unsafe {
        let handle = libc::dlopen(c_name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return None;
        }
        let symbol = libc::dlsym(handle, c"ncclGetVersion".as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        let path = if !symbol.is_null() && libc::dladdr(symbol, &mut info) != 0 && !info.dli_fname.is_null() {
            Some(PathBuf::from(CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned()))
        } else {
            None
        };
        libc::dlclose(handle);
        path
    }
}

fn run_child(helper: &Path, library: &Library, gpus: &[u32], sizes: &[u64]) -> Result<Outcome, String> {
    // Output goes to files, not pipes: NCCL_DEBUG=INFO can print more than a pipe holds.
    let dir = tempdir::TempDir::new().map_err(|e| format!("cannot create a scratch directory: {e}"))?;
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let create =
        |p: &Path| std::fs::File::create(p).map_err(|e| format!("cannot create {}: {e}", p.display()));
    let sizes_arg: Vec<String> = sizes.iter().map(u64::to_string).collect();
    let mut command = Command::new(helper);
    let visible: Vec<String> = gpus.iter().map(u32::to_string).collect();
    command
        .args(["nccl-sweep", "--gpus", &gpus.len().to_string(), "--sizes", &sizes_arg.join(",")])
        .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .env("CUDA_VISIBLE_DEVICES", visible.join(","))
        .stdin(Stdio::null())
        .stdout(create(&out_path)?)
        .stderr(create(&err_path)?);
    if let Library::At(path) = library {
        std::os::unix::fs::symlink(path, dir.path().join("libnccl.so"))
            .map_err(|e| format!("cannot link libnccl.so to {}: {e}", path.display()))?;
        let mut paths = vec![dir.path().to_path_buf()];
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            paths.extend(std::env::split_paths(&old));
        }
        command.env("LD_LIBRARY_PATH", std::env::join_paths(paths).map_err(|e| e.to_string())?);
    }
    let mut child =
        command.spawn().map_err(|e| format!("cannot start {} nccl-sweep: {e}", helper.display()))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait().map_err(|e| e.to_string())? {
            Some(status) => break status,
            None if started.elapsed() > TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "NCCL sweep did not finish within {} s (hung collective?)",
                    TIMEOUT.as_secs()
                ));
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    match stdout.lines().rev().find_map(|l| serde_json::from_str::<Outcome>(l).ok()) {
        Some(outcome) => Ok(outcome),
        None => {
            let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
            let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
            Err(format!("NCCL sweep ended with {status} and no result: {}", tail.join(" | ")))
        }
    }
}

/// A small self-removing temporary directory (no dependency needed for one directory).
mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new() -> std::io::Result<Self> {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let dir = std::env::temp_dir().join(format!("trainyard-nccl-{}-{nanos}", std::process::id()));
            std::fs::create_dir(&dir)?;
            Ok(Self(dir))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The child's side (`trainyard-agent nccl-sweep`): runs the sweep in this process and returns
/// the outcome, which the child prints as one JSON line.
pub fn sweep_in_process(n: usize, sizes: &[u64]) -> Outcome {
    // SAFETY: only dlopens the names cudarc would.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Outcome::Skipped(NOT_FOUND.into());
    }
    match std::panic::catch_unwind(|| measure(n, sizes)) {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => Outcome::Failed(e),
        Err(panic) => Outcome::Failed(format!("NCCL call panicked: {}", super::cuda::panic_text(&panic))),
    }
}

fn measure(n: usize, sizes: &[u64]) -> Result<Outcome, String> {
    use cudarc::driver::CudaContext;
    use cudarc::nccl::{Comm, ReduceOp, group_end, group_start, result};

    let raw = result::get_nccl_version().map_err(|e| format!("ncclGetVersion: {e:?}"))?;
    let version = format!("{}.{}.{}", raw / 10000, (raw % 10000) / 100, raw % 100);
    let mut streams = Vec::with_capacity(n);
    for i in 0..n {
        let ctx = CudaContext::new(i).map_err(|e| format!("CUDA context on GPU {i}: {e}"))?;
        // One stream per GPU, used for everything: cudarc's cross-stream event tracking is not
        // needed and would add work to the timed loop.
        // SAFETY: nothing on this context uses another stream.
        unsafe { ctx.disable_event_tracking() };
        streams.push(ctx.new_stream().map_err(|e| format!("stream on GPU {i}: {e}"))?);
    }
    let comms =
        Comm::from_devices(streams.clone()).map_err(|e| format!("ncclCommInitAll over {n} GPUs: {e:?}"))?;
    let mut results = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let count = (bytes / 4).max(1) as usize;
        let mut buffers = Vec::with_capacity(n);
        for (i, stream) in streams.iter().enumerate() {
            let send = stream
                .alloc_zeros::<f32>(count)
                .map_err(|e| format!("allocate {bytes} B on GPU {i}: {e}"))?;
            let recv = stream
                .alloc_zeros::<f32>(count)
                .map_err(|e| format!("allocate {bytes} B on GPU {i}: {e}"))?;
            buffers.push((send, recv));
        }
        let mut once = || -> Result<(), String> {
            group_start().map_err(|e| format!("ncclGroupStart: {e:?}"))?;
            for (comm, (send, recv)) in comms.iter().zip(buffers.iter_mut()) {
                comm.all_reduce(send, recv, &ReduceOp::Sum).map_err(|e| format!("ncclAllReduce: {e:?}"))?;
            }
            group_end().map_err(|e| format!("ncclGroupEnd: {e:?}")).map(|_| ())
        };
        let sync = |streams: &[std::sync::Arc<cudarc::driver::CudaStream>]| -> Result<(), String> {
            streams.iter().try_for_each(|s| s.synchronize().map_err(|e| format!("synchronize: {e}")))
        };
        for _ in 0..WARMUP_ITERS {
            once()?;
        }
        sync(&streams)?;
        let start = Instant::now();
        for _ in 0..TIMED_ITERS {
            once()?;
        }
        sync(&streams)?;
        let time_us = start.elapsed().as_secs_f64() * 1e6 / TIMED_ITERS as f64;
        results.push(SizeResult::new(bytes, n, time_us));
    }
    drop(comms);
    Ok(Outcome::Ran { version, results })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_bandwidth_as_nccl_tests_computes_it() {
        // 1 GiB in 5 ms over 8 GPUs: algbw 214.7 GB/s, busbw x 1.75.
        let r = SizeResult::new(1 << 30, 8, 5000.0);
        assert!((r.algbw_gbps - 214.748).abs() < 0.01, "{r:?}");
        assert!((r.busbw_gbps - r.algbw_gbps * 1.75).abs() < 1e-9);
        assert_eq!(
            SizeResult::new(1 << 20, 2, 100.0).busbw_gbps,
            SizeResult::new(1 << 20, 2, 100.0).algbw_gbps
        );
    }

    #[test]
    fn without_nccl_the_sweep_is_skipped() {
        if locate().is_some() {
            return; // a machine with NCCL: nothing to assert about absence
        }
        assert_eq!(
            sweep(Path::new("/nonexistent"), &[0, 1, 2, 3, 4, 5, 6, 7], &[1 << 20]),
            Outcome::Skipped(NOT_FOUND.into())
        );
        assert_eq!(sweep_in_process(8, &[1 << 20]), Outcome::Skipped(NOT_FOUND.into()));
        assert!(matches!(sweep(Path::new("/nonexistent"), &[0], &[1 << 20]), Outcome::Skipped(_)));
        assert!(matches!(sweep(Path::new("/nonexistent"), &[], &[1 << 20]), Outcome::Skipped(_)));
    }
}

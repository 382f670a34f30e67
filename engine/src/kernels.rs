//! Our own CUDA kernels, compiled at run time by NVRTC (through cudarc, loaded with dlopen, so the
//! engine builds and its CPU tests run without CUDA) and launched on libtorch's tensors.
//!
//! Every kernel here has a reference in tensor ops ([`crate::fused_loss::softcap_xent_reference`])
//! that the normal test suite checks on the CPU; the GPU tests launch the kernel and compare it
//! with that reference, and [`launches`] lets them assert that the kernel really ran.
//!
//! Streams: libtorch launches on the legacy default stream unless told otherwise, and the engine
//! never changes the current stream, so our kernels go to the same stream (cudarc's
//! `default_stream`, the null stream of the primary context libtorch also uses) and need no
//! synchronisation with the tensor ops around them.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context, Result, anyhow, bail};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

use crate::kernel_source::{ENTRIES, source};

/// Threads per row of `softcap_xent`.
const XENT_THREADS: u32 = 1024;

static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many of our kernels this process has launched (the GPU tests assert it grew).
pub fn launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

struct Loaded {
    stream: Arc<CudaStream>,
    functions: BTreeMap<&'static str, CudaFunction>,
}

// cudarc's handles are plain pointers into the driver; the driver API is thread-safe.
unsafe impl Send for Loaded {}

/// Compiled kernels per GPU ordinal: compiled once per process (NVRTC takes ~0.1-0.3 s; the
/// driver caches the PTX's machine code on disk).
fn loaded(gpu: usize) -> Result<Arc<Mutex<Loaded>>> {
    static CACHE: OnceLock<Mutex<BTreeMap<usize, Arc<Mutex<Loaded>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().map_err(|_| anyhow!("kernel cache poisoned"))?;
    if let Some(k) = cache.get(&gpu) {
        return Ok(k.clone());
    }
    let k = Arc::new(Mutex::new(compile(gpu)?));
    cache.insert(gpu, k.clone());
    Ok(k)
}

/// Compiles `src` with NVRTC. cudarc panics when it cannot dlopen libnvrtc.so: that becomes an
/// error that says what to install. NVRTC dlopens its builtins library by name, which the
/// engine's rpath does not reach (only LD_LIBRARY_PATH would): when that is what failed, the
/// builtins beside the loaded libnvrtc are loaded by full path and the compile is retried.
pub(crate) fn nvrtc_compile(src: &str) -> Result<cudarc::nvrtc::Ptx> {
    let compile = || {
        std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx(src)).map_err(|_| {
            anyhow!(
                "cannot load NVRTC (libnvrtc.so): put the CUDA runtime compiler's directory on \
                 LD_LIBRARY_PATH (deploy/setup.sh links the torch wheel's into .venv/nccl-lib)"
            )
        })
    };
    match compile()? {
        Ok(ptx) => Ok(ptx),
        Err(e) if format!("{e:?}").contains("builtins") && preload_builtins() => {
            compile()?.map_err(|e| anyhow!("NVRTC could not compile our kernels: {e:?}"))
        }
        Err(e) => Err(anyhow!("NVRTC could not compile our kernels: {e:?}")),
    }
}

/// Loads `libnvrtc-builtins.so.*` from the real directory of the libnvrtc this process mapped
/// (read from /proc/self/maps); true when one loaded.
fn preload_builtins() -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let Some(lib) =
        maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.contains("/libnvrtc.so"))
    else {
        return false;
    };
    let Some(dir) = std::fs::canonicalize(lib).ok().and_then(|p| p.parent().map(|d| d.to_path_buf())) else {
        return false;
    };
    let mut loaded = false;
    for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("libnvrtc-builtins.so") {
            continue;
        }
        let Ok(path) = std::ffi::CString::new(entry.path().as_os_str().as_encoded_bytes()) else { continue };
        // SAFETY: dlopen of a library by full path; the handle is kept for the process's life.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        loaded |= !handle.is_null();
    }
    loaded
}

/// The PTX of `src`, from the on-disk cache when this exact source was compiled before (NVRTC
/// costs ~0.1 s of every start; the driver caches the PTX's machine code itself), else compiled
/// and written there. The cache is `$TRAINYARD_KERNEL_CACHE`, else `$XDG_CACHE_HOME/trainyard/
/// kernels`, else `~/.cache/trainyard/kernels`; a cache that cannot be read or written is
/// skipped, never an error.
pub(crate) fn cached_ptx(src: &str, dir: Option<&std::path::Path>) -> Result<cudarc::nvrtc::Ptx> {
    let path = dir.map(|d| d.join(format!("{:016x}.ptx", fnv1a(src.as_bytes()))));
    if let Some(text) =
        path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()).filter(|t| t.contains(".entry"))
    {
        return Ok(cudarc::nvrtc::Ptx::from_src(text));
    }
    let ptx = nvrtc_compile(src)?;
    if let Some(p) = &path {
        // Written whole under a temporary name, then renamed: a concurrent rank never reads half.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let written = p.parent().is_some_and(|d| std::fs::create_dir_all(d).is_ok())
            && std::fs::write(&tmp, ptx.to_src()).is_ok()
            && std::fs::rename(&tmp, p).is_ok();
        if !written {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(ptx)
}

fn cache_dir() -> Option<std::path::PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    var("TRAINYARD_KERNEL_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("trainyard/kernels")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/trainyard/kernels")))
}

/// 64-bit FNV-1a: names a kernel source's cached PTX.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn compile(gpu: usize) -> Result<Loaded> {
    let ptx = cached_ptx(&source(), cache_dir().as_deref())?;
    let ctx = CudaContext::new(gpu).with_context(|| format!("CUDA context of GPU {gpu}"))?;
    let module = ctx.load_module(ptx).context("load the NVRTC-compiled kernels")?;
    let mut functions = BTreeMap::new();
    for name in ENTRIES {
        functions.insert(name, module.load_function(name).with_context(|| format!("kernel {name}"))?);
    }
    Ok(Loaded { stream: ctx.default_stream(), functions })
}

/// Runs `f` with the stream and the kernel `name` of GPU `gpu` (compiled on first use), and
/// counts a launch when it succeeds.
pub(crate) fn with_kernel<R>(
    gpu: usize,
    name: &str,
    f: impl FnOnce(&CudaStream, &CudaFunction) -> Result<R>,
) -> Result<R> {
    let k = loaded(gpu)?;
    let k = k.lock().map_err(|_| anyhow!("kernel handle poisoned"))?;
    let func = k.functions.get(name).ok_or_else(|| anyhow!("no kernel {name}"))?;
    let r = f(&k.stream, func).with_context(|| format!("launch {name}"))?;
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
    Ok(r)
}

/// Whether our kernels can run on `device` (a CUDA device whose NVRTC loads); the reason when
/// not, for the launch receipt.
pub fn available(device: Device) -> std::result::Result<(), String> {
    match device {
        Device::Cuda(gpu) => loaded(gpu).map(|_| ()).map_err(|e| format!("{e:#}")),
        _ => Err("not a CUDA device".into()),
    }
}

/// Runs `softcap_xent` over `logits` (rows x padded vocabulary, bf16, contiguous, on a GPU) in
/// place: the first `vocab` columns of each row become their gradient, times the 0-d fp32
/// `scale` on the same device, and the padding columns 0. Returns the rows' losses (fp32).
pub fn softcap_xent(
    logits: &Tensor,
    vocab: i64,
    targets: &Tensor,
    scale: &Tensor,
    cap: f64,
) -> Result<Tensor> {
    let Device::Cuda(gpu) = logits.device() else { bail!("softcap_xent: logits are not on a GPU") };
    let (rows, stride) = logits.size2().context("softcap_xent: logits are not 2-D")?;
    if vocab < 1 || vocab > stride {
        bail!("softcap_xent: vocabulary {vocab} outside the {stride} columns of the logits");
    }
    if logits.kind() != Kind::BFloat16 || !logits.is_contiguous() {
        bail!("softcap_xent: logits must be contiguous bf16, got {:?}", logits.kind());
    }
    if targets.kind() != Kind::Int64 || targets.size() != [rows] || targets.device() != logits.device() {
        bail!("softcap_xent: targets must be {rows} int64 values on the logits' device");
    }
    if scale.kind() != Kind::Float || scale.numel() != 1 || scale.device() != logits.device() {
        bail!("softcap_xent: scale must be one fp32 value on the logits' device");
    }
    if cap <= 0.0 {
        bail!("softcap_xent: the soft-cap must be positive, got {cap}");
    }
    let vocab = i32::try_from(vocab).context("vocabulary over 2^31")?;
    let stride = i32::try_from(stride).context("vocabulary over 2^31")?;
    let blocks = u32::try_from(rows).context("more than 2^32 rows in one chunk")?;
    let targets = targets.contiguous();
    let loss = Tensor::empty([rows], (Kind::Float, logits.device()));
    if rows == 0 {
        return Ok(loss);
    }
    let (x, t, l, s) = (
        logits.data_ptr() as u64,
        targets.data_ptr() as u64,
        loss.data_ptr() as u64,
        scale.data_ptr() as u64,
    );
    let cap = cap as f32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (XENT_THREADS, 1, 1), shared_mem_bytes: 0 };
    with_kernel(gpu, "softcap_xent", |stream, func| {
        let mut launch = stream.launch_builder(func);
        launch.arg(&x).arg(&t).arg(&l).arg(&s).arg(&vocab).arg(&stride).arg(&cap);
        // Safety: the pointers are live tensors of the checked shapes and kinds on this GPU,
        // kept alive by the caller until the stream has run the kernel (the tensors' storage
        // returns to libtorch's caching allocator, which orders reuse on this same stream).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    })?;
    Ok(loss)
}

#[cfg(test)]
mod tests {
    /// NVRTC needs no GPU: every kernel's source compiles wherever the library loads (deploy/
    /// setup.sh links the torch wheel's). Without it the test says skipped.
    #[test]
    fn the_kernels_compile_with_nvrtc() {
        match super::nvrtc_compile(&super::source()) {
            Err(e) if format!("{e}").contains("cannot load NVRTC") => {
                eprintln!("skipped: libnvrtc.so cannot be loaded here (run deploy/setup.sh): {e}")
            }
            Err(e) => panic!("{e:#}"),
            Ok(ptx) => {
                for name in super::ENTRIES {
                    assert!(ptx.to_src().contains(&format!(".entry {name}")), "no {name} entry in the PTX")
                }
            }
        }
    }

    /// The second load of a source comes from the cache (a planted file proves it is read), and
    /// a cache file that is not PTX is compiled over.
    #[test]
    fn ptx_is_cached_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let src = "extern \"C\" __global__ void k(float* x) { x[0] = 1.f; }";
        let file = dir.path().join(format!("{:016x}.ptx", super::fnv1a(src.as_bytes())));
        std::fs::write(&file, "// planted\n.entry k\n").unwrap();
        let ptx = super::cached_ptx(src, Some(dir.path())).unwrap();
        assert_eq!(ptx.to_src(), "// planted\n.entry k\n");
        std::fs::write(&file, "garbage").unwrap();
        match super::cached_ptx(src, Some(dir.path())) {
            Err(e) if format!("{e}").contains("cannot load NVRTC") => {
                eprintln!("skipped the compile half: {e}")
            }
            Err(e) => panic!("{e:#}"),
            Ok(ptx) => {
                assert!(ptx.to_src().contains(".entry k"));
                assert_eq!(
                    std::fs::read_to_string(&file).unwrap(),
                    ptx.to_src(),
                    "the compiled PTX replaced the bad file"
                );
            }
        }
    }
}

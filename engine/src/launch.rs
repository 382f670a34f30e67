//! Where a rank sits in its job, and what its receipts say of its launch: the rank variables,
//! the receipt writer, the launch receipt (stack, device, configuration, environment,
//! binding), and the device's name and dense bf16 peak that the step receipts' MFU divides by.
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tch::Device;

use crate::config::TrainConfig;
use crate::data::TokenSet;
use crate::model::Gpt;

/// Where this rank sits in the job (torchrun variables, see docs/internals.md).
#[derive(Debug, Clone)]
pub struct RankEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world: usize,
    pub master: String,
    pub gpu: Option<usize>,
    pub job: Option<String>,
    pub attempt: Option<String>,
    pub receipts: Option<PathBuf>,
}

impl RankEnv {
    pub fn from_env() -> Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let num = |k: &str, d: usize| -> Result<usize> {
            var(k).map_or(Ok(d), |v| v.parse().with_context(|| format!("{k}={v} is not a number")))
        };
        let rank = num("RANK", 0)?;
        let world = num("WORLD_SIZE", 1)?;
        if rank >= world {
            bail!("RANK {rank} is not below WORLD_SIZE {world}");
        }
        let local_rank = num("LOCAL_RANK", rank)?;
        let gpu = match var("TRAINYARD_GPU") {
            Some(v) => Some(v.parse().with_context(|| format!("TRAINYARD_GPU={v}"))?),
            None => None,
        };
        Ok(Self {
            rank,
            local_rank,
            world,
            master: format!(
                "{}:{}",
                var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
                var("MASTER_PORT").unwrap_or_else(|| "29500".into())
            ),
            gpu,
            job: var("TRAINYARD_JOB_ID"),
            attempt: var("TRAINYARD_ATTEMPT"),
            receipts: var("TRAINYARD_RECEIPTS").map(PathBuf::from),
        })
    }
}

/// Appends receipts (JSON lines) to the rank's receipts file; a no-op without one.
pub struct Receipts {
    file: Option<File>,
    base: serde_json::Map<String, Value>,
    seq: u64,
}

impl Receipts {
    pub fn open(env: &RankEnv) -> Result<Self> {
        let mut seq = 0;
        let file = match &env.receipts {
            Some(p) => {
                if let Ok(existing) = std::fs::read(p) {
                    seq = existing.iter().filter(|&&b| b == b'\n').count() as u64;
                }
                Some(
                    OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(p)
                        .with_context(|| format!("open receipts file {}", p.display()))?,
                )
            }
            None => None,
        };
        let mut base = serde_json::Map::new();
        base.insert("job".into(), json!(env.job));
        base.insert("attempt".into(), json!(env.attempt));
        base.insert("rank".into(), json!(env.rank));
        Ok(Self { file, base, seq })
    }

    pub fn emit(&mut self, kind: &str, fields: Value) -> Result<()> {
        let mut rec = serde_json::Map::new();
        rec.insert("kind".into(), json!(kind));
        // Receipt schema v1 (docs/receipts.md): milliseconds, bytes, MFU as a fraction.
        rec.insert("schema".into(), json!(1));
        rec.extend(self.base.clone());
        rec.insert("seq".into(), json!(self.seq));
        rec.insert(
            "time".into(),
            json!(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64()
            ),
        );
        if let Value::Object(m) = fields {
            rec.extend(m);
        }
        self.seq += 1;
        if let Some(f) = &mut self.file {
            let mut line = serde_json::to_vec(&Value::Object(rec))?;
            line.push(b'\n');
            f.write_all(&line)?;
            f.flush()?;
        }
        Ok(())
    }
}

/// The launch receipt: what runs, on what, built from which stack and configuration.
/// What the launch receipt records beyond the model and the data.
pub(crate) struct Launch<'a> {
    pub cfg: &'a TrainConfig,
    pub env: &'a RankEnv,
    pub device: Device,
    pub accum: i64,
    pub collectives: &'a str,
    pub device_name: &'a str,
    pub start_step: i64,
    pub loss_kernel: &'a str,
    pub block_kernels: &'a str,
}

pub(crate) fn launch_receipt(l: &Launch<'_>, model: &Gpt, train: &TokenSet) -> Value {
    let (cfg, env, device, collectives) = (l.cfg, l.env, l.device, l.collectives);
    let info = crate::runtime_info();
    json!({
        "engine": "builtin",
        "build_rev": info.build_rev,
        "torch": info.torch_version,
        "driver": info.driver_version,
        "cuda": cuda_driver_api_version(device),
        "cuda_available": info.cuda_available,
        "cuda_devices": info.cuda_device_count,
        "libtorch_cuda_loaded": info.libtorch_cuda_loaded,
        "nccl": if collectives == "nccl" { nccl_version() } else { Value::Null },
        "collectives": collectives,
        "device": l.device_name,
        "gpu": env.gpu,
        "world_size": env.world,
        "local_rank": env.local_rank,
        "threads": tch::get_num_threads(),
        "hostname": std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().trim(),
        "pid": std::process::id(),
        "model": cfg.model,
        "params": model.num_params(),
        "flops_per_token": cfg.model.flops_per_token(),
        "train_tokens": train.tokens(),
        "grad_accum_steps": l.accum,
        "config": cfg,
        "resumed_from": if l.start_step > 0 { json!(l.start_step) } else { Value::Null },
        "env": recorded_env(),
        "binding": binding(),
        "loss_kernel": l.loss_kernel,
        "block_kernels": l.block_kernels,
    })
}

/// The environment that reached this rank and matters for comparing runs (docs/field-notes.md
/// §4: knobs belong in the receipt, not in shell history): the rank variables, and every
/// NCCL/CUDA/PyTorch/OpenMP knob that is set, whatever its value.
fn recorded_env() -> std::collections::BTreeMap<String, String> {
    const RANK_VARS: [&str; 7] =
        ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"];
    const KNOB_PREFIXES: [&str; 6] = ["TRAINYARD_", "NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "OMP_"];
    std::env::vars()
        .filter(|(k, _)| RANK_VARS.contains(&k.as_str()) || KNOB_PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect()
}

/// The CPU and memory binding this process actually runs under, read back from the kernel.
fn binding() -> Value {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':').map(|v| v.trim().to_string()))
    };
    json!({"cpus_allowed": field("Cpus_allowed_list"), "mems_allowed": field("Mems_allowed_list")})
}

/// The CUDA version the driver supports (`cuDriverGetVersion`), on a CUDA device only: CPU runs
/// never load the driver library.
fn cuda_driver_api_version(device: Device) -> Value {
    if !matches!(device, Device::Cuda(_)) {
        return Value::Null;
    }
    let mut code = 0;
    // SAFETY: cuDriverGetVersion only writes the int it is given; the driver is loaded, since
    // the device was opened through it.
    match unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut code) } {
        cudarc::driver::sys::CUresult::CUDA_SUCCESS => json!(crate::cuda_version_string(code)),
        _ => Value::Null,
    }
}

/// The NCCL the collectives run on (`ncclGetVersion`); called only once NCCL is loaded.
fn nccl_version() -> Value {
    cudarc::nccl::result::get_nccl_version()
        .map_or(Value::Null, |code| json!(crate::nccl_version_string(code)))
}

/// Peak dense bf16 FLOP/s by device name (nanochat's table, first match wins).
pub fn peak_flops(device_name: &str) -> Option<f64> {
    let n = device_name.to_lowercase();
    const TABLE: [(&str, f64); 8] = [
        ("h200 nvl", 836e12),
        ("h200 pcie", 836e12),
        ("h200", 989e12),
        ("h100 nvl", 835e12),
        ("h100 pcie", 756e12),
        ("h100", 989e12),
        ("a100", 312e12),
        ("b200", 2.25e15),
    ];
    TABLE.iter().find(|(k, _)| n.contains(k)).map(|&(_, f)| f)
}

/// The device's name and its dense bf16 peak FLOP/s, where known.
pub(crate) fn device_facts(device: Device) -> (String, Option<f64>) {
    match device {
        Device::Cuda(gpu) => {
            let name = cudarc::driver::CudaContext::new(gpu)
                .and_then(|c| c.name())
                .unwrap_or_else(|_| "cuda".into());
            let peak = peak_flops(&name);
            (name, peak)
        }
        _ => ("cpu".to_string(), None),
    }
}

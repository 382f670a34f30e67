//! The per-rank training loop: receipts, evaluation, checkpoints, exact resume.
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tch::{Device, Tensor};

use crate::checkpoint;
use crate::collectives::{Collectives, Nccl, Single, TcpRing};
use crate::config::TrainConfig;
use crate::data::{TokenSet, first_row, to_batch};
use crate::model::Gpt;
use crate::optim::MuonAdamW;

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

/// Data, model and schedule of a run (what the `train` subcommand parses).
pub struct RunSpec {
    pub cfg: TrainConfig,
    pub train_shards: Vec<PathBuf>,
    pub val_shards: Vec<PathBuf>,
    pub device: String,
    pub threads: Option<i32>,
    pub checkpoint_dir: Option<PathBuf>,
    pub resume: bool,
    pub init_weights: Option<PathBuf>,
    pub export_init: Option<PathBuf>,
    /// Stop (exit 0) after this step, as if killed; tests of resume use it.
    pub stop_after: Option<i64>,
    /// The output layer and loss through autograd over fp32 logits, not [`crate::fused_loss`].
    pub unfused_loss: bool,
}

/// How the output layer and loss run, and what the launch receipt says of it: on a GPU the
/// fused kernel where NVRTC loads (else its tensor-op reference, with the reason); autograd on
/// the CPU (whose runs are held to PyTorch's step for step by the parity test, and where the
/// fp32 logits of small models cost little) or when asked for.
fn loss_path(spec: &RunSpec, device: Device) -> (Option<crate::fused_loss::Path>, String) {
    use crate::fused_loss::Path;
    if spec.unfused_loss || !device.is_cuda() {
        return (None, "unfused (autograd over fp32 logits)".into());
    }
    match crate::kernels::available(device) {
        Ok(()) => (Some(Path::Kernel), "chunked, NVRTC kernel".into()),
        Err(why) => {
            eprintln!("trainyard-engine: the fused loss kernel is unavailable, using tensor ops: {why}");
            (Some(Path::TensorOps), format!("chunked, tensor ops ({why})"))
        }
    }
}

/// The rank's GPU is `cuda:LOCAL_RANK`: the agent's device rule makes that the allocated GPU
/// (every GPU visible when the job holds the whole host, else a job-wide
/// `CUDA_VISIBLE_DEVICES` in ascending order). `TRAINYARD_GPU`, the physical index, is recorded.
fn pick_device(want: &str, env: &RankEnv) -> Result<Device> {
    let gpu = env.local_rank;
    match want {
        "cpu" => Ok(Device::Cpu),
        "cuda" => {
            if !tch::Cuda::is_available() {
                bail!("--device cuda but libtorch sees no CUDA device");
            }
            Ok(Device::Cuda(gpu))
        }
        "auto" => Ok(if tch::Cuda::is_available() { Device::Cuda(gpu) } else { Device::Cpu }),
        other => bail!("--device {other}: expected cpu, cuda or auto"),
    }
}

/// Trains per `spec` as rank `env.rank` of `env.world`. Everything that can be wrong with the
/// input is checked before the first step.
pub fn run(spec: RunSpec, env: RankEnv) -> Result<()> {
    let started = Instant::now();
    let cfg = spec.cfg.clone();
    let accum = cfg.validate(env.world as i64)?;
    if let Some(t) = spec.threads {
        tch::set_num_threads(t);
    }
    let device = pick_device(&spec.device, &env)?;
    let seq_len = cfg.model.seq_len;
    let vocab = cfg.model.vocab_size;
    let train = TokenSet::open("train", &spec.train_shards, seq_len, vocab)?;
    let val = if spec.val_shards.is_empty() {
        None
    } else {
        Some(TokenSet::open("val", &spec.val_shards, seq_len, vocab)?)
    };
    if cfg.eval_every > 0 && val.is_none() {
        bail!("--eval-every needs --val shards");
    }
    let mut model = Gpt::new(&cfg.model, device, cfg.seed);
    if let Some(w) = &spec.init_weights {
        let t = Tensor::read_safetensors(w).with_context(|| format!("read {}", w.display()))?;
        model.load_named(&t)?;
    }
    let mut opt = MuonAdamW::new(&model, &cfg, env.rank, env.world);
    opt.check(&model)?;
    if let (Some(p), 0) = (&spec.export_init, env.rank) {
        let named: Vec<(String, Tensor)> =
            model.named().into_iter().map(|(n, t)| (n, t.detach().to_device(Device::Cpu))).collect();
        Tensor::write_safetensors(&named, p)?;
    }
    let mut receipts = Receipts::open(&env)?;

    let timeout = Duration::from_secs(300);
    let mut coll: Box<dyn Collectives> = if env.world == 1 {
        let gpu = match device {
            Device::Cuda(gpu) => Some(gpu),
            _ => None,
        };
        Box::new(Single { gpu })
    } else if let Device::Cuda(gpu) = device {
        Box::new(Nccl::connect(&env.master, env.rank, env.world, gpu, timeout)?)
    } else {
        Box::new(TcpRing::connect(&env.master, env.rank, env.world, timeout)?)
    };

    // Resume.
    let mut start_step = 0;
    if spec.resume {
        let dir = spec.checkpoint_dir.as_ref().context("--resume needs --checkpoint-dir")?;
        if let Some(&step) = checkpoint::complete_steps(dir).last() {
            let d = checkpoint::step_dir(dir, step);
            let w = Tensor::read_safetensors(d.join("model.safetensors"))?;
            model.load_named(&w)?;
            let o = Tensor::load_multi(d.join(format!("optim_rank{}.ot", env.rank)))
                .with_context(|| format!("optimizer shard of rank {} in {}", env.rank, d.display()))?;
            opt.load_state(&model, &o)?;
            start_step = step;
        }
    }

    let (device_name, peak) = match device {
        Device::Cuda(gpu) => {
            let name = cudarc::driver::CudaContext::new(gpu)
                .and_then(|c| c.name())
                .unwrap_or_else(|_| "cuda".into());
            let peak = peak_flops(&name);
            (name, peak)
        }
        _ => ("cpu".to_string(), None),
    };
    let (loss_path, loss_kernel) = loss_path(&spec, device);
    let info = crate::runtime_info();
    receipts.emit(
        "launch",
        json!({
            "engine": "builtin",
            "build_rev": info.build_rev,
            "torch": info.torch_version,
            "driver": info.driver_version,
            "cuda": cuda_driver_api_version(device),
            "cuda_available": info.cuda_available,
            "cuda_devices": info.cuda_device_count,
            "libtorch_cuda_loaded": info.libtorch_cuda_loaded,
            "nccl": if coll.name() == "nccl" { nccl_version() } else { Value::Null },
            "collectives": coll.name(),
            "device": device_name,
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
            "grad_accum_steps": accum,
            "config": cfg,
            "resumed_from": if start_step > 0 { json!(start_step) } else { Value::Null },
            "env": recorded_env(),
            "binding": binding(),
            "loss_kernel": loss_kernel,
        }),
    )?;

    let b = cfg.device_batch_size;
    let world = env.world as i64;
    let rank = env.rank as i64;
    let fpt = cfg.model.flops_per_token();
    let mut train_s = 0.0;
    let mut eval_s = 0.0;
    let mut ckpt_s = 0.0;
    let mut peak_mem: Option<u64> = None;
    // Caching-allocator peaks over the whole run (the allocator's own peaks are reset each step).
    let mut run_peak: Option<(u64, u64)> = None;
    if let Device::Cuda(gpu) = device {
        // Step 1's peaks then cover step 1, not the start-up (model init, resume).
        let _ = crate::gpu_memory::reset_peak(gpu);
    }
    let startup_s = started.elapsed().as_secs_f64();
    let mut last_loss = f64::NAN;

    let eval = |model: &Gpt, coll: &mut dyn Collectives| -> Result<f64> {
        let val = val.as_ref().expect("checked");
        let _g = tch::no_grad_guard();
        let mut sum = Tensor::zeros([], (tch::Kind::Float, device));
        for i in 0..cfg.eval_batches {
            let rows = val.sequential_rows(((i * world + rank) * b) as u64, b as usize);
            let (x, y) = to_batch(&rows, b, seq_len, device);
            sum += model.loss(&x, &y)?;
        }
        let mut mean = sum / cfg.eval_batches as f64;
        coll.all_reduce_avg(&mut mean)?;
        Ok(mean.double_value(&[]))
    };

    let mut requests = checkpoint::Requests::from_env();
    let mut step = start_step;
    while step < cfg.num_iterations {
        let t0 = Instant::now();
        coll.synchronize();
        let tf = Instant::now();
        let mut loss_sum = Tensor::zeros([], (tch::Kind::Float, device));
        let mut grads: Vec<Tensor> = Vec::new();
        for micro in 0..accum {
            let rows = train.random_rows(cfg.seed, first_row(step, micro, accum, world, rank, b), b as usize);
            let (x, y) = to_batch(&rows, b, seq_len, device);
            let (loss, micro_grads) = model.loss_and_grads(&x, &y, 1.0 / accum as f64, loss_path)?;
            if grads.is_empty() {
                grads = micro_grads;
            } else {
                for (sum, g) in grads.iter_mut().zip(&micro_grads) {
                    *sum += g;
                }
            }
            loss_sum += loss;
        }
        coll.synchronize();
        let fwd_bwd_s = tf.elapsed().as_secs_f64();
        let lrm = cfg.lr_multiplier(step);
        let momentum = cfg.muon_momentum(step);
        let wd = cfg.muon_weight_decay(step);
        let (phases, grad_norm) = opt.step(&mut model, grads, coll.as_mut(), lrm, momentum, wd)?;
        let mut loss_t = loss_sum / accum as f64;
        coll.all_reduce_avg(&mut loss_t)?;
        let loss = loss_t.double_value(&[]);
        if !loss.is_finite() {
            receipts.emit("exit", json!({"step": step, "status": "failed", "reason": "non-finite loss"}))?;
            bail!("step {step}: loss is {loss}");
        }
        last_loss = loss;
        let dt = t0.elapsed().as_secs_f64();
        train_s += dt;
        step += 1;
        let tokens_per_s = cfg.total_batch_size as f64 / dt;
        // A fraction of the dense bf16 peak of all the job's GPUs (receipt schema v1).
        let mfu = peak.map(|p| fpt * tokens_per_s / (p * world as f64));
        let (mem, memory) = match device {
            Device::Cuda(gpu) => {
                let used =
                    cudarc::driver::result::mem_get_info().ok().map(|(free, total)| (total - free) as u64);
                if let Some(u) = used {
                    peak_mem = Some(peak_mem.unwrap_or(0).max(u));
                }
                let stats = crate::gpu_memory::read(gpu);
                let mut memory = json!({
                    "device_used_bytes": used,
                    "device_used_peak_bytes": peak_mem,
                    "source": "mem_*: c10 CUDA caching allocator, aggregate pool, peaks over this step; device_used_*: driver, whole device, peak over the run",
                });
                match &stats {
                    Ok(s) => {
                        let _ = crate::gpu_memory::reset_peak(gpu);
                        let (a, r) = run_peak.unwrap_or((0, 0));
                        run_peak = Some((a.max(s.peak_allocated_bytes), r.max(s.peak_reserved_bytes)));
                        memory["run_peak_allocated_bytes"] = json!(run_peak.map(|p| p.0));
                        memory["run_peak_reserved_bytes"] = json!(run_peak.map(|p| p.1));
                    }
                    Err(why) => memory["note"] = json!(format!("no caching-allocator statistics: {why}")),
                }
                (stats.ok(), memory)
            }
            _ => (None, json!({"note": "CPU device: no GPU memory statistics"})),
        };
        receipts.emit(
            "step",
            json!({
                "step": step,
                "loss": loss,
                "lr": opt.muon.first().map(|g| g.initial_lr * lrm),
                "lrm": lrm,
                "muon_momentum": momentum,
                "muon_weight_decay": wd,
                "tokens": cfg.total_batch_size,
                "tokens_total": step * cfg.total_batch_size,
                "step_time_ms": dt * 1e3,
                "fwd_bwd_ms": fwd_bwd_s * 1e3,
                "optimizer_ms": (phases.reduce_s + phases.compute_gather_s + phases.wait_s) * 1e3,
                "optimizer_reduce_ms": phases.reduce_s * 1e3,
                "optimizer_compute_gather_ms": phases.compute_gather_s * 1e3,
                "optimizer_wait_ms": phases.wait_s * 1e3,
                "tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "mfu_peak_flops": if peak.is_some() { json!(peak) } else { json!("unknown") },
                "mem_allocated_bytes": mem.map(|m| m.allocated_bytes),
                "mem_reserved_bytes": mem.map(|m| m.reserved_bytes),
                "mem_peak_allocated_bytes": mem.map(|m| m.peak_allocated_bytes),
                "mem_peak_reserved_bytes": mem.map(|m| m.peak_reserved_bytes),
                "memory": memory,
                "grad_norm": grad_norm,
            }),
        )?;
        if cfg.eval_every > 0 && (step % cfg.eval_every == 0 || step == cfg.num_iterations) {
            let te = Instant::now();
            let v = eval(&model, coll.as_mut())?;
            let took = te.elapsed().as_secs_f64();
            eval_s += took;
            let eval_receipt =
                json!({"step": step, "val_loss": v, "batches": cfg.eval_batches, "duration_ms": took * 1e3});
            receipts.emit("eval", eval_receipt)?;
        }
        // A drain or a preemption notice asks for a checkpoint now; the ranks agree on it.
        let mut asked = false;
        if requests.watched() && step % checkpoint::REQUEST_EVERY == 0 {
            let mut flag = Tensor::from_slice(&[f32::from(u8::from(requests.seen()))]).to_device(device);
            coll.all_reduce_avg(&mut flag)?;
            asked = flag.double_value(&[0]) > 0.0 && spec.checkpoint_dir.is_some();
        }
        let want_ckpt = asked
            || cfg.checkpoint_every > 0 && (step % cfg.checkpoint_every == 0 || step == cfg.num_iterations);
        if let (true, Some(dir)) = (want_ckpt, &spec.checkpoint_dir) {
            let tc = Instant::now();
            let d = checkpoint::step_dir(dir, step);
            std::fs::create_dir_all(&d)?;
            let mut bytes = 0;
            let state = opt.state_tensors(&model);
            bytes += checkpoint::save_atomic(&d.join(format!("optim_rank{}.ot", env.rank)), |p| {
                Tensor::save_multi(&state, p).map_err(Into::into)
            })?;
            if env.rank == 0 {
                let named: Vec<(String, Tensor)> =
                    model.named().into_iter().map(|(n, t)| (n, t.detach().to_device(Device::Cpu))).collect();
                bytes += checkpoint::save_atomic(&d.join("model.safetensors"), |p| {
                    Tensor::write_safetensors(&named, p).map_err(Into::into)
                })?;
            }
            // Every rank's shard is on disk before rank 0 writes the manifest that makes the
            // checkpoint complete (engine/src/checkpoint.rs).
            let mut barrier = Tensor::zeros([1], (tch::Kind::Float, device));
            coll.all_reduce_avg(&mut barrier)?;
            coll.synchronize();
            if env.rank == 0 {
                let meta = json!({
                    "step": step, "world_size": env.world, "seed": cfg.seed,
                    "data_position": {"next_step": step, "rows_per_step": cfg.total_batch_size / seq_len},
                    "rng": {"data": "stateless splitmix64(seed, global row)", "seed": cfg.seed},
                    "loss": loss, "config": cfg,
                });
                bytes += checkpoint::write_manifest(&d, meta)?;
            }
            let secs = tc.elapsed().as_secs_f64();
            ckpt_s += secs;
            receipts.emit(
                "checkpoint",
                json!({"step": step, "bytes": bytes, "duration_ms": secs * 1e3, "path": d.display().to_string()}),
            )?;
        }
        if asked {
            // This host is going away: take no step that would be lost; trainyard stops the
            // ranks once every one has checkpointed, and the next attempt resumes here.
            eprintln!("rank {}: checkpointed at step {step} as asked; waiting to be moved", env.rank);
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        if spec.stop_after == Some(step) {
            break;
        }
    }
    let wall = started.elapsed().as_secs_f64();
    receipts.emit(
        "goodput",
        json!({
            "step": step,
            "wall_ms": wall * 1e3,
            "startup_ms": startup_s * 1e3,
            "train_ms": train_s * 1e3,
            "eval_ms": eval_s * 1e3,
            "checkpoint_ms": ckpt_s * 1e3,
            "goodput": if wall > 0.0 { train_s / wall } else { 0.0 },
        }),
    )?;
    receipts.emit("exit", json!({"step": step, "status": "ok", "loss": last_loss}))?;
    drop(coll);
    Ok(())
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

//! The per-rank training loop: receipts, evaluation, checkpoints, exact resume.
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tch::{Device, Tensor};

use crate::checkpoint;
use crate::collectives::{Collectives, Nccl, Single, TcpRing};
use crate::config::TrainConfig;
use crate::data::{TokenSet, first_row, to_batch};
use crate::launch::{Launch, device_facts, launch_receipt};
pub use crate::launch::{RankEnv, Receipts, peak_flops};
use crate::model::Gpt;
use crate::optim::MuonAdamW;

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
    /// The blocks' rotary, norms, ReLU^2 and residual mix as separate libtorch ops, not
    /// [`crate::fused_ops`].
    pub unfused_blocks: bool,
    /// Steps to record with libtorch's profiler, and where the trace goes.
    pub profile: Option<crate::profiler::ProfileSpec>,
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

/// Whether the blocks' elementwise ops run fused (a GPU whose kernels load, unless asked not
/// to), and what the launch receipt says of it. The CPU runs them unfused, as PyTorch does.
fn block_path(spec: &RunSpec, device: Device, model: &mut Gpt) -> String {
    if spec.unfused_blocks || !device.is_cuda() {
        return "unfused (libtorch ops)".into();
    }
    match crate::fused_ops::available(device) {
        Ok(()) => {
            model.set_fused_blocks(true);
            "fused: rotary+QK-norm, ReLU^2, residual mix (NVRTC kernels)".into()
        }
        Err(why) => format!("unfused (kernels unavailable: {why})"),
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

/// What every phase of a rank's run reads: the configuration, where the rank sits, its device
/// and how its loss runs.
pub(crate) struct Ctx<'a> {
    pub(crate) cfg: &'a TrainConfig,
    pub(crate) spec: &'a RunSpec,
    pub(crate) env: &'a RankEnv,
    pub(crate) device: Device,
    pub(crate) accum: i64,
    pub(crate) loss_path: Option<crate::fused_loss::Path>,
}

/// Seconds spent per phase over the run (the goodput receipt).
#[derive(Default)]
struct Totals {
    train_s: f64,
    eval_s: f64,
    ckpt_s: f64,
}

impl Totals {
    /// The goodput receipt: where the `wall` seconds of a run that reached `step` went.
    fn goodput(&self, step: i64, wall: f64, startup_s: f64) -> Value {
        json!({
            "step": step,
            "wall_ms": wall * 1e3,
            "startup_ms": startup_s * 1e3,
            "train_ms": self.train_s * 1e3,
            "eval_ms": self.eval_s * 1e3,
            "checkpoint_ms": self.ckpt_s * 1e3,
            "goodput": if wall > 0.0 { self.train_s / wall } else { 0.0 },
        })
    }
}

/// What a rank's training loop works on and writes to.
struct Rig {
    model: Gpt,
    opt: MuonAdamW,
    coll: Box<dyn Collectives>,
    receipts: Receipts,
    totals: Totals,
    /// A checkpoint asked of this host (it is going away), read between steps.
    requests: checkpoint::Requests,
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
    let (train, val) = open_data(&spec)?;
    let (mut model, mut opt) = build(&spec, &env, device)?;
    let mut receipts = Receipts::open(&env)?;
    let coll = open_collectives(&env, device)?;
    let start_step = resume(&spec, &env, &mut model, &mut opt)?;
    let (loss_path, loss_kernel) = loss_path(&spec, device);
    let block_kernels = block_path(&spec, device, &mut model);
    let ctx = Ctx { cfg: &cfg, spec: &spec, env: &env, device, accum, loss_path };
    let (device_name, peak) = device_facts(device);
    let launch = launch_receipt(
        &Launch {
            cfg: &cfg,
            env: &env,
            device,
            accum,
            collectives: coll.name(),
            device_name: &device_name,
            start_step,
            loss_kernel: &loss_kernel,
            block_kernels: &block_kernels,
        },
        &model,
        &train,
    );
    receipts.emit("launch", launch)?;
    if let Device::Cuda(gpu) = device {
        // Step 1's peaks then cover step 1, not the start-up (model init, resume).
        let _ = crate::gpu_memory::reset_peak(gpu);
    }
    let startup_s = started.elapsed().as_secs_f64();
    let requests = checkpoint::Requests::from_env();
    let mut rig = Rig { model, opt, coll, receipts, totals: Totals::default(), requests };
    let (step, last_loss) = rig.train(&ctx, &train, val.as_ref(), start_step, peak)?;
    let goodput = rig.totals.goodput(step, started.elapsed().as_secs_f64(), startup_s);
    rig.receipts.emit("goodput", goodput)?;
    rig.receipts.emit("exit", json!({"step": step, "status": "ok", "loss": last_loss}))?;
    drop(rig);
    Ok(())
}

impl Rig {
    /// The steps from `start_step` to the run's end (or `--stop-after`): the step reached and
    /// the last loss.
    fn train(
        &mut self,
        ctx: &Ctx<'_>,
        train: &TokenSet,
        val: Option<&TokenSet>,
        start_step: i64,
        peak: Option<f64>,
    ) -> Result<(i64, f64)> {
        let mut memory = MemoryPeaks::default();
        let mut last_loss = f64::NAN;
        let mut step = start_step;
        let mut profiler = crate::profiler::Profiler::new(ctx.spec.profile.clone(), ctx.device.is_cuda());
        let clock = crate::clock::Clock::new(ctx.device);
        while step < ctx.cfg.num_iterations {
            profiler.before(step + 1)?;
            let facts = self.step(ctx, train, &clock, step)?;
            if !facts.loss.is_finite() {
                let exit = json!({"step": step, "status": "failed", "reason": "non-finite loss"});
                self.receipts.emit("exit", exit)?;
                bail!("step {step}: loss is {}", facts.loss);
            }
            (step, last_loss) = (facts.step, facts.loss);
            self.totals.train_s += facts.dt;
            self.receipts.emit("step", step_receipt(ctx, &self.opt, &facts, peak, &mut memory))?;
            if let Some(trace) = profiler.after(step)? {
                eprintln!("rank {}: profile of steps to {step} written to {}", ctx.env.rank, trace.display());
            }
            self.between_steps(ctx, val, step, facts.loss)?;
            if ctx.spec.stop_after == Some(step) {
                break;
            }
        }
        Ok((step, last_loss))
    }

    /// One optimizer step after `step`: forward and backward over its micro-batches, the
    /// optimizer, and the loss averaged over the ranks.
    fn step(
        &mut self,
        ctx: &Ctx<'_>,
        train: &TokenSet,
        clock: &crate::clock::Clock,
        step: i64,
    ) -> Result<StepFacts> {
        let cfg = ctx.cfg;
        let t0 = Instant::now();
        self.coll.synchronize();
        let m0 = clock.mark();
        let (loss_sum, grads) = fwd_bwd(ctx, &self.model, train, step)?;
        let m1 = clock.mark();
        let (lrm, momentum, wd) =
            (cfg.lr_multiplier(step), cfg.muon_momentum(step), cfg.muon_weight_decay(step));
        let schedule = (lrm, momentum, wd);
        let (phases, grad_norm) =
            self.opt.step(&mut self.model, grads, self.coll.as_mut(), clock, schedule)?;
        // The optimizer ended with the GPU synchronised: both marks are read without waiting.
        let fwd_bwd_s = crate::clock::Clock::seconds(&m0, &m1);
        let mut loss_t = loss_sum / ctx.accum as f64;
        self.coll.all_reduce_avg(&mut loss_t)?;
        let loss = loss_t.double_value(&[]);
        let dt = t0.elapsed().as_secs_f64();
        Ok(StepFacts { step: step + 1, loss, lrm, momentum, wd, dt, fwd_bwd_s, phases, grad_norm })
    }

    /// Between steps: an evaluation and a checkpoint where due. A checkpoint asked of this
    /// host (it is going away) is taken, and then no further step: trainyard stops the ranks
    /// once every one has checkpointed, and the next attempt resumes here.
    fn between_steps(&mut self, ctx: &Ctx<'_>, val: Option<&TokenSet>, step: i64, loss: f64) -> Result<()> {
        let coll = self.coll.as_mut();
        if let Some(receipt) = eval_if_due(ctx, &self.model, val, coll, step, &mut self.totals)? {
            self.receipts.emit("eval", receipt)?;
        }
        let asked = checkpoint_asked(ctx, &mut self.requests, self.coll.as_mut(), step)?;
        let state = (&self.model, &self.opt);
        if let Some(receipt) =
            checkpoint_if_due(ctx, asked, state, self.coll.as_mut(), step, loss, &mut self.totals)?
        {
            self.receipts.emit("checkpoint", receipt)?;
        }
        if asked {
            eprintln!("rank {}: checkpointed at step {step} as asked; waiting to be moved", ctx.env.rank);
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        Ok(())
    }
}

/// What one optimizer step measured, for its receipt.
struct StepFacts {
    step: i64,
    loss: f64,
    lrm: f64,
    momentum: f64,
    wd: f64,
    dt: f64,
    fwd_bwd_s: f64,
    phases: crate::optim::Phases,
    grad_norm: f64,
}

/// The step receipt (schema v1: milliseconds, bytes, MFU as a fraction of the dense bf16 peak
/// of all the job's GPUs).
fn step_receipt(
    ctx: &Ctx<'_>,
    opt: &MuonAdamW,
    f: &StepFacts,
    peak: Option<f64>,
    memory: &mut MemoryPeaks,
) -> Value {
    let cfg = ctx.cfg;
    let tokens_per_s = cfg.total_batch_size as f64 / f.dt;
    let mfu = peak.map(|p| cfg.model.flops_per_token() * tokens_per_s / (p * ctx.env.world as f64));
    let (mem, mem_fields) = memory.read(ctx.device);
    let phases = &f.phases;
    json!({
        "step": f.step,
        "loss": f.loss,
        "lr": opt.muon.first().map(|g| g.initial_lr * f.lrm),
        "lrm": f.lrm,
        "muon_momentum": f.momentum,
        "muon_weight_decay": f.wd,
        "tokens": cfg.total_batch_size,
        "tokens_total": f.step * cfg.total_batch_size,
        "step_time_ms": f.dt * 1e3,
        "fwd_bwd_ms": f.fwd_bwd_s * 1e3,
        "optimizer_ms": (phases.reduce_s + phases.compute_gather_s + phases.wait_s) * 1e3,
        "optimizer_reduce_ms": phases.reduce_s * 1e3,
        "optimizer_compute_gather_ms": phases.compute_gather_s * 1e3,
        "optimizer_wait_ms": phases.wait_s * 1e3,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "mfu_peak_flops": if peak.is_some() { json!(peak) } else { json!("unknown") },
        "mem_allocated_bytes": mem.as_ref().map(|m| m.allocated_bytes),
        "mem_reserved_bytes": mem.as_ref().map(|m| m.reserved_bytes),
        "mem_peak_allocated_bytes": mem.as_ref().map(|m| m.peak_allocated_bytes),
        "mem_peak_reserved_bytes": mem.as_ref().map(|m| m.peak_reserved_bytes),
        "memory": mem_fields,
        "grad_norm": f.grad_norm,
    })
}

/// The model (initial weights drawn, or read from `--init-weights`, and exported with
/// `--export-init`) and its optimizer.
fn build(spec: &RunSpec, env: &RankEnv, device: Device) -> Result<(Gpt, MuonAdamW)> {
    let cfg = &spec.cfg;
    let mut model = Gpt::new(&cfg.model, device, cfg.seed);
    if let Some(w) = &spec.init_weights {
        let t = Tensor::read_safetensors(w).with_context(|| format!("read {}", w.display()))?;
        model.load_named(&t)?;
    }
    let opt = MuonAdamW::new(&model, cfg, env.rank, env.world);
    opt.check(&model)?;
    if let (Some(p), 0) = (&spec.export_init, env.rank) {
        let named: Vec<(String, Tensor)> =
            model.named().into_iter().map(|(n, t)| (n, t.detach().to_device(Device::Cpu))).collect();
        Tensor::write_safetensors(&named, p)?;
    }
    Ok((model, opt))
}

/// One rank alone, NCCL between GPUs, or the TCP ring between CPU ranks.
fn open_collectives(env: &RankEnv, device: Device) -> Result<Box<dyn Collectives>> {
    let timeout = Duration::from_secs(300);
    Ok(if env.world == 1 {
        let gpu = match device {
            Device::Cuda(gpu) => Some(gpu),
            _ => None,
        };
        Box::new(Single { gpu })
    } else if let Device::Cuda(gpu) = device {
        Box::new(Nccl::connect(&env.master, env.rank, env.world, gpu, timeout)?)
    } else {
        Box::new(TcpRing::connect(&env.master, env.rank, env.world, timeout)?)
    })
}

/// With `--resume`, loads the newest complete checkpoint's weights and this rank's optimizer
/// shard; returns the step to continue from (0 without one).
fn resume(spec: &RunSpec, env: &RankEnv, model: &mut Gpt, opt: &mut MuonAdamW) -> Result<i64> {
    if !spec.resume {
        return Ok(0);
    }
    let dir = spec.checkpoint_dir.as_ref().context("--resume needs --checkpoint-dir")?;
    let Some(&step) = checkpoint::complete_steps(dir).last() else { return Ok(0) };
    let d = checkpoint::step_dir(dir, step);
    let w = Tensor::read_safetensors(d.join("model.safetensors"))?;
    model.load_named(&w)?;
    let o = Tensor::load_multi(d.join(format!("optim_rank{}.ot", env.rank)))
        .with_context(|| format!("optimizer shard of rank {} in {}", env.rank, d.display()))?;
    opt.load_state(model, &o)?;
    Ok(step)
}

/// Forward and backward over the step's micro-batches: the summed loss (0-d) and the gradients
/// of the mean loss, in parameter order.
fn fwd_bwd(ctx: &Ctx<'_>, model: &Gpt, train: &TokenSet, step: i64) -> Result<(Tensor, Vec<Tensor>)> {
    let (cfg, accum, device) = (ctx.cfg, ctx.accum, ctx.device);
    let (b, seq_len) = (cfg.device_batch_size, cfg.model.seq_len);
    let (world, rank) = (ctx.env.world as i64, ctx.env.rank as i64);
    let mut loss_sum = Tensor::zeros([], (tch::Kind::Float, device));
    let mut grads: Vec<Tensor> = Vec::new();
    for micro in 0..accum {
        let rows = train.random_rows(cfg.seed, first_row(step, micro, accum, world, rank, b), b as usize);
        let (x, y) = to_batch(&rows, b, seq_len, device);
        let (loss, micro_grads) = model.loss_and_grads(&x, &y, 1.0 / accum as f64, ctx.loss_path)?;
        if grads.is_empty() {
            grads = micro_grads;
        } else {
            for (sum, g) in grads.iter_mut().zip(&micro_grads) {
                *sum += g;
            }
        }
        loss_sum += loss;
    }
    Ok((loss_sum, grads))
}

/// The training shards and, if given, the validation shards (needed by `--eval-every`).
fn open_data(spec: &RunSpec) -> Result<(TokenSet, Option<TokenSet>)> {
    let (seq_len, vocab) = (spec.cfg.model.seq_len, spec.cfg.model.vocab_size);
    let train = TokenSet::open("train", &spec.train_shards, seq_len, vocab)?;
    let val = if spec.val_shards.is_empty() {
        None
    } else {
        Some(TokenSet::open("val", &spec.val_shards, seq_len, vocab)?)
    };
    if spec.cfg.eval_every > 0 && val.is_none() {
        bail!("--eval-every needs --val shards");
    }
    Ok((train, val))
}

/// Evaluates every `eval_every` steps and at the end; returns the eval receipt.
fn eval_if_due(
    ctx: &Ctx<'_>,
    model: &Gpt,
    val: Option<&TokenSet>,
    coll: &mut dyn Collectives,
    step: i64,
    totals: &mut Totals,
) -> Result<Option<Value>> {
    let cfg = ctx.cfg;
    let due = cfg.eval_every > 0 && (step % cfg.eval_every == 0 || step == cfg.num_iterations);
    let Some(val) = val.filter(|_| due) else { return Ok(None) };
    let te = Instant::now();
    let v = eval(ctx, model, val, coll)?;
    let took = te.elapsed().as_secs_f64();
    totals.eval_s += took;
    Ok(Some(json!({"step": step, "val_loss": v, "batches": cfg.eval_batches, "duration_ms": took * 1e3})))
}

/// The mean validation loss over `eval_batches` batches per rank, averaged over the ranks.
fn eval(ctx: &Ctx<'_>, model: &Gpt, val: &TokenSet, coll: &mut dyn Collectives) -> Result<f64> {
    let (cfg, device) = (ctx.cfg, ctx.device);
    let (b, seq_len) = (cfg.device_batch_size, cfg.model.seq_len);
    let (world, rank) = (ctx.env.world as i64, ctx.env.rank as i64);
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
}

/// Whether any rank was asked for a checkpoint (a preemption notice), agreed by all ranks every
/// `REQUEST_EVERY` steps; only with a checkpoint directory.
fn checkpoint_asked(
    ctx: &Ctx<'_>,
    requests: &mut checkpoint::Requests,
    coll: &mut dyn Collectives,
    step: i64,
) -> Result<bool> {
    if !requests.watched() || step % checkpoint::REQUEST_EVERY != 0 {
        return Ok(false);
    }
    let mut flag = Tensor::from_slice(&[f32::from(u8::from(requests.seen()))]).to_device(ctx.device);
    coll.all_reduce_avg(&mut flag)?;
    Ok(flag.double_value(&[0]) > 0.0 && ctx.spec.checkpoint_dir.is_some())
}

/// Checkpoints when asked, or every `checkpoint_every` steps and at the end, if the run has a
/// checkpoint directory; returns the checkpoint receipt.
fn checkpoint_if_due(
    ctx: &Ctx<'_>,
    asked: bool,
    (model, opt): (&Gpt, &MuonAdamW),
    coll: &mut dyn Collectives,
    step: i64,
    loss: f64,
    totals: &mut Totals,
) -> Result<Option<Value>> {
    let cfg = ctx.cfg;
    let due =
        asked || cfg.checkpoint_every > 0 && (step % cfg.checkpoint_every == 0 || step == cfg.num_iterations);
    let Some(dir) = ctx.spec.checkpoint_dir.as_ref().filter(|_| due) else { return Ok(None) };
    let tc = Instant::now();
    let (bytes, d) = save_checkpoint(ctx, dir, model, opt, coll, step, loss)?;
    let secs = tc.elapsed().as_secs_f64();
    totals.ckpt_s += secs;
    Ok(Some(
        json!({"step": step, "bytes": bytes, "duration_ms": secs * 1e3, "path": d.display().to_string()}),
    ))
}

/// Writes the checkpoint of `step` under `dir`: every rank its optimizer shard, rank 0 the
/// weights and, once every shard is on disk, the manifest that makes it complete. Returns the
/// bytes written and the step's directory.
fn save_checkpoint(
    ctx: &Ctx<'_>,
    dir: &std::path::Path,
    model: &Gpt,
    opt: &MuonAdamW,
    coll: &mut dyn Collectives,
    step: i64,
    loss: f64,
) -> Result<(u64, PathBuf)> {
    let (cfg, env) = (ctx.cfg, ctx.env);
    let d = checkpoint::step_dir(dir, step);
    std::fs::create_dir_all(&d)?;
    let mut bytes = 0;
    let state = opt.state_tensors(model);
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
    let mut barrier = Tensor::zeros([1], (tch::Kind::Float, ctx.device));
    coll.all_reduce_avg(&mut barrier)?;
    coll.synchronize();
    if env.rank == 0 {
        let meta = json!({
            "step": step, "world_size": env.world, "seed": cfg.seed,
            "data_position": {"next_step": step, "rows_per_step": cfg.total_batch_size / cfg.model.seq_len},
            "rng": {"data": "stateless splitmix64(seed, global row)", "seed": cfg.seed},
            "loss": loss, "config": cfg,
        });
        bytes += checkpoint::write_manifest(&d, meta)?;
    }
    Ok((bytes, d))
}

/// GPU memory over the run: the driver's view of the whole device and the caching allocator's
/// peaks (the allocator's own peaks are reset each step).
#[derive(Default)]
struct MemoryPeaks {
    device_used: Option<u64>,
    allocator: Option<(u64, u64)>,
}

impl MemoryPeaks {
    /// This step's allocator statistics and the receipt's `memory` object.
    fn read(&mut self, device: Device) -> (Option<crate::gpu_memory::MemoryStats>, Value) {
        let Device::Cuda(gpu) = device else {
            return (None, json!({"note": "CPU device: no GPU memory statistics"}));
        };
        let used = cudarc::driver::result::mem_get_info().ok().map(|(free, total)| (total - free) as u64);
        if let Some(u) = used {
            self.device_used = Some(self.device_used.unwrap_or(0).max(u));
        }
        let stats = crate::gpu_memory::read(gpu);
        let mut memory = json!({
            "device_used_bytes": used,
            "device_used_peak_bytes": self.device_used,
            "source": "mem_*: c10 CUDA caching allocator, aggregate pool, peaks over this step; device_used_*: driver, whole device, peak over the run",
        });
        match &stats {
            Ok(s) => {
                let _ = crate::gpu_memory::reset_peak(gpu);
                let (a, r) = self.allocator.unwrap_or((0, 0));
                self.allocator = Some((a.max(s.peak_allocated_bytes), r.max(s.peak_reserved_bytes)));
                memory["run_peak_allocated_bytes"] = json!(self.allocator.map(|p| p.0));
                memory["run_peak_reserved_bytes"] = json!(self.allocator.map(|p| p.1));
            }
            Err(why) => memory["note"] = json!(format!("no caching-allocator statistics: {why}")),
        }
        (stats.ok(), memory)
    }
}

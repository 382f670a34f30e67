//! `trainyard-engine`: the per-rank binary of trainyard's built-in engine. The agent starts one
//! per rank with the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) and
//! TRAINYARD_RECEIPTS; see docs/engine.md.
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use trainyard_engine::config::{GPT2_VOCAB, GptConfig, TrainConfig};
use trainyard_engine::train::{RankEnv, RunSpec};

#[derive(Parser)]
#[command(name = "trainyard-engine", version, about = "trainyard's built-in GPT training engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the libtorch / CUDA facts of this process as JSON.
    Info,
    /// Train (one process per rank; the rank comes from RANK / WORLD_SIZE).
    Train(Box<TrainArgs>),
    /// Turn text files into GPT-2 BPE token shards (train_*.bin, val_*.bin).
    Tokenize {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Fraction of every document's tokens (its tail) that goes to validation.
        #[arg(long, default_value_t = 0.1)]
        val_fraction: f64,
        /// Tokens per shard.
        #[arg(long, default_value_t = 100_000_000)]
        shard_tokens: usize,
        /// Renumber the ids present densely (vocab.json maps them back to GPT-2 ids).
        #[arg(long)]
        compact: bool,
        files: Vec<PathBuf>,
    },
    /// Unigram entropy (nats per token) of shards.
    Entropy { shards: Vec<PathBuf> },
}

#[derive(Args)]
struct TrainArgs {
    /// Model preset: d4 (tests) ... d26.
    #[arg(long, default_value = "d4")]
    preset: String,
    /// Training shards (files).
    #[arg(long = "train", num_args = 1..)]
    train: Vec<PathBuf>,
    /// Directory of shards: train_*.bin for training, val_*.bin for validation (the agent's
    /// builtin engine passes its `data` here).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Validation shards.
    #[arg(long = "val", num_args = 1..)]
    val: Vec<PathBuf>,
    #[arg(long, default_value_t = 2048)]
    seq_len: i64,
    #[arg(long, default_value_t = GPT2_VOCAB)]
    vocab_size: i64,
    /// Rows per forward pass per rank.
    #[arg(long, default_value_t = 32)]
    device_batch_size: i64,
    /// Tokens per optimizer step over all ranks (default: one forward pass on every rank).
    #[arg(long)]
    total_batch_size: Option<i64>,
    #[arg(long, default_value_t = 1000)]
    num_iterations: i64,
    #[arg(long, default_value_t = 40)]
    warmup_steps: i64,
    #[arg(long, default_value_t = 0.65)]
    warmdown_ratio: f64,
    #[arg(long, default_value_t = 0.05)]
    final_lr_frac: f64,
    #[arg(long, default_value_t = 0.02)]
    matrix_lr: f64,
    #[arg(long, default_value_t = 0.3)]
    embedding_lr: f64,
    #[arg(long, default_value_t = 0.008)]
    unembedding_lr: f64,
    #[arg(long, default_value_t = 0.5)]
    scalar_lr: f64,
    #[arg(long, default_value_t = 0.28)]
    weight_decay: f64,
    /// Multiplier of every LR (default: nanochat's sqrt(total_batch_size / 2^19)).
    #[arg(long)]
    lr_scale: Option<f64>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Validation loss every N steps (0: never).
    #[arg(long, default_value_t = 0)]
    eval_every: i64,
    /// Validation batches per rank per evaluation.
    #[arg(long, default_value_t = 8)]
    eval_batches: i64,
    /// Checkpoint every N steps and at the end (0: never).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: i64,
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Continue from the newest complete checkpoint in --checkpoint-dir, if any (also when
    /// TRAINYARD_RESUME=1).
    #[arg(long)]
    resume: bool,
    /// cpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Intra-op threads of libtorch on CPU.
    #[arg(long)]
    threads: Option<i32>,
    /// Start from these weights (safetensors, names as exported).
    #[arg(long)]
    init_weights: Option<PathBuf>,
    /// Write the initial weights (safetensors) before training.
    #[arg(long)]
    export_init: Option<PathBuf>,
    /// Attention windows per layer, repeated over the layers: L = the whole context, S = a
    /// quarter of it rounded up to 128 tokens; the last layer is always L. nanochat: SSSL.
    #[arg(long, default_value = "L")]
    window_pattern: String,
    /// Run the output layer and the loss unfused, through autograd over fp32 logits (as eager
    /// PyTorch does), instead of the chunked fused path (GPU; the CPU always runs unfused).
    #[arg(long)]
    unfused_loss: bool,
    /// Run the blocks' rotary embedding, QK-norm, ReLU^2 and residual mix as separate libtorch
    /// ops (as eager PyTorch does) instead of the fused kernels (GPU; the CPU always runs them so).
    #[arg(long)]
    unfused_blocks: bool,
    /// Record these steps (A-B or A, counted from 1) with libtorch's profiler: CPU ops and, on
    /// a GPU, every kernel; written as a Chrome trace to --profile-out.
    #[arg(long)]
    profile_steps: Option<String>,
    /// Where --profile-steps writes its trace.
    #[arg(long, default_value = "trainyard-profile.json")]
    profile_out: PathBuf,
    /// Stop after this step as if the rank had been killed (tests of resume).
    #[arg(long, hide = true)]
    stop_after: Option<i64>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Info => {
            let info = trainyard_engine::runtime_info();
            println!("{}", serde_json::to_string_pretty(&info)?);
        }
        Command::Tokenize { out, val_fraction, shard_tokens, compact, files } => {
            let (t, v, vocab) =
                trainyard_engine::data::tokenize_files(&files, &out, val_fraction, shard_tokens, compact)?;
            println!(
                "tokenize: {t} train tokens, {v} validation tokens in {}; vocab_size {vocab}",
                out.display()
            );
        }
        Command::Entropy { shards } => {
            println!("{:.6}", trainyard_engine::data::unigram_entropy(&shards)?);
        }
        Command::Train(a) => train(*a)?,
    }
    Ok(())
}

/// `train`: the run's configuration from the flags and the rank's environment, then the run.
fn train(mut a: TrainArgs) -> Result<()> {
    let env = RankEnv::from_env()?;
    if let Some(dir) = &a.data {
        let list = |prefix: &str| -> Result<Vec<PathBuf>> {
            let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| anyhow::anyhow!("--data {}: {e}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let n = p.file_name().unwrap_or_default().to_string_lossy();
                    n.starts_with(prefix) && n.ends_with(".bin")
                })
                .collect();
            v.sort();
            Ok(v)
        };
        a.train.extend(list("train_")?);
        a.val.extend(list("val_")?);
    }
    anyhow::ensure!(!a.train.is_empty(), "no training shards (--train FILES or --data DIR)");
    let model =
        GptConfig::preset(&a.preset, a.seq_len, a.vocab_size)?.with_window_pattern(&a.window_pattern)?;
    let total = a.total_batch_size.unwrap_or(a.device_batch_size * a.seq_len * env.world as i64);
    let cfg = TrainConfig {
        model,
        device_batch_size: a.device_batch_size,
        total_batch_size: total,
        num_iterations: a.num_iterations,
        warmup_steps: a.warmup_steps,
        warmdown_ratio: a.warmdown_ratio,
        final_lr_frac: a.final_lr_frac,
        matrix_lr: a.matrix_lr,
        embedding_lr: a.embedding_lr,
        unembedding_lr: a.unembedding_lr,
        scalar_lr: a.scalar_lr,
        weight_decay: a.weight_decay,
        lr_scale: a.lr_scale,
        seed: a.seed,
        eval_every: a.eval_every,
        eval_batches: a.eval_batches,
        checkpoint_every: a.checkpoint_every,
    };
    let spec = RunSpec {
        cfg,
        train_shards: a.train,
        val_shards: a.val,
        device: a.device,
        threads: a.threads,
        checkpoint_dir: a.checkpoint_dir,
        // The agent sets TRAINYARD_RESUME=1 in a restarted attempt of a job whose restart
        // policy says resume.
        resume: a.resume || std::env::var("TRAINYARD_RESUME").is_ok_and(|v| v == "1"),
        init_weights: a.init_weights,
        export_init: a.export_init,
        stop_after: a.stop_after,
        unfused_loss: a.unfused_loss,
        unfused_blocks: a.unfused_blocks,
        profile: a
            .profile_steps
            .as_deref()
            .map(|s| trainyard_engine::profiler::ProfileSpec::parse(s, a.profile_out.clone()))
            .transpose()?,
    };
    trainyard_engine::train::run(spec, env)?;
    Ok(())
}

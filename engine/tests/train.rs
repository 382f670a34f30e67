//! The engine binary end to end on the shipped corpus (license texts from Debian's
//! /usr/share/common-licenses, in engine/corpus), on CPU. Times are for 2 busy cores.
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

mod common;

use common::{BIN, Corpus, corpus};

fn base_args(c: &Corpus, steps: i64) -> Vec<String> {
    [
        "train",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--preset",
        "d4",
        "--seq-len",
        "64",
        "--device-batch-size",
        "4",
        "--total-batch-size",
        "512",
        "--warmup-steps",
        "5",
        "--lr-scale",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--vocab-size".into(),
        c.vocab.to_string(),
        "--num-iterations".into(),
        steps.to_string(),
        "--train".into(),
        c.train.display().to_string(),
        "--val".into(),
        c.val.display().to_string(),
    ])
    .collect()
}

fn run(args: &[String], env: &[(&str, String)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn receipts(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn losses(r: &[Value]) -> Vec<f64> {
    r.iter().filter(|v| v["kind"] == "step").map(|v| v["loss"].as_f64().unwrap()).collect()
}

/// About 40 s (150 steps of d4 at 512 tokens; 2-3 minutes when the cores are shared).
#[test]
fn d4_learns_below_unigram_entropy() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("r.jsonl");
    let mut args = base_args(&c, 150);
    args.extend(["--eval-every", "50", "--eval-batches", "8"].map(String::from));
    let i = args.iter().position(|s| s == "--threads").unwrap();
    args[i + 1] = "2".into();
    // 8 rows per pass; 8 eval batches of 8 rows cover 4096 of the 4765 validation tokens.
    let i = args.iter().position(|s| s == "--device-batch-size").unwrap();
    args[i + 1] = "8".into();
    let out = run(&args, &[("TRAINYARD_RECEIPTS", rec.display().to_string())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ent = Command::new(BIN).arg("entropy").arg(&c.val).output().unwrap();
    let entropy: f64 = String::from_utf8_lossy(&ent.stdout).trim().parse().unwrap();
    let r = receipts(&rec);
    let evals: Vec<f64> =
        r.iter().filter(|v| v["kind"] == "eval").map(|v| v["val_loss"].as_f64().unwrap()).collect();
    eprintln!("unigram entropy {entropy:.3}, validation losses {evals:?}");
    assert_eq!(evals.len(), 3);
    // Measured: entropy 5.46 nats; validation 5.48 / 5.05 / 4.76 at steps 50 / 100 / 150.
    assert!(*evals.last().unwrap() < entropy - 0.4, "{evals:?} vs entropy {entropy}");
    assert!(evals[2] < evals[0]);
    let kinds: Vec<&str> = r.iter().map(|v| v["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"launch"));
    assert_eq!(&kinds[kinds.len() - 2..], &["goodput", "exit"]);
    let step = r.iter().find(|v| v["kind"] == "step").unwrap();
    let v1 =
        ["loss", "lr", "tokens", "step_time_ms", "fwd_bwd_ms", "optimizer_ms", "tokens_per_s", "grad_norm"];
    for f in v1 {
        assert!(step[f].is_number(), "step receipt lacks {f}: {step}");
    }
    assert!(r.iter().all(|v| v["schema"] == 1), "every receipt says schema 1");
    assert!(step["optimizer_reduce_ms"].is_number() && step["optimizer_wait_ms"].is_number());
    assert!(step["step"].is_u64());
    assert_eq!(step["mfu_peak_flops"], "unknown");
}

/// About 10 s: 8 steps straight vs 4 steps, "killed", resumed from the checkpoint.
#[test]
fn resume_gives_identical_losses() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("a.jsonl");
    let out = run(&base_args(&c, 8), &[("TRAINYARD_RECEIPTS", straight.display().to_string())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ck = dir.path().join("ck");
    let mut args = base_args(&c, 8);
    args.extend(["--checkpoint-every", "4", "--resume", "--checkpoint-dir"].map(String::from));
    args.push(ck.display().to_string());
    let first = dir.path().join("b.jsonl");
    let mut a1 = args.clone();
    a1.extend(["--stop-after", "5"].map(String::from));
    let out = run(&a1, &[("TRAINYARD_RECEIPTS", first.display().to_string())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r1 = receipts(&first);
    assert!(r1.iter().any(|v| v["kind"] == "checkpoint" && v["step"] == 4));
    let second = dir.path().join("c.jsonl");
    let out = run(&args, &[("TRAINYARD_RECEIPTS", second.display().to_string())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r2 = receipts(&second);
    assert_eq!(r2[0]["resumed_from"], 4);
    let full = losses(&receipts(&straight));
    let resumed: Vec<f64> = [&losses(&r1)[..4], &losses(&r2)[..]].concat();
    assert_eq!(full.len(), 8);
    assert_eq!(full, resumed, "resumed run diverged");
}

/// About 15 s: the same global batch on 1 rank (2 micro-steps) and on 2 ranks over TCP.
#[test]
fn two_cpu_ranks_match_one() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let one = dir.path().join("one.jsonl");
    let out = run(&base_args(&c, 6), &[("TRAINYARD_RECEIPTS", one.display().to_string())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let children: Vec<_> = (0..2)
        .map(|r| {
            let mut cmd = Command::new(BIN);
            cmd.args(base_args(&c, 6))
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("TRAINYARD_RECEIPTS", dir.path().join(format!("r{r}.jsonl")));
            cmd.spawn().unwrap()
        })
        .collect();
    for mut ch in children {
        assert!(ch.wait().unwrap().success());
    }
    let a = losses(&receipts(&one));
    for r in 0..2 {
        let b = losses(&receipts(&dir.path().join(format!("r{r}.jsonl"))));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(((x - y) / x).abs() < 1e-4, "rank {r}: 1-rank {a:?} vs 2-rank {b:?}");
        }
    }
}

/// Each bad input fails before the first step, with a message naming the problem.
#[test]
fn bad_inputs_fail_clearly_before_training() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let check = |args: Vec<String>, env: &[(&str, String)], want: &str| {
        let rec = dir.path().join("bad.jsonl");
        let _ = std::fs::remove_file(&rec);
        let mut env = env.to_vec();
        env.push(("TRAINYARD_RECEIPTS", rec.display().to_string()));
        let out = run(&args, &env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{want}: succeeded");
        assert!(err.contains(want), "expected {want:?} in: {err}");
        assert!(!receipts(&rec).iter().any(|v| v["kind"] == "step"), "{want}: trained");
    };
    let with_train = |p: &Path| {
        let mut a = base_args(&c, 2);
        let i = a.iter().position(|s| s == "--train").unwrap();
        a[i + 1] = p.display().to_string();
        a
    };
    check(with_train(&dir.path().join("nope.bin")), &[], "No such file");
    let bytes = std::fs::read(&c.train).unwrap();
    let short = dir.path().join("short.bin");
    std::fs::write(&short, &bytes[..bytes.len() / 2]).unwrap();
    check(with_train(&short), &[], "header claims");
    let mut magic = bytes.clone();
    magic[0..4].copy_from_slice(&1234i32.to_le_bytes());
    let wrong = dir.path().join("magic.bin");
    std::fs::write(&wrong, &magic).unwrap();
    check(with_train(&wrong), &[], "wrong magic");
    let mut a = base_args(&c, 2);
    let i = a.iter().position(|s| s == "d4").unwrap();
    a[i] = "d0".into();
    check(a, &[], "depth must be at least 1");
    // 512 tokens do not divide into 3 ranks x 4 rows x 64.
    check(base_args(&c, 2), &[("WORLD_SIZE", "3".into()), ("RANK", "0".into())], "total_batch_size");
}

/// About 3 s: step receipts carry the caching-allocator fields. On CPU they are null and
/// `memory.note` says why; on a GPU host a CUDA run fills them (reserved >= allocated, peaks >=
/// current) next to the driver's device-wide figure.
#[test]
fn step_receipts_carry_allocator_memory_fields() {
    const FIELDS: [&str; 4] =
        ["mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_allocated_bytes", "mem_peak_reserved_bytes"];
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let rec = dir.path().join("cpu.jsonl");
    let out = run(&base_args(&c, 2), &[("TRAINYARD_RECEIPTS", rec.display().to_string())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let steps: Vec<Value> = receipts(&rec).into_iter().filter(|v| v["kind"] == "step").collect();
    assert_eq!(steps.len(), 2);
    for s in &steps {
        for f in FIELDS {
            assert!(s.get(f).is_some_and(Value::is_null), "{f} should be present and null on CPU: {s}");
        }
        assert!(s["memory"]["note"].as_str().is_some_and(|n| n.contains("CPU")), "{s}");
    }

    let info = Command::new(BIN).arg("info").output().unwrap();
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    if info["cuda_available"] != true {
        eprintln!("no CUDA: the GPU half of this test is skipped");
        return;
    }
    let rec = dir.path().join("gpu.jsonl");
    let mut args = base_args(&c, 3);
    let i = args.iter().position(|s| s == "--device").unwrap();
    args[i + 1] = "cuda".into();
    let out = run(&args, &[("TRAINYARD_RECEIPTS", rec.display().to_string())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let steps: Vec<Value> = receipts(&rec).into_iter().filter(|v| v["kind"] == "step").collect();
    assert_eq!(steps.len(), 3);
    for s in &steps {
        let b = |f: &str| s[f].as_u64().unwrap_or_else(|| panic!("{f} missing on GPU: {s}"));
        assert!(b("mem_allocated_bytes") > 0, "{s}");
        assert!(b("mem_reserved_bytes") >= b("mem_allocated_bytes"), "{s}");
        assert!(b("mem_peak_allocated_bytes") >= b("mem_allocated_bytes"), "{s}");
        assert!(b("mem_peak_reserved_bytes") >= b("mem_reserved_bytes"), "{s}");
        assert!(s["memory"]["device_used_bytes"].as_u64().unwrap_or(0) >= b("mem_reserved_bytes"), "{s}");
        assert!(
            s["memory"]["run_peak_allocated_bytes"].as_u64().unwrap() >= b("mem_peak_allocated_bytes"),
            "{s}"
        );
    }
}

//! Parity with the PyTorch reference (engine/reference/gpt_ref.py): the same exported weights,
//! the same batches, fp32 on CPU, 20 steps of d4; losses within 1e-4 relative (measured:
//! 6e-8). About 20 s. Needs the venv of deploy/setup.sh (.venv/bin/python with torch).
use std::path::Path;
use std::process::Command;

mod common;

use common::{BIN, corpus};

#[test]
fn twenty_steps_match_pytorch_reference() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv/bin/python");
    assert!(python.exists(), "{} missing: run deploy/setup.sh", python.display());
    let c = corpus();
    let dir = &c.dir;
    let train = c.train.clone();
    let weights = dir.path().join("init.safetensors");
    let rec = dir.path().join("r.jsonl");
    let common = ["--lr-scale", "1", "--num-iterations", "20", "--warmup-steps", "5"];
    let out = Command::new(BIN)
        .args(["train", "--device", "cpu", "--threads", "1", "--preset", "d4", "--seq-len", "64"])
        .args(["--device-batch-size", "4", "--total-batch-size", "512"])
        .args(common)
        .arg("--vocab-size")
        .arg(c.vocab.to_string())
        .arg("--train")
        .arg(&train)
        .arg("--export-init")
        .arg(&weights)
        .env("TRAINYARD_RECEIPTS", &rec)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let engine: Vec<f64> = std::fs::read_to_string(&rec)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "step")
        .map(|v| v["loss"].as_f64().unwrap())
        .collect();
    let out = Command::new(&python)
        .arg(root.join("engine/reference/gpt_ref.py"))
        .arg("--weights")
        .arg(&weights)
        .arg("--train")
        .arg(&train)
        .args(common)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let py: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let reference: Vec<f64> = py["losses"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(engine.len(), 20);
    assert_eq!(reference.len(), 20);
    let worst = engine.iter().zip(&reference).map(|(a, b)| ((a - b) / b).abs()).fold(0.0f64, f64::max);
    eprintln!("parity: worst relative loss difference {worst:e} over 20 steps");
    assert!(worst < 1e-4, "engine {engine:?}\nreference {reference:?}");
    // It trained: the loss fell.
    assert!(engine[19] < engine[0] - 1.0, "{engine:?}");
}

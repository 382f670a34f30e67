//! Shared by the engine's integration tests: the binary and the shipped corpus, tokenized.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_trainyard-engine");

/// The corpus of engine/corpus tokenized into compact shards in a temporary directory.
pub struct Corpus {
    pub dir: tempfile::TempDir,
    pub train: PathBuf,
    pub val: PathBuf,
    pub vocab: i64,
}

pub fn corpus() -> Corpus {
    let dir = tempfile::tempdir().unwrap();
    let texts = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&texts).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let out = Command::new(BIN)
        .args(["tokenize", "--compact", "--out"])
        .arg(dir.path())
        .args(&files)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let vocab: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("vocab.json")).unwrap()).unwrap();
    Corpus {
        train: dir.path().join("train_000000.bin"),
        val: dir.path().join("val_000000.bin"),
        vocab: vocab["vocab_size"].as_i64().unwrap(),
        dir,
    }
}

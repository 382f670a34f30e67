//! Checkpoints that are complete or absent, never half-written.
//!
//! Every file goes to a temporary name, is fsynced, renamed into place, and its directory is
//! fsynced ([`save_atomic`]); after every rank's files are in place, rank 0 writes the
//! manifest (`meta.json`, the same way) listing each file with its size. A step directory
//! counts only when its manifest exists and every file it lists has the listed size
//! ([`complete_steps`]), so a rank killed mid-write, a full disk or a torn copy is skipped and
//! the run resumes from the newest complete one (a corrupt "latest" pointer once cost
//! Megatron-LM 44 identical restart cycles; there is no pointer here to corrupt).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// The manifest of a step directory.
pub const MANIFEST: &str = "meta.json";

/// The directory of step `step` under `dir`.
pub fn step_dir(dir: &Path, step: i64) -> PathBuf {
    dir.join(format!("step_{step:06}"))
}

/// Writes `path` through `write` (which is given a temporary path) so that `path` is either
/// absent or complete and on disk; returns its size.
pub fn save_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<u64> {
    let tmp = path.with_extension("tmp");
    write(&tmp).with_context(|| format!("write {}", tmp.display()))?;
    File::open(&tmp).and_then(|f| f.sync_all()).with_context(|| format!("fsync {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename {} into place", tmp.display()))?;
    if let Some(parent) = path.parent() {
        File::open(parent)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("fsync {}", parent.display()))?;
    }
    Ok(std::fs::metadata(path)?.len())
}

/// Writes the manifest of step directory `dir`: `meta` plus `files`, every file now in `dir`
/// (but the manifest) with its size. Called by rank 0 once every rank's files are in place.
pub fn write_manifest(dir: &Path, mut meta: Value) -> Result<u64> {
    let mut files = serde_json::Map::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("list {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if name == MANIFEST || name.ends_with(".tmp") {
            continue;
        }
        files.insert(name, json!(entry.metadata()?.len()));
    }
    meta["files"] = Value::Object(files);
    save_atomic(&dir.join(MANIFEST), |p| {
        std::fs::write(p, serde_json::to_vec_pretty(&meta)?).map_err(Into::into)
    })
}

/// Whether a step directory is complete: its manifest parses and lists files that all exist
/// with their listed sizes.
pub fn is_complete(step_dir: &Path) -> bool {
    let Ok(text) = std::fs::read(step_dir.join(MANIFEST)) else { return false };
    let Ok(meta) = serde_json::from_slice::<Value>(&text) else { return false };
    let Some(files) = meta.get("files").and_then(Value::as_object) else { return false };
    !files.is_empty()
        && files.iter().all(|(name, size)| {
            std::fs::metadata(step_dir.join(name)).is_ok_and(|m| Some(m.len()) == size.as_u64())
        })
}

/// The steps of `dir` with a complete checkpoint, ascending.
pub fn complete_steps(dir: &Path) -> Vec<i64> {
    let mut steps: Vec<i64> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step_")?.parse().ok()?;
            is_complete(&e.path()).then_some(step)
        })
        .collect();
    steps.sort();
    steps
}

/// Steps between the ranks' agreement on a checkpoint request: one one-float all-reduce every
/// this many steps, so the request costs nothing measurable and every rank acts at one step.
pub const REQUEST_EVERY: i64 = 10;

/// Requests from trainyard to checkpoint now (a drain, a preemption notice): the agent rewrites
/// the file `TRAINYARD_CHECKPOINT_REQUEST` names; a rank has seen a request when its modification
/// time moved since the last one it answered.
#[derive(Debug, Default)]
pub struct Requests {
    path: Option<PathBuf>,
    answered: Option<SystemTime>,
}

impl Requests {
    /// The request file of this rank, from its environment (none outside trainyard).
    pub fn from_env() -> Requests {
        let path =
            std::env::var_os("TRAINYARD_CHECKPOINT_REQUEST").filter(|p| !p.is_empty()).map(PathBuf::from);
        Requests { path, answered: None }
    }

    /// Whether the ranks should look at requests at all (every rank has the same answer).
    pub fn watched(&self) -> bool {
        self.path.is_some()
    }

    /// A request this rank has not answered yet (local: the ranks then agree on it).
    pub fn seen(&mut self) -> bool {
        let Some(path) = &self.path else { return false };
        let Ok(changed) = std::fs::metadata(path).and_then(|m| m.modified()) else { return false };
        if self.answered.is_some_and(|a| changed <= a) {
            return false;
        }
        self.answered = Some(changed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> u64 {
        save_atomic(&dir.join(name), |p| std::fs::write(p, bytes).map_err(Into::into)).unwrap()
    }

    #[test]
    fn each_request_is_seen_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.request");
        let mut r = Requests { path: Some(path.clone()), answered: None };
        assert!(!r.seen(), "no request yet");
        std::fs::write(&path, "1 drain").unwrap();
        assert!(r.seen());
        assert!(!r.seen(), "answered");
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        File::options().write(true).open(&path).unwrap().set_modified(later).unwrap();
        assert!(r.seen(), "a new request");
        assert!(!Requests::default().watched());
    }

    #[test]
    fn only_steps_whose_manifest_matches_their_files_count() {
        let root = tempfile::tempdir().unwrap();
        for step in [10, 20, 30, 40] {
            let d = step_dir(root.path(), step);
            std::fs::create_dir_all(&d).unwrap();
            assert_eq!(write(&d, "model.safetensors", &[1; 64]), 64);
            write(&d, "optim_rank0.ot", &[2; 32]);
            if step != 40 {
                write_manifest(&d, json!({"step": step})).unwrap();
            }
        }
        // 20: a shard torn after the manifest was written; 30: a shard gone.
        std::fs::write(step_dir(root.path(), 20).join("optim_rank0.ot"), [2; 7]).unwrap();
        std::fs::remove_file(step_dir(root.path(), 30).join("optim_rank0.ot")).unwrap();
        // A leftover temporary file of a write cut short is neither listed nor counted.
        std::fs::write(step_dir(root.path(), 10).join("optim_rank1.tmp"), [0; 3]).unwrap();
        assert_eq!(complete_steps(root.path()), [10], "40 has no manifest, 20 and 30 are broken");
        let meta: Value =
            serde_json::from_slice(&std::fs::read(step_dir(root.path(), 10).join(MANIFEST)).unwrap())
                .unwrap();
        assert_eq!(meta["files"]["model.safetensors"], 64);
        assert_eq!(meta["step"], 10);
    }
}

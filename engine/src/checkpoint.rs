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

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> u64 {
        save_atomic(&dir.join(name), |p| std::fs::write(p, bytes).map_err(Into::into)).unwrap()
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

//! Where a restarted attempt resumes (docs/faults.md, "Resume"): the newest checkpoint that is
//! complete where its ranks will read it, whether or not its receipts reached the controller.
//!
//! The controller sends the checkpoints every rank of an earlier attempt reported (newest
//! first). Receipts can lag: a host whose agent was away when a checkpoint was written reports
//! it only when the agent returns, and a restart meanwhile would resume from an older one and
//! redo every step between. So the shim, as the job's user, also looks beside each reported
//! checkpoint for newer ones of the same naming (`step_120` beside `step_100`, zero padding
//! kept) and takes one only when its manifest, written last, is there: PyTorch DCP's
//! `.metadata`, the built-in engine's `meta.json`, or a `manifest.json`. A checkpoint on a disk
//! this host cannot see (node-local storage on another host) is not seen: the newest complete
//! one that can be read is used.

use std::path::{Path, PathBuf};

/// Files whose presence says a checkpoint directory is complete: each is written last, once
/// every shard is.
pub const MANIFESTS: [&str; 3] = [".metadata", "meta.json", "manifest.json"];

/// How many entries of a checkpoint folder are looked at, at most (a folder of millions of
/// files must not stall a rank's start).
const MAX_ENTRIES: usize = 100_000;

/// The checkpoints to try, newest first: the reported ones, and the complete ones newer than
/// the newest reported that sit beside a reported one under the same naming.
pub fn candidates(reported: &[(i64, String)]) -> Vec<(i64, String)> {
    let newest = reported.iter().map(|(s, _)| *s).max();
    let mut all: Vec<(i64, String)> = reported.to_vec();
    let mut looked: Vec<PathBuf> = Vec::new();
    for (step, path) in reported {
        let path = Path::new(path);
        let (Some(parent), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
            continue;
        };
        let Some((prefix, _, suffix)) = split_step(name, *step) else { continue };
        if looked.iter().any(|p| p == parent) {
            continue;
        }
        looked.push(parent.to_path_buf());
        let Ok(entries) = std::fs::read_dir(parent) else { continue };
        for entry in entries.flatten().take(MAX_ENTRIES) {
            let other = entry.file_name();
            let Some(other) = other.to_str() else { continue };
            let Some(found) = step_of(other, prefix, suffix) else { continue };
            if newest.is_some_and(|n| found > n) && complete(&entry.path()) {
                all.push((found, entry.path().display().to_string()));
            }
        }
    }
    all.sort_by_key(|c| std::cmp::Reverse(c.0));
    all.dedup();
    all
}

/// Whether a checkpoint directory holds one of the [`MANIFESTS`] (a regular file).
pub fn complete(dir: &Path) -> bool {
    MANIFESTS.iter().any(|m| std::fs::symlink_metadata(dir.join(m)).is_ok_and(|md| md.is_file()))
}

/// `name` split around the last run of digits whose value is `step`: (prefix, digits, suffix).
fn split_step(name: &str, step: i64) -> Option<(&str, &str, &str)> {
    let bytes = name.as_bytes();
    let mut end = bytes.len();
    while end > 0 {
        while end > 0 && !bytes[end - 1].is_ascii_digit() {
            end -= 1;
        }
        let mut start = end;
        while start > 0 && bytes[start - 1].is_ascii_digit() {
            start -= 1;
        }
        if start < end && name[start..end].parse::<i64>().ok() == Some(step) {
            return Some((&name[..start], &name[start..end], &name[end..]));
        }
        end = start;
    }
    None
}

/// The step in `name` when it is `prefix`, digits, `suffix`.
fn step_of(name: &str, prefix: &str, suffix: &str) -> Option<i64> {
    let digits = name.strip_prefix(prefix)?.strip_suffix(suffix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(root: &Path, name: &str, manifest: Option<&str>) -> String {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        if let Some(m) = manifest {
            std::fs::write(d.join(m), b"{}").unwrap();
        }
        d.display().to_string()
    }

    #[test]
    fn a_newer_complete_checkpoint_beside_a_reported_one_comes_first() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let reported = dir_with(r, "step_000100", None);
        let newer = dir_with(r, "step_000140", Some(".metadata"));
        let partial = dir_with(r, "step_000160", None);
        let _older = dir_with(r, "step_000080", Some("meta.json"));
        let _other = dir_with(r, "eval_000200", Some("manifest.json"));
        let got = candidates(&[(100, reported.clone())]);
        assert_eq!(got, [(140, newer), (100, reported)], "not {partial}, nor older, nor other names");
    }

    #[test]
    fn names_split_around_the_step_and_a_link_is_no_manifest() {
        assert_eq!(split_step("ckpt-7-step_120.pt", 120), Some(("ckpt-7-step_", "120", ".pt")));
        assert_eq!(split_step("run3_step0042", 42), Some(("run3_step", "0042", "")));
        assert_eq!(split_step("step_x", 1), None);
        assert_eq!(step_of("step_0099", "step_", ""), Some(99));
        assert_eq!(step_of("step_0099.tmp", "step_", ""), None);
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("step_5");
        std::fs::create_dir_all(&d).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", d.join("manifest.json")).unwrap();
        assert!(!complete(&d), "a link is not a manifest the job wrote");
        assert_eq!(candidates(&[]), []);
    }
}

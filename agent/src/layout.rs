//! Where the agent keeps things under its data directory (see docs/internals.md):
//!
//! ```text
//! DATA/runs/job-<id>/attempt-<n>/launch.json
//! DATA/runs/job-<id>/attempt-<n>/rank-<r>/{receipts.jsonl,stdout.log,stderr.log,exit.json,rank.pid}
//! DATA/state/ranks/<job>.<attempt>.<rank>.json
//! ```
//!
//! `rank.pid` (the rank's pid, written by the shim) is ours; the rest is the documented layout.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use trainyard_proto::v1::RankKey;

/// One rank of one attempt of one job: the agent's key for everything per rank.
///
/// The proto `RankKey` derives neither `Ord` nor `Hash`, hence this twin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RankId {
    pub job_id: u64,
    pub attempt: u32,
    pub rank: u32,
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.job_id, self.attempt, self.rank)
    }
}

impl From<RankId> for RankKey {
    fn from(id: RankId) -> Self {
        RankKey { job_id: id.job_id, attempt: id.attempt, rank: id.rank }
    }
}

impl From<&RankKey> for RankId {
    fn from(key: &RankKey) -> Self {
        RankId { job_id: key.job_id, attempt: key.attempt, rank: key.rank }
    }
}

/// Paths under one data directory.
#[derive(Debug, Clone)]
pub struct Layout {
    data_dir: PathBuf,
}

impl Layout {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self { data_dir: data_dir.into() }
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn attempt_dir(&self, job_id: u64, attempt: u32) -> PathBuf {
        self.data_dir.join("runs").join(format!("job-{job_id}")).join(format!("attempt-{attempt}"))
    }

    pub fn launch_json(&self, job_id: u64, attempt: u32) -> PathBuf {
        self.attempt_dir(job_id, attempt).join("launch.json")
    }

    pub fn rank_dir(&self, id: RankId) -> PathBuf {
        self.attempt_dir(id.job_id, id.attempt).join(format!("rank-{}", id.rank))
    }

    pub fn state_dir(&self) -> PathBuf {
        self.data_dir.join("state").join("ranks")
    }

    pub fn state_file(&self, id: RankId) -> PathBuf {
        self.state_dir().join(format!("{id}.json"))
    }

    pub fn rank_files(&self, id: RankId) -> RankFiles {
        let dir = self.rank_dir(id);
        RankFiles {
            receipts: dir.join("receipts.jsonl"),
            stdout: dir.join("stdout.log"),
            stderr: dir.join("stderr.log"),
            exit: dir.join("exit.json"),
            pid: dir.join("rank.pid"),
            dir,
        }
    }
}

/// The files of one rank's run directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankFiles {
    pub dir: PathBuf,
    pub receipts: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub exit: PathBuf,
    pub pid: PathBuf,
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader (or a restarted agent) sees the old content or the new one, never half of it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

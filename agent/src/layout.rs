//! Where the agent keeps things under its data directory (see docs/internals.md):
//!
//! ```text
//! DATA/runs/<run>/attempt-<n>/launch.json
//! DATA/runs/<run>/attempt-<n>/rank-<r>/{receipts.jsonl,stdout.log,stderr.log,exit.json,rank.pid}
//! DATA/state/ranks/<job>.<attempt>.<rank>.json
//! DATA/state/runs/<run>
//! ```
//!
//! `<run>` is the job's run directory name ([`run_name`]): the controller's, unique to its job.
//!
//! `rank.pid` (the rank's pid, written by the shim) and `env.json` (the rank's environment, read
//! by the shim) are ours; the rest is the documented layout.
//!
//! Who may read what: the agent's state directory is its own, 0700. A job's run directories
//! (`<run>`, `attempt-<n>`, `rank-<r>`) are the agent's, with the job user's group and mode
//! 0710: the job's user (and whoever shares its primary group) may pass through but not list,
//! and only the agent (root) creates entries there, so a user can never plant a link where the
//! root shim writes. Every file in them is 0600: the rank's own (`receipts.jsonl`, `stdout.log`,
//! `stderr.log`) and `launch.json` (it holds the environment overlay) the job user's, the rest
//! the agent's. So nobody but the job's user and root reads a job's files, whatever the groups.

use std::fmt;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
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

    /// The run directories the agent made, one marker each (`state/runs/<run name>`): a run
    /// directory without one is not this agent's record of a launch, and is moved aside.
    pub fn made_runs_dir(&self) -> PathBuf {
        self.data_dir.join("state").join("runs")
    }

    /// A job's run directory, `runs/<run>` ([`run_name`]).
    pub fn run_dir(&self, run: &str) -> PathBuf {
        self.data_dir.join("runs").join(run)
    }

    pub fn attempt_dir(&self, run: &str, attempt: u32) -> PathBuf {
        self.run_dir(run).join(format!("attempt-{attempt}"))
    }

    pub fn launch_json(&self, run: &str, attempt: u32) -> PathBuf {
        self.attempt_dir(run, attempt).join("launch.json")
    }

    pub fn rank_dir(&self, run: &str, id: RankId) -> PathBuf {
        self.attempt_dir(run, id.attempt).join(format!("rank-{}", id.rank))
    }

    /// Space the agent keeps allocated for its own records (`state/reserve`): given up when a
    /// full disk would stop it from writing them ([`Layout::release_reserve`]).
    pub fn reserve(&self) -> PathBuf {
        self.data_dir.join("state").join("reserve")
    }

    /// Allocates the reserve when it is not there; `Ok(false)` when the disk has no room for it.
    pub fn keep_reserve(&self) -> std::io::Result<bool> {
        let path = self.reserve();
        if std::fs::metadata(&path).is_ok_and(|m| m.len() == RESERVE_BYTES as u64) {
            return Ok(true);
        }
        match allocated(&path, RESERVE_BYTES) {
            Ok(_) => Ok(true),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                if e.raw_os_error() == Some(libc::ENOSPC) { Ok(false) } else { Err(e) }
            }
        }
    }

    /// Gives the reserve up; whether there was one to give.
    pub fn release_reserve(&self) -> bool {
        std::fs::remove_file(self.reserve()).is_ok()
    }

    pub fn state_dir(&self) -> PathBuf {
        self.data_dir.join("state").join("ranks")
    }

    pub fn state_file(&self, id: RankId) -> PathBuf {
        self.state_dir().join(format!("{id}.json"))
    }

    pub fn rank_files(&self, run: &str, id: RankId) -> RankFiles {
        let dir = self.rank_dir(run, id);
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

/// The longest run directory name the agent accepts.
pub const MAX_RUN_NAME: usize = 128;

/// The name of a job's run directory: what the controller chose (`Launch.run_name`, unique to
/// its job: `job-<id>-<cluster id>-<submitted ms>`), or `job-<id>` from a controller that chose
/// none. A name that could leave `runs/` (a `/`, `..`, a leading dot) or is too long is refused.
pub fn run_name(job_id: u64, chosen: &str) -> Result<String, String> {
    if chosen.is_empty() {
        return Ok(format!("job-{job_id}"));
    }
    let fine = chosen.len() <= MAX_RUN_NAME
        && !chosen.starts_with('.')
        && chosen.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if fine {
        Ok(chosen.to_string())
    } else {
        Err(format!(
            "launch refused: run directory name {chosen:?} is not 1-{MAX_RUN_NAME} letters, digits, '-', '_' or '.' (not leading)"
        ))
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

impl RankFiles {
    /// The rank's environment as the agent hands it to the shim (root-only).
    pub fn env(&self) -> PathBuf {
        self.dir.join("env.json")
    }

    /// Written by the agent when the rank should checkpoint now (a drain or a preemption
    /// notice); the rank sees it through `TRAINYARD_CHECKPOINT_REQUEST`.
    pub fn checkpoint_request(&self) -> PathBuf {
        checkpoint_request_beside(&self.receipts)
    }
}

/// The checkpoint request file of the rank whose receipts file is `receipts`.
pub fn checkpoint_request_beside(receipts: &Path) -> PathBuf {
    receipts.with_file_name("checkpoint.request")
}

/// The space set aside for the exit status of the rank whose `exit.json` is `exit`.
pub fn exit_slot_beside(exit: &Path) -> PathBuf {
    exit.with_file_name("exit.slot")
}

/// Bytes set aside for an exit status: far more than `exit.json` ever holds.
pub const EXIT_SLOT_BYTES: i64 = 4096;

/// Creates `slot` with its blocks allocated (`fallocate`), so a later [`fill_slot`] needs no new
/// space on the disk.
pub fn allocate_slot(slot: &Path) -> std::io::Result<()> {
    // Not synced: its blocks are set aside once allocated, and it matters only while the
    // host is up (after a power cut the rank is gone too).
    allocated(slot, EXIT_SLOT_BYTES).map(drop)
}

/// Creates (or empties) the private file `path`, never through a link, with `bytes` of its
/// blocks allocated (`fallocate`).
fn allocated(path: &Path, bytes: i64) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd as _;
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(PRIVATE_FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    // SAFETY: fallocate on our own open descriptor.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Writes `bytes` into the allocated `slot` (in place: no new blocks), cuts it to their length,
/// syncs it and renames it to `path`, then syncs the directory: readers see no file or the whole
/// status. `NotFound` when there is no slot.
pub fn fill_slot(slot: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    if bytes.len() as i64 > EXIT_SLOT_BYTES {
        return Err(std::io::Error::other("the exit status is larger than its slot"));
    }
    let file = OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW).open(slot)?;
    file.write_all_at(bytes, 0)?;
    file.set_len(bytes.len() as u64)?;
    file.sync_all()?;
    std::fs::rename(slot, path)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Bytes of the agent's reserve: enough for every state file and exit status of a full node.
pub const RESERVE_BYTES: i64 = 32 << 20;

/// Free bytes of the file system holding `dir`, and its size.
pub fn disk_space(dir: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; the path is NUL-terminated.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let unit = s.f_frsize as u64;
    Ok((s.f_bavail as u64 * unit, s.f_blocks as u64 * unit))
}

/// The free space a node's data directory keeps: no launch starts and no rank output is
/// written below it, so the agent's records and exit statuses always find room. It is the
/// larger of `bytes` (`--disk-floor-mib`, 1 GiB by default) and `percent` of the file system
/// (`--disk-floor-percent`, 5 by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskFloor {
    pub bytes: u64,
    pub percent: u8,
}

impl Default for DiskFloor {
    fn default() -> Self {
        Self { bytes: 1 << 30, percent: 5 }
    }
}

impl DiskFloor {
    /// The floor on a file system of `size` bytes.
    pub fn of(&self, size: u64) -> u64 {
        self.bytes.max(size / 100 * u64::from(self.percent))
    }

    /// `Some((free, floor))` when the file system holding `dir` has less free than its floor;
    /// `Err` when its free space cannot be read.
    pub fn short(&self, dir: &Path) -> std::io::Result<Option<(u64, u64)>> {
        let (free, size) = disk_space(dir)?;
        let floor = self.of(size);
        Ok((free < floor).then_some((free, floor)))
    }
}

/// Mode of the run directories of a job (owner the agent, group the job's user's primary
/// group: pass through, never list; the files inside are private).
pub const RUN_DIR_MODE: u32 = 0o710;
/// Mode of a rank's own files (owner the job's user): nobody else reads them, whatever the
/// groups.
pub const RUN_FILE_MODE: u32 = 0o600;
/// Mode of files that may hold secrets (the environment overlay) and of the agent's state.
pub const PRIVATE_FILE_MODE: u32 = 0o600;
/// Mode of the agent's state directory.
pub const STATE_DIR_MODE: u32 = 0o700;

/// The account a file is given to: the job's user when the agent runs ranks as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Creates `dir` and its missing parents, then sets `mode` on it, and `group` when given.
pub fn make_dir(dir: &Path, mode: u32, group: Option<u32>) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    if let Some(gid) = group {
        std::os::unix::fs::chown(dir, None, Some(gid))?;
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
}

/// Writes `bytes` to `path` so that it survives a power cut whole or not at all: a fresh
/// temporary file beside it (never following a link), fsynced, renamed over `path`, then the
/// directory fsynced. Readers (and a restarted agent) see the old content or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_durable(path, bytes, PRIVATE_FILE_MODE, None)
}

/// [`write_atomic`] with the file's `mode` and, when given, its owner.
pub fn write_durable(path: &Path, bytes: &[u8], mode: u32, owner: Option<Owner>) -> std::io::Result<()> {
    write_whole(path, bytes, mode, owner, true)
}

/// Replaces `path` whole (a fresh temporary file renamed over it), without the fsyncs of
/// [`write_atomic`]: readers, and an agent restarted while the host stayed up, see the old
/// content or the new; a power cut may leave the old. For what a restarted agent can also
/// find out by itself.
pub fn write_replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_whole(path, bytes, PRIVATE_FILE_MODE, None, false)
}

/// [`write_replace`] with the file's `mode` and, when given, its owner.
pub fn write_replace_as(path: &Path, bytes: &[u8], mode: u32, owner: Option<Owner>) -> std::io::Result<()> {
    write_whole(path, bytes, mode, owner, false)
}

fn write_whole(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    owner: Option<Owner>,
    sync: bool,
) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    if let Some(o) = owner {
        std::os::unix::fs::fchown(&file, Some(o.uid), Some(o.gid))?;
    }
    file.write_all(bytes)?;
    if sync {
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if sync { sync_dir(path.parent().unwrap_or(Path::new("."))) } else { Ok(()) }
}

/// Writes a small private file (`mode`, created or truncated, never through a link) without
/// the fsyncs of [`write_durable`]: for files that matter only while the host is up.
pub fn write_private(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    file.write_all(bytes)
}

/// Makes a rename or a new entry in `dir` durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_the_larger_of_its_two_parts() {
        let floor = DiskFloor::default();
        assert_eq!(floor.of(10 << 30), 1 << 30, "1 GiB over 5 % of 10 GiB");
        assert_eq!(floor.of(100 << 30), 5 << 30, "5 % of 100 GiB over 1 GiB");
        assert_eq!(DiskFloor { bytes: 1 << 20, percent: 0 }.of(1 << 40), 1 << 20, "0 %: the bytes alone");
        let dir = tempfile::tempdir().unwrap();
        let none = DiskFloor { bytes: 0, percent: 0 };
        assert_eq!(none.short(dir.path()).unwrap(), None, "a floor of nothing is never short");
        let all = DiskFloor { bytes: u64::MAX, percent: 0 };
        let (free, floor) = all.short(dir.path()).unwrap().expect("a floor of everything is short");
        assert!(free < floor);
    }
}

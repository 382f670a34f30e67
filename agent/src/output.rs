//! A rank's stdout and stderr, as its shim keeps them: the rank writes into a pipe, never into
//! a file, and a thread of the shim copies each stream into its log file. So a rank never
//! blocks on, fails on, or fills the disk with its output:
//!
//! - each stream is capped (`--rank-output-cap-mib`): past half the cap the file is rotated to
//!   `<name>.1` (the previous `.1` is dropped), so the newest output is kept and the two files
//!   never hold more than the cap;
//! - a write that fails (the disk is full) drops what could not be written and goes on
//!   reading: the rank never sees the error;
//! - what was dropped is counted (in `exit.json` and the agent's exit receipt) and said at the
//!   end of the log itself, where `ctl logs` shows it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The default cap on each of a rank's streams: what is kept of its stdout (and of its stderr).
pub const DEFAULT_CAP_BYTES: u64 = 512 << 20;

/// One stream's log: where it goes, the cap, who owns the files the shim makes.
#[derive(Debug, Clone)]
pub struct Log {
    pub path: PathBuf,
    pub cap: u64,
    /// uid and gid of the job's user, for a rotated file (`None`: the shim's own).
    pub owner: Option<(u32, u32)>,
    /// Output stops being written (and is counted as dropped) while the log's file system
    /// is under this floor, so the agent's records and exit statuses always find room.
    pub floor: crate::layout::DiskFloor,
}

/// Bytes of a stream dropped so far, readable while its copier runs.
#[derive(Debug, Clone, Default)]
pub struct Dropped(Arc<AtomicU64>);

impl Dropped {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
}

/// Copies `from` (the read end of the rank's pipe) into `log` until every writer has closed
/// it, on a thread of its own; `file` is the log opened for appending (the shim's own stdout or
/// stderr). Returns the thread, which ends at the pipe's end, and the dropped count.
pub fn copy(
    from: impl Read + Send + 'static,
    file: File,
    log: Log,
) -> (std::thread::JoinHandle<()>, Dropped) {
    let dropped = Dropped::default();
    let counter = dropped.clone();
    let handle = std::thread::spawn(move || run(from, file, &log, &counter));
    (handle, dropped)
}

fn run(mut from: impl Read, mut file: File, log: &Log, dropped: &Dropped) {
    let mut written = file.metadata().map(|m| m.len()).unwrap_or(0);
    let half = (log.cap / 2).max(1);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let mut chunk = &buf[..n];
        if below_floor(log) {
            dropped.add(n as u64);
            continue;
        }
        if written + n as u64 > half {
            match rotate(log, &mut file) {
                Ok(dropped_old) => {
                    dropped.add(dropped_old);
                    written = 0;
                }
                // Cannot rotate (the disk is full): what does not fit is dropped.
                Err(_) if written >= half => {
                    dropped.add(n as u64);
                    continue;
                }
                Err(_) => {}
            }
            // A chunk larger than a whole file keeps only its newest part.
            let room = half.saturating_sub(written) as usize;
            if chunk.len() > room {
                dropped.add((chunk.len() - room) as u64);
                chunk = &chunk[chunk.len() - room..];
            }
        }
        match file.write_all(chunk) {
            Ok(()) => written += chunk.len() as u64,
            // ENOSPC or any other failure: the bytes are dropped, the rank never waits.
            Err(_) => dropped.add(chunk.len() as u64),
        }
    }
    let lost = dropped.get();
    if lost > 0 {
        let note = format!(
            "\n[trainyard: {lost} bytes of this stream were dropped: over its {} cap (the oldest went first) or the disk was full]\n",
            crate::preflight::checks::human_bytes(log.cap)
        );
        let _ = file.write_all(note.as_bytes());
    }
}

/// Whether the log's file system is under its floor (see [`Log::floor`]).
fn below_floor(log: &Log) -> bool {
    let dir = log.path.parent().unwrap_or(Path::new("/"));
    log.floor.short(dir).is_ok_and(|short| short.is_some())
}

/// Moves the log to `<name>.1` (dropping the previous `.1`, whose size is returned) and opens
/// a fresh one at its path, private to the job's user.
fn rotate(log: &Log, file: &mut File) -> std::io::Result<u64> {
    let old = rotated(&log.path);
    let dropped = std::fs::symlink_metadata(&old).map(|m| m.len()).unwrap_or(0);
    std::fs::rename(&log.path, &old)?;
    let fresh = OpenOptions::new()
        .create_new(true)
        .append(true)
        .mode(crate::layout::RUN_FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&log.path)?;
    if let Some((uid, gid)) = log.owner {
        std::os::unix::fs::fchown(&fresh, Some(uid), Some(gid))?;
    }
    *file = fresh;
    Ok(dropped)
}

/// Where a log's older half goes.
pub fn rotated(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// Waits for the copiers to reach the end of their pipes, at most `timeout` (a process that
/// escaped every tracking could hold a pipe open for ever: the exit status must not wait on it).
pub fn join(handles: Vec<std::thread::JoinHandle<()>>, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    for h in handles {
        while !h.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test machine's disk is not ours: how full it is must not decide what these see.
    const NO_FLOOR: crate::layout::DiskFloor = crate::layout::DiskFloor { bytes: 0, percent: 0 };

    #[test]
    fn a_stream_past_its_cap_keeps_the_newest_and_counts_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stdout.log");
        let file = OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let input: Vec<u8> = (0..10_000u32).flat_map(|i| format!("line {i:05}\n").into_bytes()).collect();
        let total = input.len() as u64;
        let (h, dropped) = copy(
            std::io::Cursor::new(input),
            file,
            Log { path: path.clone(), cap: 20_000, owner: None, floor: NO_FLOOR },
        );
        h.join().unwrap();
        let now = std::fs::read_to_string(&path).unwrap();
        let older = std::fs::read_to_string(rotated(&path)).unwrap();
        let kept = (now.len() + older.len()) as u64;
        assert!(now.contains("line 09999"), "the newest output is kept");
        assert!(
            now.contains(&format!("[trainyard: {} bytes of this stream were dropped", dropped.get())),
            "{now}"
        );
        let note = now.len() - now.find("\n[trainyard").unwrap();
        assert_eq!(kept - note as u64 + dropped.get(), total, "kept + dropped = written");
        assert!(kept <= 20_000 + note as u64, "{kept} bytes kept under a cap of 20,000");
    }

    #[test]
    fn under_the_floor_nothing_is_written_and_everything_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stdout.log");
        let file = OpenOptions::new().create(true).append(true).open(&path).unwrap();
        let everything = crate::layout::DiskFloor { bytes: u64::MAX, percent: 0 };
        let (h, dropped) = copy(
            std::io::Cursor::new(vec![b'x'; 100_000]),
            file,
            Log { path: path.clone(), cap: 1 << 30, owner: None, floor: everything },
        );
        h.join().unwrap();
        assert_eq!(dropped.get(), 100_000);
        let now = std::fs::read_to_string(&path).unwrap();
        assert!(now.starts_with("\n[trainyard: 100000 bytes of this stream were dropped"), "{now}");
    }

    #[test]
    fn a_write_that_fails_drops_the_bytes_and_the_copier_goes_on() {
        // /dev/full fails every write with ENOSPC, as a full disk does.
        let full = OpenOptions::new().append(true).open("/dev/full").unwrap();
        let (h, dropped) = copy(
            std::io::Cursor::new(vec![b'x'; 300_000]),
            full,
            Log { path: "/dev/full".into(), cap: 1 << 30, owner: None, floor: NO_FLOOR },
        );
        h.join().unwrap();
        assert_eq!(dropped.get(), 300_000, "every byte counted as dropped, none blocked");
    }
}

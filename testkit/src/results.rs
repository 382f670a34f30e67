//! Bench results as files (docs/results/): one JSON-lines file per run, named
//! `<bench>-<UTC date and time>.jsonl`. Its first line says what ran and where (the bench, its
//! arguments, the commit and whether the tree was dirty, the date, the machine's cores, CPU
//! model, memory, disk and kernel); then one line per event the bench records; the last line is
//! its summary. The same format `deploy/bench_pair.py` writes, so the docs' figures can be read
//! back from either.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// A file must stay small enough to commit: no run writes more than this.
const MAX_BYTES: u64 = 1 << 20;

/// An open results file.
pub struct Results {
    path: PathBuf,
    file: std::fs::File,
    written: u64,
}

/// `dir/<name>.jsonl`, or the first of `<name>-2.jsonl`, `<name>-3.jsonl`, ... not there yet.
fn create_new(dir: &Path, name: &str) -> Result<(PathBuf, std::fs::File)> {
    for n in 1.. {
        let path = match n {
            1 => dir.join(format!("{name}.jsonl")),
            n => dir.join(format!("{name}-{n}.jsonl")),
        };
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| path.display().to_string()),
        }
    }
    unreachable!("the suffixes run out only past usize::MAX")
}

impl Results {
    /// Creates `dir/<bench>-<date>.jsonl` (`-2`, `-3`, ... before `.jsonl` when a run of the
    /// same minute made it already: a result is never written over) and writes its header line.
    pub fn create(dir: &Path, bench: &str, args: &[String]) -> Result<Results> {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        let stamp = utc_stamp();
        let (path, file) = create_new(dir, &format!("{bench}-{stamp}"))?;
        let mut r = Results { path, file, written: 0 };
        let (commit, dirty) = checkout();
        r.line(&json!({
            "bench": bench,
            "arguments": args,
            "commit": commit,
            "dirty": dirty,
            "date": stamp,
            "machine": machine(),
        }))?;
        Ok(r)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One more line (an event, or the summary); refused once the file would pass 1 MiB.
    pub fn line(&mut self, value: &Value) -> Result<()> {
        let text = format!("{value}\n");
        anyhow::ensure!(
            self.written + text.len() as u64 <= MAX_BYTES,
            "{}: a results file holds at most {MAX_BYTES} bytes",
            self.path.display()
        );
        self.file.write_all(text.as_bytes()).with_context(|| self.path.display().to_string())?;
        self.written += text.len() as u64;
        Ok(())
    }
}

/// The repository's results folder.
pub fn results_dir() -> PathBuf {
    repo_root().join("docs/results")
}

/// The repository's root (this crate's parent folder).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repo root").to_path_buf()
}

/// `2026-11-27T0402Z`, from the system clock.
fn utc_stamp() -> String {
    let out = Command::new("date").args(["-u", "+%Y-%m-%dT%H%MZ"]).output();
    out.ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
}

/// The commit checked out and whether the tree differs from it.
fn checkout() -> (String, bool) {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(repo_root())
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let commit = git(&["rev-parse", "HEAD"]);
    let dirty = !git(&["status", "--porcelain", "--untracked-files=no"]).is_empty();
    (commit, dirty)
}

/// The machine's facts that matter to a figure.
pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, m)| m.trim()))
        .unwrap_or("unknown")
        .to_string();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    json!({
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu_model": model,
        "memory_gib": (mem_kib / 1048576.0 * 10.0).round() / 10.0,
        "disk_gib": disk_gib(&repo_root()),
        "kernel": kernel.trim(),
    })
}

fn disk_gib(path: &Path) -> u64 {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else { return 0 };
    // SAFETY: statvfs writes into the zeroed struct we pass; the path is a valid C string.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return 0;
    }
    (s.f_blocks as u64).saturating_mul(s.f_frsize as u64) >> 30
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_runs_of_one_minute_keep_both_files() {
        let dir = std::env::temp_dir().join(format!("trainyard-results-test-{}", std::process::id()));
        let first = Results::create(&dir, "twice", &[]).unwrap();
        let second = Results::create(&dir, "twice", &[]).unwrap();
        let third = Results::create(&dir, "twice", &[]).unwrap();
        let names: Vec<String> = [&first, &second, &third]
            .iter()
            .map(|r| r.path().file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        // Three runs in one minute (or, rarely, across a minute's edge): three distinct files.
        assert_ne!(names[0], names[1]);
        assert_ne!(names[1], names[2]);
        assert_ne!(names[0], names[2]);
        assert!(names.iter().all(|n| n.starts_with("twice-") && n.ends_with(".jsonl")), "{names:?}");
    }
}

//! Every process a rank starts, held by the agent: a cgroup per rank (under one per job attempt
//! on this node, which carries the job's limits), so that the end of a rank, a cancel and a
//! restart take all of them, `setsid` and double-forked children included.
//!
//! - cgroup v2 (current GPU nodes): membership, `cgroup.kill`, CPU time from `cpu.stat`, and
//!   `memory.max`/`pids.max`/`memory.peak` where the controllers are enabled.
//! - cgroup v1 (the fallback, and systemd's hybrid layout where v2 holds no controllers):
//!   `memory` and `pids` for limits, `cpuacct` and `memory.max_usage_in_bytes` for accounting,
//!   and the `freezer` to kill without a race when there is no v2 group.
//! - neither (an agent running as an unprivileged user): the shim is a child subreaper
//!   (`PR_SET_CHILD_SUBREAPER`): orphans of the rank become its children, and it kills them when
//!   the rank ends. The agent says so at start.
//!
//! The layout under each hierarchy's mount: `trainyard/<run>.a<attempt>/rank-<r>`. The agent
//! creates the groups (it is root); the shim moves the rank into them between fork and exec, so
//! the rank's first instruction already runs inside; the shim kills what is left when the rank
//! ends, reads the usage, and removes the groups.

pub mod mounts;

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use mounts::Mounts;

/// The directory under each hierarchy's mount that holds trainyard's groups.
pub const ROOT_NAME: &str = "trainyard";

/// Per-job limits on one node, from the spec (`[resources] memory_limit_mib`, `max_processes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: Option<u64>,
    pub processes: Option<u64>,
}

/// How the agent holds on to a rank's processes on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tracking {
    /// cgroups: trainyard's v2 root and v1 roots (controller, `<mount>/trainyard`).
    Cgroups { v2: Option<PathBuf>, v1: Vec<(String, PathBuf)> },
    /// No cgroup can be made here, and why: the shim is a child subreaper instead.
    Subreaper(String),
}

impl Tracking {
    /// What this host allows: trainyard's root made (or found) in the v2 mount and in each v1
    /// controller's; those that cannot be made are left out. None at all: the subreaper.
    pub fn detect(mounts: &Mounts) -> Tracking {
        let mut failures = Vec::new();
        let mut make = |mount: &Path| {
            let root = mount.join(ROOT_NAME);
            match std::fs::create_dir_all(&root) {
                Ok(()) => Some(root),
                Err(e) => {
                    failures.push(format!("{}: {e}", root.display()));
                    None
                }
            }
        };
        let v2 = mounts.v2.as_deref().and_then(&mut make);
        if let (Some(root), Some(base)) = (&v2, &mounts.v2) {
            delegate_controllers(base, root);
        }
        let v1: Vec<(String, PathBuf)> =
            mounts.v1.iter().filter_map(|(c, mount)| make(mount).map(|root| (c.clone(), root))).collect();
        if v2.is_none() && v1.is_empty() {
            let why = match failures.is_empty() {
                true => "no cgroup hierarchy is mounted".to_string(),
                false => format!("cannot create trainyard's cgroups ({})", failures.join("; ")),
            };
            return Tracking::Subreaper(why);
        }
        Tracking::Cgroups { v2, v1 }
    }

    /// For the agent's log line at start.
    pub fn describe(&self) -> String {
        match self {
            Tracking::Cgroups { v2, v1 } => {
                let mut parts = Vec::new();
                if let Some(root) = v2 {
                    parts.push(format!("cgroup v2 at {}", root.display()));
                }
                if !v1.is_empty() {
                    let names: Vec<&str> = v1.iter().map(|(c, _)| c.as_str()).collect();
                    parts.push(format!("cgroup v1 ({})", names.join(", ")));
                }
                format!("each rank's processes are held in a cgroup: {}", parts.join(" and "))
            }
            Tracking::Subreaper(why) => format!(
                "each rank's processes are tracked by its shim as a child subreaper, not a cgroup ({why}): \
                 orphans are killed when the rank ends, but no limit applies and a cancel reaches a \
                 detached process only when its rank ends"
            ),
        }
    }

    /// Creates the cgroups of rank `rank` of the attempt whose groups are named `attempt_name`
    /// (`<run>.a<attempt>`), applying `limits` to the attempt's group. A limit this host cannot
    /// apply is an error naming it: the launch is refused rather than run unbounded.
    pub fn create(&self, attempt_name: &str, rank: u32, limits: &Limits) -> io::Result<RankGroup> {
        let Tracking::Cgroups { v2, v1 } = self else {
            if limits.memory_bytes.is_some() || limits.processes.is_some() {
                return Err(io::Error::other(
                    "the job sets resource limits, but this node's agent cannot create cgroups to apply them",
                ));
            }
            return Ok(RankGroup::default());
        };
        let rank_dir = format!("rank-{rank}");
        let mut group = RankGroup::default();
        let (mut memory_done, mut pids_done) = (limits.memory_bytes.is_none(), limits.processes.is_none());
        if let Some(root) = v2 {
            let job = root.join(attempt_name);
            std::fs::create_dir_all(&job)?;
            for c in controllers(&job) {
                let _ = std::fs::write(job.join("cgroup.subtree_control"), format!("+{c}"));
            }
            memory_done |= write_limit(&job.join("memory.max"), limits.memory_bytes)?;
            pids_done |= write_limit(&job.join("pids.max"), limits.processes)?;
            let dir = job.join(&rank_dir);
            std::fs::create_dir_all(&dir)?;
            group.v2 = Some(dir);
        }
        for (controller, root) in v1 {
            let job = root.join(attempt_name);
            std::fs::create_dir_all(&job)?;
            match controller.as_str() {
                "memory" if !memory_done => {
                    memory_done = write_limit(&job.join("memory.limit_in_bytes"), limits.memory_bytes)?
                }
                "pids" if !pids_done => pids_done = write_limit(&job.join("pids.max"), limits.processes)?,
                _ => {}
            }
            let dir = job.join(&rank_dir);
            std::fs::create_dir_all(&dir)?;
            group.v1.push((controller.clone(), dir));
        }
        match (memory_done, pids_done) {
            (true, true) => Ok(group),
            (false, _) => {
                Err(io::Error::other("this node has no cgroup memory controller to apply memory_limit_mib"))
            }
            (_, false) => {
                Err(io::Error::other("this node has no cgroup pids controller to apply max_processes"))
            }
        }
    }
}

/// Hands the v2 controllers the agent's own group has (memory, pids, cpu) down to trainyard's
/// root `root` under it, best effort: limits that cannot be applied through v2 fall to v1, or
/// refuse the launch that asks for them. v2 lets a group hand controllers down only while no
/// process sits in it ("no internal processes"): a service's group holds the agent itself, so
/// the agent first moves into a leaf of its own (`<its group>/agent`), as container runtimes do
/// under a delegated service (systemd's `Delegate=yes`).
fn delegate_controllers(base: &Path, root: &Path) {
    let wanted = controllers(base);
    if wanted.is_empty() {
        return;
    }
    let enable = |dir: &Path| {
        wanted.iter().all(|c| std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}")).is_ok())
    };
    let own_pid = std::process::id().to_string();
    let holds_me = || {
        std::fs::read_to_string(base.join("cgroup.procs"))
            .is_ok_and(|t| t.lines().any(|l| l.trim() == own_pid))
    };
    if !enable(base) && holds_me() {
        let leaf = base.join("agent");
        let moved =
            std::fs::create_dir_all(&leaf).and_then(|()| std::fs::write(leaf.join("cgroup.procs"), &own_pid));
        match moved {
            Ok(()) => {
                tracing::info!(leaf = %leaf.display(), "moved the agent into a leaf cgroup so its ranks' groups can have controllers")
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot move the agent into a leaf cgroup; limits go through cgroup v1 if at all")
            }
        }
        enable(base);
    }
    enable(root);
}

/// Writes `value` into a limit file that exists; `Ok(false)` when the file is not there (the
/// controller is not enabled here) or there is no value to write.
fn write_limit(path: &Path, value: Option<u64>) -> io::Result<bool> {
    let Some(value) = value else { return Ok(false) };
    if !path.exists() {
        return Ok(false);
    }
    std::fs::write(path, value.to_string())
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    Ok(true)
}

/// The v2 controllers `dir` may hand to its children (`cgroup.controllers`).
fn controllers(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("cgroup.controllers"))
        .map(|t| {
            t.split_whitespace().filter(|c| ["memory", "pids", "cpu"].contains(c)).map(String::from).collect()
        })
        .unwrap_or_default()
}

/// A rank's cgroups: its v2 group and its v1 groups (by controller). Empty: the shim tracks the
/// rank as a subreaper. Kept in the rank's state record, so a restarted agent still holds them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankGroup {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub v2: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub v1: Vec<(String, PathBuf)>,
}

/// What a rank used, read from its cgroups when it ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// CPU time of every process of the rank, user and system.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_ms: Option<u64>,
    /// The most memory the rank's processes held at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
}

impl RankGroup {
    pub fn is_empty(&self) -> bool {
        self.v2.is_none() && self.v1.is_empty()
    }

    /// Every group directory, v2 first.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.v2.iter().map(PathBuf::as_path).chain(self.v1.iter().map(|(_, d)| d.as_path()))
    }

    fn v1_dir(&self, controller: &str) -> Option<&Path> {
        self.v1.iter().find(|(c, _)| c == controller).map(|(_, d)| d.as_path())
    }

    /// The `cgroup.procs` files a process writes `0` into to join every group of the rank.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs().map(|d| d.join("cgroup.procs")).collect()
    }

    /// The processes in the rank's groups now.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .dirs()
            .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|t| t.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Whether a process of the rank is still alive in its groups.
    pub fn populated(&self) -> bool {
        !self.pids().is_empty()
    }

    /// SIGKILLs every process of the rank: `cgroup.kill` on v2 (atomic, forks included); on v1
    /// the freezer stops them all first, so none forks away between the read and the kill.
    pub fn kill(&self) -> io::Result<()> {
        if let Some(dir) = &self.v2 {
            let kill = dir.join("cgroup.kill");
            if kill.exists() {
                return std::fs::write(kill, "1");
            }
        }
        let freezer = self.v1_dir("freezer");
        if let Some(f) = freezer {
            std::fs::write(f.join("freezer.state"), "FROZEN")?;
        }
        for pid in self.pids() {
            // SAFETY: kill(2) with integer arguments; pids come from the rank's own groups.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        if let Some(f) = freezer {
            std::fs::write(f.join("freezer.state"), "THAWED")?;
        }
        Ok(())
    }

    /// Kills every process of the rank and waits until its groups are empty, at most `timeout`;
    /// returns how many processes were there when it began.
    pub fn kill_and_wait(&self, timeout: Duration) -> io::Result<usize> {
        let before = self.pids().len();
        if before == 0 {
            return Ok(0);
        }
        self.kill()?;
        let deadline = Instant::now() + timeout;
        while self.populated() {
            if Instant::now() > deadline {
                return Err(io::Error::other(format!("processes still in {:?} after SIGKILL", self.pids())));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(before)
    }

    /// The rank's CPU time and peak memory, where the groups count them.
    pub fn usage(&self) -> Usage {
        let read = |p: PathBuf| std::fs::read_to_string(p).ok();
        let v2_cpu = self.v2.as_ref().and_then(|d| read(d.join("cpu.stat"))).and_then(|t| {
            t.lines().find_map(|l| l.strip_prefix("usage_usec ")).and_then(|v| v.trim().parse::<u64>().ok())
        });
        let v1_cpu = self.v1_dir("cpuacct").and_then(|d| read(d.join("cpuacct.usage")));
        let cpu_ms = v2_cpu
            .map(|us| us / 1_000)
            .or_else(|| v1_cpu.and_then(|t| t.trim().parse::<u64>().ok()).map(|ns| ns / 1_000_000));
        let v2_peak = self.v2.as_ref().and_then(|d| read(d.join("memory.peak")));
        let v1_peak = self.v1_dir("memory").and_then(|d| read(d.join("memory.max_usage_in_bytes")));
        let peak_memory_bytes = v2_peak.or(v1_peak).and_then(|t| t.trim().parse().ok());
        Usage { cpu_ms, peak_memory_bytes }
    }

    /// Removes the rank's groups, and its attempt's when no other rank's is left in it. Groups
    /// that still hold a process stay (and are reported).
    pub fn remove(&self) -> io::Result<()> {
        let mut first_error = None;
        for dir in self.dirs() {
            if let Err(e) = std::fs::remove_dir(dir)
                && e.kind() != io::ErrorKind::NotFound
            {
                first_error.get_or_insert(io::Error::new(e.kind(), format!("{}: {e}", dir.display())));
            }
            if let Some(job) = dir.parent() {
                let _ = std::fs::remove_dir(job);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The rank's `cgroup.procs` files, prepared before a fork so the child joins them between
/// fork and exec without allocating.
pub struct Joiner {
    files: Vec<std::ffi::CString>,
}

impl Joiner {
    pub fn new(group: &RankGroup) -> io::Result<Joiner> {
        use std::os::unix::ffi::OsStrExt as _;
        let files = group
            .procs_files()
            .iter()
            .map(|p| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other))
            .collect::<io::Result<_>>()?;
        Ok(Joiner { files })
    }

    /// Moves the calling process into every group (`0` is "the writer"). Async-signal-safe.
    pub fn join_in_child(&self) -> io::Result<()> {
        for file in &self.files {
            // SAFETY: open, write and close on a prepared NUL-terminated path and a static byte.
            unsafe {
                let fd = libc::open(file.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if written != 1 {
                    return Err(err);
                }
            }
        }
        Ok(())
    }
}

/// The shim's side without cgroups: makes the calling process a child subreaper, so orphans of
/// the rank are reparented to it rather than to init.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// SIGKILLs and reaps every remaining child of the calling subreaper (the rank's orphans), until
/// none is left or `timeout`; returns how many it killed.
pub fn reap_orphans(timeout: Duration) -> usize {
    let me = std::process::id();
    let deadline = Instant::now() + timeout;
    let mut killed = std::collections::BTreeSet::new();
    loop {
        let children = crate::procfs::children_of(me);
        if children.is_empty() || Instant::now() > deadline {
            return killed.len();
        }
        for pid in children {
            // SAFETY: kill(2) on our own child.
            if unsafe { libc::kill(pid as i32, libc::SIGKILL) } == 0 {
                killed.insert(pid);
            }
        }
        // Reap whatever ended; WNOHANG so a child that ignores nothing but is slow to die
        // does not block the loop past the deadline.
        loop {
            let mut status = 0;
            // SAFETY: waitpid on any child of ours.
            if unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } <= 0 {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests;

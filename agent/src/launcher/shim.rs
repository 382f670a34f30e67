//! The shim's command for one rank: the files its output goes to, the switch to the job's
//! user, the planned CPU and memory binding, and the start in a session of its own.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use tokio::process::Command;
use tracing::warn;

use crate::account::Account;
use crate::cgroup::{RankGroup, Tracking};
use crate::layout::{DiskFloor, RUN_FILE_MODE, RankFiles};
use crate::procfs;
use trainyard_proto::v1::RankAssignment;

/// Opens (creating, appending) one of the rank's output files, never through a link.
pub(super) fn open_output(path: &Path) -> Result<File, String> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(RUN_FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))
}

/// Gives the rank's output and receipts files to `user` and has the shim switch to them:
/// `--uid`, `--gid`, `--groups`, and the account's `USER`, `LOGNAME` and `HOME`.
pub(super) fn switch_user(
    command: &mut Command,
    env: &mut BTreeMap<String, String>,
    user: &Account,
    files: &RankFiles,
    [stdout, stderr]: [&File; 2],
) -> Result<(), String> {
    let receipts = open_output(&files.receipts)?;
    for (file, path) in [(stdout, &files.stdout), (stderr, &files.stderr), (&receipts, &files.receipts)] {
        std::os::unix::fs::fchown(file, Some(user.uid), Some(user.gid))
            .map_err(|e| format!("cannot give {} to {}: {e}", path.display(), user.name))?;
    }
    let groups: Vec<String> = user.groups.iter().map(u32::to_string).collect();
    command.args(["--uid", &user.uid.to_string(), "--gid", &user.gid.to_string()]);
    command.arg("--groups").arg(groups.join(","));
    for (name, value) in [("USER", &user.name), ("LOGNAME", &user.name), ("HOME", &user.home)] {
        env.insert(name.to_string(), value.clone());
    }
    Ok(())
}

/// The planned binding: applied by the shim to the rank between fork and exec, and told to the
/// rank (`TRAINYARD_CPUS` / `TRAINYARD_MEMS`) so its launch receipt can record it.
pub(super) fn bind(command: &mut Command, env: &mut BTreeMap<String, String>, assignment: &RankAssignment) {
    if !assignment.cpus.is_empty() {
        command.arg("--cpus").arg(&assignment.cpus);
        env.insert("TRAINYARD_CPUS".into(), assignment.cpus.clone());
    }
    if assignment.numa_node >= 0 && !assignment.cpus.is_empty() {
        let node = assignment.numa_node.to_string();
        command.arg("--mem-node").arg(&node);
        env.insert("TRAINYARD_MEMS".into(), node);
    }
}

/// The rank's cgroups for the shim to move it into (and empty when it ends), or the subreaper
/// where this host gives the agent no cgroups.
pub(super) fn track(command: &mut Command, group: &RankGroup, tracking: &Tracking) {
    if let Some(dir) = &group.v2 {
        command.arg("--cgroup2").arg(dir);
    }
    for (controller, dir) in &group.v1 {
        let mut pair = std::ffi::OsString::from(format!("{controller}="));
        pair.push(dir);
        command.arg("--cgroup1").arg(pair);
    }
    if matches!(tracking, Tracking::Subreaper(_)) {
        command.arg("--subreaper");
    }
}

/// The rank's log files and the cap on each: the shim copies the rank's output there
/// ([`crate::output`]).
pub(super) fn logs(command: &mut Command, files: &RankFiles, cap: u64, floor: DiskFloor) {
    command.arg("--stdout-log").arg(&files.stdout).arg("--stderr-log").arg(&files.stderr);
    command.arg("--output-cap").arg(cap.to_string());
    command.arg("--keep-free").arg(floor.bytes.to_string());
    command.arg("--keep-free-percent").arg(floor.percent.to_string());
}

/// Starts the shim in a session of its own; returns its pid and start time. The shim is
/// reaped when it ends, so it never lingers as a zombie of the agent.
pub(super) fn start(mut command: Command, program: &Path) -> Result<(u32, u64), String> {
    // SAFETY: setsid, close_range and fcntl are async-signal-safe, the only calls between fork
    // and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            // Nothing the agent inherited (a service manager's sockets, a test harness's pipes)
            // reaches the shim, nor the rank after it.
            procfs::cloexec_from(3);
            Ok(())
        });
    }
    let mut child =
        command.spawn().map_err(|e| format!("spawn failed: supervisor {}: {e}", program.display()))?;
    let pid = child.id().ok_or("spawn failed: supervisor exited at once")?;
    let start_time =
        procfs::stat(pid).map(|s| s.start_time).ok_or("spawn failed: supervisor vanished at once")?;
    tokio::spawn(async move {
        let _ = child.wait().await;
    });
    Ok((pid, start_time))
}

/// Test hook: with `TRAINYARD_AGENT_FAILPOINT=<name>` the agent dies (SIGKILL-like, no cleanup)
/// when it reaches failpoint `name`. The end-to-end tests kill the agent at the exact moments
/// between recording a rank and spawning it this way; unset in production, it costs one
/// environment lookup per rank start.
pub(super) fn failpoint(name: &str) {
    if std::env::var("TRAINYARD_AGENT_FAILPOINT").is_ok_and(|v| v == name) {
        warn!(failpoint = name, "failpoint reached; the agent dies here");
        std::process::abort();
    }
}

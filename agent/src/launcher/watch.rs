//! How the launcher follows a rank it started: reading what its shim left (pid file,
//! `exit.json`), finding a shim it had not recorded, and terminating a rank's process group.

use std::path::PathBuf;
use std::time::Duration;

use tracing::{info, warn};
use trainyard_proto::words::RankState;

use crate::cgroup::RankGroup;
use crate::layout::RankId;
use crate::pinning;
use crate::procfs;
use crate::state::RankRecord;
use crate::supervise::{ExitFile, read_pid_file};

/// How long after a launch its ranks' starts are watched every [`STARTING_TICK`]: a shim that
/// has not started its rank by then is seen at the ordinary tick.
pub const STARTING_WATCH: Duration = Duration::from_secs(2);

/// How often ranks just launched are looked at (their pid files: a rank is `running` once its
/// shim has exec'd it), so a submit is not answered a whole tick late.
pub const STARTING_TICK: Duration = Duration::from_millis(2);

/// For a rank recorded as launching with no shim (the agent stopped between recording it and
/// recording its shim): adopts the shim if one runs for it, else marks the rank lost, since it
/// was never started (or its shim is gone without a trace) and must not be started twice.
pub(super) fn find_unrecorded_shim(record: &mut RankRecord, shims: &[PathBuf]) {
    let found = procfs::find_by_argument("--status-file", record.files.exit.as_os_str());
    let ours = found.into_iter().find(|(pid, stat)| procfs::is_own_process(*pid, stat.start_time, shims));
    if let Some((pid, stat)) = ours {
        info!(rank_id = %record.id, shim_pid = pid, "found the shim of a rank the agent had not recorded as started");
        record.shim_pid = Some(pid);
        record.shim_start_time = Some(stat.start_time);
    } else if !record.files.exit.exists() {
        warn!(rank_id = %record.id, "the agent stopped while starting this rank; it was not started");
        record.phase = RankState::Lost;
        record.message = "the agent stopped while starting this rank; it was not started".to_string();
    }
}

/// Looks at one unfinished rank whose shim runs one of the programs `shims`; returns whether its
/// record changed.
pub(super) fn observe(record: &mut RankRecord, shims: &[PathBuf]) -> bool {
    // Liveness first: the shim writes exit.json before it exits, so a shim seen gone before
    // exit.json is looked for really left without writing it. Only the agent's own process
    // counts as the shim (its uid, its binary, its start time).
    let shim_alive = match (record.shim_pid, record.shim_start_time) {
        (Some(pid), Some(start)) => procfs::is_own_process(pid, start, shims),
        _ => false,
    };
    let mut changed = false;
    if record.pid.is_none()
        && let Some(pid) = read_pid_file(&record.files.pid)
    {
        record.pid = Some(pid);
        record.phase = RankState::Running;
        // The shim writes the pid once the rank has exec'd, so its binding is final now.
        match pinning::read_effective(pid) {
            Ok(e) => {
                if !e.cpus.is_empty() {
                    info!(rank_id = %record.id, pid, cpus = %e.cpus, mems = %e.mems, "rank binding read back");
                }
                record.effective_cpus = e.cpus;
                record.effective_mems = e.mems;
            }
            Err(e) => warn!(rank_id = %record.id, pid, error = %e, "cannot read the rank's binding"),
        }
        changed = true;
    }
    if record.files.exit.exists() {
        match ExitFile::read(&record.files.exit) {
            Ok(exit) => {
                record.phase = RankState::Exited;
                record.exit_code = exit.exit_code;
                record.signal = exit.signal;
                record.usage = exit.usage;
                record.leftover_killed = exit.leftover_killed;
                record.output_dropped_bytes = exit.output_dropped_bytes;
                if let Some(error) = exit.error {
                    record.message = error;
                }
                if let Some(n) = exit.leftover_killed {
                    info!(rank_id = %record.id, processes = n, "the rank left processes behind; its shim killed them");
                }
            }
            Err(e) => {
                record.phase = RankState::Lost;
                record.message = format!("unreadable exit.json: {e:#}");
            }
        }
        info!(rank_id = %record.id, exit_code = ?record.exit_code, signal = ?record.signal, "rank ended");
        return true;
    }
    if !shim_alive {
        record.phase = RankState::Lost;
        record.message = "supervisor vanished".to_string();
        warn!(rank_id = %record.id, "supervisor vanished without an exit status; killing every process of the rank");
        if let Some(pid) = record.pid {
            let _ = procfs::killpg(pid, libc::SIGKILL);
        }
        if let Err(e) = record.cgroup.kill().and_then(|()| record.cgroup.remove()) {
            warn!(rank_id = %record.id, error = %e, "cannot empty the rank's cgroups");
        }
        return true;
    }
    changed
}

/// Terminates one rank: SIGTERM to its process group, then, after `grace`, SIGKILL to every
/// process in its cgroups (a `setsid` child included) and to its group.
pub(super) async fn terminate(
    id: RankId,
    known_pid: Option<u32>,
    pid_file: PathBuf,
    group: RankGroup,
    grace: Duration,
) {
    let mut pid = known_pid;
    // The shim writes the pid right after starting the rank; wait briefly for a fresh launch.
    for _ in 0..100 {
        if pid.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        pid = read_pid_file(&pid_file);
    }
    let Some(pid) = pid else {
        warn!(rank_id = %id, "cannot cancel: the rank's pid never appeared");
        return;
    };
    if let Err(e) = procfs::killpg(pid, libc::SIGTERM) {
        warn!(rank_id = %id, pid, error = %e, "SIGTERM failed");
    }
    let deadline = tokio::time::Instant::now() + grace;
    while tokio::time::Instant::now() < deadline {
        if !procfs::group_has_live_member(pid) && !group.populated() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50).min(grace)).await;
    }
    if group.populated() {
        warn!(rank_id = %id, pid, "rank outlived its grace period; killing every process in its cgroups");
        if let Err(e) = group.kill() {
            warn!(rank_id = %id, error = %e, "cannot kill the rank's cgroups");
        }
    }
    if procfs::group_has_live_member(pid) {
        warn!(rank_id = %id, pid, "rank outlived its grace period; sending SIGKILL");
        if let Err(e) = procfs::killpg(pid, libc::SIGKILL) {
            warn!(rank_id = %id, pid, error = %e, "SIGKILL failed");
        }
    }
}

//! What the agent itself writes into a rank's receipts file: the step receipts of a rank
//! without its own (its printed lines, [`super::read`]) and its exit receipt for every rank
//! that ran. Appended as whole lines, so they get a sequence number as the rank's own do.

use std::io::Write as _;

use trainyard_proto::words::RankState;

use crate::cgroup::Limits;
use crate::state::RankRecord;
use trainyard_proto::v1::Launch;

/// Appends whole lines to a rank's receipts file: one `write` each, on a file opened for
/// appending, as the rank's own writers do, so no line is ever split by another writer's. A
/// last line the rank left unterminated gets its newline first, so it is never glued to ours.
pub(super) fn append(path: &std::path::Path, lines: &[String]) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(crate::layout::RUN_FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let len = file.metadata()?.len();
    let mut last = [b'\n'];
    if len > 0 {
        file.read_exact_at(&mut last, len - 1)?;
    }
    if last[0] != b'\n' {
        file.write_all(b"\n")?;
    }
    for line in lines {
        file.write_all(format!("{line}\n").as_bytes())?;
    }
    Ok(())
}

/// [`append`] of the agent's own `line` (its exit receipt), which a disk a job filled must not
/// lose: on ENOSPC the agent's reserve is given up and the line written again.
pub(super) fn append_kept(
    layout: &crate::layout::Layout,
    path: &std::path::Path,
    line: &str,
) -> std::io::Result<()> {
    let lines = [line.to_string()];
    match append(path, &lines) {
        Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && layout.release_reserve() => append(path, &lines),
        other => other,
    }
}

/// The agent's `exit` receipt for a rank that ran: how it ended and what all of its processes
/// used (CPU time, peak memory, from its cgroups), and how many it left behind.
pub(super) fn exit_receipt(r: &RankRecord) -> String {
    let ok = r.phase == RankState::Exited && r.exit_code == Some(0);
    let mut body = serde_json::json!({
        "kind": "exit", "schema": 1, "producer": "trainyard agent (rank end)",
        "status": if ok { "ok" } else { "failed" },
        "exit_code": r.exit_code, "signal": r.signal,
        "processes": if r.cgroup.is_empty() { "subreaper" } else { "cgroup" },
    });
    if !ok && !r.message.is_empty() {
        body["reason"] = r.message.clone().into();
    }
    for (name, value) in [
        ("cpu_ms", r.usage.cpu_ms),
        ("peak_memory_bytes", r.usage.peak_memory_bytes),
        ("leftover_killed", r.leftover_killed.map(|n| n as u64)),
        ("output_dropped_bytes", r.output_dropped_bytes),
    ] {
        if let Some(v) = value {
            body[name] = v.into();
        }
    }
    body.to_string()
}

/// The job's limits on this node, from its spec.
pub(super) fn limits_of(launch: &Launch) -> Limits {
    let res = launch.spec.as_ref().and_then(|s| s.resources.as_ref());
    let memory = res.map_or(0, |r| r.memory_limit_mib);
    let processes = res.map_or(0, |r| r.max_processes);
    Limits {
        memory_bytes: (memory > 0).then(|| memory.saturating_mul(1 << 20)),
        processes: (processes > 0).then_some(u64::from(processes)),
    }
}

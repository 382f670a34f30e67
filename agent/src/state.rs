//! The agent's durable record of each rank, one JSON file per rank in `DATA/state/ranks/`.
//!
//! What we persist: enough to adopt a rank after an agent restart (shim pid and start time, rank
//! pid, run files), what the controller was last told it could rely on (phase, exit status), and
//! how far its receipts were acknowledged. The file is written durably (a temporary file,
//! fsynced, renamed, the directory fsynced: [`crate::layout::write_atomic`]) before any report of
//! the change leaves the agent, so the controller never knows more than the disk, even after a
//! power cut. One change is not synced: a rank's start (`running`, its pid and binding), which
//! a power cut ends with the rank; the restarted agent reports the rank lost from either record
//! (synced, a launch's ranks each waited about 1 ms for the disk, one after another, before the
//! first was reported). Acknowledged positions are persisted at most once a second
//! ([`crate::launcher::Launcher::persist_acks`]): losing the last second of them only resends
//! receipts the store deduplicates.

use std::path::Path;

use serde::{Deserialize, Serialize};
use trainyard_proto::v1::RankReport;
use trainyard_proto::words::RankState;

use crate::layout::{Layout, RankFiles, RankId, write_atomic, write_replace};
use crate::tail::Position;

/// The durable state of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRecord {
    pub id: RankId,
    pub local_rank: u32,
    pub node_rank: u32,
    pub gpu_index: u32,
    pub files: RankFiles,
    /// Where the rank is in its life: `launching` (the shim was started, the rank's pid is
    /// not known yet), `running`, `exited` (its status is known, or it never started: see
    /// `message`) or `lost` (the shim vanished without writing `exit.json`). Never `planned`:
    /// that is the controller's word for a rank no agent has reported on.
    pub phase: RankState,
    pub shim_pid: Option<u32>,
    pub shim_start_time: Option<u64>,
    /// The rank's pid, which is also its process group id.
    pub pid: Option<u32>,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// Free text for the operator, e.g. why a spawn failed.
    #[serde(default)]
    pub message: String,
    /// Receipts acknowledged up to here.
    #[serde(default)]
    pub acked: Position,
    /// The controller sent `ForgetRanks`: drop the record once every receipt is acknowledged.
    #[serde(default)]
    pub forget: bool,
    /// The binding read back from `/proc` once the rank ran (`Cpus_allowed_list`, and the
    /// memory binding as [`crate::pinning`] describes); empty until read.
    #[serde(default)]
    pub effective_cpus: String,
    #[serde(default)]
    pub effective_mems: String,
    /// `MASTER_PORT` of the rank's job attempt (chosen here when this host holds rank 0).
    #[serde(default)]
    pub master_port: u16,
    /// The reader of the rank's printed step lines (`exec` ranks with automatic receipts): the
    /// job's pattern and how far it read ([`crate::printed`]).
    #[serde(default)]
    pub printed: Option<crate::printed::PrintedState>,
    /// The rank's cgroups (empty: tracked by its shim as a subreaper, or not started).
    #[serde(default)]
    pub cgroup: crate::cgroup::RankGroup,
    /// What the rank used, from `exit.json`, and processes it left that its shim killed.
    #[serde(default)]
    pub usage: crate::cgroup::Usage,
    #[serde(default)]
    pub leftover_killed: Option<usize>,
    /// Bytes of its stdout and stderr dropped (past the cap, or a full disk).
    #[serde(default)]
    pub output_dropped_bytes: Option<u64>,
    /// The agent's exit receipt for the rank was appended to its receipts file (saved first,
    /// so a restarted agent never appends it twice).
    #[serde(default)]
    pub exit_receipt: bool,
}

impl RankRecord {
    /// The record of a rank a launch is about to start: `launching`, nothing observed yet.
    pub fn launching(
        id: RankId,
        launch: &trainyard_proto::v1::Launch,
        assignment: &trainyard_proto::v1::RankAssignment,
        files: RankFiles,
    ) -> Self {
        RankRecord {
            id,
            local_rank: assignment.local_rank,
            node_rank: launch.node_rank,
            gpu_index: assignment.gpu_index,
            files,
            phase: RankState::Launching,
            shim_pid: None,
            shim_start_time: None,
            pid: None,
            exit_code: None,
            signal: None,
            message: String::new(),
            acked: Position::default(),
            forget: false,
            effective_cpus: String::new(),
            effective_mems: String::new(),
            master_port: u16::try_from(launch.master_port).unwrap_or(0),
            printed: crate::bootstrap::printed_state(launch),
            cgroup: crate::cgroup::RankGroup::default(),
            usage: Default::default(),
            leftover_killed: None,
            output_dropped_bytes: None,
            exit_receipt: false,
        }
    }

    /// Writes the record to its state file. On a full disk (a job's output filled it), the
    /// agent's reserve ([`Layout::reserve`]) is given up and the write tried again: the agent's
    /// records never share the fate of ranks' output.
    pub fn save(&self, layout: &Layout) -> std::io::Result<()> {
        self.write_with(layout, write_atomic)
    }

    /// [`RankRecord::save`] without waiting for the disk ([`write_replace`]): for what a
    /// restarted agent also finds by itself (a shim just spawned: [`crate::launcher::Launcher::adopt`]
    /// finds it by its command line).
    pub fn note(&self, layout: &Layout) -> std::io::Result<()> {
        self.write_with(layout, write_replace)
    }

    fn write_with(
        &self,
        layout: &Layout,
        write: fn(&Path, &[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let bytes = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let path = layout.state_file(self.id);
        match write(&path, &bytes) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && layout.release_reserve() => {
                tracing::warn!(
                    rank_id = %self.id,
                    "the data directory's file system is full: gave up the agent's reserve to keep its records; \
                     no launch until there is room again"
                );
                write(&path, &bytes)
            }
            other => other,
        }
    }

    /// Removes the record's state file (the run files stay).
    pub fn remove(&self, layout: &Layout) -> std::io::Result<()> {
        match std::fs::remove_file(layout.state_file(self.id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// The report the controller gets for this rank.
    pub fn report(&self, skipped_lines: u64) -> RankReport {
        RankReport {
            key: Some(self.id.into()),
            state: self.phase.as_str().to_string(),
            pid: self.pid.unwrap_or(0),
            exit_code: self.exit_code.unwrap_or(-1),
            signal: self.signal.unwrap_or(0),
            message: self.message.clone(),
            skipped_lines,
            effective_cpus: self.effective_cpus.clone(),
            effective_mems: self.effective_mems.clone(),
            master_port: u32::from(self.master_port),
        }
    }
}

/// Reads every state file. A file that cannot be read or parsed (torn by a crash of a disk
/// that lied about fsync, or edited by hand) is an error naming it: it may be the only record of
/// a running rank, so the agent neither skips nor deletes it, and an operator decides.
/// Leftover `*.json.tmp` files of an interrupted write are ignored (the rename never happened).
pub fn load_all(layout: &Layout) -> std::io::Result<Vec<RankRecord>> {
    let dir = layout.state_dir();
    let mut records = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let record = load_one(&path).map_err(|e| {
            std::io::Error::other(format!(
                "rank state file {} is unreadable ({e:#}); it may record a running rank: check the \
                 rank, then move the file out of {} and start the agent again",
                path.display(),
                dir.display()
            ))
        })?;
        records.push(record);
    }
    records.sort_by_key(|r| r.id);
    Ok(records)
}

fn load_one(path: &Path) -> anyhow::Result<RankRecord> {
    let bytes = std::fs::read(path)?;
    Ok(serde_json::from_slice(&bytes)?)
}

//! Whether a launch may start on this node, and what a rank needs before anything of it runs.

use tracing::warn;
use trainyard_proto::v1::Launch;

use crate::cgroup::{RankGroup, Tracking};
use crate::gpu_holders::GpuHolders;
use crate::layout::{DiskFloor, Layout, RankId};
use crate::state::RankRecord;

/// Why no launch may start now, when the data directory's file system is under its floor: a
/// job's output would fill it for everyone. Once there is room again, the agent's reserve is
/// made again too.
pub(super) fn short_of_disk(layout: &Layout, disk_floor: DiskFloor) -> Option<String> {
    let dir = layout.data_dir();
    match disk_floor.short(dir) {
        Ok(None) => {}
        Ok(Some((free, floor))) => {
            return Some(format!(
                "launch refused: the agent's data directory {} has {} free, under its floor of {} (the larger of \
                 --disk-floor-mib and --disk-floor-percent of the file system); free space there or give the \
                 agent another --data-dir",
                dir.display(),
                crate::preflight::checks::human_bytes(free),
                crate::preflight::checks::human_bytes(floor)
            ));
        }
        Err(e) => {
            warn!(dir = %dir.display(), error = %e, "cannot read the data directory's free space");
            return None;
        }
    }
    if let Err(e) = layout.keep_reserve() {
        warn!(error = %e, "cannot allocate the agent's reserve");
    }
    None
}

/// What rank `record` of `launch` (in run directory `run`, on GPU `gpu`) needs before it runs:
/// the space of its exit status (`exit.slot`), its GPU free of other jobs' processes (`others`,
/// the agent's other ranks, and every compute process the driver lists, `holders`), and its
/// cgroups with the job's limits. `Err` is why it is not started.
pub(super) fn prepare<'a>(
    tracking: &Tracking,
    record: &RankRecord,
    run: &str,
    launch: &Launch,
    (gpu, holders): (u32, Option<&dyn GpuHolders>),
    others: impl Iterator<Item = &'a RankRecord>,
) -> Result<RankGroup, String> {
    let slot = crate::layout::exit_slot_beside(&record.files.exit);
    crate::layout::allocate_slot(&slot).map_err(|e| {
        format!("launch refused: cannot set aside {} for the rank's exit status: {e}", slot.display())
    })?;
    gpu_free(record.id, gpu, others)?;
    if let Some(holders) = holders {
        crate::gpu_holders::refuse_if_held(gpu, holders)?;
    }
    tracking
        .create(
            &format!("{run}.a{}", record.id.attempt),
            record.id.rank,
            &super::receipts_file::limits_of(launch),
        )
        .map_err(|e| format!("launch refused: the rank's cgroups: {e}"))
}

/// `Err` naming the holder when a process of another job's rank on GPU `gpu` still lives in its
/// cgroups: a GPU is never shared with what a previous job left running.
fn gpu_free<'a>(
    id: RankId,
    gpu: u32,
    mut others: impl Iterator<Item = &'a RankRecord>,
) -> Result<(), String> {
    let holder = others.find(|r| {
        r.id.job_id != id.job_id && r.gpu_index == gpu && !r.cgroup.is_empty() && r.cgroup.populated()
    });
    match holder {
        Some(r) => Err(format!(
            "launch refused: GPU {gpu} is still held by processes of job {} rank {} ({} left in its cgroup)",
            r.id.job_id,
            r.id.rank,
            r.cgroup.pids().len()
        )),
        None => Ok(()),
    }
}

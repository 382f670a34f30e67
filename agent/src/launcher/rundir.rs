//! A job's run directories on this node: named by the controller ([`crate::layout::run_name`]),
//! never reused, private to the job's user (docs/security.md, "Files on a node").

use tracing::warn;

use crate::account::RunAs;
use crate::layout::{Layout, Owner, PRIVATE_FILE_MODE, RUN_DIR_MODE, RankId, make_dir, write_replace_as};

/// Makes `runs/<run>` this agent's: a directory of that name it did not make (no marker in
/// `state/runs/`) and holding none of its ranks (`ours` false), left by a restored database's
/// job or another controller's, is moved aside (`<run>.moved-<ms>`), never reused or re-owned.
pub(super) fn claim(layout: &Layout, run: &str, ours: bool) -> std::io::Result<()> {
    let marker = layout.made_runs_dir().join(run);
    if marker.exists() {
        return Ok(());
    }
    let dir = layout.run_dir(run);
    if !ours && std::fs::symlink_metadata(&dir).is_ok() {
        let ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let aside = layout.run_dir(&format!("{run}.moved-{ms}"));
        std::fs::rename(&dir, &aside)?;
        warn!(
            from = %dir.display(),
            to = %aside.display(),
            "a run directory this agent did not make was in the way of a launch; moved aside, not reused"
        );
    }
    // Not synced: a marker a power cut loses only makes a later launch move this agent's own
    // directory aside (never reuse one it did not make), and every launch waited for it.
    write_replace_as(&marker, b"", PRIVATE_FILE_MODE, None)
}

/// Creates the run directory `run`, the attempt's of `id` and (with `rank_dir`) the rank's,
/// mode 0710 with the job user's group: only the agent creates entries there, only the job's
/// user (and root) reads what is in them.
pub(super) fn make(
    layout: &Layout,
    run: &str,
    id: RankId,
    rank_dir: bool,
    owner: Option<Owner>,
) -> std::io::Result<()> {
    let group = owner.map(|o| o.gid);
    make_dir(&layout.run_dir(run), RUN_DIR_MODE, group)?;
    make_dir(&layout.attempt_dir(run, id.attempt), RUN_DIR_MODE, group)?;
    if rank_dir {
        make_dir(&layout.rank_dir(run, id), RUN_DIR_MODE, group)?;
    }
    Ok(())
}

/// The account a launch's run files are given to: the job's user when the agent switches.
pub(super) fn owner(run_as: &Result<RunAs, String>) -> Option<Owner> {
    match run_as {
        Ok(RunAs::Switch(user)) => Some(Owner { uid: user.uid, gid: user.gid }),
        _ => None,
    }
}

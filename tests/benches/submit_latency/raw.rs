//! The raw launch: what this machine charges for starting a launch's ranks the way the agent
//! must, from one thread of one process and nothing else: each rank's run directory, its output
//! files and a record synced before it starts, its groups in every cgroup hierarchy the agent
//! uses (made by the agent's own [`Tracking`]), and a fork whose child moves itself into them and
//! execs the rank's program (`sh -c "sleep 0.3"`, the bench's trivial rank). Timed from the
//! first directory to the last rank's exec: the floor that `ctl submit → running` is held
//! against (`trainyard / raw`), a ratio that travels between machines where milliseconds do not.
//! No controller, network, store, shim or report is in it.

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use trainyard_agent::cgroup::{Joiner, Limits, Mounts, RankGroup, Tracking};

/// Milliseconds each of `launches` raw launches of `ranks` ranks took, sorted.
pub fn launch_times(ranks: u32, launches: usize) -> anyhow::Result<Vec<i64>> {
    let tracking = Tracking::detect(&Mounts::read());
    let dir = tempfile::Builder::new().prefix("trainyard-raw-launch-").tempdir()?;
    let mut times = Vec::with_capacity(launches);
    for launch in 0..launches {
        let run = dir.path().join(format!("launch-{launch}"));
        let name = format!("raw-{}-{launch}.a0", std::process::id());
        let t0 = Instant::now();
        let mut started = Vec::new();
        let mut groups = Vec::new();
        for rank in 0..ranks {
            let rank_dir = run.join(format!("rank-{rank}"));
            std::fs::create_dir_all(&rank_dir)?;
            groups.push(tracking.create(&name, rank, &Limits::default())?);
            record(&run, rank)?;
        }
        for (rank, group) in groups.iter().enumerate() {
            started.push(spawn(&run.join(format!("rank-{rank}")), group)?);
        }
        times.push(t0.elapsed().as_millis() as i64);
        for mut child in started {
            child.wait()?;
        }
        for group in &groups {
            let _ = group.remove();
        }
    }
    times.sort_unstable();
    Ok(times)
}

/// The rank's record (about the size of the agent's), synced with its name before it starts.
fn record(run: &Path, rank: u32) -> anyhow::Result<()> {
    let path = run.join(format!("rank-{rank}.json"));
    let tmp = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(&[b' '; 2048])?;
    file.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(run)?.sync_all()?;
    Ok(())
}

/// Forks a child that joins `group` and execs the trivial rank; returns once it has exec'd.
fn spawn(rank_dir: &Path, group: &RankGroup) -> anyhow::Result<Child> {
    let joiner = Joiner::new(group)?;
    let mut command = Command::new("sh");
    command.args(["-c", "sleep 0.3"]).stdin(Stdio::null());
    command.stdout(std::fs::File::create(rank_dir.join("stdout.log"))?);
    command.stderr(std::fs::File::create(rank_dir.join("stderr.log"))?);
    // SAFETY: setsid and the joiner's open/write/close on prepared paths are async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            libc::setsid();
            joiner.join_in_child()
        });
    }
    Ok(command.spawn()?)
}

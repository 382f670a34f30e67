//! Ranks: starting them from a `Launch`, cancelling them, noticing how they end, and adopting
//! them again after an agent restart.
//!
//! Every rank runs under the shim (`supervise`), which outlives the agent; the launcher only
//! keeps the shim's pid and start time (so a reused pid is not mistaken for its shim) and
//! polls: `exit.json` present means exited, shim gone without it means lost. Every change is
//! written to the rank's state file before anyone is told about it.
//!
//! - `admit`: whether a launch may start here (the disk floor, the GPU free of other jobs'
//!   processes) and what a rank needs before it runs (its exit status's space, its cgroups).
//! - `engines`: what a launch runs (the engine's argv) and `launch.json`.
//! - `rundir`: the job's run directories, named by the controller and never reused.
//! - `shim`: the shim's command (output files, user switch, binding, cgroups) and its start.
//! - `watch`: reading what a rank's shim left, and terminating every process of a rank.
//! - `read`, `receipts_file`: reading a rank each tick; the receipts the agent appends for it.
//!
//! The launcher is owned by the connection task and used without locks: nothing here awaits,
//! and the work per call is a few small file operations.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

use tracing::{info, warn};
use trainyard_proto::v1::{HostInventory, Launch, RankAssignment};

mod admit;
mod engines;
mod port;
mod read;
mod receipts_file;
mod rundir;
mod shim;
mod watch;

use engines::{exec_engine, launch_json};
pub use read::Rank;
pub use watch::{STARTING_TICK, STARTING_WATCH};
use watch::{find_unrecorded_shim, observe, terminate};

use crate::account::{self, RunAs};
use crate::bootstrap::Bootstrap;
use crate::cgroup::Tracking;
use crate::env::{HostContext, PREFLIGHT_REPORT, VISIBLE_DEVICES, rank_env};
use crate::gpu_holders::GpuHolders;
use crate::layout::{
    DiskFloor, Layout, Owner, PRIVATE_FILE_MODE, RankId, STATE_DIR_MODE, make_dir, write_private,
    write_replace_as,
};
use crate::state::{self, RankRecord};
use crate::supervise::{SHIM_PATH, SPAWN_FAILED_EXIT_CODE};
use trainyard_proto::words::RankState;

/// Starts, watches and stops the ranks of this host.
#[derive(Debug)]
pub struct Launcher {
    layout: Layout,
    /// What a shim of this agent may run: first the program ranks start under, then the agent's
    /// own binary (its `supervise`), which an earlier agent may have started shims as.
    shims: Vec<PathBuf>,
    inventory: HostInventory,
    ranks: BTreeMap<RankId, Rank>,
    /// Local id of the preflight report the next ranks start under (`TRAINYARD_PREFLIGHT_REPORT`).
    preflight_report: Option<String>,
    /// A root agent may run launches that name no Unix account as root (`--allow-root-ranks`).
    root_ranks: bool,
    /// The Python bootstrap `exec` ranks get on their path.
    bootstrap: Bootstrap,
    /// The bootstrap's compile, until the first launch has waited for it.
    compiling: Option<crate::bootstrap::Compiling>,
    /// When acknowledged positions were last written to the state files.
    acks_persisted_at: std::time::Instant,
    /// How every process of a rank is held: its cgroups, or its shim as a subreaper.
    tracking: Tracking,
    /// What is kept of each of a rank's streams ([`crate::output`]).
    output_cap: u64,
    /// No launch, and no rank output, while the data directory's file system is under this.
    disk_floor: DiskFloor,
    /// Until when the ranks of the newest launch are watched closely for their start.
    starting_until: Option<std::time::Instant>,
    /// The compute processes on each GPU by the driver's account (none: the cgroups alone).
    gpu_holders: Option<Arc<dyn GpuHolders>>,
}

/// How often acknowledged positions reach the state files (each write is fsynced): a crash
/// loses at most this much of them, which only resends receipts the store deduplicates.
pub const ACK_PERSIST_EVERY: Duration = Duration::from_secs(1);

impl Launcher {
    /// A launcher over `layout`; creates the state directory.
    pub fn new(layout: Layout, shim_program: PathBuf, inventory: HostInventory) -> std::io::Result<Self> {
        make_dir(&layout.data_dir().join("state"), STATE_DIR_MODE, None)?;
        make_dir(&layout.state_dir(), STATE_DIR_MODE, None)?;
        make_dir(&layout.made_runs_dir(), STATE_DIR_MODE, None)?;
        make_dir(&layout.data_dir().join("runs"), 0o755, None)?;
        let bootstrap = crate::bootstrap::install(layout.data_dir())?;
        // create_dir_all succeeds on a read-only directory that exists: prove it is writable now
        // rather than at the first launch.
        let probe = layout.state_dir().join(".write-probe");
        std::fs::write(&probe, b"")?;
        std::fs::remove_file(&probe)?;
        let tracking = Tracking::detect(&crate::cgroup::Mounts::read());
        info!("{}", tracking.describe());
        match layout.keep_reserve() {
            Ok(true) => {}
            Ok(false) => warn!("no room on the data directory's file system for the agent's reserve"),
            Err(e) => warn!(error = %e, "cannot allocate the agent's reserve"),
        }
        info!(shim = %shim_program.display(), "ranks start under this shim");
        let me = std::env::current_exe().ok().filter(|me| *me != shim_program);
        let shims = std::iter::once(shim_program).chain(me).collect();
        Ok(Self {
            layout,
            shims,
            inventory,
            ranks: BTreeMap::new(),
            preflight_report: None,
            root_ranks: false,
            bootstrap,
            compiling: None,
            acks_persisted_at: std::time::Instant::now(),
            tracking,
            output_cap: crate::output::DEFAULT_CAP_BYTES,
            disk_floor: DiskFloor::default(),
            starting_until: None,
            gpu_holders: None,
        })
    }

    /// Keeps at most `cap` bytes of each of a rank's streams, and starts no launch (and writes
    /// no rank output) while the data directory is under `disk_floor`.
    pub fn with_limits(mut self, cap: u64, disk_floor: DiskFloor) -> Self {
        self.output_cap = cap;
        self.disk_floor = disk_floor;
        self
    }

    /// Compiles the Python bootstrap with `pythons` (once per bootstrap, docs/receipts.md) on a
    /// thread of its own; the first launch waits for it, so no rank starts while it runs.
    pub fn precompile_bootstrap(mut self, pythons: &[PathBuf]) -> Self {
        self.compiling = Some(self.bootstrap.compile_in_background(pythons.to_vec()));
        self
    }

    /// Asks `holders` which processes compute on a GPU before a rank starts there.
    pub fn with_gpu_holders(mut self, holders: Option<Arc<dyn GpuHolders>>) -> Self {
        self.gpu_holders = holders;
        self
    }

    /// Holds ranks' processes as `tracking` says rather than as this host allows (tests: the
    /// subreaper on a host with cgroups).
    pub fn with_tracking(mut self, tracking: Tracking) -> Self {
        self.tracking = tracking;
        self
    }

    pub fn tracking(&self) -> &Tracking {
        &self.tracking
    }

    /// Lets a root agent run launches that name no Unix account as root (see
    /// [`account::decide`]).
    pub fn allow_root_ranks(mut self, allow: bool) -> Self {
        self.root_ranks = allow;
        self
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Takes over every rank recorded in the state directory (after a restart).
    pub fn adopt(&mut self) -> std::io::Result<usize> {
        let records = state::load_all(&self.layout)?;
        let count = records.len();
        for mut record in records {
            if record.phase == RankState::Launching && record.shim_pid.is_none() {
                find_unrecorded_shim(&mut record, &self.shims);
                if let Err(e) = record.save(&self.layout) {
                    warn!(rank_id = %record.id, error = %e, "failed to write rank state file");
                }
            }
            info!(rank_id = %record.id, phase = record.phase.as_str(), "adopting rank");
            self.ranks.insert(record.id, Rank::open(record));
        }
        Ok(count)
    }

    pub fn ranks(&self) -> impl Iterator<Item = &Rank> {
        self.ranks.values()
    }

    pub fn ranks_mut(&mut self) -> impl Iterator<Item = &mut Rank> {
        self.ranks.values_mut()
    }

    pub fn get(&self, id: RankId) -> Option<&Rank> {
        self.ranks.get(&id)
    }

    pub fn get_mut(&mut self, id: RankId) -> Option<&mut Rank> {
        self.ranks.get_mut(&id)
    }

    /// Starts the ranks of `launch` this agent does not have yet; returns the ids of all the
    /// launch's ranks. Spawn failures become exited ranks with a message, never errors.
    /// Must run inside a tokio runtime (the shims are reaped by tasks).
    pub fn launch(&mut self, launch: &Launch) -> Vec<RankId> {
        self.launch_or_refuse(launch, None)
    }

    /// Records the launch's ranks this agent does not have yet as `lost` with `reason`, without
    /// starting them (a failed preflight); returns the ids of all the launch's ranks.
    pub fn refuse(&mut self, launch: &Launch, reason: &str) -> Vec<RankId> {
        self.launch_or_refuse(launch, Some(reason))
    }

    /// The preflight report the ranks started from now on run under.
    pub fn set_preflight_report(&mut self, local_id: Option<String>) {
        self.preflight_report = local_id;
    }

    fn launch_or_refuse(&mut self, launch: &Launch, refusal: Option<&str>) -> Vec<RankId> {
        if let Some(compiling) = self.compiling.take() {
            compiling.wait(Duration::from_secs(2));
        }
        let mut launch = launch.clone();
        if launch.master_port == 0 {
            launch.master_port =
                u32::from(port::master_port_for(self.ranks.values().map(|r| &r.record), &launch));
        }
        let launch = &launch;
        let run_as =
            account::decide(&launch.run_as, account::effective_uid(), self.root_ranks, account::lookup);
        let (run, bad_name) = match crate::layout::run_name(launch.job_id, &launch.run_name) {
            Ok(run) => (run, None),
            Err(e) => (format!("job-{}", launch.job_id), Some(e)),
        };
        if bad_name.is_none()
            && let Err(e) = self.write_launch_json(&run, launch, rundir::owner(&run_as))
        {
            warn!(job_id = launch.job_id, attempt = launch.attempt, error = %e, "failed to write launch.json");
        }
        let low_disk =
            if refusal.is_none() { admit::short_of_disk(&self.layout, self.disk_floor) } else { None };
        let refusal = refusal.or(bad_name.as_deref()).or(low_disk.as_deref());
        let mut ids = Vec::new();
        let mut recorded = Vec::new();
        for assignment in &launch.ranks {
            let id = RankId { job_id: launch.job_id, attempt: launch.attempt, rank: assignment.rank };
            ids.push(id);
            if self.ranks.contains_key(&id) {
                info!(rank_id = %id, "rank already known; launch is idempotent");
                continue;
            }
            let record = match self.record_rank(&run, id, launch, assignment, &run_as, refusal) {
                Ok(record) => record,
                Err(e) => {
                    // Not recorded, so not started: the controller sees no report for it.
                    warn!(rank_id = %id, error = %e, "cannot record the rank before starting it; not started");
                    continue;
                }
            };
            if record.phase == RankState::Launching {
                recorded.push((id, assignment));
            } else if let Err(e) = record.note(&self.layout) {
                warn!(rank_id = %id, error = %e, "failed to write rank state file");
            }
            self.ranks.insert(id, Rank::open(record));
        }
        // Every rank recorded and its groups made, the shims are spawned back to back: their
        // moves into their cgroups share one RCU grace period (architecture.md).
        for (id, assignment) in recorded {
            self.spawn_recorded(id, launch, assignment, &run_as);
        }
        ids
    }

    /// Spawns a recorded rank's shim and notes its pid (a failed spawn: exited, with why).
    fn spawn_recorded(
        &mut self,
        id: RankId,
        launch: &Launch,
        assignment: &RankAssignment,
        run_as: &Result<RunAs, String>,
    ) {
        let Some(rank) = self.ranks.get(&id) else { return };
        shim::failpoint("before-spawn");
        let spawned = self.spawn_shim(&rank.record, launch, assignment, run_as);
        if spawned.is_ok() {
            shim::failpoint("after-spawn");
        }
        let Some(rank) = self.ranks.get_mut(&id) else { return };
        let record = &mut rank.record;
        match spawned {
            Ok((pid, start_time)) => {
                info!(rank_id = %id, shim_pid = pid, "rank started");
                record.shim_pid = Some(pid);
                record.shim_start_time = Some(start_time);
                self.starting_until = Some(std::time::Instant::now() + STARTING_WATCH);
            }
            Err(message) => {
                warn!(rank_id = %id, %message, "rank could not be started");
                let _ = record.cgroup.remove();
                record.phase = RankState::Exited;
                record.exit_code = Some(SPAWN_FAILED_EXIT_CODE);
                record.message = message;
            }
        }
        // Not synced: an agent that dies before the disk has it finds the shim by its argv.
        if let Err(e) = record.note(&self.layout) {
            warn!(rank_id = %id, error = %e, "failed to write rank state file");
        }
    }

    /// Whether ranks launched in the last [`STARTING_WATCH`] are still starting: until they
    /// are, [`Launcher::poll_exits`] runs every [`STARTING_TICK`].
    pub fn starting(&mut self) -> bool {
        let watching = self.starting_until.is_some_and(|until| std::time::Instant::now() < until)
            && self.ranks.values().any(|r| r.record.phase == RankState::Launching);
        if !watching {
            self.starting_until = None;
        }
        watching
    }

    /// Writes `launch.json` (the environment overlay in it: the job's user's, 0600; read by people,
    /// never by the agent, so not synced) after making the job's run directories the user's.
    fn write_launch_json(&self, run: &str, launch: &Launch, owner: Option<Owner>) -> std::io::Result<()> {
        self.make_run_dirs(run, launch.job_id, launch.attempt, None, owner)?;
        let bytes = serde_json::to_vec_pretty(&launch_json(launch, run, &self.inventory, &self.layout))
            .map_err(std::io::Error::other)?;
        let path = self.layout.launch_json(run, launch.attempt);
        write_replace_as(&path, &bytes, PRIVATE_FILE_MODE, owner)
    }

    /// Creates the job's run directories ([`rundir::make`]); a directory of that name this agent
    /// did not make is moved aside first, unless a rank of its own is in it.
    fn make_run_dirs(
        &self,
        run: &str,
        job_id: u64,
        attempt: u32,
        rank: Option<u32>,
        owner: Option<Owner>,
    ) -> std::io::Result<()> {
        let dir = self.layout.run_dir(run);
        let ours = self.ranks.values().any(|r| r.record.files.dir.starts_with(&dir));
        rundir::claim(&self.layout, run, ours)?;
        rundir::make(
            &self.layout,
            run,
            RankId { job_id, attempt, rank: rank.unwrap_or(0) },
            rank.is_some(),
            owner,
        )
    }

    /// Records the rank durably (`launching`, exit slot and cgroups made, no shim yet) for
    /// [`Launcher::spawn_recorded`]: an agent killed in between never starts it twice, as
    /// [`Launcher::adopt`] finds the shim if it was spawned and marks the rank lost if not.
    /// Fails only when the record cannot be written, and then nothing was started.
    fn record_rank(
        &self,
        run: &str,
        id: RankId,
        launch: &Launch,
        assignment: &RankAssignment,
        run_as: &Result<RunAs, String>,
        refusal: Option<&str>,
    ) -> std::io::Result<RankRecord> {
        let files = self.layout.rank_files(run, id);
        let mut record = RankRecord::launching(id, launch, assignment, files);
        if let Some(reason) = refusal {
            record.phase = RankState::Lost;
            record.message = reason.to_string();
            return Ok(record);
        }
        self.make_run_dirs(run, id.job_id, id.attempt, Some(id.rank), rundir::owner(run_as))?;
        // The exit status has its space, and the groups exist and are recorded, before
        // anything runs in them.
        let others = self.ranks.values().map(|r| &r.record);
        let holders = self.gpu_holders.as_deref();
        let grouped =
            admit::prepare(&self.tracking, &record, run, launch, (assignment.gpu_index, holders), others);
        match grouped {
            Ok(group) => record.cgroup = group,
            Err(message) => {
                warn!(rank_id = %id, %message, "rank not started");
                record.phase = RankState::Exited;
                record.exit_code = Some(SPAWN_FAILED_EXIT_CODE);
                record.message = message;
                return Ok(record);
            }
        }
        record.save(&self.layout)?;
        Ok(record)
    }

    /// Spawns the shim for one rank; returns its pid and start time, or why it could not.
    ///
    /// The shim is root on a root agent, so it gets nothing of the user's: a clean environment
    /// (`PATH` only), `/` as its directory, and the rank's environment in a root-only file it
    /// hands to the rank's exec after the drop ([`crate::supervise`]).
    fn spawn_shim(
        &self,
        record: &RankRecord,
        launch: &Launch,
        assignment: &RankAssignment,
        run_as: &Result<RunAs, String>,
    ) -> Result<(u32, u64), String> {
        let exec = &exec_engine(launch)?;
        if !self.inventory.gpus.iter().any(|g| g.index == assignment.gpu_index) {
            return Err(format!("launch refused: GPU {} is not on this host", assignment.gpu_index));
        }
        let run_as = run_as.as_ref().map_err(Clone::clone)?;
        let (id, files) = (record.id, &record.files);
        let host = HostContext {
            gpus: &self.inventory.gpus,
            inherited_omp_threads: std::env::var_os("OMP_NUM_THREADS").is_some(),
        };
        let rank = rank_env(launch, assignment, &files.receipts, &host);
        if !rank.ignored_overlay.is_empty() {
            warn!(rank_id = %id, names = ?rank.ignored_overlay, "overlay variables ignored: the agent owns them");
        }
        // The rank's whole environment: the agent's own (never its CUDA_VISIBLE_DEVICES), the
        // user's account, the binding, then the rank's variables and the job's overlay.
        let mut env: BTreeMap<String, String> = std::env::vars_os()
            .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
            .filter(|(name, _)| name != VISIBLE_DEVICES)
            .collect();
        let program = &self.shims[0];
        let mut command = tokio::process::Command::new(program);
        command.env_clear().env("PATH", SHIM_PATH).current_dir("/");
        command.arg("supervise").arg("--status-file").arg(&files.exit).arg("--pid-file").arg(&files.pid);
        command.arg("--env-file").arg(files.env()).arg("--workdir").arg(&exec.workdir);
        let (stdout, stderr) = (shim::open_output(&files.stdout)?, shim::open_output(&files.stderr)?);
        if let RunAs::Switch(user) = run_as {
            shim::switch_user(&mut command, &mut env, user, files, [&stdout, &stderr])?;
            info!(rank_id = %id, user = %user.name, uid = user.uid, "rank runs as its job's user");
        }
        shim::bind(&mut command, &mut env, assignment);
        shim::track(&mut command, &record.cgroup, &self.tracking);
        shim::logs(&mut command, files, self.output_cap, self.disk_floor);
        env.extend(rank.vars);
        self.bootstrap.apply(launch, &mut env);
        if let Some(local_id) = &self.preflight_report {
            env.insert(PREFLIGHT_REPORT.to_string(), local_id.clone());
        }
        let bytes =
            serde_json::to_vec(&env).map_err(|e| format!("cannot encode the rank's environment: {e}"))?;
        write_private(&files.env(), &bytes, PRIVATE_FILE_MODE)
            .map_err(|e| format!("cannot write {}: {e}", files.env().display()))?;
        command.arg("--").args(&exec.argv).stdin(Stdio::null()).stdout(stdout).stderr(stderr);
        shim::start(command, program)
    }

    /// Checks every rank that has not ended yet; returns the ids of those that changed (their
    /// state files are already written).
    pub fn poll_exits(&mut self) -> Vec<RankId> {
        let mut changed = Vec::new();
        for rank in self.ranks.values_mut() {
            if !rank.record.phase.is_done() && observe(&mut rank.record, &self.shims) {
                let done = rank.record.phase.is_done();
                let receipt = done && rank.record.pid.is_some() && !rank.record.exit_receipt;
                rank.record.exit_receipt |= receipt;
                // Only an end is synced before its report: a power cut ends a started rank too.
                let (record, layout) = (&rank.record, &self.layout);
                let saved = if done { record.save(layout) } else { record.note(layout) };
                if let Err(e) = saved {
                    warn!(rank_id = %rank.record.id, error = %e, "failed to write rank state file");
                }
                // After the save: an agent killed in between loses this receipt, never doubles it.
                let line = receipt.then(|| receipts_file::exit_receipt(&rank.record));
                if let Some(line) = line
                    && let Err(e) =
                        receipts_file::append_kept(&self.layout, &rank.record.files.receipts, &line)
                {
                    warn!(rank_id = %rank.record.id, error = %e, "failed to append the rank's exit receipt");
                }
                changed.push(rank.record.id);
            }
        }
        changed
    }

    /// SIGTERM to the process group of every live rank of the attempt, SIGKILL after `grace`.
    /// Runs in background tasks (returned); exits are noticed by [`Launcher::poll_exits`].
    pub fn cancel(
        &mut self,
        job_id: u64,
        attempt: u32,
        grace: Duration,
        reason: &str,
    ) -> Vec<JoinHandle<()>> {
        let mut stops = Vec::new();
        for rank in self.ranks.values_mut() {
            let r = &mut rank.record;
            if r.id.job_id != job_id || r.id.attempt != attempt || r.phase.is_done() {
                continue;
            }
            info!(rank_id = %r.id, grace_ms = grace.as_millis() as u64, reason, "cancelling rank");
            if r.message.is_empty() {
                r.message = format!("cancelled: {reason}");
            }
            stops.push(tokio::spawn(terminate(r.id, r.pid, r.files.pid.clone(), r.cgroup.clone(), grace)));
        }
        stops
    }

    /// Asks the attempt's live ranks to checkpoint now: (re)writes each one's request file and
    /// sends `signal` when the job names one (`SIGUSR1`, `SIGUSR2`). Returns how many were asked.
    pub fn checkpoint_now(&mut self, job_id: u64, attempt: u32, signal: &str, reason: &str) -> usize {
        let sig = match signal {
            "SIGUSR1" => Some(libc::SIGUSR1),
            "SIGUSR2" => Some(libc::SIGUSR2),
            _ => None,
        };
        let mut asked = 0;
        for rank in self.ranks.values() {
            let r = &rank.record;
            if r.id.job_id != job_id || r.id.attempt != attempt || r.phase.is_done() {
                continue;
            }
            let path = r.files.checkpoint_request();
            let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let line = format!("{} {reason}\n", at.as_millis());
            if let Err(e) = std::fs::write(&path, line) {
                warn!(rank_id = %r.id, path = %path.display(), error = %e, "failed to write the checkpoint request");
            }
            if let (Some(sig), Some(pid)) = (sig, r.pid) {
                // SAFETY: kill(2) on the rank's own pid, which the launcher started and tracks.
                unsafe { libc::kill(pid as i32, sig) };
            }
            info!(rank_id = %r.id, signal, reason, "asked the rank to checkpoint now");
            asked += 1;
        }
        asked
    }

    /// Marks the attempt's ranks to be forgotten once their receipts are all acknowledged.
    pub fn forget(&mut self, job_id: u64, attempt: u32) {
        for rank in self.ranks.values_mut() {
            let r = &mut rank.record;
            if r.id.job_id == job_id && r.id.attempt == attempt && !r.forget {
                r.forget = true;
                if let Err(e) = r.save(&self.layout) {
                    warn!(rank_id = %r.id, error = %e, "failed to write rank state file");
                }
            }
        }
    }

    /// Writes the acknowledged positions that moved into the state files, at most once per
    /// [`ACK_PERSIST_EVERY`], except for ranks that ended (so they can be forgotten promptly).
    pub fn persist_acks(&mut self) {
        let due = self.acks_persisted_at.elapsed() >= ACK_PERSIST_EVERY;
        if due {
            self.acks_persisted_at = std::time::Instant::now();
        }
        for rank in self.ranks.values_mut().filter(|r| due || r.record.phase.is_done()) {
            if rank.tailer.take_acked_dirty() {
                rank.record.acked = rank.tailer.acked();
                if let Err(e) = rank.record.save(&self.layout) {
                    warn!(rank_id = %rank.record.id, error = %e, "failed to persist acknowledged position");
                }
            }
        }
    }

    /// Drops ranks marked to be forgotten that have ended and whose receipts are all
    /// acknowledged: their state files go, their run files stay. Returns the dropped ids.
    pub fn drop_forgotten(&mut self) -> Vec<RankId> {
        let done: Vec<RankId> = self
            .ranks
            .values()
            .filter(|r| r.record.forget && r.record.phase.is_done() && r.tailer.fully_acked())
            .map(|r| r.record.id)
            .collect();
        for id in &done {
            if let Some(rank) = self.ranks.remove(id) {
                if let Err(e) = rank.record.remove(&self.layout) {
                    warn!(rank_id = %id, error = %e, "failed to remove rank state file");
                }
                info!(rank_id = %id, "rank forgotten");
            }
        }
        done
    }
}

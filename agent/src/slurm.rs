//! An agent started inside a Slurm allocation (docs/slurm.md): one per node, by the batch
//! script `ctl submit --slurm` writes (`srun --ntasks-per-node=1 trainyard-agent --slurm-job N`).
//!
//! It runs as the user who submitted, joins with its job's token (no certificate), takes that
//! job's ranks alone and exits when the controller dismisses it, which ends its Slurm step. It
//! cannot make cgroups, so it holds each rank's processes with its shim as a child subreaper and
//! stops them itself when the allocation ends; Slurm's step cgroup (`proctrack/cgroup`) is the
//! final kill. It plans pinning within the CPUs the step may use, read from its own affinity,
//! not assumed from the node.

use std::collections::BTreeSet;
use std::path::PathBuf;

use trainyard_proto::contract::cpulist;
use trainyard_proto::v1::HostInventory;

/// What an agent inside an allocation knows of it.
#[derive(Clone, PartialEq, Eq)]
pub struct SlurmAgent {
    /// The trainyard job it joined for.
    pub job: u64,
    /// The job's join token (`tyj_...`).
    pub join_token: String,
    /// `SLURM_JOB_ID`: the Slurm job holding the allocation.
    pub slurm_job_id: String,
    /// `SLURMD_NODENAME`: the node's name in Slurm (the hostname where it is not set).
    pub node: String,
    /// `SLURM_RESTART_COUNT`: how often the Slurm job was requeued (0 at first).
    pub restart: u32,
}

impl std::fmt::Debug for SlurmAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlurmAgent")
            .field("job", &self.job)
            .field("slurm_job_id", &self.slurm_job_id)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl SlurmAgent {
    /// From the step's environment; the error names what is missing.
    pub fn from_env(job: u64, join_token: String) -> Result<SlurmAgent, String> {
        if job == 0 {
            return Err("--slurm-job: give the trainyard job this allocation is for (a positive id)".into());
        }
        if join_token.trim().is_empty() {
            return Err(
                "--slurm-job needs the job's join token in TRAINYARD_JOIN_TOKEN (the batch script `ctl submit \
                 --slurm` writes sets it)"
                    .into(),
            );
        }
        let slurm_job_id = std::env::var("SLURM_JOB_ID").map_err(|_| {
            "--slurm-job: SLURM_JOB_ID is not set; the agent of a [slurm] job runs inside its allocation \
             (started by srun from the batch script)"
                .to_string()
        })?;
        let node = std::env::var("SLURMD_NODENAME")
            .ok()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(crate::preflight::host::hostname);
        let restart = std::env::var("SLURM_RESTART_COUNT").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
        Ok(SlurmAgent { job, join_token: join_token.trim().to_string(), slurm_job_id, node, restart })
    }

    /// `j<job>-<node>`: the id the controller takes from this job's agents alone.
    pub fn agent_id(&self) -> String {
        trainyard_model::slurm::agent_id(self.job, &self.node, self.restart)
    }

    /// The data directory when none is given: the node's temporary directory (Slurm's `TMPDIR`
    /// where the cluster sets one), one per job, Slurm job and node. The job's part is a hash of
    /// its token, so a job id another controller (or a restored database) repeats never meets
    /// an old job's state.
    pub fn default_data_dir(&self) -> PathBuf {
        use sha2::Digest as _;
        let tmp = std::env::var_os("TMPDIR").filter(|t| !t.is_empty()).unwrap_or_else(|| "/tmp".into());
        let digest = sha2::Sha256::digest(self.join_token.as_bytes());
        let tag: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!(
            "trainyard-j{}-{tag}-slurm{}.{}-{}",
            self.job, self.slurm_job_id, self.restart, self.node
        );
        PathBuf::from(tmp).join(name)
    }
}

/// How Slurm is ending the allocation, as a Slurm job state (`CANCELLED`, `TIMEOUT`, ...), when
/// the agent is told to stop. While the allocation's processes are being killed `scontrol`
/// says only `COMPLETING` (the final state appears once the last step, this agent's, ended), so
/// the cause is read from what is known: a node of it down (`Reason=NodeDown`) is `NODE_FAIL`;
/// past the time limit (or after the warning) it is `TIMEOUT`; otherwise someone ended it
/// (`scancel`, or preemption): `CANCELLED`.
pub async fn ending_state(slurm_job_id: &str, warned: bool, restart: u32) -> String {
    let out = tokio::process::Command::new("scontrol")
        .args(["show", "job", "-o", slurm_job_id])
        .kill_on_drop(true)
        .output();
    let text = match tokio::time::timeout(std::time::Duration::from_secs(5), out).await {
        Ok(Ok(out)) => String::from_utf8_lossy(&out.stdout).into_owned(),
        _ => String::new(),
    };
    tracing::info!(slurm_job_id, said = %text.trim(), "how Slurm is ending the allocation");
    classify(&text, warned, restart)
}

/// [`ending_state`] from one line of `scontrol show job -o` (empty: `scontrol` did not answer).
pub fn classify(text: &str, warned: bool, restart: u32) -> String {
    let field = |name: &str| text.split_whitespace().find_map(|f| f.strip_prefix(name));
    match field("JobState=") {
        Some(state) if state != "COMPLETING" && state != "RUNNING" => return state.to_string(),
        _ => {}
    }
    // Slurm requeued the job already (a node failure, a preemption): it goes on elsewhere.
    if field("Restarts=").and_then(|r| r.parse::<u32>().ok()).is_some_and(|r| r > restart) {
        return "REQUEUED".into();
    }
    if matches!(field("Reason="), Some("NodeDown" | "NodeFail")) {
        return "NODE_FAIL".into();
    }
    let secs = |t: &str| -> Option<u64> {
        let (days, rest) = t.split_once('-').map_or((0, t), |(d, r)| (d.parse().unwrap_or(0), r));
        let parts: Vec<u64> = rest.split(':').map(|p| p.parse().ok()).collect::<Option<_>>()?;
        let hms = parts.iter().fold(0, |acc, p| acc * 60 + p);
        Some(days * 86_400 + hms)
    };
    let over = match (field("RunTime=").and_then(secs), field("TimeLimit=").and_then(secs)) {
        (Some(run), Some(limit)) => run + 1 >= limit,
        _ => false,
    };
    if warned || over { "TIMEOUT".into() } else { "CANCELLED".into() }
}

/// Makes the directory of a `file:` notice source (the time-limit warning the batch script
/// writes on its node) on this node, private to this agent's user, when it is not there yet:
/// every agent of the allocation watches the same path, and only the batch host's sees it
/// appear. Its name carries a random part `ctl` chose, so no other user can make it first.
pub fn prepare_warning_dir(source: &str) -> Result<(), String> {
    let Some(path) = source.strip_prefix("file:") else { return Ok(()) };
    let Some(dir) = std::path::Path::new(path).parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    if dir.exists() {
        return Ok(());
    }
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(dir)
        .or_else(|e| if e.kind() == std::io::ErrorKind::AlreadyExists { Ok(()) } else { Err(e) })
        .map_err(|e| format!("cannot make the warning directory {}: {e}", dir.display()))
}

/// Asks Slurm to requeue the Slurm job (`scontrol requeue`): the job goes on in a new
/// allocation. Logged, never fatal (another agent of the allocation may have asked first).
pub async fn requeue(slurm_job_id: &str) {
    let out =
        tokio::process::Command::new("scontrol").args(["requeue", slurm_job_id]).kill_on_drop(true).output();
    match tokio::time::timeout(std::time::Duration::from_secs(10), out).await {
        Ok(Ok(out)) if out.status.success() => tracing::info!(slurm_job_id, "Slurm job requeued"),
        Ok(Ok(out)) => tracing::warn!(
            slurm_job_id,
            said = %String::from_utf8_lossy(&out.stderr).trim(),
            "scontrol requeue refused (another agent of the allocation may have asked first)"
        ),
        Ok(Err(e)) => tracing::warn!(slurm_job_id, error = %e, "cannot run scontrol requeue"),
        Err(_) => tracing::warn!(slurm_job_id, "scontrol requeue did not answer within 10 s"),
    }
}

/// The CPUs and the memory nodes this process may use (the bounds a Slurm step's cpuset sets),
/// from `Cpus_allowed_list` and `Mems_allowed_list` of `/proc/self/status`.
pub fn allowed_cpus() -> Option<(BTreeSet<u32>, BTreeSet<u32>)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let list = |field: &str| -> Option<BTreeSet<u32>> {
        let text = status.lines().find_map(|l| l.strip_prefix(field))?.trim();
        cpulist::parse(text).ok().map(|ids| ids.into_iter().collect())
    };
    Some((list("Cpus_allowed_list:")?, list("Mems_allowed_list:")?))
}

/// Keeps only the allowed CPUs, of NUMA nodes whose memory is allowed (`mems`), in the NUMA
/// nodes (and cores) the controller plans pinning from.
pub fn restrict_to(inventory: &mut HostInventory, (allowed, mems): &(BTreeSet<u32>, BTreeSet<u32>)) {
    for node in &mut inventory.numa_nodes {
        let cpus: Vec<u32> = cpulist::parse(&node.cpus)
            .unwrap_or_default()
            .into_iter()
            .filter(|c| allowed.contains(c) && mems.contains(&node.id))
            .collect();
        node.cpus = cpulist::format(&cpus);
    }
    inventory.cores.retain(|core| cpulist::parse(core).is_ok_and(|c| c.iter().all(|c| allowed.contains(c))));
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainyard_proto::v1::NumaNode;

    #[test]
    fn how_slurm_ends_an_allocation_is_read_from_scontrols_line() {
        let line = |state: &str, run: &str, limit: &str| {
            format!(
                "JobId=7 JobName=trainyard-3 JobState={state} Reason=None RunTime={run} TimeLimit={limit} TimeMin=N/A"
            )
        };
        // While the allocation is killed, only the clock tells a time limit from a scancel.
        assert_eq!(classify(&line("COMPLETING", "00:00:03", "UNLIMITED"), false, 0), "CANCELLED");
        assert_eq!(classify(&line("COMPLETING", "00:01:00", "00:01:00"), false, 0), "TIMEOUT");
        assert_eq!(classify(&line("COMPLETING", "1-00:00:00", "1-00:00:00"), false, 0), "TIMEOUT");
        assert_eq!(
            classify(&line("COMPLETING", "00:00:30", "00:10:00"), true, 0),
            "TIMEOUT",
            "after the warning"
        );
        assert_eq!(
            classify(&line("PREEMPTED", "00:00:30", "00:10:00"), false, 0),
            "PREEMPTED",
            "a final state is said"
        );
        assert_eq!(classify("", false, 0), "CANCELLED", "scontrol did not answer");
        let down = "JobId=7 JobState=COMPLETING Reason=NodeDown RunTime=00:00:30 TimeLimit=00:10:00";
        assert_eq!(classify(down, false, 0), "NODE_FAIL", "a node of the allocation went down");
        let requeued =
            "JobId=7 JobState=COMPLETING Reason=None Restarts=1 RunTime=00:00:30 TimeLimit=UNLIMITED";
        assert_eq!(classify(requeued, false, 0), "REQUEUED", "Slurm requeued the job already");
        assert_eq!(classify(requeued, false, 1), "CANCELLED", "the requeued allocation's own count");
    }

    #[test]
    fn pinning_is_planned_within_the_allowed_cpus() {
        let mut inv = HostInventory {
            numa_nodes: vec![NumaNode { id: 0, cpus: "0-3".into() }, NumaNode { id: 1, cpus: "4-7".into() }],
            cores: vec!["0,4".into(), "1".into(), "2".into(), "5".into()],
            ..Default::default()
        };
        let mut both = inv.clone();
        restrict_to(&mut inv, &(BTreeSet::from([1, 2, 5]), BTreeSet::from([0, 1])));
        assert_eq!(inv.numa_nodes[0].cpus, "1-2");
        assert_eq!(inv.numa_nodes[1].cpus, "5");
        assert_eq!(
            inv.cores,
            vec!["1".to_string(), "2".into(), "5".into()],
            "a core half outside is dropped"
        );
        // A NUMA node whose memory the step may not use gets no rank pinned to it.
        restrict_to(&mut both, &(BTreeSet::from([1, 2, 5]), BTreeSet::from([0])));
        assert_eq!((both.numa_nodes[0].cpus.as_str(), both.numa_nodes[1].cpus.as_str()), ("1-2", ""));
    }

    #[test]
    fn the_environment_names_what_is_missing() {
        assert!(SlurmAgent::from_env(0, "tyj_1_x".into()).unwrap_err().contains("positive"));
        assert!(SlurmAgent::from_env(3, " ".into()).unwrap_err().contains("TRAINYARD_JOIN_TOKEN"));
        let agent = SlurmAgent {
            job: 3,
            join_token: "tyj_3_x".into(),
            slurm_job_id: "41".into(),
            node: "n0".into(),
            restart: 0,
        };
        assert_eq!(agent.agent_id(), "j3-n0");
        assert_eq!(
            SlurmAgent { restart: 1, ..agent.clone() }.agent_id(),
            "j3-n0-r1",
            "a requeued allocation's"
        );
        let dir = agent.default_data_dir().file_name().unwrap().to_string_lossy().into_owned();
        assert!(dir.starts_with("trainyard-j3-") && dir.ends_with("-slurm41.0-n0"), "{dir}");
        let other = SlurmAgent { join_token: "tyj_3_y".into(), ..agent.clone() };
        assert_ne!(other.default_data_dir(), agent.default_data_dir(), "another controller's job 3");
        assert!(!format!("{agent:?}").contains("tyj_"), "the token is never logged");
    }
}

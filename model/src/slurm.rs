//! A job on a Slurm cluster (`[slurm]` of a spec, docs/slurm.md): what `sbatch` is asked for,
//! checked at submit, and the names trainyard gives the agents of an allocation.
//!
//! Pure: the `sbatch` command line is built here (and unit-tested) but run by `ctl`, as the
//! user; the controller never talks to Slurm.

use std::time::Duration;

use trainyard_proto::v1 as pb;

/// A `[slurm]` field and what is wrong with it (the spec's error names it the same way).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub field: String,
    pub reason: String,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

type SpecError = Invalid;

/// Seconds before the time limit Slurm warns the agents when `[slurm] warning_s` is unset.
pub const DEFAULT_WARNING_S: u32 = 120;
/// The longest warning a job may ask for (a day).
pub const MAX_WARNING_S: u32 = 86_400;
/// Further `sbatch` options a job may give, at most, and the length of each.
pub const MAX_OPTIONS: usize = 32;
pub const MAX_OPTION_BYTES: usize = 256;
/// Spare nodes a job may ask for, at most.
pub const MAX_SPARE_NODES: u32 = 64;

/// Options trainyard sets itself from the spec: a job that gave them would get an allocation
/// shaped unlike its ranks, or without the warning and requeue trainyard relies on.
const OWN_OPTIONS: &[&str] = &[
    "-N",
    "--nodes",
    "-n",
    "--ntasks",
    "--ntasks-per-node",
    "--signal",
    "--requeue",
    "--no-requeue",
    "-k",
    "--no-kill",
    "--wrap",
    "-J",
    "--job-name",
    "--parsable",
    "-o",
    "--output",
    "-e",
    "--error",
];

/// `[slurm]` of a job, every part parsed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlurmOptions {
    pub partition: String,
    pub account: String,
    pub qos: String,
    /// `sbatch --time` as written; empty: the partition's limit.
    pub time_limit: String,
    /// Further `sbatch` options, one argument each.
    pub options: Vec<String>,
    /// How long before the time limit the agents are warned (SIGUSR1).
    pub warning: Duration,
    /// Requeue the Slurm job at the warning (after a checkpoint), and let Slurm requeue it when
    /// it is preempted.
    pub requeue: bool,
    /// Nodes beyond the job's own; with any, the allocation survives a lost node (`--no-kill`).
    pub spare_nodes: u32,
}

impl From<&pb::SlurmSpec> for SlurmOptions {
    fn from(s: &pb::SlurmSpec) -> Self {
        let warning_s = if s.warning_s == 0 { DEFAULT_WARNING_S } else { s.warning_s };
        SlurmOptions {
            partition: s.partition.clone(),
            account: s.account.clone(),
            qos: s.qos.clone(),
            time_limit: s.time_limit.clone(),
            options: s.options.clone(),
            warning: Duration::from_secs(u64::from(warning_s)),
            requeue: s.requeue,
            spare_nodes: s.spare_nodes,
        }
    }
}

impl From<&SlurmOptions> for pb::SlurmSpec {
    fn from(s: &SlurmOptions) -> Self {
        pb::SlurmSpec {
            partition: s.partition.clone(),
            account: s.account.clone(),
            qos: s.qos.clone(),
            time_limit: s.time_limit.clone(),
            options: s.options.clone(),
            warning_s: s.warning.as_secs() as u32,
            requeue: s.requeue,
            spare_nodes: s.spare_nodes,
        }
    }
}

fn bad(field: &str, reason: impl Into<String>) -> SpecError {
    SpecError { field: format!("slurm.{field}"), reason: reason.into() }
}

/// A Slurm name (partition, account, QOS): letters, digits and `_.-`, at most 64 bytes.
fn check_name(field: &str, value: &str) -> Result<(), SpecError> {
    if value.len() > 64 {
        return Err(bad(field, format!("is {} bytes long, at most 64 allowed", value.len())));
    }
    if let Some(c) = value.chars().find(|c| !(c.is_ascii_alphanumeric() || "_.-,".contains(*c))) {
        return Err(bad(field, format!("{value:?} has {c:?}; a Slurm name has letters, digits and _ . - ,")));
    }
    Ok(())
}

/// Checks `[slurm]` of a spec whose resources are `res`: every rule that needs no Slurm. What
/// Slurm itself refuses (an unknown partition, a limit over the partition's) is `sbatch`'s
/// error, shown to the user as Slurm says it.
pub fn validate(s: &pb::SlurmSpec, res: Option<&pb::Resources>) -> Result<(), SpecError> {
    check_name("partition", &s.partition)?;
    check_name("account", &s.account)?;
    check_name("qos", &s.qos)?;
    let limit = &s.time_limit;
    if limit.len() > 32
        || !(limit.chars().all(|c| c.is_ascii_digit() || c == ':' || c == '-')
            || matches!(limit.as_str(), "UNLIMITED" | "INFINITE"))
    {
        return Err(bad(
            "time_limit",
            format!("{limit:?} is not a Slurm time (minutes, \"H:MM:SS\", \"D-HH:MM:SS\" or \"UNLIMITED\")"),
        ));
    }
    if s.options.len() > MAX_OPTIONS {
        return Err(bad("options", format!("has {} options, at most {MAX_OPTIONS}", s.options.len())));
    }
    for option in &s.options {
        check_option(option)?;
    }
    if s.warning_s > MAX_WARNING_S {
        return Err(bad("warning_s", format!("{} is more than {MAX_WARNING_S} (a day)", s.warning_s)));
    }
    if s.spare_nodes > MAX_SPARE_NODES {
        return Err(bad("spare_nodes", format!("{} is more than {MAX_SPARE_NODES}", s.spare_nodes)));
    }
    let per_node = res.map_or(0, |r| r.gpus_per_node);
    if per_node == 0 {
        return Err(SpecError {
            field: "resources.gpus_per_node".into(),
            reason: "must be set for a [slurm] job: its allocation asks Slurm for gpus / gpus_per_node \
                     nodes with that many GPUs each"
                .into(),
        });
    }
    Ok(())
}

fn check_option(option: &str) -> Result<(), SpecError> {
    if option.len() > MAX_OPTION_BYTES {
        return Err(bad(
            "options",
            format!("an option is {} bytes long, at most {MAX_OPTION_BYTES}", option.len()),
        ));
    }
    if option.chars().any(char::is_control) {
        return Err(bad("options", format!("{option:?} has a control character")));
    }
    if !option.starts_with('-') {
        return Err(bad(
            "options",
            format!(
                "{option:?} is not an sbatch option (each entry is one option, e.g. \"--constraint=h100\")"
            ),
        ));
    }
    let name = option.split('=').next().unwrap_or(option);
    let short = OWN_OPTIONS.iter().find(|o| o.len() == 2 && name.starts_with(**o) && !name.starts_with("--"));
    if let Some(own) = OWN_OPTIONS.iter().find(|o| **o == name).or(short) {
        return Err(bad(
            "options",
            format!(
                "{option:?}: trainyard sets {own} itself from the spec (resources, warning_s, requeue, spare_nodes)"
            ),
        ));
    }
    Ok(())
}

/// The nodes an allocation holds: the job's (`gpus / gpus_per_node`) and its spares.
pub fn nodes(res: &pb::Resources, slurm: &SlurmOptions) -> u32 {
    res.gpus / res.gpus_per_node.max(1) + slurm.spare_nodes
}

/// The `sbatch` arguments for trainyard job `job` (before the batch script's path): the
/// allocation's shape from the spec, the warning, requeue and `--no-kill` as the spec asks,
/// then the job's own options. `output` is where Slurm writes the batch script's output.
pub fn sbatch_args(job: u64, res: &pb::Resources, slurm: &SlurmOptions, output: &str) -> Vec<String> {
    let mut args = vec![
        "--parsable".to_string(),
        format!("--job-name=trainyard-{job}"),
        format!("--nodes={}", nodes(res, slurm)),
        "--ntasks-per-node=1".into(),
        format!("--gres=gpu:{}", res.gpus_per_node),
        // To the batch shell only (`B:`): a signal to the steps would reach every rank too, and
        // a script that does not handle SIGUSR1 dies of it.
        format!("--signal=B:USR1@{}", slurm.warning.as_secs()),
        format!("--output={output}"),
    ];
    args.push(if slurm.requeue { "--requeue" } else { "--no-requeue" }.into());
    if slurm.spare_nodes > 0 {
        args.push("--no-kill".into());
    }
    for (flag, value) in [
        ("partition", &slurm.partition),
        ("account", &slurm.account),
        ("qos", &slurm.qos),
        ("time", &slurm.time_limit),
    ] {
        if !value.is_empty() {
            args.push(format!("--{flag}={value}"));
        }
    }
    args.extend(slurm.options.iter().cloned());
    args
}

/// The id an agent started for job `job` on Slurm node `node` joins with: `j<job>-<node>`, and
/// `-r<n>` after it in the `n`th requeued allocation (`SLURM_RESTART_COUNT`), so an agent of a
/// new allocation is never taken for one of the old.
pub fn agent_id(job: u64, node: &str, restart: u32) -> String {
    if restart == 0 { format!("j{job}-{node}") } else { format!("j{job}-{node}-r{restart}") }
}

/// Whether `agent_id` is a name [`agent_id`] gives the agents of job `job`.
pub fn is_agent_of(agent_id: &str, job: u64) -> bool {
    agent_id.strip_prefix(&format!("j{job}-")).is_some_and(|node| !node.is_empty())
}

/// The state Slurm gives a job whose allocation trainyard's agents saw end, as a cause: the
/// user cancelled it (`scancel`), or Slurm ended it (time limit, preemption, node failure): a
/// job that asks for requeue then goes on in the allocation Slurm requeues, one that does not
/// ends there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// `scancel` by the user (or an admin): the trainyard job ends as cancelled.
    Cancelled,
    /// The time limit, preemption, a requeue, a node failure or anything else Slurm did: the
    /// attempt ends without blame on a node.
    BySlurm,
}

impl Ending {
    /// From the `JobState` of `scontrol show job` (`CANCELLED`, `TIMEOUT`, `PREEMPTED`, ...).
    pub fn of(state: &str) -> Ending {
        if state.starts_with("CANCELLED") { Ending::Cancelled } else { Ending::BySlurm }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(gpus: u32, per_node: u32) -> pb::Resources {
        pb::Resources { gpus, gpus_per_node: per_node, ..Default::default() }
    }

    fn spec() -> pb::SlurmSpec {
        pb::SlurmSpec { partition: "gpu".into(), time_limit: "4:00:00".into(), ..Default::default() }
    }

    #[test]
    fn a_plain_spec_passes_and_builds_its_sbatch_line() {
        let s = spec();
        validate(&s, Some(&res(16, 8))).unwrap();
        let options = SlurmOptions::from(&s);
        assert_eq!(options.warning, Duration::from_secs(120), "the default warning");
        let args = sbatch_args(7, &res(16, 8), &options, "/home/u/slurm-%j.out");
        for want in [
            "--parsable",
            "--job-name=trainyard-7",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--gres=gpu:8",
            "--signal=B:USR1@120",
            "--no-requeue",
            "--partition=gpu",
            "--time=4:00:00",
            "--output=/home/u/slurm-%j.out",
        ] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
        assert!(!args.iter().any(|a| a.starts_with("--account") || a == "--no-kill"), "{args:?}");
    }

    #[test]
    fn spares_ask_for_more_nodes_and_no_kill_and_requeue_is_passed() {
        let s = pb::SlurmSpec { spare_nodes: 1, requeue: true, warning_s: 30, ..spec() };
        let args = sbatch_args(3, &res(2, 1), &SlurmOptions::from(&s), "o");
        for want in ["--nodes=3", "--no-kill", "--requeue", "--signal=B:USR1@30"] {
            assert!(args.iter().any(|a| a == want), "{want} missing from {args:?}");
        }
        let round = pb::SlurmSpec::from(&SlurmOptions::from(&s));
        assert_eq!(round, s, "the wire form goes round");
    }

    #[test]
    fn bad_slurm_tables_name_the_field() {
        let err = |s: pb::SlurmSpec, r: pb::Resources| validate(&s, Some(&r)).unwrap_err().to_string();
        assert!(
            err(pb::SlurmSpec { partition: "gpu; rm -rf".into(), ..spec() }, res(8, 8))
                .starts_with("slurm.partition:")
        );
        assert!(
            err(pb::SlurmSpec { time_limit: "four hours".into(), ..spec() }, res(8, 8))
                .starts_with("slurm.time_limit:")
        );
        assert!(err(spec(), res(8, 0)).starts_with("resources.gpus_per_node: must be set"));
        for own in ["--nodes=4", "-N4", "--signal=B:USR2@60", "--no-kill", "--wrap=true", "-J", "--output=x"]
        {
            let e = err(pb::SlurmSpec { options: vec![own.into()], ..spec() }, res(8, 8));
            assert!(e.contains("trainyard sets"), "{own}: {e}");
        }
        let e = err(pb::SlurmSpec { options: vec!["constraint=h100".into()], ..spec() }, res(8, 8));
        assert!(e.contains("not an sbatch option"), "{e}");
        let e = err(pb::SlurmSpec { options: vec!["--comment=a\nb".into()], ..spec() }, res(8, 8));
        assert!(e.contains("control character"), "{e}");
        assert!(
            err(pb::SlurmSpec { warning_s: 100_000, ..spec() }, res(8, 8)).starts_with("slurm.warning_s")
        );
        // Options trainyard does not set pass, whatever their value.
        validate(
            &pb::SlurmSpec { options: vec!["--constraint=h100".into(), "--exclusive".into()], ..spec() },
            Some(&res(8, 8)),
        )
        .unwrap();
        validate(&pb::SlurmSpec { time_limit: "UNLIMITED".into(), ..spec() }, Some(&res(8, 8))).unwrap();
    }

    #[test]
    fn agent_ids_belong_to_one_job() {
        let id = agent_id(12, "gpu-node-3", 0);
        assert_eq!(id, "j12-gpu-node-3");
        assert_eq!(agent_id(12, "gpu-node-3", 2), "j12-gpu-node-3-r2");
        assert!(is_agent_of(&agent_id(12, "n0", 1), 12));
        assert!(is_agent_of(&id, 12));
        assert!(!is_agent_of(&id, 1), "job 1's prefix j1- is not j12-");
        assert!(!is_agent_of("j12-", 12) && !is_agent_of("node-a", 12));
        assert_eq!(Ending::of("CANCELLED by 1000"), Ending::Cancelled);
        assert_eq!(Ending::of("TIMEOUT"), Ending::BySlurm);
        assert_eq!(Ending::of("PREEMPTED"), Ending::BySlurm);
    }
}

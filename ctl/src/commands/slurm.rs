//! `ctl submit --slurm` and what `ctl` does with Slurm for a `[slurm]` job (docs/slurm.md):
//! `sbatch` the allocation (as you), `scancel` it, and say Slurm's reason while it is pending.
//! The controller never talks to Slurm.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use trainyard_model::slurm::{SlurmOptions, sbatch_args};
use trainyard_proto::v1::{CancelRequest, JobSpec, SlurmSubmittedRequest};

use crate::client::Controller;

/// How the agents of an allocation are started: the program on the compute nodes, the
/// controller URL they dial, the CA they trust it from, and further agent flags.
#[derive(Debug, Clone, Default)]
pub struct AgentLaunch {
    pub program: PathBuf,
    pub controller: String,
    pub ca: Option<PathBuf>,
    pub args: Vec<String>,
}

/// sbatch options given to `ctl submit --slurm` itself, over the spec's `[slurm]` table (the
/// controller checks them as it checks the table).
#[derive(Debug, Clone, Default)]
pub struct SbatchFlags {
    pub partition: Option<String>,
    pub account: Option<String>,
    pub qos: Option<String>,
    pub time_limit: Option<String>,
    /// Appended to the table's options.
    pub options: Vec<String>,
}

impl SbatchFlags {
    /// Writes the flags into `spec`'s `[slurm]` table (nothing when it has none: the submit
    /// then says the table is missing).
    pub fn apply(self, spec: &mut JobSpec) {
        let Some(table) = spec.slurm.as_mut() else { return };
        for (flag, field) in [
            (self.partition, &mut table.partition),
            (self.account, &mut table.account),
            (self.qos, &mut table.qos),
            (self.time_limit, &mut table.time_limit),
        ] {
            if let Some(value) = flag {
                *field = value;
            }
        }
        table.options.extend(self.options);
    }
}

/// `trainyard-agent` beside this `ctl` when it is there (an install on a shared file system),
/// else the name, found on the compute nodes' PATH.
pub fn default_agent_program() -> PathBuf {
    let beside = std::env::current_exe().ok().and_then(|p| Some(p.parent()?.join("trainyard-agent")));
    beside.filter(|p| p.is_file()).unwrap_or_else(|| PathBuf::from("trainyard-agent"))
}

/// Where `ctl` keeps the batch scripts it writes and Slurm's output of them: `$TRAINYARD_SLURM_DIR`,
/// else `~/.trainyard/slurm` (a directory of yours, 0700: the scripts hold join tokens).
fn spool_dir() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("TRAINYARD_SLURM_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set; set TRAINYARD_SLURM_DIR")?)
            .join(".trainyard/slurm"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("make {} private", dir.display()))?;
    Ok(dir)
}

/// Fails with what to do when `sbatch` cannot be found.
pub fn need_slurm(program: &str) -> anyhow::Result<()> {
    match Command::new(program).arg("--version").output() {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "{program} is not on PATH: `ctl submit --slurm` runs on a Slurm login node, where Slurm's client \
             commands (sbatch, squeue, scancel) are installed"
        ),
        Err(e) => bail!("cannot run {program}: {e}"),
    }
}

/// `s` quoted for sh.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The batch script: one agent per node of the allocation, run as you. Slurm warns the script
/// (`--signal=B:USR1@N`) before the time limit; it writes a file the agent on its node watches as
/// a preemption notice, so the controller checkpoints the job and moves it (docs/slurm.md).
pub fn batch_script(job_id: u64, name: &str, token: &str, agent: &AgentLaunch, warning_s: u64) -> String {
    // A name no other user can guess and make first (the agents refuse a notice directory
    // someone else owns).
    let private = &super::new_key()[..12];
    let mut argv = vec![
        "srun".to_string(),
        "--ntasks-per-node=1".into(),
        "--whole".into(),
        // A node of the allocation lost ends only its agent, not the step: with a spare node the
        // job goes on there (sbatch --no-kill keeps the allocation).
        "--no-kill".into(),
        "--kill-on-bad-exit=0".into(),
        quote(&agent.program.display().to_string()),
        "--slurm-job".into(),
        job_id.to_string(),
        "--preemption-notice".into(),
        "\"file:$warning\"".into(),
        "--preemption-deadline-secs".into(),
        warning_s.to_string(),
    ];
    if let Some(ca) = &agent.ca {
        argv.extend(["--tls-ca".into(), quote(&ca.display().to_string())]);
    }
    argv.extend(agent.args.iter().map(|a| quote(a)));
    let name: String = name.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    format!(
        "#!/bin/sh\n\
         # trainyard job {job_id} ({name}): one agent per node of this allocation, as you (docs/slurm.md).\n\
         # Written by `ctl submit --slurm`. It holds the job's join token: keep it private.\n\
         export TRAINYARD_CONTROLLER={}\n\
         export TRAINYARD_JOIN_TOKEN={}\n\
         # Slurm's warning before the time limit comes here; the agent on this node watches the file.\n\
         warning=\"${{TMPDIR:-/tmp}}/trainyard-{private}-$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}/warning\"\n\
         mkdir -p -m 700 \"${{warning%/warning}}\" && rm -f \"$warning\"\n\
         trap 'date +%s > \"$warning\"' USR1\n\
         {} &\n\
         agents=$!\n\
         while :; do wait \"$agents\"; status=$?; kill -0 \"$agents\" 2>/dev/null || break; done\n\
         rm -f \"$warning\"\n\
         exit $status\n",
        quote(&agent.controller),
        quote(token),
        argv.join(" ")
    )
}

/// The Slurm job id in `sbatch --parsable`'s answer (`ID` or `ID;CLUSTER`).
fn parse_sbatch(stdout: &str) -> Option<u64> {
    stdout.trim().split(';').next()?.trim().parse().ok()
}

/// Asks Slurm for job `job_id`'s allocation: writes its batch script, runs `sbatch` as you and
/// tells the controller the Slurm job. When Slurm refuses, the job is cancelled and the error is
/// Slurm's own message. Returns the Slurm job id.
pub async fn allocate(
    ctl: &mut Controller,
    job_id: u64,
    spec: &JobSpec,
    token: &str,
    agent: &AgentLaunch,
) -> anyhow::Result<u64> {
    let slurm = SlurmOptions::from(spec.slurm.as_ref().context("the spec has no [slurm] table")?);
    let res = spec.resources.clone().unwrap_or_default();
    let dir = spool_dir()?;
    let script = dir.join(format!("job-{job_id}.sh"));
    write_private(&script, &batch_script(job_id, &spec.name, token, agent, slurm.warning.as_secs()))?;
    let output = dir.join(format!("job-{job_id}-slurm-%j.out"));
    let args = sbatch_args(job_id, &res, &slurm, &output.display().to_string());
    let out = Command::new("sbatch").args(&args).arg(&script).output().context("run sbatch")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let slurm_id = match (out.status.success(), parse_sbatch(&stdout)) {
        (true, Some(id)) => id,
        _ => {
            let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
            let said = if said.is_empty() { stdout.trim().to_string() } else { said };
            let reason = format!("sbatch refused the allocation: {said}");
            let _ = ctl.jobs.cancel(CancelRequest { job_id, reason: reason.clone() }).await;
            bail!("job {job_id}: {reason} (the job is cancelled; sbatch {})", args.join(" "));
        }
    };
    let detail = format!("{} node(s){}", trainyard_model::slurm::nodes(&res, &slurm), partition_of(&slurm));
    let request = SlurmSubmittedRequest { job_id, slurm_job_id: slurm_id, detail };
    if let Err(status) = ctl.jobs.slurm_submitted(request).await {
        let _ = scancel(slurm_id);
        return Err(ctl.error(status, Some(job_id)));
    }
    eprintln!("job {job_id}: Slurm job {slurm_id} asks for the allocation (script {})", script.display());
    Ok(slurm_id)
}

fn partition_of(slurm: &SlurmOptions) -> String {
    if slurm.partition.is_empty() { String::new() } else { format!(" in partition {}", slurm.partition) }
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o700)
        .open(path)
        .with_context(|| format!("write {}", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("write {}", path.display()))
}

/// Ends Slurm job `slurm_id` (`scancel`, as you).
pub fn scancel(slurm_id: u64) -> anyhow::Result<()> {
    let out = Command::new("scancel").arg(slurm_id.to_string()).output().context("run scancel")?;
    if !out.status.success() {
        bail!("scancel {slurm_id}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Slurm's word on a Slurm job: "PENDING (Resources)", "RUNNING", or why it cannot say.
pub fn queue_state(slurm_id: u64) -> String {
    let out = Command::new("squeue").args(["-h", "-j", &slurm_id.to_string(), "-o", "%T|%r"]).output();
    match out {
        Err(e) => format!("squeue cannot be run here ({e})"),
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            match text.trim().split_once('|') {
                Some((state, reason)) if reason.is_empty() || reason == "None" => state.to_string(),
                Some((state, reason)) => format!("{state} ({reason})"),
                None => "no longer in Slurm's queue".to_string(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_script_starts_one_agent_per_node_with_everything_quoted() {
        let agent = AgentLaunch {
            program: "/opt/trainyard/bin/trainyard-agent".into(),
            controller: "https://ctl.example:7070".into(),
            ca: Some("/home/u/ca.pem".into()),
            args: vec!["--host-file".into(), "/it's here.json".into()],
        };
        let script = batch_script(7, "nano\nchat", "tyj_7_abc", &agent, 120);
        assert!(script.starts_with("#!/bin/sh\n"), "{script}");
        assert!(script.contains("export TRAINYARD_JOIN_TOKEN='tyj_7_abc'\n"), "{script}");
        assert!(script.contains("export TRAINYARD_CONTROLLER='https://ctl.example:7070'\n"), "{script}");
        assert!(script.contains("(nano chat)"), "no newline from the name reaches the script: {script}");
        let srun = script.lines().find(|l| l.starts_with("srun ")).expect("the srun line");
        assert!(srun.starts_with("srun --ntasks-per-node=1 --whole --no-kill"), "{srun}");
        assert!(
            srun.contains(
                "--slurm-job 7 --preemption-notice \"file:$warning\" --preemption-deadline-secs 120"
            ),
            "{srun}"
        );
        assert!(srun.contains("--tls-ca '/home/u/ca.pem' '--host-file' '/it'\\''s here.json' &"), "{srun}");
        assert!(script.contains("trap 'date +%s > \"$warning\"' USR1\n"), "{script}");
        // The script is valid sh.
        let checked = std::process::Command::new("sh").args(["-n", "-c", &script]).status().unwrap();
        assert!(checked.success(), "{script}");
        assert_eq!(parse_sbatch("4242\n"), Some(4242));
        assert_eq!(parse_sbatch("4242;cluster-a\n"), Some(4242));
        assert_eq!(parse_sbatch("Submitted batch job 4242"), None);
    }

    #[test]
    fn flags_override_the_table_and_add_options() {
        let mut spec = JobSpec {
            slurm: Some(trainyard_proto::v1::SlurmSpec {
                partition: "gpu".into(),
                time_limit: "1:00:00".into(),
                options: vec!["--exclusive".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let flags = SbatchFlags {
            partition: Some("debug".into()),
            time_limit: None,
            options: vec!["--constraint=h100".into()],
            ..Default::default()
        };
        flags.apply(&mut spec);
        let table = spec.slurm.unwrap();
        assert_eq!((table.partition.as_str(), table.time_limit.as_str()), ("debug", "1:00:00"));
        assert_eq!(table.options, vec!["--exclusive".to_string(), "--constraint=h100".into()]);
    }

    #[test]
    fn a_missing_sbatch_is_named() {
        let e = need_slurm("no-such-sbatch-here").unwrap_err().to_string();
        assert!(e.contains("no-such-sbatch-here is not on PATH") && e.contains("login node"), "{e}");
    }
}

//! `trainyard-agent supervise`: the flags of the per-rank shim the agent starts for every rank
//! ([`trainyard_agent::supervise`] does the work).

use std::path::PathBuf;
use std::process::ExitCode;

use trainyard_agent::pinning::Binding;
use trainyard_agent::supervise::{SuperviseArgs, SwitchUser, supervise};

/// `supervise`'s flags (boxed: by far the largest command).
#[derive(Debug, clap::Args)]
pub struct ShimCli {
    #[arg(long)]
    status_file: PathBuf,
    #[arg(long)]
    pid_file: PathBuf,
    /// The rank's environment, a JSON object written by the agent (root-only).
    #[arg(long)]
    env_file: PathBuf,
    /// The rank's working directory, entered after dropping to the rank's user.
    #[arg(long)]
    workdir: PathBuf,
    /// CPUs to bind the rank to (kernel list format, e.g. 0-15).
    #[arg(long)]
    cpus: Option<String>,
    /// NUMA node the rank's memory is bound to (MPOL_BIND).
    #[arg(long)]
    mem_node: Option<u32>,
    /// User id the rank runs as (with --gid and --groups; the shim must be root).
    #[arg(long, requires = "gid")]
    uid: Option<u32>,
    #[arg(long, requires = "uid")]
    gid: Option<u32>,
    /// Supplementary group ids of the rank, comma-separated.
    #[arg(long, value_delimiter = ',')]
    groups: Vec<u32>,
    /// The rank's cgroup v2 directory: joined before exec, emptied when the rank ends.
    #[arg(long)]
    cgroup2: Option<PathBuf>,
    /// A cgroup v1 directory of the rank, CONTROLLER=DIR (repeatable).
    #[arg(long)]
    cgroup1: Vec<String>,
    /// No cgroups: the shim is a child subreaper and kills the rank's orphans at its end.
    #[arg(long)]
    subreaper: bool,
    /// The rank's stdout log (the shim's own stdout): the rank writes into a pipe the shim
    /// copies there, at most --output-cap bytes kept.
    #[arg(long, requires = "stderr_log")]
    stdout_log: Option<PathBuf>,
    #[arg(long, requires = "stdout_log")]
    stderr_log: Option<PathBuf>,
    #[arg(long, default_value_t = trainyard_agent::output::DEFAULT_CAP_BYTES)]
    output_cap: u64,
    /// No output is written while the logs' file system has less free than the larger of
    /// --keep-free bytes and --keep-free-percent of its size.
    #[arg(long, default_value_t = 0)]
    keep_free: u64,
    #[arg(long, default_value_t = 0)]
    keep_free_percent: u8,
    /// The rank's program and arguments.
    #[arg(last = true, required = true)]
    argv: Vec<String>,
}

/// Runs the shim to the end; its exit code is 0 once `exit.json` is written.
pub fn run(shim: ShimCli) -> ExitCode {
    let ShimCli {
        status_file,
        pid_file,
        env_file,
        workdir,
        cpus,
        mem_node,
        uid,
        gid,
        groups,
        cgroup2,
        cgroup1,
        subreaper,
        stdout_log,
        stderr_log,
        output_cap,
        keep_free,
        keep_free_percent,
        argv,
    } = shim;
    // A binding that cannot even be parsed leaves the rank unpinned; the read-back and
    // the controller's warning tell the operator (see `trainyard_agent::pinning`).
    let binding = Binding::from_flags(cpus.as_deref(), mem_node).unwrap_or_else(|e| {
        eprintln!("trainyard-agent supervise: {e}; the rank runs unpinned");
        None
    });
    let user = uid.zip(gid).map(|(uid, gid)| SwitchUser { uid, gid, groups });
    let owner = user.as_ref().map(|u| (u.uid, u.gid));
    let floor = trainyard_agent::layout::DiskFloor { bytes: keep_free, percent: keep_free_percent };
    let log = |path: PathBuf| trainyard_agent::output::Log { path, cap: output_cap, owner, floor };
    let logs = stdout_log.zip(stderr_log).map(|(out, err)| [log(out), log(err)]);
    let v1 = cgroup1
        .iter()
        .filter_map(|pair| pair.split_once('=').map(|(c, d)| (c.to_string(), PathBuf::from(d))))
        .collect();
    let group = trainyard_agent::cgroup::RankGroup { v2: cgroup2, v1 };
    let args = SuperviseArgs {
        status_file,
        pid_file,
        env_file,
        workdir,
        binding,
        user,
        group,
        subreaper,
        logs,
        argv,
    };
    ExitCode::from(u8::try_from(supervise(&args)).unwrap_or(1))
}

//! `ctl`: the operator's command line for trainyard.
//!
//! # Layout
//! - `spec`: the TOML job spec file and its conversion to the proto `JobSpec`.
//! - `client`: the connection to the controller; gRPC failures become actionable sentences.
//! - `commands`: one module per subcommand (submit, status, cancel, watch, logs, diagnose,
//!   compare, nodes, preflight).
//! - `progress`: the rate-limited progress line of `submit --follow`.
//! - `output`: the stable JSON rendering behind `-o json`.
//! - `render`: tables, ages, timestamps and receipt lines for people.
//! - `fleet`: the fleet table and preflight reports for people.
//!
//! Errors are printed as one line on stderr with a non-zero exit status.

mod client;
mod commands;
mod fleet;
mod output;
mod progress;
mod render;
mod spec;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use trainyard_proto::words::PreflightLevel;

#[derive(Debug, Parser)]
#[command(
    name = "ctl",
    version,
    about = "Submit, inspect, watch and cancel trainyard jobs; inspect the fleet"
)]
struct Cli {
    /// Address of the controller's gRPC endpoint, or several separated by commas (a controller
    /// group: reads go to the first that answers, writes to the leader it names).
    #[arg(long, global = true, env = "TRAINYARD_CONTROLLER", default_value = "http://127.0.0.1:7070")]
    controller: String,
    /// The CA that signed the controller's certificate, for an https:// controller (the
    /// ca.pem `trainyard-controller init-pki` wrote).
    #[arg(long, global = true, env = "TRAINYARD_CA")]
    ca: Option<PathBuf>,
    /// A file holding your token (default: ~/.config/trainyard/token when it exists);
    /// TRAINYARD_TOKEN, when set, is used instead.
    #[arg(long, global = true, env = "TRAINYARD_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Submit a job spec (TOML); prints the job id on stdout.
    Submit {
        /// The job spec file.
        file: PathBuf,
        /// Stream progress to stderr until the job ends; exit 0 only if it succeeded.
        #[arg(long)]
        follow: bool,
        /// Idempotency key: a submit with a key already used returns that job instead of
        /// creating another (for scripts that retry). Default: a fresh random key, which ctl
        /// reuses when it retries on its own.
        #[arg(long, value_name = "KEY")]
        key: Option<String>,
        /// Run the job in an allocation of this Slurm cluster: `sbatch` (as you) asks for its
        /// nodes, with the spec's [slurm] table; one agent per node joins for this job alone.
        #[arg(long)]
        slurm: bool,
        /// The agent program on the compute nodes (default: trainyard-agent beside this ctl, else
        /// on their PATH).
        #[arg(long, requires = "slurm", value_name = "PATH")]
        agent_program: Option<PathBuf>,
        /// The controller URL the agents dial from the compute nodes (default: --controller).
        #[arg(long, requires = "slurm", value_name = "URL")]
        agent_controller: Option<String>,
        /// A further flag for every agent (repeat it; e.g. --agent-arg=--reserve-cpus=2).
        #[arg(long = "agent-arg", requires = "slurm", allow_hyphen_values = true, value_name = "ARG")]
        agent_args: Vec<String>,
        /// sbatch's partition, account, QOS and time limit for this submit, over the spec's
        /// [slurm] table.
        #[arg(long, requires = "slurm")]
        partition: Option<String>,
        #[arg(long, requires = "slurm")]
        account: Option<String>,
        #[arg(long, requires = "slurm")]
        qos: Option<String>,
        #[arg(long, requires = "slurm", value_name = "TIME")]
        time_limit: Option<String>,
        /// A further sbatch option for this submit, after the table's (repeat it; e.g.
        /// --sbatch-arg=--constraint=h100).
        #[arg(long = "sbatch-arg", requires = "slurm", allow_hyphen_values = true, value_name = "OPTION")]
        sbatch_args: Vec<String>,
    },
    /// Show all jobs, or one job's events and ranks.
    Status {
        job: Option<u64>,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Cancel a job and wait until its ranks have stopped.
    Cancel { job: u64 },
    /// Stream a job's receipts until it ends.
    Watch {
        job: u64,
        /// Only receipts stored after this position (as printed by `-o json`).
        #[arg(long, default_value_t = 0)]
        from: u64,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Print a rank's stdout and stderr, read by its agent (works after the job ended).
    Logs {
        job: u64,
        /// The rank (default 0).
        #[arg(long, default_value_t = 0)]
        rank: u32,
        /// Only the last N lines of each stream (0: everything).
        #[arg(long, default_value_t = 0)]
        tail: u32,
        /// Keep printing new output until the rank ends.
        #[arg(short = 'f', long)]
        follow: bool,
    },
    /// Name the likely cause of a slow or uneven run: the node, the ranks, the evidence, what it
    /// costs and the fix (or say the run is healthy).
    Diagnose {
        job: u64,
        /// The attempt to diagnose (default: the job's current attempt).
        #[arg(long)]
        attempt: Option<u32>,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
        output: Format,
        /// Follow the live diagnosis instead: print each finding as it opens, changes and
        /// closes, until the job ends (one JSON object per line with -o json).
        #[arg(short = 'f', long, conflicts_with = "attempt")]
        follow: bool,
    },
    /// Two jobs side by side (provenance, env, placement, preflight, step time, collectives)
    /// and what most likely explains their difference; A is the reference.
    Compare {
        a: u64,
        b: u64,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Show the fleet: every node with its GPUs, class, NUMA layout, verdict and free GPUs.
    Nodes {
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Show a node's newest preflight report, or have it run one now with --run.
    Preflight {
        /// The node's agent id (or its hostname, when only one node has it).
        host: String,
        /// Run a preflight at this level now and show its report.
        #[arg(long, value_name = "LEVEL", value_parser = runnable_level)]
        run: Option<PreflightLevel>,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
        output: Format,
    },
    /// Take a node out of scheduling (admins): running jobs stay, no new work goes there until
    /// `ctl uncordon`.
    Cordon {
        /// The node's agent id (or its hostname, when only one node has it).
        host: String,
        /// Why, for the fleet table and the audit log.
        #[arg(long)]
        reason: String,
    },
    /// Put a cordoned node back into scheduling (admins); also lifts a cordon set after failures.
    Uncordon { host: String },
    /// Drain a node (admins): cordon it, ask the jobs running there to checkpoint now, and move
    /// them elsewhere once they have, or at the deadline.
    Drain {
        host: String,
        /// How long the jobs have to checkpoint, e.g. 120s, 5m (default 120s).
        #[arg(long, default_value = "120s", value_parser = parse_seconds)]
        deadline: u32,
        #[arg(long, default_value = "")]
        reason: String,
    },
}

/// `120`, `120s`, `5m` or `1h` as whole seconds, at most a day.
fn parse_seconds(text: &str) -> Result<u32, String> {
    let (number, unit) = match text.trim().char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => text.trim().split_at(i),
        None => (text.trim(), "s"),
    };
    let n: u32 = number.parse().map_err(|_| format!("{text:?} is not a duration like 120s, 5m or 1h"))?;
    let seconds = match unit {
        "s" => Some(n),
        "m" => n.checked_mul(60),
        "h" => n.checked_mul(3600),
        other => return Err(format!("{text:?}: unknown unit {other:?}; use s, m or h")),
    };
    seconds.filter(|s| *s <= 86_400).ok_or_else(|| format!("{text:?} is more than a day"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ctl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ctl: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    // Parse the spec before dialing, so a typo is reported even with no controller around.
    let spec = match &cli.command {
        Command::Submit { file, .. } => Some(spec::load(file)?),
        _ => None,
    };
    let credentials = client::Credentials::from_env(cli.ca.clone(), cli.token_file.clone())?;
    // Writes go to the leader of a controller group; any member answers reads.
    let writes = match &cli.command {
        Command::Submit { .. }
        | Command::Cancel { .. }
        | Command::Cordon { .. }
        | Command::Uncordon { .. }
        | Command::Drain { .. }
        | Command::Logs { .. } => true,
        Command::Preflight { run, .. } => run.is_some(),
        _ => false,
    };
    let mut ctl = if writes {
        client::connect_leader(&cli.controller, &credentials).await?
    } else {
        client::connect(&cli.controller, &credentials).await?
    };
    match cli.command {
        Command::Submit {
            follow,
            key,
            slurm,
            agent_program,
            agent_controller,
            agent_args,
            partition,
            account,
            qos,
            time_limit,
            sbatch_args,
            ..
        } => {
            let mut spec = spec.unwrap_or_default();
            let flags =
                commands::slurm::SbatchFlags { partition, account, qos, time_limit, options: sbatch_args };
            flags.apply(&mut spec);
            let slurm = slurm.then(|| commands::slurm::AgentLaunch {
                program: agent_program.unwrap_or_else(commands::slurm::default_agent_program),
                controller: agent_controller.unwrap_or_else(|| cli.controller.clone()),
                ca: cli.ca.clone(),
                args: agent_args,
            });
            commands::submit::run(&mut ctl, spec, key, follow, slurm).await
        }
        Command::Status { job, output } => commands::status::run(&mut ctl, job, output == Format::Json).await,
        Command::Cancel { job } => commands::cancel::run(&mut ctl, job).await,
        Command::Watch { job, from, output } => {
            commands::watch::run(&mut ctl, job, from, output == Format::Json).await
        }
        Command::Logs { job, rank, tail, follow } => {
            commands::logs::run(&mut ctl, job, rank, tail, follow).await
        }
        Command::Diagnose { job, follow: true, output, .. } => {
            commands::diagnose::follow(&mut ctl, job, output == Format::Json).await
        }
        Command::Diagnose { job, attempt, output, .. } => {
            commands::diagnose::run(&mut ctl, job, attempt, output == Format::Json).await
        }
        Command::Compare { a, b, output } => {
            commands::compare::run(&mut ctl, a, b, output == Format::Json).await
        }
        Command::Nodes { output } => commands::nodes::run(&mut ctl, output == Format::Json).await,
        Command::Preflight { host, run, output } => {
            commands::preflight::run(&mut ctl, &host, run, output == Format::Json).await
        }
        Command::Cordon { host, reason } => commands::nodes::cordon(&mut ctl, &host, Some(reason)).await,
        Command::Uncordon { host } => commands::nodes::cordon(&mut ctl, &host, None).await,
        Command::Drain { host, deadline, reason } => {
            commands::nodes::drain(&mut ctl, &host, deadline, reason).await
        }
    }
}

/// A level a node can run now (`none` is a job spec's word only).
fn runnable_level(text: &str) -> Result<PreflightLevel, String> {
    match text.parse::<PreflightLevel>() {
        Ok(PreflightLevel::None) | Err(_) => {
            Err(format!("{text:?}: the levels a node runs are quick, standard and full"))
        }
        Ok(level) => Ok(level),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_controller_flag_after_the_subcommand() {
        let cli = Cli::try_parse_from(["ctl", "status", "3", "-o", "json", "--controller", "http://x:1"])
            .expect("parse");
        assert_eq!(cli.controller, "http://x:1");
        assert!(matches!(cli.command, Command::Status { job: Some(3), output: Format::Json }));
    }

    #[test]
    fn preflight_takes_a_host_and_a_known_level() {
        let cli =
            Cli::try_parse_from(["ctl", "preflight", "sxm-a", "--run", "full", "-o", "json"]).expect("parse");
        let Command::Preflight { host, run, output } = cli.command else { panic!("not preflight") };
        assert_eq!((host.as_str(), run, output), ("sxm-a", Some(PreflightLevel::Full), Format::Json));
        let err =
            Cli::try_parse_from(["ctl", "preflight", "sxm-a", "--run", "thorough"]).expect_err("bad level");
        assert!(err.to_string().contains("quick"), "{err}");
        let err =
            Cli::try_parse_from(["ctl", "preflight", "sxm-a", "--run", "none"]).expect_err("not runnable");
        assert!(err.to_string().contains("the levels a node runs are quick, standard and full"), "{err}");
    }
}

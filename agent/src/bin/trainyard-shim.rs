//! `trainyard-shim`: the per-rank shim alone, the same as `trainyard-agent supervise` and with the
//! same command line. The agent starts one for every rank: a binary a tenth of the agent's size
//! starts in less time and CPU (fewer pages to map and relocate), which every rank of a launch pays.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod shim;

#[derive(Debug, Parser)]
#[command(name = "trainyard-shim", version, about = "trainyard's per-rank shim (started by the agent)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Supervises one rank: binds, tracks and runs it, copies its output, writes its exit.
    Supervise(Box<shim::ShimCli>),
}

fn main() -> ExitCode {
    let Command::Supervise(shim) = Cli::parse().command;
    shim::run(*shim)
}

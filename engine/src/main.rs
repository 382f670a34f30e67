//! `trainyard-engine`: the per-rank binary of trainyard's built-in engine.
use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "trainyard-engine", version, about = "trainyard's built-in GPT training engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the libtorch / CUDA facts of this process as JSON.
    Info,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Info => {
            let info = trainyard_engine::runtime_info();
            println!("{}", serde_json::to_string_pretty(&info)?);
        }
    }
    Ok(())
}

//! The `qarl` command line: argument parsing that calls into the library, no logic of its own.

mod generate;
mod score;

use clap::{Parser, Subcommand};

/// qarl: reinforcement learning of LLMs with quantized rollouts aligned with training.
#[derive(Debug, Parser)]
#[command(name = "qarl", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Full-sequence forward: logits and next-token log-probs of given token ids.
    Score(score::ScoreArgs),
    /// Generate continuations of prompts (greedy for now).
    Generate(generate::GenerateArgs),
}

/// Parses the command line and runs the command.
pub fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Score(a) => score::run(a),
        Command::Generate(a) => generate::run(a),
    }
}

//! `engine-shim`: kvmesh's native engine. Not built yet beyond the model loader: see
//! docs/engine-shim.md. `engine-shim inspect MODEL.gguf` prints what the loader reads.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "engine-shim",
    version,
    about = "kvmesh's native libtorch engine (in progress)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Reads a GGUF model and prints its architecture, tensors and a tokenized chat prompt.
    Inspect {
        /// The GGUF file.
        model: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Inspect { model } => {
            let g = engine_shim::gguf::Gguf::open(&model)?;
            let arch = g.get_str("general.architecture")?;
            println!("architecture {arch}, {} tensors", g.tensors.len());
            let t = engine_shim::tokenizer::ModelTokenizer::from_gguf(&g)
                .context("building the tokenizer")?;
            let prompt =
                t.render_chat(&[("user".into(), "What is the capital of France?".into())])?;
            let ids = t.encode(&prompt)?;
            println!("chat prompt ({} tokens): {prompt:?}", ids.len());
            Ok(())
        }
    }
}

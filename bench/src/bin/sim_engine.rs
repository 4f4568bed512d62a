//! `kvmesh-sim-engine`: see [`kvmesh_bench::sim`].

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    kvmesh_bench::sim::serve(kvmesh_bench::sim::SimConfig::parse()).await
}

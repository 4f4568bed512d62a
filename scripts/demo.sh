#!/usr/bin/env bash
# The main job: build (release), start 2 real engines (engine-shim serving SmolLM2-135M on CPU)
# and kvmesh-proxy on 127.0.0.1, run a shared-prefix chat workload once with `round_robin` and
# once with `prefix` (fresh engines each time), and print the table. `--engine sim` runs the
# larger workload on simulated engines instead. Extra arguments go to `kvmesh-bench demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --locked --workspace --bins
exec target/release/kvmesh-bench demo "$@"

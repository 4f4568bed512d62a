#!/usr/bin/env bash
# The main job: build (release), start 3 simulated engines and kvmesh-proxy on 127.0.0.1, run a
# shared-prefix workload once with `round_robin` and once with `prefix` (fresh engines each
# time), and print the table. Extra arguments go to `kvmesh-bench demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --locked --workspace --bins
exec target/release/kvmesh-bench demo "$@"

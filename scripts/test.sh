#!/usr/bin/env bash
# The whole test suite: formatting, lints, then every unit and end-to-end test (real proxy and
# simulated-engine processes on loopback ports), then the Docker tests (images, compose stacks,
# Kubernetes manifests). This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# The end-to-end tests start other packages' binaries (kvmesh-sim-engine), which `cargo test`
# alone does not build.
cargo build --workspace --bins --locked
cargo test --workspace --locked
# The images, the compose stacks and the Kubernetes manifests on a real Docker engine (starts
# one if none runs, and stops it again).
scripts/test-docker.sh

#!/usr/bin/env bash
# The whole test suite: formatting, lints, then every unit and end-to-end test (real proxy and
# simulated-engine processes on loopback ports), a bounded fuzzing run, then the Docker tests
# (images, compose stacks, Kubernetes manifests). This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
# Free disk first: a build that runs out of it fails as a linker crash (SIGBUS), not as ENOSPC.
df -h . | sed 's/^/test.sh: /'
scripts/setup.sh
cargo fmt --all -- --check
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
# The fuzz workspace keeps its own lock file: a stale one fails here, not after the tests.
cargo metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null
cargo clippy --workspace --all-targets --locked -- -D warnings
# The end-to-end tests start other packages' binaries (kvmesh-sim-engine), which `cargo test`
# alone does not build.
cargo build --workspace --bins --locked
cargo test --workspace --locked
# Two minutes at a steady rate through a gateway and two sidecars: every request answered, and
# each proxy's RSS, open fds and residency index bounded, with no growth trend (the 30-minute
# soak is the same command with --minutes 30; docs/benchmarks.md, "Soak").
cargo run -q --locked -p kvmesh-bench --bin kvmesh-bench -- soak --minutes 2 --sample-secs 5
# Every parser of outside input under libFuzzer, KVMESH_FUZZ_SECS (here 10) seconds per target,
# from the committed corpus (installs cargo-fuzz when missing; docs/fuzzing.md). The quick build
# optimises mainly the parsers' code: about 40% less building than release (docs/fuzzing.md).
KVMESH_FUZZ_SECS="${KVMESH_FUZZ_SECS:-10}" KVMESH_FUZZ_PROFILE="${KVMESH_FUZZ_PROFILE:-dev}" scripts/fuzz.sh
# The images, the compose stacks and the Kubernetes manifests on a real Docker engine (starts
# one if none runs, and stops it again). The images package the debug binaries built above: a
# release build of the same code would add about 20 minutes and test nothing these tests see.
KVMESH_IMAGE_PROFILE=dev scripts/test-docker.sh

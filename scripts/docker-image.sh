#!/usr/bin/env bash
# Builds the kvmesh images from release binaries built on this host, for machines that cannot
# pull a Rust image (with one, `docker build -t kvmesh:dev .` builds from source instead).
#
#   scripts/docker-image.sh                  # kvmesh:dev (proxy, kvagent, sim engine)
#   scripts/docker-image.sh --engine-shim    # also kvmesh-engine-shim:dev (libtorch + model)
#
# The base image is $BASE_IMAGE (default debian:bookworm-slim) when Docker has it locally.
# Otherwise (no registry reachable) a minimal Debian 12 is made with debootstrap and imported
# as kvmesh/debian:bookworm-minbase. Env: KVMESH_IMAGE, KVMESH_SHIM_IMAGE (tags),
# KVMESH_IMAGE_PROFILE (the Cargo profile of the binaries: `release`, the default and what to
# ship; the test suite passes `dev` to package the debug binaries it has already built instead
# of compiling everything a second time).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${KVMESH_IMAGE:-kvmesh:dev}
SHIM_IMAGE=${KVMESH_SHIM_IMAGE:-kvmesh-engine-shim:dev}
BASE=${BASE_IMAGE:-debian:bookworm-slim}
PROFILE=${KVMESH_IMAGE_PROFILE:-release}
case "$PROFILE" in
  release) profile_dir=release ;;
  dev) profile_dir=debug ;;
  *) echo "docker-image: KVMESH_IMAGE_PROFILE must be release or dev, not '$PROFILE'" >&2; exit 2 ;;
esac
shim=0
for arg in "$@"; do
  case "$arg" in
    --engine-shim) shim=1 ;;
    *) echo "usage: $0 [--engine-shim]" >&2; exit 2 ;;
  esac
done
command -v docker >/dev/null || { echo "docker-image: no docker client" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "docker-image: no Docker daemon answers" >&2; exit 1; }

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  [ -n "${BASE_IMAGE:-}" ] && { echo "docker-image: BASE_IMAGE=$BASE is not a local image" >&2; exit 1; }
  BASE=kvmesh/debian:bookworm-minbase
  if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || {
      echo "docker-image: debian:bookworm-slim is not local and debootstrap is missing" \
           "(apt-get install debootstrap, or docker pull debian:bookworm-slim)" >&2; exit 1; }
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "docker-image: debootstrap bookworm (minbase) -> $BASE" >&2
    debootstrap --variant=minbase --include=ca-certificates bookworm "$root" >"$root.log" 2>&1 \
      || { tail -20 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    # What a slim image leaves out: docs, manuals, locales, apt's caches.
    rm -rf "$root"/usr/share/{doc,man,info,locale}/* "$root"/var/cache/apt/* \
           "$root"/var/lib/apt/lists/* "$root"/var/log/*
    tar -C "$root" -c . | docker import - "$BASE" >/dev/null
  fi
fi

echo "docker-image: $PROFILE build" >&2
bins=(--bin kvmesh-proxy --bin kvagent --bin kvmesh-sim-engine)
pkgs=(-p kvmesh-proxy -p kvagent -p kvmesh-bench)
if ((shim)); then bins+=(--bin engine-shim); pkgs+=(-p engine-shim); fi
cargo build --profile "$PROFILE" --locked "${pkgs[@]}" "${bins[@]}"
target=${CARGO_TARGET_DIR:-target}/$profile_dir

rm -rf dist && mkdir -p dist/bin
for b in kvmesh-proxy kvagent kvmesh-sim-engine; do strip -o "dist/bin/$b" "$target/$b"; done
docker build -q -t "$IMAGE" --target runtime-prebuilt --build-arg BASE_IMAGE="$BASE" . >/dev/null
echo "docker-image: $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))" >&2

if ((shim)); then
  mkdir -p dist/engine-shim/{bin,lib,models}
  strip -o dist/engine-shim/bin/engine-shim "$target/engine-shim"
  # libtorch and what it loads, from the wheel scripts/setup.sh unpacked (ldd names them).
  ldd "$target/engine-shim" | awk '$3 ~ /\.libtorch\// {print $3}' | while read -r lib; do
    cp -L "$lib" dist/engine-shim/lib/
  done
  cp models/SmolLM2-135M-Instruct.Q4_1.gguf dist/engine-shim/models/
  docker build -q -t "$SHIM_IMAGE" --target engine-shim-prebuilt --build-arg BASE_IMAGE="$BASE" . >/dev/null
  echo "docker-image: $SHIM_IMAGE ($(docker image inspect -f '{{.Size}}' "$SHIM_IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
fi

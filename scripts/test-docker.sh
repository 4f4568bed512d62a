#!/usr/bin/env bash
# The Docker part of the test suite (scripts/test.sh runs it last): builds the images, then runs
# compose/tests/test_stacks.py against a real Docker engine: the image, every compose profile's
# config, the gateway and mesh stacks (kill, partition), a broken config, the engine-shim
# profile with the real model, and the Kubernetes manifests against the 1.37 schemas.
#
# Installs docker.io, docker-compose and debootstrap from Debian when missing, and starts dockerd
# when no daemon answers (needs root); what it started it stops at the end, pass or fail, with
# every compose project it created. Where Docker cannot be started it fails, saying so.
# Arguments: test names of compose/tests/test_stacks.py to run only those. KVMESH_IMAGE_PROFILE
# (release unless set; scripts/test.sh sets dev) picks the binaries the images package.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ] && ! docker info >/dev/null 2>&1; then
  echo "test-docker: FAIL: no Docker daemon this user can reach, and starting one needs root" >&2
  exit 1
fi
[ -x .venv-peers/bin/python ] || { echo "test-docker: FAIL: .venv-peers missing (run scripts/setup.sh)" >&2; exit 1; }

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if ((${#need[@]})); then
  echo "test-docker: installing ${need[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

dockerd_pid=""
log_dir=$(mktemp -d)
# Every container and network of the tests' compose projects (kvmeshtest-*), whatever state a
# killed earlier run left them in.
remove_test_projects() {
  docker ps -a --filter label=com.docker.compose.project --format '{{.ID}} {{.Label "com.docker.compose.project"}}' 2>/dev/null \
    | awk '$2 ~ /^kvmeshtest-/ {print $1}' | xargs -r docker rm -f >/dev/null 2>&1 || true
  docker network ls --format '{{.Name}}' 2>/dev/null | grep '^kvmeshtest-' \
    | xargs -r docker network rm >/dev/null 2>&1 || true
}
cleanup() {
  local rc=$?
  remove_test_projects
  if [ -n "$dockerd_pid" ]; then
    echo "test-docker: stopping the dockerd it started (pid $dockerd_pid)" >&2
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
  fi
  rm -rf "$log_dir"
  exit $rc
}
trap cleanup EXIT

if ! docker info >/dev/null 2>&1; then
  echo "test-docker: no Docker daemon answers; starting dockerd" >&2
  sh -c "dockerd >'$log_dir/dockerd.log' 2>&1 & echo \$! >'$log_dir/pid'"
  dockerd_pid=$(cat "$log_dir/pid")
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  if ! docker info >/dev/null 2>&1; then
    echo "test-docker: FAIL: Docker could not be started on this machine; dockerd said:" >&2
    tail -20 "$log_dir/dockerd.log" >&2 || true
    exit 1
  fi
fi

remove_test_projects

# The Kubernetes schema validator (ships the schemas: no network at validation time).
K8S_VALIDATE_VERSION=1.37.0
if [ ! -x .venv-k8s/bin/kubernetes-validate ] || \
   [ "$(.venv-k8s/bin/python -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))' 2>/dev/null)" != "$K8S_VALIDATE_VERSION" ]; then
  echo "test-docker: installing kubernetes-validate $K8S_VALIDATE_VERSION into .venv-k8s" >&2
  rm -rf .venv-k8s && python3 -m venv .venv-k8s
  .venv-k8s/bin/pip install -q --disable-pip-version-check "kubernetes-validate==$K8S_VALIDATE_VERSION"
fi

if ! scripts/docker-image.sh --engine-shim >"$log_dir/image.log" 2>&1; then
  echo "test-docker: FAIL: building the images failed:" >&2
  tail -40 "$log_dir/image.log" >&2
  exit 1
fi
grep '^docker-image:' "$log_dir/image.log" >&2 || true
# A bound on the whole run (it takes about 2 minutes): a hang fails, and cleanup still runs.
K8S_VALIDATE=.venv-k8s/bin/kubernetes-validate timeout 1200 .venv-peers/bin/python compose/tests/test_stacks.py "$@"

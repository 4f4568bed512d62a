# kvmesh images: kvmesh-proxy, kvagent and kvmesh-sim-engine on a slim Debian 12, running as a
# non-root user. compose/README.md explains how to build them; in short:
#
#   From source (needs a Rust image; the default target):
#     docker build -t kvmesh:dev .
#   From release binaries built on the host (machines that cannot pull a Rust image):
#     scripts/docker-image.sh          # stages dist/, builds --target runtime-prebuilt
#
# The stages are ordered so that the classic builder, which builds every stage before the
# target, never needs the Rust image for the prebuilt targets.

ARG BASE_IMAGE=debian:bookworm-slim
ARG RUST_IMAGE=rust:1-bookworm

# What every image shares: the user, the config directory, the healthcheck, the entry point.
FROM ${BASE_IMAGE} AS base
# The system CA bundle, for https:// engines and peers verified against public roots (the
# debootstrap base of scripts/docker-image.sh already has it; slim images need the network).
RUN if [ ! -s /etc/ssl/certs/ca-certificates.crt ]; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid 10001 kvmesh \
 && useradd --system --uid 10001 --gid kvmesh --home-dir /var/lib/kvmesh --shell /usr/sbin/nologin kvmesh \
 && mkdir -p /etc/kvmesh /var/lib/kvmesh \
 && chown kvmesh:kvmesh /var/lib/kvmesh
WORKDIR /var/lib/kvmesh
USER 10001:10001
EXPOSE 8080 7946/udp 7946/tcp
# /ready on the default container port: 200 once an engine is up (/health answers as soon as
# the proxy runs). Another port, TLS (add --ca-file), engines and kvagent: override it, as the
# compose files do (kvmesh-proxy probe GETs any URL).
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 \
  CMD ["kvmesh-proxy", "probe", "http://127.0.0.1:8080/ready"]
ENTRYPOINT ["kvmesh-proxy"]
# Replaced by any arguments: `docker run kvmesh:dev --engine http://e:8000 --listen
# 0.0.0.0:8080` runs from flags alone, `docker run kvmesh:dev --version` prints the version.
CMD ["--config", "/etc/kvmesh/kvmesh.toml"]

# Host-built binaries (dist/bin, staged by scripts/docker-image.sh).
FROM base AS runtime-prebuilt
COPY dist/bin/kvmesh-proxy dist/bin/kvagent dist/bin/kvmesh-sim-engine /usr/local/bin/

# engine-shim: the native libtorch engine, its libtorch (from the PyPI torch wheel, see
# scripts/setup.sh) and the SmolLM2-135M-Instruct GGUF, all host-staged in dist/engine-shim.
FROM runtime-prebuilt AS engine-shim-prebuilt
COPY dist/engine-shim/lib/ /opt/kvmesh/lib/
COPY dist/engine-shim/models/ /opt/kvmesh/models/
COPY dist/engine-shim/bin/engine-shim /usr/local/bin/
ENV LD_LIBRARY_PATH=/opt/kvmesh/lib
EXPOSE 8000
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
  CMD ["kvmesh-proxy", "probe", "http://127.0.0.1:8000/v1/models"]
ENTRYPOINT ["engine-shim"]
CMD ["--config", "/etc/kvmesh/engine-shim.toml"]

# From source: a release build of the three binaries (engine-shim needs libtorch, which this
# stage does not install: build it on the host and use engine-shim-prebuilt).
FROM ${RUST_IMAGE} AS build
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends cmake \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# --version names this commit (there is no .git in the context).
ARG GIT_HASH=""
RUN KVMESH_GIT_HASH="$GIT_HASH" cargo build --release --locked -p kvmesh-proxy -p kvagent -p kvmesh-bench \
      --bin kvmesh-proxy --bin kvagent --bin kvmesh-sim-engine \
 && mkdir -p /out \
 && for b in kvmesh-proxy kvagent kvmesh-sim-engine; do \
      strip -o /out/$b target/release/$b; \
    done

FROM base AS runtime
COPY --from=build /out/ /usr/local/bin/

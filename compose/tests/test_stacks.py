#!/usr/bin/env python3
"""End-to-end tests of the images, compose stacks and Kubernetes manifests on a real Docker
engine (scripts/test-docker.sh builds the images and starts the daemon, then runs this).

Every check asserts behaviour seen from outside: the real `openai` client through the proxy's
published port, response headers, /metrics, container states. Each stack runs under its own
compose project and is torn down (down -v) whether its checks pass or not. Exit status: 0 when
every check passed, 1 otherwise; a table of checks and figures is printed either way.
"""

import concurrent.futures
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from openai import OpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE = os.environ.get("KVMESH_IMAGE", "kvmesh:dev")
SHIM_IMAGE = os.environ.get("KVMESH_SHIM_IMAGE", "kvmesh-engine-shim:dev")
COMPOSE = os.environ.get("COMPOSE", "docker-compose").split()
K8S_VALIDATE = os.environ.get("K8S_VALIDATE", "kubernetes-validate")
GATEWAY = os.path.join(ROOT, "compose", "gateway")
MESH = os.path.join(ROOT, "compose", "mesh")

results = []  # (check, passed, detail)
figures = []  # (what, value)


def check(name, passed, detail=""):
    detail = " / ".join(ln.strip() for ln in str(detail).splitlines() if ln.strip())
    results.append((name, bool(passed), detail.replace("|", "\\|")))
    print(f"{'PASS' if passed else 'FAIL'}  {name}  {detail}", flush=True)
    return passed


class Failed(Exception):
    """A step a check depends on did not work (recorded as a failed check)."""


def run(args, timeout=300, check_rc=True, env=None, cwd=None):
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check_rc and p.returncode != 0:
        raise Failed(f"{' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=2.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (OSError, urllib.error.URLError):
        return None, ""


def metric(port, name, labels=None):
    """The value of one series on a proxy's /metrics (None when absent)."""
    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return None
    want = labels or {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in want.items()):
            return float(m.group(3))
    return None


def wait_until(what, pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.25)
    raise Failed(f"timed out after {timeout} s waiting for {what}")


class Stack:
    """One compose project: up on enter, logs kept, down -v on exit whatever happened."""

    def __init__(self, directory, project, env, files=None, first=()):
        """`first`: the services `up -d` starts (default: all of the active profiles)."""
        self.dir, self.project, self.first = directory, project, list(first)
        self.env = {**os.environ, **env}
        self.files = files or [os.path.join(directory, "docker-compose.yml")]

    def compose(self, *args, timeout=300, check_rc=True):
        cmd = COMPOSE + ["-p", self.project, "--project-directory", self.dir]
        for f in self.files:
            cmd += ["-f", f]
        return run(cmd + list(args), timeout=timeout, check_rc=check_rc, env=self.env)

    def container(self, service):
        cid = self.compose("ps", "-q", service).stdout.strip()
        if not cid:
            raise Failed(f"no container for {service}")
        return cid

    def health(self, service):
        cid = self.container(service)
        return run(["docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}"
                    "{{else}}none{{end}}", cid]).stdout.strip()

    def wait_healthy(self, services, timeout=120):
        return wait_until(f"{services} healthy",
                          lambda: all(self.health(s) == "healthy" for s in services), timeout)

    def ip(self, service):
        return run(["docker", "inspect", "-f",
                    "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                    self.container(service)]).stdout.strip()

    def __enter__(self):
        try:
            self.compose("up", "-d", *self.first)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            logs = self.compose("logs", "--no-color", "--tail", "40", check_rc=False)
            print(f"--- logs of {self.project} ---\n{logs.stdout[-6000:]}", flush=True)
        self.compose("down", "-v", "--remove-orphans", timeout=120, check_rc=False)
        return False


def client(port):
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                  timeout=30)


def chat(port, system, user, stream=False, model="sim-model", max_tokens=None):
    """One chat request with the openai client: (headers, text, usage, chunks)."""
    kw = dict(model=model, messages=[{"role": "system", "content": system},
                                     {"role": "user", "content": user}])
    if max_tokens:
        kw.update(max_tokens=max_tokens, temperature=0)
    c = client(port)
    if not stream:
        raw = c.chat.completions.with_raw_response.create(**kw)
        r = raw.parse()
        return raw.headers, r.choices[0].message.content, r.usage, 1
    with c.chat.completions.with_streaming_response.create(stream=True, **kw) as raw:
        text, chunks = "", 0
        for chunk in raw.parse():
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return raw.headers, text, None, chunks


def long_prefix(tag, sentences=60):
    return " ".join(f"{tag}: rule {i} of the shared system prompt says to answer with care."
                    for i in range(sentences))


# ---------------------------------------------------------------------------------------------


def test_image():
    user = run(["docker", "image", "inspect", "-f", "{{.Config.User}}", IMAGE]).stdout.strip()
    uid = run(["docker", "run", "--rm", "--entrypoint", "id", IMAGE, "-u"]).stdout.strip()
    check("image runs as non-root", user == "10001:10001" and uid == "10001",
          f"User={user!r} id -u={uid}")
    version = run(["docker", "run", "--rm", IMAGE, "--version"]).stdout.strip()
    check("image: kvmesh-proxy --version names a commit",
          re.fullmatch(r"kvmesh-proxy \d+\.\d+\.\d+ \([0-9a-f]{12}\)", version), version)
    for image in (IMAGE, SHIM_IMAGE):
        size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", image]).stdout)
        figures.append((f"image size {image}", f"{size / 1e6:.0f} MB"))
    hc = run(["docker", "image", "inspect", "-f", "{{json .Config.Healthcheck.Test}}",
              IMAGE]).stdout
    check("image has a HEALTHCHECK on /ready", "/ready" in hc, hc.strip())


def test_compose_config():
    """Every profile of both stacks is a valid compose file (the GPU ones are not started)."""
    env = {**os.environ, "KVMESH_GOSSIP_KEYS": "x"}
    for directory, profiles in ((GATEWAY, ["sim", "engine-shim", "vllm", "sglang"]),
                                (MESH, [""])):
        for profile in profiles:
            p = run(COMPOSE + ["-f", os.path.join(directory, "docker-compose.yml"), "config",
                               "-q"], check_rc=False,
                    env={**env, "COMPOSE_PROFILES": profile})
            check(f"compose config {os.path.basename(directory)} profile={profile or '-'}",
                  p.returncode == 0, p.stderr.strip()[-300:])
    # An empty env file: a developer's compose/mesh/.env must not provide the key here.
    with tempfile.NamedTemporaryFile("w", suffix=".env") as empty:
        p = run(COMPOSE + ["--env-file", empty.name, "-f", os.path.join(MESH, "docker-compose.yml"),
                           "config", "-q"], check_rc=False,
                env={k: v for k, v in os.environ.items() if k != "KVMESH_GOSSIP_KEYS"})
    check("mesh stack refuses to start without a gossip key",
          p.returncode != 0 and "gossip-keygen" in p.stderr,
          p.stderr.strip().rsplit(": ", 1)[-1][:200])


def test_configs_check():
    """The TOMLs shipped for compose and Kubernetes pass the binaries' own check-config."""
    cm = open(os.path.join(ROOT, "deploy", "k8s", "configmap.yaml")).read()
    tmp = tempfile.mkdtemp()
    try:
        files = {"gateway kvmesh.toml": ("kvmesh-proxy", os.path.join(GATEWAY, "kvmesh.toml")),
                 "gateway kvagent.toml": ("kvagent", os.path.join(GATEWAY, "kvagent.toml")),
                 "mesh kvmesh.toml": ("kvmesh-proxy", os.path.join(MESH, "kvmesh.toml"))}
        for key, binary in (("kvmesh.toml", "kvmesh-proxy"), ("kvagent.toml", "kvagent")):
            m = re.search(rf"^  {re.escape(key)}: \|\n((?:    .*\n|\n)+)", cm, re.M)
            path = os.path.join(tmp, key)
            with open(path, "w") as f:
                f.write(re.sub(r"^    ", "", m.group(1), flags=re.M) if m else "")
            files[f"k8s {key}"] = (binary, path)
        for name, (binary, path) in files.items():
            mount = f"{path}:/etc/kvmesh/check.toml:ro"
            # The per-node keys the stacks set from the environment.
            env = ["-e", "KVMESH_CLUSTER__ADVERTISE=127.0.0.1:7946", "-e",
                   "KVMESH_GOSSIP_KEYS=" + gossip_key()]
            p = run(["docker", "run", "--rm", *env, "-v", mount, "--entrypoint", binary, IMAGE,
                     "check-config", "/etc/kvmesh/check.toml"], check_rc=False)
            check(f"check-config {name}", p.returncode == 0,
                  (p.stdout.strip() if p.returncode == 0 else p.stderr.strip())[-200:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_key = []


def gossip_key():
    if not _key:
        _key.append(run(["docker", "run", "--rm", IMAGE, "gossip-keygen"]).stdout.strip())
    return _key[0]


def test_gateway():
    port = free_port()
    t0 = time.monotonic()
    with Stack(GATEWAY, "kvmeshtest-gw", {"KVMESH_PORT": str(port),
                                          "COMPOSE_PROFILES": "sim"}, first=["kvmesh"]) as s:
        # The proxy alone: its engines' names do not resolve yet. It must run, not ready.
        wait_until("the proxy answering", lambda: http_get(
            f"http://127.0.0.1:{port}/health")[0] == 200, 30)
        time.sleep(2)
        status, _ = http_get(f"http://127.0.0.1:{port}/ready")
        running = run(["docker", "inspect", "-f", "{{.State.Running}} {{.RestartCount}}",
                       s.container("kvmesh")]).stdout.strip()
        check("gateway: the proxy starts before its engines exist, running and not ready",
              status == 503 and running == "true 0"
              and metric(port, "kvmesh_engine_healthy", {"engine": "engine1"}) == 0,
              f"/ready {status}, running/restarts {running}")
        s.compose("up", "-d")
        s.wait_healthy(["kvmesh", "sim1", "sim2"])
        figures.append(("gateway stack (sim): up -d to healthy", f"{time.monotonic() - t0:.1f} s"))
        wait_until("both engines up", lambda: metric(port, "kvmesh_engine_healthy",
                                                     {"engine": "engine2"}) == 1
                   and metric(port, "kvmesh_engine_healthy", {"engine": "engine1"}) == 1, 30)

        h, text, usage, _ = chat(port, "You are terse.", "Say hello.")
        check("gateway: openai chat (non-stream) through the proxy",
              text and h.get("x-kvmesh-engine") in ("engine1", "engine2"),
              f"engine={h.get('x-kvmesh-engine')} tokens={usage.completion_tokens}")
        h, text, _, chunks = chat(port, "You are terse.", "Say hello, streamed.", stream=True)
        check("gateway: openai chat (stream) through the proxy", text and chunks > 2,
              f"{chunks} chunks, engine={h.get('x-kvmesh-engine')}")

        # Same prefix -> one engine, and the engine's own cache confirms it.
        prefix = long_prefix("affinity")
        served, cached = [], []
        for i in range(6):
            h, _, usage, _ = chat(port, prefix, f"question {i}")
            served.append(h.get("x-kvmesh-engine"))
            cached.append(usage.prompt_tokens_details.cached_tokens if i else 0)
        check("gateway: same-prefix requests land on one engine",
              len(set(served)) == 1 and min(cached[1:]) > 0,
              f"engines={served} cached_tokens={cached}")

        # Kill one engine under load: no request fails before its first byte.
        victim = "sim1"
        stop = threading.Event()
        tally = {"ok": 0, "before_first_byte": 0, "mid_stream": 0}
        errors = []
        lock = threading.Lock()

        def load(worker):
            n = 0
            while not stop.is_set():
                n += 1
                got_first = False
                try:
                    c = client(port)
                    with c.chat.completions.with_streaming_response.create(
                            model="sim-model", stream=True,
                            messages=[{"role": "user",
                                       "content": f"{long_prefix(f'w{worker}-{n}', 4)}"}]) as r:
                        # The response head has arrived: the first byte. A failure after it
                        # (an engine killed mid-stream) cannot be retried elsewhere.
                        got_first = True
                        for _ in r.parse():
                            pass
                    key = "ok"
                except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                    key = "mid_stream" if got_first else "before_first_byte"
                    with lock:
                        errors.append(f"{key}: {type(e).__name__}: {e}"[:200])
                with lock:
                    tally[key] += 1

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            try:
                for w in range(4):
                    pool.submit(load, w)
                time.sleep(2)
                run(["docker", "kill", s.container(victim)])
                killed_at = time.monotonic()
                down = wait_until("engine1 marked down", lambda: metric(
                    port, "kvmesh_engine_healthy", {"engine": "engine1"}) == 0, 15)
                marked_down_s = time.monotonic() - killed_at
                time.sleep(3)
            finally:
                stop.set()
        check("gateway: docker kill of an engine under load fails no request before its "
              "first byte", tally["before_first_byte"] == 0 and tally["ok"] > 20,
              f"{tally} {errors[:3]}")
        check("gateway: the killed engine is marked down", down,
              f"after {marked_down_s:.1f} s")
        run(["docker", "start", s.container(victim)])
        started = time.monotonic()
        wait_until("engine1 up again", lambda: metric(port, "kvmesh_engine_healthy",
                                                      {"engine": "engine1"}) == 1, 30)
        back_s = time.monotonic() - started
        seen = set()
        for i in range(12):
            h, _, _, _ = chat(port, long_prefix(f"after-{i}", 4), "hi")
            seen.add(h.get("x-kvmesh-engine"))
        check("gateway: after docker start the engine is back and takes requests",
              "engine1" in seen, f"up {back_s:.1f} s after start; engines used {sorted(seen)}")

        # The engine comes back on another IP: a placeholder container takes its old one.
        old_ip = s.ip(victim)
        s.compose("rm", "-f", "-s", victim)
        # (Docker hands out the lowest free address: the placeholder gets the freed one.)
        placeholder = run(["docker", "run", "-d", "--rm", "--network", f"{s.project}_default",
                           "--label", f"com.docker.compose.project={s.project}",
                           "--entrypoint", "sleep", IMAGE, "infinity"]).stdout.strip()
        try:
            s.compose("up", "-d", victim)
            new_ip = s.ip(victim)
            wait_until("engine1 up at its new address", lambda: metric(
                port, "kvmesh_engine_healthy", {"engine": "engine1"}) == 1, 30)
            seen = set()
            for i in range(12):
                h, _, _, _ = chat(port, long_prefix(f"moved-{i}", 4), "hi")
                seen.add(h.get("x-kvmesh-engine"))
            check("gateway: an engine back on another IP is followed (name resolved again)",
                  new_ip != old_ip and "engine1" in seen,
                  f"{old_ip} -> {new_ip}; engines used {sorted(seen)}")
        finally:
            run(["docker", "rm", "-f", placeholder], check_rc=False)


def test_mesh():
    ports = [free_port() for _ in range(3)]
    env = {"KVMESH_GOSSIP_KEYS": gossip_key(),
           **{f"KVMESH_PORT_{i + 1}": str(p) for i, p in enumerate(ports)}}
    t0 = time.monotonic()
    with Stack(MESH, "kvmeshtest-mesh", env) as s:
        nodes = ["node1", "node2", "node3"]
        s.wait_healthy(nodes + ["proxy1", "proxy2", "proxy3", "engine1", "engine2", "engine3"])
        wait_until("every node sees 2 peers", lambda: all(
            metric(p, "kvmesh_gossip_peers") == 2 for p in ports), 60)
        figures.append(("mesh stack: up -d to healthy and gossiping",
                        f"{time.monotonic() - t0:.1f} s"))
        check("mesh: three nodes gossip by service name", True, "kvmesh_gossip_peers 2 on each")

        # A new prefix enters at node1; the node that serves it is its owner.
        prefix = long_prefix("mesh")
        h, _, _, _ = chat(ports[0], prefix, "first")
        owner = h.get("x-sim-engine", "").replace("engine", "node")
        if owner not in nodes:
            raise Failed(f"no x-sim-engine header: {dict(h)}")
        others = [n for n in nodes if n != owner]
        seen = wait_until(f"{owner}'s residency on the other nodes", lambda: all(
            (metric(ports[nodes.index(n)], "kvmesh_engine_residency_digests",
                    {"engine": owner}) or 0) > 0 for n in others), 10)
        check("mesh: residency learnt on one node is visible on the others (metrics)", seen,
              f"owner {owner}; kvmesh_engine_residency_digests{{engine=\"{owner}\"}} > 0 on "
              f"{others}")
        entry = others[0]
        h, _, usage, _ = chat(ports[nodes.index(entry)], prefix, "second")
        check("mesh: a request entering elsewhere is forwarded once to the owner's engine",
              h.get("x-sim-engine") == owner.replace("node", "engine")
              and h.get("x-kvmesh-peer") == owner
              and usage.prompt_tokens_details.cached_tokens > 0,
              f"entered {entry}, served by {h.get('x-sim-engine')} via {h.get('x-kvmesh-peer')},"
              f" cached_tokens={usage.prompt_tokens_details.cached_tokens}")

        # Partition node3; nodes 1 and 2 drop it and keep serving.
        net = f"{s.project}_default"
        n3 = s.container("node3")
        run(["docker", "network", "disconnect", net, n3])
        cut = time.monotonic()
        failures, served = [], 0
        deadline = time.monotonic() + 20
        dropped_after = None
        i = 0
        while time.monotonic() < deadline:
            i += 1
            for p in ports[:2]:
                try:
                    chat(p, long_prefix(f"partition-{i}", 8), "hi")
                    served += 1
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{type(e).__name__}: {e}"[:160])
            if dropped_after is None and all(metric(p, "kvmesh_gossip_peers") == 1
                                             for p in ports[:2]):
                dropped_after = time.monotonic() - cut
            if dropped_after is not None and time.monotonic() - cut > dropped_after + 3:
                break
        check("mesh: a partitioned node is dropped by the others", dropped_after is not None,
              f"kvmesh_gossip_peers 1 on node1 and node2 after {dropped_after or 0:.1f} s")
        check("mesh: requests keep being served during the partition",
              not failures and served > 10, f"{served} served, failures {failures[:3]}")
        run(["docker", "network", "connect", net, n3])
        rejoined = wait_until("node3 rejoins", lambda: all(
            metric(p, "kvmesh_gossip_peers") == 2 for p in ports), 60)
        rejoin_s = time.monotonic() - cut
        # Across node3's link again: the owner's prefix entering at node3 (or, when node3 owns
        # it, at node1) is forwarded once over the reconnected network.
        # Once the entry node has re-admitted the owner and relearnt its residency (before
        # that it serves locally, and then holds the prefix itself: one try only).
        entry = "node1" if owner == "node3" else "node3"
        wait_until(f"{entry} relearning {owner}'s residency", lambda: (metric(
            ports[nodes.index(entry)], "kvmesh_engine_residency_digests",
            {"engine": owner}) or 0) > 0, 30)
        h, _, usage, _ = chat(ports[nodes.index(entry)], prefix, "third")
        again = (h.get("x-kvmesh-peer") == owner
                 and usage.prompt_tokens_details.cached_tokens > 0)
        check("mesh: after reconnecting, the node rejoins and forwards again",
              rejoined and again, f"kvmesh_gossip_peers 2 everywhere {rejoin_s:.1f} s after "
              f"the cut; {entry} -> {owner} forwarded with a cache hit")


def test_bad_config():
    """A stack whose kvmesh TOML is broken: the container exits naming the key, never healthy."""
    tmp = tempfile.mkdtemp()
    try:
        for f in ("docker-compose.yml", ".env", "kvagent.toml", "engine-shim.toml"):
            shutil.copy(os.path.join(GATEWAY, f), tmp)
        with open(os.path.join(GATEWAY, "kvmesh.toml")) as src, \
                open(os.path.join(tmp, "kvmesh.toml"), "w") as dst:
            dst.write(src.read().replace("[health]", "[health]\ninterval_msec = 1000"))
        with Stack(tmp, "kvmeshtest-bad", {"KVMESH_PORT": str(free_port()),
                                           "COMPOSE_PROFILES": "sim"}) as s:
            states = set()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                states.add(s.health("kvmesh"))
                time.sleep(0.5)
            logs = s.compose("logs", "--no-color", "kvmesh").stdout
            cid = s.container("kvmesh")
            code = run(["docker", "inspect", "-f", "{{.State.ExitCode}}", cid]).stdout.strip()
            named = "unknown field `interval_msec`, expected `interval_ms`" in logs
            check("bad config: the container exits with the message naming the key",
                  named and code not in ("0", ""), f"exit code {code}; "
                  + next((ln.split("|", 1)[-1].strip() for ln in logs.splitlines()
                          if "unknown field" in ln), ""))
            check("bad config: the healthcheck never reports healthy",
                  "healthy" not in states, f"states seen: {sorted(states)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_engine_shim_gateway():
    """The engine-shim profile: two native engines with their kvagents, the real model."""
    port = free_port()
    t0 = time.monotonic()
    with Stack(GATEWAY, "kvmeshtest-shim", {"KVMESH_PORT": str(port),
                                            "COMPOSE_PROFILES": "engine-shim"}) as s:
        s.wait_healthy(["kvmesh", "pod1", "pod2", "shim1", "shim2", "kvagent1", "kvagent2"],
                       timeout=180)
        figures.append(("gateway stack (engine-shim): up -d to healthy",
                        f"{time.monotonic() - t0:.1f} s"))
        system = "You are a helpful assistant. Answer in one short sentence. " * 8
        answers, engines = [], []
        for _ in range(2):
            h, text, usage, _ = chat(port, system, "What is the capital of France?",
                                     model="SmolLM2-135M-Instruct", max_tokens=12)
            answers.append(text)
            engines.append(h.get("x-kvmesh-engine"))
        cached = usage.prompt_tokens_details.cached_tokens
        check("engine-shim stack: the real model answers through the proxy, the repeat hits "
              "the same engine's cache", "Paris" in answers[0] and answers[0] == answers[1]
              and engines[0] == engines[1] and cached > 0,
              f"{answers[0]!r} from {engines}, cached_tokens={cached}")


def test_k8s():
    files = sorted(os.path.join(ROOT, "deploy", "k8s", f)
                   for f in os.listdir(os.path.join(ROOT, "deploy", "k8s"))
                   if f.endswith(".yaml") and f != "kustomization.yaml")
    p = run([K8S_VALIDATE, "--strict", "--quiet", *files], check_rc=False)
    check("k8s: every manifest validates against the Kubernetes 1.37 schemas (strict)",
          p.returncode == 0, (p.stdout + p.stderr).strip()[-300:] or f"{len(files)} files")
    # The validator can fail: a misspelt field in a copy of the StatefulSet.
    tmp = tempfile.mkdtemp()
    try:
        bad = os.path.join(tmp, "bad.yaml")
        with open(os.path.join(ROOT, "deploy", "k8s", "statefulset.yaml")) as f:
            open(bad, "w").write(f.read().replace("readinessProbe:", "readinesProbe:", 1))
        p = run([K8S_VALIDATE, "--strict", "--quiet", bad], check_rc=False)
        check("k8s: the validator refuses a misspelt field", p.returncode != 0,
              (p.stdout + p.stderr).strip().splitlines()[-1][:200] if p.stdout + p.stderr else "")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kust = open(os.path.join(ROOT, "deploy", "k8s", "kustomization.yaml")).read()
    listed = set(re.findall(r"^  - (\S+\.yaml)$", kust, re.M))
    check("k8s: kustomization lists every manifest",
          listed == {os.path.basename(f) for f in files}, f"{sorted(listed)}")


def main():
    tests = [test_image, test_compose_config, test_configs_check, test_k8s, test_bad_config,
             test_gateway, test_mesh, test_engine_shim_gateway]
    only = set(sys.argv[1:])
    for t in tests:
        if only and t.__name__ not in only:
            continue
        print(f"== {t.__name__}", flush=True)
        try:
            t()
        except Exception as e:  # noqa: BLE001 - a broken step fails its test, the rest go on
            check(t.__name__, False, f"{type(e).__name__}: {e}")
    print("\n| check | result | detail |\n|---|---|---|")
    for name, ok, detail in results:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |")
    print("\n| figure | value |\n|---|---|")
    for what, value in figures:
        print(f"| {what} | {value} |")
    failed = [r for r in results if not r[1]]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())

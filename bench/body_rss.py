#!/usr/bin/env python3
"""Peak memory of kvmesh-proxy under many concurrent large request bodies.

Starts a stub engine (answers GET /v1/models, and every POST after reading and discarding its
body), a kvmesh-proxy in front of it, and N clients that each send one completions request whose
body is a ~32 MiB `{"model":"m","prompt":[0,0,0,...]}` (the worst case for a parser that builds a
JSON tree: one tree node per two body bytes). When all clients are done it reads the proxy's
VmHWM (peak resident set) from /proc/PID/status and prints a Markdown table row.

    bench/body_rss.py --proxy target/debug/kvmesh-proxy --clients 64 --body-mib 32
    bench/body_rss.py --proxy /tmp/old-proxy --clients 64 --as-limit-gib 8   # an older build
    bench/body_rss.py --clients 64 --tokenizer-gguf models/SmolLM2-135M-Instruct.Q4_1.gguf  # token mode

--as-limit-gib runs the proxy under `prlimit --as` (an address-space cap), so that a proxy that
would need tens of GB aborts instead of pushing the machine into the OOM killer.
"""

import argparse
import http.server
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time


class Engine(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(b'{"object":"list","data":[{"id":"m","object":"model"}]}')

    def do_POST(self):
        left = int(self.headers.get("Content-Length", "0"))
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                break
            left -= len(chunk)
        self._send(
            b'{"id":"x","object":"text_completion","model":"m","choices":[{"index":0,"text":"ok",'
            b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}'
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def client(port: int, body: bytes, out: list, i: int):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
            s.sendall(head)
            s.sendall(body)
            raw = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                raw += chunk
        out[i] = raw.split(b" ", 2)[1].decode() if raw.startswith(b"HTTP/") else "no answer"
    except OSError as e:
        out[i] = type(e).__name__


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxy", default="target/debug/kvmesh-proxy")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--body-mib", type=int, default=32)
    ap.add_argument("--as-limit-gib", type=int, default=0)
    ap.add_argument(
        "--tokenizer-gguf",
        default="",
        help="route model m in token mode with this GGUF's tokenizer ([[tokenizers]])",
    )
    ap.add_argument("--label", default="")
    ap.add_argument("--header", action="store_true", help="print the table header first")
    a = ap.parse_args()

    engine = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    port = free_port()
    cfg = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    cfg.write(
        f'listen = "127.0.0.1:{port}"\nthreads = 2\nlog = "error"\n'
        f'[[engines]]\nname = "stub"\nurl = "http://127.0.0.1:{engine.server_address[1]}"\nmodels = ["m"]\n'
    )
    if a.tokenizer_gguf:
        gguf = os.path.abspath(a.tokenizer_gguf)
        cfg.write(f'[[tokenizers]]\nmodel = "m"\ngguf = "{gguf}"\n')
    cfg.close()
    cmd = [a.proxy, "--config", cfg.name]
    if a.as_limit_gib:
        cmd = ["prlimit", f"--as={a.as_limit_gib << 30}", "--"] + cmd
    proxy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or proxy.poll() is not None:
                sys.exit("proxy did not start")
            time.sleep(0.05)
    time.sleep(0.5)  # first health probe

    # `{"model":"m","prompt":[0,0,...,0]}`, just under the limit of 32 MiB.
    total = (a.body_mib << 20) - 1024
    head, tail = b'{"model":"m","prompt":[0', b"]}"
    n = (total - len(head) - len(tail)) // 2
    body = head + b",0" * n + tail
    idle_kib = status_kib(proxy.pid, "VmRSS")

    results = [None] * a.clients
    t0 = time.time()
    threads = [
        threading.Thread(target=client, args=(port, body, results, i)) for i in range(a.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    secs = time.time() - t0
    alive = proxy.poll() is None
    hwm = status_kib(proxy.pid, "VmHWM") if alive else -1
    proxy.kill()
    proxy.wait()
    os.unlink(cfg.name)
    engine.shutdown()

    counts = {}
    for r in results:
        counts[r] = counts.get(r, 0) + 1
    answers = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    if a.header:
        print("| proxy | clients | body MiB | answers | seconds | idle RSS MiB | peak RSS (VmHWM) MiB |")
        print("|---|---:|---:|---|---:|---:|---:|")
    peak = f"{hwm / 1024:.0f}" if alive else f"died (exit {proxy.returncode})"
    print(
        f"| {a.label or a.proxy} | {a.clients} | {len(body) / (1 << 20):.1f} | {answers} | "
        f"{secs:.1f} | {idle_kib / 1024:.0f} | {peak} |"
    )


if __name__ == "__main__":
    main()

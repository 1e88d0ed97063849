"""Reverse-proxy overhead: mmgate vs nginx in front of the same local upstream, in one run.

The upstream is an nginx answering every chat completion with a fixed JSON body, so what is measured
is the proxies, not a model. wrk drives three targets on loopback with the same text-only chat
request: the upstream directly, nginx proxying to it (keep-alive upstream connections), and mmgate
serving a model whose upstream pool is that server. Latency is measured with one connection (the
added latency of a hop), throughput with many. mmgate and nginx get the same number of worker
threads/processes. For the throughput runs (with two CPUs or more) the proxies are pinned to a CPU
of their own while wrk and the upstream share the others, so each proxy's throughput is what its
CPU can do; latency is measured unpinned, as a deployment runs (pinned, every hop crosses CPUs and
the proxy's housekeeping threads queue behind its HTTP thread).

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"
WORKERS = 1
DURATION = "8s"
# Throughput runs per target (alternating); the median is reported.
ROUNDS = 3

REPLY = (
    '{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench",'
    '"choices":[{"index":0,"message":{"role":"assistant","content":"Hello! How can I help?"},'
    '"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":7,"total_tokens":19}}'
)
REQUEST = (
    '{"model":"bench","messages":[{"role":"system","content":"You are terse."},'
    '{"role":"user","content":"Say hello in one short sentence, please."}],"max_tokens":16}'
)


CPUS = sorted(os.sched_getaffinity(0))
# The proxy under test on the last CPU, the load generator and the upstream on the rest.
PROXY_CPUS = set(CPUS[-1:]) if len(CPUS) > 1 else set(CPUS)
LOAD_CPUS = set(CPUS[:-1]) if len(CPUS) > 1 else set(CPUS)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its child processes (nginx's workers) onto `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)
        children = task / "children"
        if children.exists():
            for child in children.read_text().split():
                pin(int(child), cpus)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, what: str) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"{what} did not start on port {port}")


def nginx(workdir: Path, name: str, server_block: str) -> subprocess.Popen:
    conf = workdir / f"{name}.conf"
    conf.write_text(f"""
worker_processes {WORKERS};
daemon off;
pid {workdir}/{name}.pid;
error_log {workdir}/{name}.error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {workdir}/{name}-body;
    proxy_temp_path {workdir}/{name}-proxy;
    fastcgi_temp_path {workdir}/{name}-fastcgi;
    uwsgi_temp_path {workdir}/{name}-uwsgi;
    scgi_temp_path {workdir}/{name}-scgi;
    {server_block}
}}
""")
    return subprocess.Popen(["nginx", "-p", str(workdir), "-c", str(conf)])


def wrk(port: int, connections: int, script: Path,
        cpus: set[int] | None = None) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms)"""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{DURATION}", "--latency", "-s", str(script),
         f"http://127.0.0.1:{port}/v1/chat/completions"],
        check=True, capture_output=True, text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None).stdout
    if "Non-2xx" in out:
        sys.exit(f"errors while benchmarking port {port}:\n{out}")

    def ms(label: str) -> float:
        m = re.search(rf"^\s*{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            sys.exit(f"no {label} latency in wrk output:\n{out}")
        value, unit = float(m.group(1)), m.group(2)
        return value / 1e3 if unit == "us" else value * 1e3 if unit == "s" else value

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not rps:
        sys.exit(f"no throughput in wrk output:\n{out}")
    return float(rps.group(1)), ms("50%"), ms("99%")


def main() -> None:
    print(f"# {cpu_name()}")
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(
            'wrk.method = "POST"\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
            f"wrk.body = [[{REQUEST}]]\n")
        upstream_port, nginx_port, mmgate_port = free_port(), free_port(), free_port()
        processes = [
            nginx(work, "upstream", f"""
    server {{
        listen 127.0.0.1:{upstream_port};
        keepalive_requests 1000000;
        location = /health {{ return 200 '{{"status":"ok"}}'; }}
        location / {{ default_type application/json; return 200 '{REPLY}'; }}
    }}"""),
            nginx(work, "proxy", f"""
    upstream backend {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{nginx_port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}"""),
        ]
        config = work / "mmgate.toml"
        # As many pingora worker threads as nginx has worker processes.
        # Each thread serving its own connections, as each nginx worker does.
        config.write_text(
            f"http_threads = {WORKERS}\nhttp_work_stealing = false\n"
            f'models = [{{ name = "bench", upstreams = ["127.0.0.1:{upstream_port}"] }}]\n')
        env = dict(os.environ, RUST_LOG="warn")
        processes.append(subprocess.Popen(
            [str(MMGATE), "serve", "--config", str(config), "--listen", f"127.0.0.1:{mmgate_port}"],
            env=env))
        try:
            for port, what in [(upstream_port, "upstream nginx"), (nginx_port, "nginx proxy"),
                               (mmgate_port, "mmgate")]:
                wait_listening(port, what)
            targets = [("direct", upstream_port), ("nginx", nginx_port), ("mmgate", mmgate_port)]
            results = {}
            for name, port in targets:
                wrk(port, 4, script)  # warm-up: connections, caches
                rate_1, p50, p99 = wrk(port, 1, script)
                results[name] = [p50, p99, rate_1]
            upstream, nginx_proxy, mmgate = processes
            pin(upstream.pid, LOAD_CPUS)
            pin(nginx_proxy.pid, PROXY_CPUS)
            pin(mmgate.pid, PROXY_CPUS)
            # Throughput runs alternate between the targets, and the median of each is taken: one
            # run apiece varied by about 4 %, as much as the difference being measured.
            rates: dict[str, list[float]] = {name: [] for name, _ in targets}
            for _ in range(ROUNDS):
                for name, port in targets:
                    wrk(port, 4, script, LOAD_CPUS)
                    rates[name].append(wrk(port, 32, script, LOAD_CPUS)[0])
            for name, runs in rates.items():
                results[name].append(statistics.median(runs))
        finally:
            for p in processes:
                p.terminate()
            for p in processes:
                p.wait()

    print(f"{'target':<8} {'p50 ms':>8} {'p99 ms':>8} {'req/s c=1':>10} {'req/s c=32':>11}"
          f"  (c=32: median of {ROUNDS} alternating runs)")
    for name, (p50, p99, r1, rn) in results.items():
        print(f"{name:<8} {p50:>8.3f} {p99:>8.3f} {r1:>10.0f} {rn:>11.0f}")
    d50, d99 = results["direct"][0], results["direct"][1]
    for name in ("nginx", "mmgate"):
        p50, p99 = results[name][0], results[name][1]
        print(f"{name} adds p50 {p50 - d50:+.3f} ms, p99 {p99 - d99:+.3f} ms over direct")
    ratio = results["mmgate"][3] / results["nginx"][3]
    print(f"throughput mmgate / nginx at 32 connections: {ratio:.2f}x "
          f"(goal >= 1.0); at 1 connection: {results['mmgate'][2] / results['nginx'][2]:.2f}x")


if __name__ == "__main__":
    main()

"""The cost of traces per request: the same requests to three gateways, interleaved round by round:
- off: no OTLP endpoint (the default);
- on: every request traced (`OTEL_TRACES_SAMPLER=always_on`) and exported to a live receiver on
  loopback (tests/fixtures/traces/receiver.py, which decodes every span);
- dead: traced as `on`, the endpoint a closed loopback port (a collector that is down).
Each round sends a text chat and an image chat (PNG, data URL) to each, one at a time; the median
latency of each kind is printed, and `on` and `dead` as ratios to `off`.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it),
with the engine venv (its opentelemetry-proto runs the receiver): ENGINE_VENV or
~/.cache/mmgate/engine-venv.
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import free_port, wait_for_health
from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"
VENV = Path(os.environ.get("ENGINE_VENV", Path.home() / ".cache/mmgate/engine-venv"))
ROUNDS = 60


def post(port: int, body: bytes) -> float:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
        assert response.status == 200
    return (time.perf_counter() - started) * 1e3


def chat(content) -> bytes:
    return json.dumps({"model": "demo", "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()


def main() -> None:
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    png = (ROOT / "tests/fixtures/image/images/png-rgb-wide.png").read_bytes()
    image = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    bodies = {
        "text": chat("Say something."),
        "image": chat([{"type": "image_url", "image_url": {"url": image}},
                       {"type": "text", "text": "What is this?"}]),
    }
    with tempfile.TemporaryDirectory() as scratch:
        port_file, spans = Path(scratch, "port"), Path(scratch, "spans.jsonl")
        receiver = subprocess.Popen([str(VENV / "bin/python"),
                                     str(ROOT / "tests/fixtures/traces/receiver.py"),
                                     str(port_file), str(spans)])
        while not port_file.exists():
            time.sleep(0.05)
        live = f"http://127.0.0.1:{port_file.read_text().strip()}"
        dead = f"http://127.0.0.1:{free_port()}"
        cache = Path(scratch, "cache")
        ways = {"off": {}, "on": {"OTEL_EXPORTER_OTLP_ENDPOINT": live},
                "dead": {"OTEL_EXPORTER_OTLP_ENDPOINT": dead}}
        servers, ports = [], {}
        try:
            for way, extra in ways.items():
                port = free_port()
                env = dict(os.environ, RUST_LOG="warn", XDG_CACHE_HOME=str(cache),
                           OTEL_TRACES_SAMPLER="always_on", **extra)
                server = subprocess.Popen([str(MMGATE), "serve", "--listen", f"127.0.0.1:{port}"],
                                          env=env)
                servers.append(server)
                wait_for_health(port, server)
                ports[way] = port
            times = {(way, kind): [] for way in ways for kind in bodies}
            for kind, body in bodies.items():  # warm-up
                for way in ways:
                    post(ports[way], body)
            for _ in range(ROUNDS):
                for kind, body in bodies.items():
                    for way in ways:
                        times[(way, kind)].append(post(ports[way], body))
        finally:
            for server in servers:
                server.terminate()
                server.wait()
            receiver.terminate()
            receiver.wait()
        received = len(spans.read_text().splitlines()) if spans.exists() else 0
    print(f"traces: median ms per request, {ROUNDS} interleaved rounds, one at a time ({cpu_name()})")
    for kind in bodies:
        off = statistics.median(times[("off", kind)])
        on = statistics.median(times[("on", kind)])
        down = statistics.median(times[("dead", kind)])
        print(f"  {kind:5}  off {off:7.2f}   on {on:7.2f} ({on / off:.3f}x)   "
              f"collector down {down:7.2f} ({down / off:.3f}x)")
    print(f"  spans received from the traced gateway: {received}")


if __name__ == "__main__":
    main()

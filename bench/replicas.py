"""One replica against three sharing Redis, on the same image workload, in one run.

The workload: 16 distinct images (BMPs, so every one is encoded), each asked about 3 times, the
requests spread round-robin over the replicas, so a repeat usually lands on another replica than the
first ask. Three set-ups on the demo model: one replica (its own feature cache), three replicas
that share nothing (each encodes what it has not seen), three replicas sharing Redis (an image
encoded anywhere is a hit everywhere). Printed: requests/s from 8 clients, encoder runs, and the
cache hit rate (1 - encoder runs / image requests).

Then the cost of a Redis round trip per request: the median latency of `GET /v1/models` on one
replica whose per-key limit lives in memory vs in Redis (one GCRA script per request), sequential
requests on one kept-alive connection.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it);
needs `redis-server`.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from chat import bmp, chat, data_url, free_port, post
from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"
CLIENTS = 8
IMAGES = 16
ASKS = 3


def wait_for(url: str, process: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            if time.time() > deadline or process.poll() is not None:
                sys.exit(f"{what} did not start")
            time.sleep(0.1)


def start_redis(workdir: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    deadline = time.time() + 30
    while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                         text=True).stdout.strip() != "PONG":
        if time.time() > deadline:
            sys.exit("redis-server did not start")
        time.sleep(0.1)
    return redis, port


def start_replicas(n: int, config: str, workdir: str, cache: str) -> list[tuple[subprocess.Popen, int]]:
    path = Path(workdir) / f"mmgate-{free_port()}.toml"
    path.write_text(config)
    env = dict(os.environ, RUST_LOG="warn", XDG_CACHE_HOME=cache)
    replicas = []
    for _ in range(n):
        port = free_port()
        process = subprocess.Popen([str(MMGATE), "serve", "--config", str(path),
                                    "--listen", f"127.0.0.1:{port}"], env=env)
        replicas.append((process, port))
    for process, port in replicas:
        wait_for(f"http://127.0.0.1:{port}/health", process, "mmgate")
    return replicas


def stop(processes) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait()


def metric(port: int, prefix: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def image_workload(ports: list[int]) -> tuple[float, int]:
    """(requests/s, encoder runs) of the workload spread over `ports`."""
    bodies = [chat("demo", [{"type": "image_url", "image_url": {"url": data_url("image/bmp", bmp(i))}},
                            {"type": "text", "text": "What is in this picture?"}])
              for _ in range(ASKS) for i in range(IMAGES)]
    jobs = [(ports[k % len(ports)], body) for k, body in enumerate(bodies)]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda job: post(*job), jobs))
    rate = len(jobs) / (time.perf_counter() - start)
    encoded = sum(metric(p, 'mmgate_encoded_items_total{model="demo"') for p in ports)
    return rate, int(encoded)


def models_latency_ms(port: int, n: int = 2000) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", port)
    samples = []
    for _ in range(n + 100):
        start = time.perf_counter()
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            sys.exit(f"GET /v1/models: {response.status}")
        samples.append((time.perf_counter() - start) * 1e3)
    connection.close()
    return statistics.median(samples[100:])


def main() -> None:
    print(f"# {cpu_name()}")
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    model = 'models = [{ name = "demo", path = "demo" }]\n'
    with tempfile.TemporaryDirectory() as workdir, tempfile.TemporaryDirectory() as cache:
        redis, redis_port = start_redis(workdir)
        shared = (f'{model}[store]\nkind = "redis"\nurl = "redis://127.0.0.1:{redis_port}/0"\n')
        try:
            rows = []
            for name, n, config in [("1 replica", 1, model), ("3 replicas, no store", 3, model),
                                    ("3 replicas + Redis", 3, shared)]:
                replicas = start_replicas(n, config, workdir, cache)
                try:
                    rate, encoded = image_workload([port for _, port in replicas])
                finally:
                    stop(p for p, _ in replicas)
                rows.append((name, rate, encoded))
                subprocess.run(["redis-cli", "-p", str(redis_port), "flushall"], capture_output=True)

            limits = "[key_limits]\nrequests_per_minute = 100000000\n"
            latency = {}
            for name, config in [("memory", model + limits), ("redis", shared + limits)]:
                replicas = start_replicas(1, config, workdir, cache)
                try:
                    latency[name] = models_latency_ms(replicas[0][1])
                finally:
                    stop(p for p, _ in replicas)
        finally:
            redis.terminate()
            redis.wait()

    requests = IMAGES * ASKS
    print(f"{IMAGES} distinct images x {ASKS} asks = {requests} requests, {CLIENTS} clients, "
          f"round-robin over the replicas, {os.cpu_count()} cores")
    print(f"{'set-up':<22} {'req/s':>7} {'encoder runs':>13} {'hit rate':>9} {'vs 1 replica':>13}")
    base = rows[0][1]
    for name, rate, encoded in rows:
        print(f"{name:<22} {rate:>7.1f} {encoded:>13} {1 - encoded / requests:>8.0%} {rate / base:>12.2f}x")
    print(f"GET /v1/models p50 with a per-key limit: in memory {latency['memory']:.3f} ms, in Redis "
          f"{latency['redis']:.3f} ms: a Redis round trip costs {latency['redis'] - latency['memory']:.3f} ms "
          "per request")


if __name__ == "__main__":
    main()

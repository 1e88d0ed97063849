"""Start-up time: from spawning `mmgate serve` to its first `GET /health` 200.

Three ways, interleaved, the same binary and config (the embedded default: demo models and the
built-in plugins), each started RUNS times:
- cold: an empty compile cache, so the built-in plugins are compiled by Cranelift (and stored);
- warm: the cache the cold runs filled, so the plugins are loaded from disk;
- no cache: `[plugins] no_compile_cache = true`, the baseline (every start compiles).
The demo models are written once before timing (first use only), so every run loads the same files.
Prints the best and median of each and warm's speed-up over the baseline.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"
RUNS = 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def start_seconds(config: Path) -> float:
    """Seconds from spawn to the first 200 on /health."""
    port = free_port()
    started = time.perf_counter()
    child = subprocess.Popen([str(MMGATE), "serve", "--config", str(config), "--listen",
                              f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        while not healthy(port):
            if child.poll() is not None:
                sys.exit(f"mmgate exited during start-up ({child.returncode})")
            if time.perf_counter() - started > 120:
                sys.exit("mmgate did not become healthy in 120 s")
            time.sleep(0.005)
        return time.perf_counter() - started
    finally:
        child.kill()
        child.wait()


def main() -> None:
    print(f"# {cpu_name()}")
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "compiled-plugins"
        cached = Path(tmp) / "cached.toml"
        cached.write_text(f'[plugins]\ncompile_cache_dir = "{cache}"\n')
        uncached = Path(tmp) / "uncached.toml"
        uncached.write_text("[plugins]\nno_compile_cache = true\n")
        start_seconds(uncached)  # writes the demo models on first use
        times: dict[str, list[float]] = {"cold": [], "warm": [], "no cache": []}
        for _ in range(RUNS):
            shutil.rmtree(cache, ignore_errors=True)
            times["cold"].append(start_seconds(cached))
            times["warm"].append(start_seconds(cached))
            times["no cache"].append(start_seconds(uncached))
    print(f"start-up to GET /health 200 ({RUNS} runs each, interleaved)")
    print(f"{'':10} {'best s':>8} {'median s':>9}")
    for name, values in times.items():
        print(f"{name:10} {min(values):8.3f} {statistics.median(values):9.3f}")
    ratio = statistics.median(times["no cache"]) / statistics.median(times["warm"])
    print(f"warm start is {ratio:.1f}x faster than compiling every start (medians)")


if __name__ == "__main__":
    main()

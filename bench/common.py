"""What the benchmark scripts share: one core for everyone, medians, and running the Rust sides."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# One core for everyone: imported before numpy/torch load their thread pools.
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"

ROOT = Path(__file__).resolve().parent.parent


def median_ms(fn, iterations: int) -> float:
    """Median wall time of `fn()` in milliseconds, after one warm-up call."""
    fn()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


PEER = ROOT / "bench" / "peer"


def build_rust_sides() -> None:
    """Build the native plugin bench, the host bench and the peer first, so no timing includes
    compilation."""
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "mmgate-native-bench"],
                   cwd=ROOT / "plugins", check=True)
    subprocess.run(["cargo", "build", "--release", "--locked"], cwd=PEER, check=True)
    subprocess.run(["cargo", "bench", "--locked", "-p", "mmgate-host", "--bench", "plugin_preprocess",
                    "--no-run"], cwd=ROOT, check=True)


def _last_json_line(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def wasm_ms(modality: str, path: Path, config: Path, iterations: int) -> dict:
    """The built-in plugin through the host: {"wasm_ms_median", "tokens"}."""
    return _last_json_line(["cargo", "bench", "--locked", "-q", "-p", "mmgate-host", "--bench",
                            "plugin_preprocess", "--", modality, str(path), str(config), str(iterations)])


def peer_ms(path: Path, config: Path, iterations: int) -> dict:
    """smg's `llm-multimodal` (the fastest Rust peer) on the same file and config:
    {"peer_ms_median", "tokens", "turbojpeg"}."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", PEER / "target"))
    return _last_json_line([str(target / "release" / "mmgate-peer-bench"), str(path), str(config),
                            str(iterations)])


def native_ms(modality: str, path: Path, config: Path, iterations: int) -> dict:
    """The same plugin code built natively: {"native_ms_median", "tokens"}."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "plugins" / "target"))
    binary = target / "release" / "mmgate-native-bench"
    return _last_json_line([str(binary), modality, str(path), str(config), str(iterations)])


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(port: int, server: subprocess.Popen, seconds: float = 120) -> None:
    """Until `GET /health` answers on `port`; exits if the server stops or takes too long."""
    deadline = time.time() + seconds
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                sys.exit("mmgate did not start")
            time.sleep(0.1)

"""Multimodal chat throughput on the demo models, with text-only requests as the same-run baseline.

Starts the release `mmgate serve` on its embedded default (demo models, built-in plugins) and sends
chat completions from 8 concurrent clients: text-only, one image (a 640x480 JPEG as a data URL), and
one 5 s speech clip (WAV), 8 tokens each, greedy. Prints requests/s and p50 latency per kind and each
kind's throughput relative to text-only. Each image request carries the same image, so after the
first one its encoder output comes from the feature store: the image row measures the gateway and
plugin path (decode, resize, patchify) plus the LLM; the `distinct` row sends a different crop each
time, so every request is encoded too.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
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
CLIENTS = 8
REQUESTS = 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: bytes) -> float:
    start = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.load(response)
    if "choices" not in reply:
        sys.exit(f"unexpected reply: {reply}")
    return (time.perf_counter() - start) * 1e3


def run(port: int, bodies: list[bytes]) -> tuple[float, float]:
    """(requests/s, p50 ms) of sending `bodies` from CLIENTS threads."""
    post(port, bodies[0])  # warm-up
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        latencies = list(pool.map(lambda b: post(port, b), bodies))
    return len(bodies) / (time.perf_counter() - start), statistics.median(latencies)


def chat(model: str, content) -> bytes:
    return json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def bmp(seed: int) -> bytes:
    """A 448x336 BMP whose pixels differ with `seed`: distinct images without an image library (the
    same JPEG with different trailing bytes after its end-of-image marker decodes to the same pixels,
    so it would hit the feature store)."""
    w, h = 448, 336
    row = bytearray((x * 7 + seed * 13) % 256 for x in range(w * 3))
    pixels = b"".join(bytes(row[(y * 3) % len(row):] + row[:(y * 3) % len(row)]) for y in range(h))
    header = b"BM" + (54 + len(pixels)).to_bytes(4, "little") + b"\0\0\0\0" + (54).to_bytes(4, "little")
    info = ((40).to_bytes(4, "little") + w.to_bytes(4, "little") + h.to_bytes(4, "little")
            + (1).to_bytes(2, "little") + (24).to_bytes(2, "little") + bytes(24))
    return header + info + pixels


def main() -> None:
    print(f"# {cpu_name()}")
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    jpeg = (ROOT / "tests/fixtures/image/images/photo-640x480.jpg").read_bytes()
    wav = (ROOT / "tests/fixtures/audio/clips/speech-16k-s16.wav").read_bytes()
    text = [chat("demo", "Describe a sunny day at the beach in a few words.")] * REQUESTS
    image = [chat("demo", [{"type": "image_url", "image_url": {"url": data_url("image/jpeg", jpeg)}},
                           {"type": "text", "text": "What is in this picture?"}])] * REQUESTS
    distinct = [chat("demo", [{"type": "image_url", "image_url": {"url": data_url("image/bmp", bmp(i))}},
                              {"type": "text", "text": "What is in this picture?"}])
                for i in range(REQUESTS + 1)]
    audio = [chat("demo-audio", [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "What was said?"}])] * REQUESTS

    port = free_port()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, RUST_LOG="warn", XDG_CACHE_HOME=cache)
        server = subprocess.Popen([str(MMGATE), "serve", "--listen", f"127.0.0.1:{port}"], env=env)
        try:
            deadline = time.time() + 120
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    if time.time() > deadline or server.poll() is not None:
                        sys.exit("mmgate did not start")
                    time.sleep(0.1)
            results = {
                "text": run(port, text),
                "image": run(port, image),
                "distinct": run(port, distinct),
                "audio": run(port, audio),
            }
        finally:
            server.terminate()
            server.wait()
    print(f"{CLIENTS} clients, {REQUESTS} requests each, 8 tokens, demo models")
    print(f"{'kind':<9} {'req/s':>7} {'p50 ms':>8} {'vs text':>8}")
    base = results["text"][0]
    for kind, (rate, p50) in results.items():
        print(f"{kind:<9} {rate:>7.1f} {p50:>8.1f} {rate / base:>7.2f}x")


if __name__ == "__main__":
    main()

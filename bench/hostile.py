"""A 100 MB text prompt against `mmgate serve` (release, the embedded default): how long until it
is refused, how long `/health` waits meanwhile (probed every 20 ms from another thread), and how
much the server's resident memory grows. The goal: refused in under 0.5 s, `/health` answering
throughout, under +300 MB. A 10 MB prompt that is within the text limit but cannot fit the
context is measured the same way. Then requests small on the wire that used to cost gigabytes or
minutes: a million empty content parts (goal: refused in < 0.5 s, RSS < +100 MB), a 120 MB
Responses body (`/health` <= 100 ms throughout), 50 stored responses of 3.6 MB (100 000 empty
parts each, on a server whose parts limit lets them in: RSS < +400 MB), and /v1/preprocess of 60
and of 32 distinct 512x512 images, two such requests at once, beside a chat with an image (its
latency < 1 s; printed beside the same chat alone). Prints the CPU it ran on.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from pathlib import Path

from machine import cpu_name
from common import ROOT, free_port, wait_for_health

MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def curl(port: int, path: str, body: bytes) -> tuple[int, str | None, float, dict]:
    """POSTs `body` with curl (a Python client sharing the interpreter with the probes would time
    itself): the status, the error code, the seconds it took and the answer."""
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        file.write(body)
        file.flush()
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code} %{time_total}", "-H",
                              "content-type: application/json", "--data-binary", f"@{file.name}",
                              f"http://127.0.0.1:{port}{path}"],
                             capture_output=True, text=True, check=True).stdout
    answer, status_and_time = out.rsplit("\n", 1)
    status, took = status_and_time.split()
    try:
        parsed = json.loads(answer)
    except ValueError:
        parsed = {}
    return int(status), (parsed.get("error") or {}).get("code"), float(took), parsed


def watched(port: int, pid: int, work) -> dict:
    """Runs `work()` while `/health` is probed every 20 ms and the server's RSS watched."""
    idle = rss_mb(pid)
    peak, probes, worst_probe, stop = [idle], [0], [0.0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            worst_probe[0] = max(worst_probe[0], time.perf_counter() - started)
            probes[0] += ok
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    result = work()
    time.sleep(0.2)
    stop.set()
    watcher.join()
    result.update(worst_health_ms=worst_probe[0] * 1e3, probes=probes[0],
                  rss_growth_mb=max(peak[0], rss_mb(pid)) - idle)
    return result


def attack(port: int, pid: int, path: str, body: bytes) -> dict:
    def work() -> dict:
        status, code, took, _ = curl(port, path, body)
        return {"status": status, "code": code, "refused_s": took}
    return watched(port, pid, work)


def row(what: str, r: dict) -> None:
    print(f"{what:>34} {r['status']:>6} {str(r['code']):>24} {r['refused_s']:>8.2f}s "
          f"{r['worst_health_ms']:>11.0f} ms {r['rss_growth_mb']:>8.0f} MB")


def text_prompt(text_bytes: int) -> bytes:
    word = "lorem ipsum dolor "
    return json.dumps({"model": "demo", "max_tokens": 4,
                       "messages": [{"role": "user", "content": word * (text_bytes // len(word))}]}
                      ).encode()


def empty_parts(count: int, responses: bool) -> bytes:
    if responses:
        return json.dumps({"model": "demo", "max_output_tokens": 1, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": ""}] * count}]}).encode()
    return json.dumps({"model": "demo", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}] * count}]}).encode()


def stored_responses(port: int, pid: int) -> dict:
    """50 stored responses of 3.6 MB each (100 000 empty parts)."""
    body = empty_parts(100_000, responses=True)

    def work() -> dict:
        started, statuses = time.perf_counter(), set()
        for _ in range(50):
            statuses.add(curl(port, "/v1/responses", body)[0])
        return {"status": ",".join(map(str, sorted(statuses))), "code": f"{len(body) >> 20} MB x 50",
                "refused_s": time.perf_counter() - started}
    return watched(port, pid, work)


def noise_png(seed: int, side: int = 512) -> bytes:
    """A `side`-square RGB PNG of seeded noise: distinct bytes and pixels for every seed."""
    rows = bytearray()
    pixels = random.Random(seed).randbytes(side * side * 3)
    for y in range(side):
        rows += b"\0" + pixels[y * side * 3:(y + 1) * side * 3]

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(rows)))
            + chunk(b"IEND", b""))


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def preprocess_beside_chat(port: int, images: int) -> tuple[int, str | None, float, float, float]:
    """/v1/preprocess of `images` distinct PNGs (no cache can answer them), twice at once, and a
    small chat with an image of its own sent meanwhile."""
    pngs = [noise_png(seed) for seed in range(2 * images)]
    bodies = [json.dumps({"model": "demo", "media": [data_url(png) for png in
                                                       pngs[run * images:(run + 1) * images]]}).encode()
              for run in range(2)]
    results: list = []
    runs = [threading.Thread(target=lambda body=body: results.append(curl(port, "/v1/preprocess", body)))
            for body in bodies]
    def chat(seed: int) -> float:
        body = json.dumps({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": data_url(noise_png(seed))}}]}]})
        status, _, took, _ = curl(port, "/v1/chat/completions", body.encode())
        assert status == 200, status
        return took
    alone = chat(10_000 + images)
    for run in runs:
        run.start()
    time.sleep(0.1)
    beside = chat(20_000 + images)
    for run in runs:
        run.join()
    status, code, took, _ = max(results, key=lambda r: r[2])
    return status, code, took, alone, beside


def serve(config: str | None = None) -> tuple[subprocess.Popen, int, tempfile.TemporaryDirectory]:
    port, work = free_port(), tempfile.TemporaryDirectory()
    args = [str(MMGATE), "serve", "--listen", f"127.0.0.1:{port}"]
    if config is not None:
        path = Path(work.name) / "mmgate.toml"
        path.write_text(config)
        args += ["--config", str(path)]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_health(port, server)
    return server, port, work


def main() -> None:
    print(f"# {cpu_name()}")
    server, port, _work = serve()
    try:
        print(f"{'request':>34} {'status':>6} {'code':>24} {'refused':>9} {'worst /health':>14} "
              f"{'RSS growth':>11}")
        for megabytes in (100, 10, 5):
            row(f"{megabytes} MB prompt", attack(port, server.pid, "/v1/chat/completions",
                                                 text_prompt(megabytes << 20)))
        row("1 000 000 empty parts (chat)", attack(port, server.pid, "/v1/chat/completions",
                                                   empty_parts(1_000_000, responses=False)))
        row("200 000 empty messages (chat)", attack(port, server.pid, "/v1/chat/completions", json.dumps(
            {"model": "demo", "messages": [{"role": "user", "content": ""}] * 200_000}).encode()))
        responses = json.dumps({"model": "demo", "input": "lorem ipsum " * (10 << 20)}).encode()
        row("120 MB Responses input", attack(port, server.pid, "/v1/responses", responses))
    finally:
        server.terminate()
        server.wait()
    # The store's own bound, and the plugin workers' fairness, on the requests that found them:
    # limits that let them in (by default a request carries at most 32 items).
    server, port, _work = serve("[limits]\nmax_content_parts = 200000\nmax_media_items = 64\n")
    try:
        row("50 stored responses of 3.6 MB", stored_responses(port, server.pid))
        print(f"{'/v1/preprocess x2 beside a chat':>34} {'status':>6} {'code':>24} {'took':>9} "
              f"{'the chat took':>14} {'alone':>8} {'ratio':>6}")
        for images in (60, 32):
            status, code, took, alone, beside = preprocess_beside_chat(port, images)
            print(f"{f'{images} 512x512 PNGs':>34} {status:>6} {str(code):>24} {took:>8.2f}s "
                  f"{beside:>12.2f} s {alone:>6.2f} s {beside / alone:>5.1f}x")
    finally:
        server.terminate()
        server.wait()
if __name__ == "__main__":
    main()

"""A 100 MB text prompt against `mmgate serve` (release, the embedded default): how long until it
is refused, how long `/health` waits meanwhile (probed every 20 ms from another thread), and how
much the server's resident memory grows. The goal: refused in under 0.5 s, `/health` answering
throughout, under +300 MB. A 10 MB prompt that is within the text limit but cannot fit the
context is measured the same way. Prints the CPU it ran on.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from machine import cpu_name
from common import ROOT, free_port, wait_for_health

MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def attack(port: int, pid: int, text_bytes: int) -> dict:
    word = "lorem ipsum dolor "
    body = json.dumps({"model": "demo", "max_tokens": 4,
                       "messages": [{"role": "user", "content": word * (text_bytes // len(word))}]})
    body = body.encode()
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
    # curl sends the body and times the answer: a Python client sharing its interpreter with the
    # probes would time itself.
    with tempfile.NamedTemporaryFile(suffix=".json") as file:
        file.write(body)
        file.flush()
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code} %{time_total}", "-H",
                              "content-type: application/json", "--data-binary", f"@{file.name}",
                              f"http://127.0.0.1:{port}/v1/chat/completions"],
                             capture_output=True, text=True, check=True).stdout
    answer, status_and_time = out.rsplit("\n", 1)
    status, took = status_and_time.split()
    time.sleep(0.2)
    stop.set()
    watcher.join()
    return {"status": int(status), "code": json.loads(answer).get("error", {}).get("code"),
            "refused_s": float(took), "worst_health_ms": worst_probe[0] * 1e3,
            "probes": probes[0], "rss_growth_mb": peak[0] - idle}


def main() -> None:
    print(f"# {cpu_name()}")
    port = free_port()
    server = subprocess.Popen([str(MMGATE), "serve", "--listen", f"127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_health(port, server)
        print(f"{'prompt':>8} {'status':>6} {'code':>24} {'refused':>9} {'worst /health':>14} "
              f"{'RSS growth':>11}")
        for megabytes in (100, 10, 5):
            r = attack(port, server.pid, megabytes << 20)
            print(f"{megabytes:>5} MB {r['status']:>6} {r['code']:>24} {r['refused_s']:>8.2f}s "
                  f"{r['worst_health_ms']:>11.0f} ms {r['rss_growth_mb']:>8.0f} MB")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()

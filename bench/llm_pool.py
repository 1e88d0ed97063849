"""The CPU LLM pool's width under load: half the cores (the encoder device keeping the other half)
vs as many threads as the machine has cores (the default: the two pools overlap), in one run.

Each round sends a mixed burst at once: videos (60 s 1080p, at an 8 192-token context), 10-minute
WAVs and text-only questions, and times the whole burst and each request's time to first token.
Once with one server, and once with three servers on the same machine, each with its own burst at
the same moment: the case where wider pools could crowd each other out. Every server serves both
widths as two models, so the widths alternate on the same processes. Prints medians and the
all-cores/half ratios of the bursts' times.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import functools
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from machine import cpu_name
from common import free_port, wait_for_health
from pieces import MMGATE, make_audio, make_clip, ttft

ROUNDS = 2
HALF = max(1, (os.cpu_count() or 2) // 2)


def burst(port: int, model: str, video: dict, audio: dict, scale: int) -> dict[str, list[float]]:
    """`scale` x (2 videos, 1 audio file, 4 text questions) at once: each kind's TTFTs."""
    out: dict[str, list[float]] = {}
    lock = threading.Lock()

    def one(kind: str, model: str, content) -> None:
        seconds = ttft(port, model, content)
        with lock:
            out.setdefault(kind, []).append(seconds)

    question = {"type": "text", "text": "Describe it."}
    jobs = [("video", model, [video, question])] * (2 * scale)
    jobs += [("audio", model + "-audio", [audio, question])] * scale
    jobs += [("text", model, "Describe a sunny day in a few words.")] * (4 * scale)
    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def together(ports: list[int], model: str, video: dict, audio: dict, scale: int):
    """A burst to every server at the same moment: (seconds until all answered, TTFTs by kind)."""
    results: list[dict[str, list[float]]] = [{} for _ in ports]
    start = time.perf_counter()
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, burst(ports[i], model, video, audio, scale))) for i in range(len(ports))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    merged: dict[str, list[float]] = {}
    for result in results:
        for kind, values in result.items():
            merged.setdefault(kind, []).extend(values)
    return wall, merged


def main() -> None:
    print(f"# {cpu_name()}")
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_clip(tmp / "clip.mp4")
        make_audio(tmp / "audio.wav")

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

        files = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp)))
        threading.Thread(target=files.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{files.server_address[1]}"
        video = {"type": "video_url", "video_url": {"url": f"{base}/clip.mp4"}}
        audio = {"type": "audio_url", "audio_url": {"url": f"{base}/audio.wav"}}
        models = ""
        for name, threads in (("half", HALF), ("all", os.cpu_count() or 2)):
            models += (f'[[models]]\nname = "{name}"\npath = "demo"\nfeature_cache_bytes = 0\n'
                       f'max_model_len = 8192\nllm_threads = {threads}\n\n'
                       f'[[models]]\nname = "{name}-audio"\npath = "demo-audio"\n'
                       f'feature_cache_bytes = 0\nllm_threads = {threads}\n\n')
        config = tmp / "mmgate.toml"
        config.write_text('[fetch]\nallow = ["127.0.0.1/32"]\n\n' + models)
        ports = [free_port() for _ in range(3)]
        servers = [subprocess.Popen(
            [str(MMGATE), "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
            env=dict(os.environ, RUST_LOG="warn", XDG_CACHE_HOME=str(tmp / f"cache-{port}")))
            for port in ports]
        rows = []
        try:
            for port, server in zip(ports, servers):
                wait_for_health(port, server)
            for label, used, scale in (("one server", ports[:1], 2), ("three servers", ports, 1)):
                for model in ("half", "all"):  # warm-up
                    together(used, model, video, audio, scale)
                runs: dict[str, list] = {"half": [], "all": []}
                for _ in range(ROUNDS):
                    for model in ("half", "all"):
                        runs[model].append(together(used, model, video, audio, scale))
                rows.append((label, runs))
        finally:
            for server in servers:
                server.terminate()
                server.wait()
            files.shutdown()
    print(f"a mixed burst (videos at 8k context, 10 min WAVs, text questions), {os.cpu_count()} "
          f"cores, LLM pool of {HALF} thread(s) (half) vs {os.cpu_count()} (all), median of "
          f"{ROUNDS} (interleaved)")
    print(f"{'':<14} {'pool':<5} {'burst s':>8} {'video TTFT s':>13} {'audio TTFT s':>13} "
          f"{'text TTFT s':>12} {'text max s':>11}")
    for label, runs in rows:
        walls = {}
        for model, results in runs.items():
            walls[model] = statistics.median(wall for wall, _ in results)
            kinds = {kind: [v for _, r in results for v in r.get(kind, [])]
                     for kind in ("video", "audio", "text")}
            print(f"{label:<14} {model:<5} {walls[model]:>8.2f} "
                  f"{statistics.median(kinds['video']):>13.2f} "
                  f"{statistics.median(kinds['audio']):>13.2f} "
                  f"{statistics.median(kinds['text']):>12.2f} {max(kinds['text']):>11.2f}")
        print(f"{label}: all cores / half, burst time {walls['all'] / walls['half']:.2f}x")


if __name__ == "__main__":
    main()

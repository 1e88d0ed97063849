"""Time to first token for a long video, made whole vs in its plugin's parts, in one run.

Makes a 60 s 1080p H.264 clip with ffmpeg, serves it from a loopback HTTP server, and starts the
release `mmgate serve` with the demo model twice: `whole` (`media_parts = false`: one plugin call
makes the whole video, then it is encoded, then prefilled) and `pieces` (the default: the video
plugin's runs of 8 temporal patches made on every core at once, each encoded and prefilled as soon
as it and what precedes it are ready). Both have no feature cache, so every request decodes and
encodes anew. For each, streaming chat requests with the video: time to the first content token
(TTFT), and the TTFT of a text-only question sent 0.2 s after the video (text never waits for an
encoder). Prints medians and the pieces/whole ratios.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"
ROUNDS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_clip(path: Path) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    "testsrc2=size=1920x1080:rate=30", "-t", "60", "-c:v", "libx264", "-preset",
                    "veryfast", "-crf", "30", "-g", "60", "-pix_fmt", "yuv420p", str(path)],
                   check=True)


def ttft(port: int, model: str, content) -> float:
    """Seconds to the first content delta of a streamed chat completion."""
    body = json.dumps({"model": model, "max_tokens": 4, "temperature": 0, "stream": True,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                sys.exit(f"error: {event}")
            delta = event["choices"][0]["delta"] if event.get("choices") else {}
            if first is None and delta.get("content") is not None:
                first = time.perf_counter() - start
    if first is None:
        sys.exit("no content came back")
    return first


def measure(port: int, model: str, video_url: str) -> tuple[float, float]:
    """(video TTFT, TTFT of a text question asked 0.2 s into the video's request)."""
    video = [{"type": "video_url", "video_url": {"url": video_url}},
             {"type": "text", "text": "Describe the video."}]
    text_ttft: list[float] = []

    def beside() -> None:
        time.sleep(0.2)
        text_ttft.append(ttft(port, model, "Describe a sunny day in a few words."))

    thread = threading.Thread(target=beside)
    thread.start()
    video_ttft = ttft(port, model, video)
    thread.join()
    return video_ttft, text_ttft[0]


def main() -> None:
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        clip = tmp / "clip.mp4"
        make_clip(clip)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp))
        handler.log_message = lambda *args: None
        files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=files.serve_forever, daemon=True).start()
        video_url = f"http://127.0.0.1:{files.server_address[1]}/clip.mp4"
        config = tmp / "mmgate.toml"
        config.write_text(
            '[fetch]\nallow = ["127.0.0.1/32"]\n\n'
            '[[models]]\nname = "whole"\npath = "demo"\nmedia_parts = false\nfeature_cache_bytes = 0\n\n'
            '[[models]]\nname = "pieces"\npath = "demo"\nfeature_cache_bytes = 0\n')
        port = free_port()
        env = dict(os.environ, RUST_LOG="warn", XDG_CACHE_HOME=str(tmp / "cache"))
        server = subprocess.Popen([str(MMGATE), "serve", "--config", str(config), "--listen",
                                   f"127.0.0.1:{port}"], env=env)
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
            results: dict[str, list[tuple[float, float]]] = {"whole": [], "pieces": []}
            measure(port, "pieces", video_url)  # warm-up: compiled plugins, first allocations
            for _ in range(ROUNDS):
                for model in ("whole", "pieces"):
                    results[model].append(measure(port, model, video_url))
        finally:
            server.terminate()
            server.wait()
            files.shutdown()
    cores = os.cpu_count()
    print(f"60 s 1080p H.264 video, demo model, {cores} cores, median of {ROUNDS} (interleaved)")
    print(f"{'':<8} {'video TTFT s':>13} {'text beside s':>14}")
    med = {m: (statistics.median(v for v, _ in r), statistics.median(t for _, t in r))
           for m, r in results.items()}
    for model, (video, text) in med.items():
        print(f"{model:<8} {video:>13.2f} {text:>14.3f}")
    print(f"pieces / whole: video TTFT {med['pieces'][0] / med['whole'][0]:.2f}x, "
          f"text beside {med['pieces'][1] / med['whole'][1]:.2f}x")


if __name__ == "__main__":
    main()

"""Time to first token for a long video and a long audio file, made whole vs in their plugins'
parts, in one run.

Makes a 60 s 1080p H.264 clip with ffmpeg, serves it from a loopback HTTP server, and starts the
release `mmgate serve` with the demo model as `whole` (`media_parts = false`: one plugin call makes
the whole video, then it is encoded, then prefilled) and `pieces` (the default: the video plugin's
parts, 2 temporal patches first and then runs of at most 8, made on every core at once, each
encoded and prefilled as soon as it and what precedes it are ready), each at the demo's full 32 768-token context (the plan fills it: the
LLM's prefill dominates) and at 8 192 (`max_model_len`). No feature cache: every request decodes and
encodes anew. For each, streaming chat requests with the video: time to the first content token
(TTFT); and text-only questions asked every 2 s while the video's request runs, whose TTFTs show
what a long video does to other users. The same for a 10-minute 16 kHz PCM WAV on the demo audio
model (Qwen2-Audio: 20 chunks of 30 s, 15 000 tokens), whole vs one piece per chunk. Prints medians
and the pieces/whole ratios, and beside each the server's CPU seconds for the media's request
(Linux: from /proc; the text questions' share is small) and that over the cores: no overlap of the
stages can bring a TTFT below that bound, so it tells how far pieces can go on this machine; and
for the pieced items, from the engine's metrics, when their first and last pieces were encoded.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it);
`python3 bench/pieces.py audio` (or `video`) runs one half; `ENCODER_DEVICES=2` gives each model two
encoder devices of half the cores (two pieces of an item encode at once, a whole item on one);
`PLUGIN_NICE=0` runs the plugin workers at the encoders' and the LLM's priority (the default is
`plugins.nice`'s, 10).
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from machine import cpu_name
from common import free_port, wait_for_health

ROOT = Path(__file__).resolve().parent.parent
MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"
ROUNDS = 3


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


def make_audio(path: Path) -> None:
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    "aevalsrc=0.3*sin(2*PI*(200+20*mod(t\\,7))*t)+0.02*random(0):s=16000:d=600",
                    "-ac", "1", "-c:a", "pcm_s16le", str(path)], check=True)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far, all its threads (0 where /proc is not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def piece_sums(port: int, model: str) -> tuple[float, float, float]:
    """The engine's counters for `model`'s items made in pieces: (items, milliseconds from admission
    to their first piece encoded, to their last), summed since start."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    value = {}
    for line in text.splitlines():
        for name in ("pieced_items", "first_piece_ms_sum", "last_piece_ms_sum"):
            if line.startswith(f'mmgate_engine_{name}{{model="{model}"}} '):
                value[name] = float(line.rsplit(" ", 1)[1])
    return (value.get("pieced_items", 0.0), value.get("first_piece_ms_sum", 0.0),
            value.get("last_piece_ms_sum", 0.0))


@dataclasses.dataclass
class Measurement:
    """One media request and what ran beside it."""
    media_ttft: float
    # TTFTs of the text questions asked every 2 s while the media's request ran.
    text_ttfts: list[float]
    # The server's CPU seconds meanwhile.
    cpu_seconds: float
    # For an item made in pieces: seconds from its admission to its first and its last piece
    # encoded.
    pieces: tuple[float, float] | None


def measure(port: int, model: str, part: dict, pid: int) -> Measurement:
    """Sends the media with a question and, every 2 s until it answers, a text-only question."""
    media = [part, {"type": "text", "text": "Describe it."}]
    result: list[float] = []
    pieces_before = piece_sums(port, model)
    cpu_before = cpu_seconds(pid)
    thread = threading.Thread(target=lambda: result.append(ttft(port, model, media)))
    thread.start()
    text_ttft = []
    while thread.is_alive():
        time.sleep(2)
        if thread.is_alive():
            text_ttft.append(ttft(port, model, "Describe a sunny day in a few words."))
    thread.join()
    cpu = cpu_seconds(pid) - cpu_before
    items, first, last = (a - b for a, b in zip(piece_sums(port, model), pieces_before))
    pieces = (first / items / 1e3, last / items / 1e3) if items else None
    return Measurement(result[0], text_ttft, cpu, pieces)


def main() -> None:
    print(f"# {cpu_name()}")
    if not MMGATE.exists():
        sys.exit(f"{MMGATE} is missing: cargo build --release -p mmgate-gateway")
    devices = int(os.environ.get("ENCODER_DEVICES", "1"))
    plugin_nice = os.environ.get("PLUGIN_NICE")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        clip = tmp / "clip.mp4"
        make_clip(clip)
        make_audio(tmp / "audio.wav")
        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

        handler = functools.partial(Quiet, directory=str(tmp))
        files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=files.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{files.server_address[1]}"
        video = {"type": "video_url", "video_url": {"url": f"{base}/clip.mp4"}}
        audio = {"type": "audio_url", "audio_url": {"url": f"{base}/audio.wav"}}
        config = tmp / "mmgate.toml"
        models = ""
        # ENCODER_DEVICES=2: two encoder devices of half the cores each (the default is one), so
        # that two pieces of an item encode at once; a whole item still encodes on one.
        half = max((os.cpu_count() or 2) // 2, 1)
        encoders = ("encoder_devices = [" + ", ".join([f"{{ threads = {half} }}"] * devices) + "]\n"
                    if devices > 1 else "")
        for context, suffix in ((32768, ""), (8192, "-8k")):
            for name, parts in (("whole", "false"), ("pieces", "true")):
                models += (f'[[models]]\nname = "{name}{suffix}"\npath = "demo"\nmedia_parts = {parts}\n'
                           f'feature_cache_bytes = 0\nmax_model_len = {context}\n{encoders}\n')
        for name, parts in (("whole", "false"), ("pieces", "true")):
            models += (f'[[models]]\nname = "audio-{name}"\npath = "demo-audio"\n'
                       f'media_parts = {parts}\nfeature_cache_bytes = 0\n{encoders}\n')
        plugins = f"[plugins]\nnice = {int(plugin_nice)}\n\n" if plugin_nice is not None else ""
        config.write_text('[fetch]\nallow = ["127.0.0.1/32"]\n\n' + plugins + models)
        port = free_port()
        env = dict(os.environ, RUST_LOG="warn", XDG_CACHE_HOME=str(tmp / "cache"))
        server = subprocess.Popen([str(MMGATE), "serve", "--config", str(config), "--listen",
                                   f"127.0.0.1:{port}"], env=env)
        try:
            wait_for_health(port, server)
            names = ["whole", "pieces", "whole-8k", "pieces-8k", "audio-whole", "audio-pieces"]
            only = sys.argv[1] if len(sys.argv) > 1 else None
            names = [n for n in names if only is None or ("audio" in n) == (only == "audio")]
            results: dict[str, list[Measurement]] = {name: [] for name in names}
            # Warm-up: compiled plugins, first allocations.
            if only != "audio":
                measure(port, "pieces-8k", video, server.pid)
            if only != "video":
                measure(port, "audio-pieces", audio, server.pid)
            for _ in range(ROUNDS):
                for model in names:
                    results[model].append(
                        measure(port, model, audio if "audio" in model else video, server.pid))
        finally:
            server.terminate()
            server.wait()
            files.shutdown()
    cores = os.cpu_count()
    print(f"60 s 1080p H.264 video (demo model) and 10 min 16 kHz WAV (demo-audio), {cores} cores, "
          f"{devices} encoder device(s), plugin workers at nice "
          f"{plugin_nice if plugin_nice is not None else 'default'}, median of {ROUNDS} (interleaved)")
    print(f"{'':<12} {'media TTFT s':>13} {'text beside: median s':>22} {'max s':>7} "
          f"{'CPU s':>7} {'CPU s / cores':>14} {'1st piece s':>12} {'last piece s':>13}")
    med = {}
    for model, runs in results.items():
        texts = sorted(t for run in runs for t in run.text_ttfts) or [0.0]
        med[model] = statistics.median(run.media_ttft for run in runs)
        cpu = statistics.median(run.cpu_seconds for run in runs)
        pieces = [run.pieces for run in runs if run.pieces]
        first, last = (
            (f"{statistics.median(p[0] for p in pieces):>12.2f}",
             f"{statistics.median(p[1] for p in pieces):>13.2f}") if pieces else
            (f"{'-':>12}", f"{'-':>13}"))
        print(f"{model:<12} {med[model]:>13.2f} {statistics.median(texts):>22.3f} {texts[-1]:>7.3f} "
              f"{cpu:>7.1f} {cpu / cores:>14.1f} {first} {last}")
    for suffix in ("", "-8k"):
        if "whole" + suffix in med:
            print(f"pieces / whole{suffix or ' (32k context)'}: video TTFT "
                  f"{med['pieces' + suffix] / med['whole' + suffix]:.2f}x")
    if "audio-whole" in med:
        print(f"pieces / whole: 10 min audio TTFT {med['audio-pieces'] / med['audio-whole']:.2f}x")


if __name__ == "__main__":
    main()

"""mmgate in front of a real engine: media sent as they came (`media = "forward"`) vs as planned here
(`media = "preprocess"`, a 1 024-token budget), in one run.

The engine is transformers' own OpenAI-compatible server (`transformers serve`, CPU torch, from the
engine venv `./dev test` installs) serving the tiny demo Qwen2-VL checkpoint, its image processor
given the real Qwen2-VL limits (max_pixels 12 845 056), so a photo sent as it came is processed at
the size a real deployment would process it. Between mmgate and the engine a byte-counting TCP relay
measures what goes upstream. Per item, the median of RUNS requests:
- the engine's CPU time (user + system of its process, from /proc) per request;
- the bytes sent upstream;
- the gateway's own cost: its plugin time (probe, plan, reduce) from `usage.media` / the
  `x-mmgate-media` header, and the request's wall time end to end.
Items: a 4032x3024 JPEG photo (noisy test pattern, ~5 MB) and a 60 s 1080p H.264 video (30 fps),
both made here with ffmpeg. transformers' server takes no `video_url`, so for the video only the
bytes and the gateway's cost are measured (the engine's answer is an error either way).

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MMGATE = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "mmgate"
VENV = Path(os.environ.get("MMGATE_ENGINE_VENV", Path.home() / ".cache/mmgate/engine-venv"))
RUNS = 3
BUDGET = 1024
QWEN2_VL_MAX_PIXELS = 12845056


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingRelay:
    """A TCP relay on loopback that counts the bytes its clients send."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.sent = 0
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            # Passed on at once, as the servers at either end send (uvicorn and pingora both set
            # TCP_NODELAY): with Nagle's algorithm here, a keep-alive connection's piece that
            # follows an unacknowledged one waits for the delayed ACK (~40 ms), which a client
            # reusing its connection (a gateway) pays and one opening a new one does not.
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self.lock:
                        self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_healthy(url: str, child: subprocess.Popen, what: str, limit: float = 300) -> None:
    started = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if child.poll() is not None:
            sys.exit(f"{what} exited during start-up ({child.returncode})")
        if time.monotonic() - started > limit:
            sys.exit(f"{what} did not become healthy in {limit:.0f} s")
        time.sleep(0.2)


def make_media(scratch: Path) -> dict[str, tuple[str, Path]]:
    photo, video = scratch / "photo-4032x3024.jpg", scratch / "video-60s-1080p.mp4"
    ffmpeg = ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi", "-i"]
    subprocess.run(ffmpeg + ["testsrc2=size=4032x3024:rate=1", "-vf", "noise=alls=12:allf=t",
                             "-frames:v", "1", "-q:v", "2", str(photo)], check=True)
    subprocess.run(ffmpeg + ["testsrc2=size=1920x1080:rate=30", "-t", "60", "-c:v", "libx264",
                             "-preset", "veryfast", "-crf", "30", "-pix_fmt", "yuv420p", str(video)],
                   check=True)
    return {"photo 4032x3024": ("image", photo), "video 60 s 1080p": ("video", video)}


def model_dirs(scratch: Path, cache: Path,
               max_pixels: int = QWEN2_VL_MAX_PIXELS) -> tuple[Path, Path]:
    """The demo Qwen2-VL checkpoint for the engine (with real Qwen2-VL image limits, or
    `max_pixels`, and its chat template as transformers 5 reads it), and the same without weights
    for mmgate."""
    subprocess.run([str(MMGATE), "generate", "--model", "demo", "--prompt", "hi", "--max-tokens",
                    "1"], env={**os.environ, "XDG_CACHE_HOME": str(cache)}, check=True,
                   capture_output=True)
    demo = next(p for p in (cache / "mmgate/models").iterdir() if "qwen2-vl" in p.name)
    engine_dir, weightless = scratch / "engine-model", scratch / "weightless"
    shutil.copytree(demo, engine_dir)
    processor = json.loads((engine_dir / "preprocessor_config.json").read_text())
    processor["max_pixels"] = max_pixels
    (engine_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    tokenizer_config = json.loads((engine_dir / "tokenizer_config.json").read_text())
    (engine_dir / "chat_template.jinja").write_text(tokenizer_config["chat_template"])
    shutil.copytree(engine_dir, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    return engine_dir, weightless


def request(port: int, model: str, kind: str, path: Path) -> tuple[int, dict, dict, float]:
    mime = "image/jpeg" if kind == "image" else "video/mp4"
    url = f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"
    part = {"type": "image_url", "image_url": {"url": url}} if kind == "image" else \
        {"type": "video_url", "video_url": {"url": url}}
    body = json.dumps({"model": model, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=1800) as r:
            status, headers, answer = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, answer = e.code, dict(e.headers), e.read()
    wall = time.perf_counter() - started
    try:
        answer = json.loads(answer)
    except ValueError:
        answer = {}
    return status, headers, answer, wall


def gateway_plugin_ms(headers: dict, answer: dict) -> float | None:
    accounts = (answer.get("usage") or {}).get("media")
    if accounts is None and "x-mmgate-media" in {k.lower() for k in headers}:
        accounts = json.loads(next(v for k, v in headers.items() if k.lower() == "x-mmgate-media"))
    if not accounts:
        return None
    return sum(a.get("plugin_ms", 0) for a in accounts)


def in_scratch(name: str, run) -> None:
    """`run(scratch)` in a scratch directory of its own, removed however it ends."""
    scratch = Path(tempfile.mkdtemp(prefix=f"mmgate-bench-{name}-"))
    try:
        run(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    print(f"# {cpu_name()}")
    if not (VENV / "bin/transformers").exists():
        sys.exit(f"no engine venv at {VENV}: ./dev test installs it")
    in_scratch("upstream", run)


def run(scratch: Path) -> None:
    media = make_media(scratch)
    engine_dir, weightless = model_dirs(scratch, scratch / "cache")
    engine_port = free_port()
    engine = subprocess.Popen([str(VENV / "bin/transformers"), "serve", str(engine_dir), "--device",
                               "cpu", "--host", "127.0.0.1", "--port", str(engine_port)],
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    gateway = None
    try:
        wait_healthy(f"http://127.0.0.1:{engine_port}/health", engine, "transformers serve")
        relay = CountingRelay(engine_port)
        # The budget: max_model_len less the text and the one completion token.
        config = scratch / "mmgate.toml"
        common = f'upstreams = ["127.0.0.1:{relay.port}"]\nupstream_model = "{engine_dir}"\n'
        config.write_text(
            f'[limits]\nmax_body_bytes = 268435456\n\n'
            f'[[models]]\nname = "forward"\n{common}\n'
            f'[[models]]\nname = "preprocess"\n{common}media = "preprocess"\npath = "{weightless}"\n'
            f'max_model_len = {BUDGET + 64}\n')
        port = free_port()
        gateway = subprocess.Popen([str(MMGATE), "serve", "--config", str(config), "--listen",
                                    f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        wait_healthy(f"http://127.0.0.1:{port}/health", gateway, "mmgate")

        rows = []
        for label, (kind, path) in media.items():
            for mode in ("forward", "preprocess"):
                cpu, sent, wall, plugin, statuses, tokens = [], [], [], [], set(), None
                for _ in range(RUNS):
                    cpu0, sent0 = cpu_seconds(engine.pid), relay.sent
                    status, headers, answer, seconds = request(port, mode, kind, path)
                    time.sleep(0.2)  # the relay's last bytes, the engine's last accounting
                    cpu.append(cpu_seconds(engine.pid) - cpu0)
                    sent.append(relay.sent - sent0)
                    wall.append(seconds)
                    statuses.add(status)
                    if (ms := gateway_plugin_ms(headers, answer)) is not None:
                        plugin.append(ms)
                    tokens = (answer.get("usage") or {}).get("prompt_tokens", tokens)
                rows.append((label, mode, statuses, statistics.median(cpu), statistics.median(sent),
                             statistics.median(wall), statistics.median(plugin) if plugin else None,
                             tokens))
    finally:
        for child in (gateway, engine):
            if child is not None:
                child.kill()
                child.wait()

    print(f"{'item':18} {'media':10} {'status':7} {'engine CPU s':>12} {'bytes upstream':>15} "
          f"{'wall s':>8} {'gateway plugin ms':>18} {'prompt tokens':>14}")
    for label, mode, statuses, cpu, sent, wall, plugin, tokens in rows:
        plugin_text = f"{plugin:.1f}" if plugin is not None else "-"
        print(f"{label:18} {mode:10} {','.join(map(str, sorted(statuses))):7} {cpu:12.2f} "
              f"{sent:15,d} {wall:8.2f} {plugin_text:>18} {tokens if tokens is not None else '-':>14}")
    for label in media:
        by_mode = {mode: row for row in rows if row[0] == label for mode in [row[1]]}
        fwd, pre = by_mode["forward"], by_mode["preprocess"]
        cpu_ratio = fwd[3] / pre[3] if pre[3] > 0 else float("inf")
        print(f"{label}: preprocess sends {fwd[4] / max(pre[4], 1):.1f}x fewer bytes upstream; "
              f"engine CPU {cpu_ratio:.1f}x less" + ("" if 200 in fwd[2] else
                                                      " (the engine refused it sent as it came)"))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A soak: mixed load on one gateway for a while at ~80 % of its capacity, measured first in the
same run, with its memory, file descriptors and live bytes sampled throughout; a verdict at the end.

The load: chat completions on the native demo models (text, distinct images, audio, video, streamed,
and streamed with the client leaving after its first event), uploads used by a chat request and
deleted, and text and streamed requests for a model served by an upstream (a second gateway).

The verdict (exit status 1 when any fails):
  - no answer with a 5xx status and no request that failed on the client's side;
  - resident memory with no upward trend: over the last two thirds of the run, the median of the
    last third of its ten-sample stretches within 5 % above the first third's (single samples
    swing with what is in flight, ±7 % in a 30-minute run here: a leak is a trend, not a swing);
    the spread of the stretches is printed too. Runs under 10 minutes (CI's 2) are a smoke test for
    gross leaks, their thirds a few samples with warm-up in them: 10 %;
  - file descriptors flat, the gateway's kept-alive connections to its upstream counted apart: the
    others with no upward trend under load (over the last two thirds of the run, as for memory, the
    median of the last third of the samples within a connection per sender of the first third's:
    the client connections in flight swing with the load, a leak grows with every request) and
    back to the idle count from before the load once it stops (within 8); the upstream's idle
    connections within their bound, a connection per sender on each HTTP worker thread (each
    keeps a pool of its own, for 60 s; one the upstream closed meanwhile goes when it is taken or,
    the oldest, when another is returned);
  - once the load stops, the KV caches and the features pinned for requests in flight are back to 0.

    python3 bench/soak.py [--minutes 30]     (./dev soak; ./dev test runs --minutes 2)

Uses $MMGATE_BIN, else the release build, else the debug build of CARGO_TARGET_DIR (or target/).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from chat import bmp, data_url, free_port
from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
WORKERS = 8
# Threads sending the soak's requests (open loop: as many may be in flight).
SENDERS = 4 * WORKERS


def binary() -> Path:
    if os.environ.get("MMGATE_BIN"):
        return Path(os.environ["MMGATE_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    for profile in ("release", "debug"):
        if (target / profile / "mmgate").exists():
            return target / profile / "mmgate"
    sys.exit(f"no mmgate binary under {target}: cargo build -p mmgate-gateway")


def start(config: str, workdir: Path, name: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    path = workdir / f"{name}.toml"
    path.write_text(config)
    log = open(workdir / f"{name}.log", "w")
    env = dict(os.environ, RUST_LOG="warn", XDG_CACHE_HOME=str(workdir / "cache"))
    process = subprocess.Popen([str(binary()), "serve", "--config", str(path), "--listen",
                                f"127.0.0.1:{port}"], env=env, stdout=log, stderr=log)
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return process, port
        except OSError:
            if time.time() > deadline or process.poll() is not None:
                sys.exit(f"{name} did not start; see its log:\n{(workdir / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.2)


def chat_body(model: str, content, stream: bool = False, max_tokens: int = 8) -> bytes:
    return json.dumps({"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                       "messages": [{"role": "user", "content": content}]}).encode()


class Load:
    """The request kinds, each a function of a connection-less client returning the status."""

    def __init__(self, port: int):
        self.port = port
        self.images = [data_url("image/bmp", bmp(i)) for i in range(40)]
        self.audio = data_url("audio/wav", (FIXTURES / "audio/clips/short-16k-s16.wav").read_bytes())
        self.video = data_url("video/mp4", (FIXTURES / "video/clips/short.mp4").read_bytes())
        self.png = (FIXTURES / "image/images/png-rgb-wide.png").read_bytes()
        self.kinds = [
            (25, self.text), (20, self.image), (8, self.audio_chat), (4, self.video_chat),
            (8, self.upload), (10, self.stream), (5, self.stream_and_leave),
            (12, self.upstream_text), (8, self.upstream_stream),
        ]

    def pick(self, rng: random.Random):
        return rng.choices([k for _, k in self.kinds], weights=[w for w, _ in self.kinds])[0]

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, bytes]:
        connection = self.connection()
        try:
            connection.request(method, path, body=body,
                               headers=headers or {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def chat(self, body: bytes) -> int:
        return self.request("POST", "/v1/chat/completions", body)[0]

    def text(self, rng):
        return self.chat(chat_body("demo", f"Tell me about the number {rng.randrange(1000)}."))

    def image(self, rng):
        return self.chat(chat_body("demo", [
            {"type": "image_url", "image_url": {"url": rng.choice(self.images)}},
            {"type": "text", "text": "What is in this picture?"}]))

    def audio_chat(self, rng):
        return self.chat(chat_body("demo-audio", [
            {"type": "input_audio", "input_audio": {"data": self.audio.split(",", 1)[1], "format": "wav"}},
            {"type": "text", "text": "What is said?"}]))

    def video_chat(self, rng):
        return self.chat(chat_body("demo", [
            {"type": "video_url", "video_url": {"url": self.video}},
            {"type": "text", "text": "What happens?"}]))

    def upload(self, rng):
        boundary = f"soak{rng.randrange(1 << 30)}"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nvision\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\n"
                f"Content-Type: image/png\r\n\r\n").encode() + self.png + f"\r\n--{boundary}--\r\n".encode()
        status, reply = self.request("POST", "/v1/files", body,
                                     {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        if status != 200:
            return status
        file_id = json.loads(reply)["id"]
        status = self.chat(chat_body("demo", [{"type": "file", "file": {"file_id": file_id}},
                                              {"type": "text", "text": "And this?"}]))
        deleted, _ = self.request("DELETE", f"/v1/files/{file_id}")
        return status if status != 200 else deleted

    def stream(self, rng, model: str = "demo", leave: bool = False):
        connection = self.connection()
        try:
            connection.request("POST", "/v1/chat/completions",
                               body=chat_body(model, "Count slowly to twenty.", True, 32),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                return response.status
            if leave:
                response.readline()  # the first event, then the client is gone
                return 200
            text = response.read().decode()
            return 200 if "data: [DONE]" in text else 599
        finally:
            connection.close()

    def stream_and_leave(self, rng):
        return self.stream(rng, leave=True)

    def upstream_text(self, rng):
        return self.chat(chat_body("proxied", f"Say {rng.randrange(1000)}."))

    def upstream_stream(self, rng):
        return self.stream(rng, model="proxied")


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.statuses: dict[int, int] = {}
        self.failures: list[str] = []

    def add(self, kind: str, outcome) -> None:
        with self.lock:
            if isinstance(outcome, int):
                self.statuses[outcome] = self.statuses.get(outcome, 0) + 1
                if outcome != 200:
                    self.failures.append(f"{kind}: {outcome}")
            else:
                self.failures.append(f"{kind}: {outcome}")

    def done(self) -> int:
        with self.lock:
            return sum(self.statuses.values())


def run_one(load: Load, tally: Tally, rng: random.Random) -> None:
    kind = load.pick(rng)
    try:
        outcome = kind(rng)
    except Exception as e:  # noqa: BLE001 -- a client-side failure is part of the verdict
        outcome = f"{type(e).__name__}: {e}"
    tally.add(kind.__name__, outcome)


def capacity(load: Load, seconds: float) -> float:
    """Requests per second the mix reaches from WORKERS closed-loop clients."""
    tally, stop = Tally(), time.time() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.time() < stop:
            run_one(load, tally, rng)

    start = time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if tally.failures:
        sys.exit(f"failures while measuring capacity: {tally.failures[:5]}")
    return tally.done() / (time.time() - start)


def gauges(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    wanted = {"kv": "mmgate_kv_cache_bytes", "pinned": "mmgate_feature_store_pinned_bytes",
              "cached": "mmgate_feature_store_cached_bytes"}
    values: dict[str, float] = {}
    for line in text.splitlines():
        for key, prefix in wanted.items():
            if line.startswith(prefix + "{") or line.startswith(prefix + " "):
                values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    if missing := [wanted[k] for k in wanted if k not in values]:
        sys.exit(f"/metrics lacks {missing}")
    return values


def process_sample(pid: int, upstream_port: int) -> tuple[int, int, int]:
    """(resident bytes, descriptors other than connections to `upstream_port`, those connections)."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024
    # Sockets whose remote end is the upstream's port, by inode (/proc/PID/net/tcp: remote
    # address in field 2 as hex "ADDR:PORT", inode in field 9).
    to_upstream = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == upstream_port:
                to_upstream.add(fields[9])
    fds, pooled = 0, 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target[8:-1] in to_upstream:
            pooled += 1
        else:
            fds += 1
    return rss, fds, pooled


def http_threads(pid: int) -> int:
    """The gateway's HTTP worker threads (pingora's, each with its own upstream pool)."""
    names = [Path(task, "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()]
    return max(1, sum(name.startswith("mmgate http") for name in names))


def main() -> None:
    print(f"# {cpu_name()}")
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30.0)
    args = parser.parse_args()
    duration = args.minutes * 60
    period = 5.0 if args.minutes >= 10 else 2.0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        upstream, up_port = start('models = [{ name = "proxied", path = "demo" }]\n', workdir, "upstream")
        front, port = start(
            'models = [{ name = "demo", path = "demo" }, { name = "demo-audio", path = "demo-audio" },\n'
            f'  {{ name = "proxied", upstreams = ["127.0.0.1:{up_port}"] }}]\n', workdir, "front")
        try:
            load = Load(port)
            rate = capacity(load, min(30.0, max(10.0, duration / 10)))
            target = 0.8 * rate
            print(f"capacity {rate:.1f} req/s from {WORKERS} clients; the soak sends {target:.1f} req/s "
                  f"for {args.minutes:g} min", flush=True)

            _, idle_fds_before, _ = process_sample(front.pid, up_port)
            pool_bound = SENDERS * http_threads(front.pid)
            tally, samples = Tally(), []
            stop = threading.Event()

            def sampler() -> None:
                while not stop.wait(period):
                    rss, fds, pooled = process_sample(front.pid, up_port)
                    samples.append((time.time(), rss, fds, gauges(port), pooled))

            sampling = threading.Thread(target=sampler)
            sampling.start()
            rng = random.Random(7)
            start_time = time.time()
            with ThreadPoolExecutor(SENDERS) as pool:
                sent = 0
                while (now := time.time()) < start_time + duration:
                    due = start_time + sent / target
                    if due > now:
                        time.sleep(min(due - now, 0.5))
                        continue
                    seed = rng.randrange(1 << 30)
                    pool.submit(run_one, load, tally, random.Random(seed))
                    sent += 1
            stop.set()
            sampling.join()
            # Idle: whatever the requests held must be given back.
            deadline = time.time() + 30
            while (idle := gauges(port))["kv"] or idle["pinned"]:
                if time.time() > deadline:
                    break
                time.sleep(0.5)
            idle_rss, idle_fds, idle_pooled = process_sample(front.pid, up_port)
        finally:
            for process in (front, upstream):
                process.terminate()
                process.wait()

    elapsed = time.time() - start_time
    print(f"sent {tally.done()} requests in {elapsed:.0f} s ({tally.done() / elapsed:.1f}/s); statuses "
          f"{dict(sorted(tally.statuses.items()))}")
    print(f"{'t (s)':>6} {'RSS (MiB)':>10} {'fds':>5} {'upstream':>9} {'KV (MiB)':>9} "
          f"{'pinned (MiB)':>13} {'cached (MiB)':>13}")
    step = max(1, len(samples) // 20)
    for t, rss, fds, g, pooled in samples[::step]:
        print(f"{t - start_time:>6.0f} {rss / 2**20:>10.1f} {fds:>5} {pooled:>9} {g['kv'] / 2**20:>9.2f} "
              f"{g['pinned'] / 2**20:>13.2f} {g['cached'] / 2**20:>13.2f}")
    print(f"{'idle':>6} {idle_rss / 2**20:>10.1f} {idle_fds:>5} {idle_pooled:>9} "
          f"{idle['kv'] / 2**20:>9.2f} {idle['pinned'] / 2**20:>13.2f} {idle['cached'] / 2**20:>13.2f}")

    window = [s for s in samples if s[0] - start_time >= duration / 3]
    rss = [s[1] for s in window]
    # Descriptors over the same window: in the first third the upstream's connection pool is still
    # growing towards the concurrency the load reaches (a 2-minute run is mostly that).
    fds = [s[2] for s in window]
    pooled_all = [s[4] for s in samples] + [idle_pooled]
    stretches = [statistics.median(rss[i:i + 10]) for i in range(0, len(rss), 10) if len(rss[i:i + 10]) >= 5]
    part = max(1, len(stretches) // 3)
    rss_first, rss_last = statistics.median(stretches[:part]), statistics.median(stretches[-part:])
    rss_growth = rss_last / rss_first - 1
    rss_spread = (max(stretches) - min(stretches)) / rss_first
    # A short run (CI's 2 minutes) is a smoke test for gross leaks, a descriptor or 100 KB a
    # request (thousands of descriptors, hundreds of MiB): its thirds are a few samples each, with
    # warm-up still in them, so memory gets twice the room there.
    rss_room = 0.05 if duration >= 600 else 0.10
    third = max(1, len(fds) // 3)
    fds_first, fds_last = statistics.median(fds[:third]), statistics.median(fds[-third:])
    verdicts = [
        ("no 5xx, no failed request", not tally.failures,
         f"{len(tally.failures)} failed, the first: {tally.failures[:3]}"),
        ("resident memory with no upward trend", rss_growth <= rss_room,
         f"medians of the first and last thirds {rss_first / 2**20:.0f} and {rss_last / 2**20:.0f} MiB "
         f"({rss_growth:+.1%}); stretches of 10 samples {min(stretches) / 2**20:.0f}..{max(stretches) / 2**20:.0f} "
         f"MiB (spread {rss_spread:.1%})"),
        ("file descriptors flat", fds_last <= fds_first + SENDERS and idle_fds <= idle_fds_before + 8,
         f"besides the upstream's: idle {idle_fds_before} before; over the last two thirds "
         f"{min(fds)}..{max(fds)}, medians of the first and last thirds {fds_first:.0f} and "
         f"{fds_last:.0f}; idle {idle_fds} after"),
        ("kept-alive upstream connections within their bound", max(pooled_all) <= pool_bound,
         f"at most {max(pooled_all)} (bound {pool_bound}: a connection per sender on each HTTP "
         f"worker thread); {idle_pooled} idle after"),
        ("KV and pinned features back to 0 when idle", idle["kv"] == 0 and idle["pinned"] == 0,
         f"KV {idle['kv']:.0f} B, pinned {idle['pinned']:.0f} B"),
    ]
    for name, ok, detail in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    if not all(ok for _, ok, _ in verdicts):
        sys.exit(1)


if __name__ == "__main__":
    main()

"""P12, what fronting vLLM buys: the same multimodal workload sent to vLLM alone and through mmgate
in each `media` mode (`forward`, `preprocess`, `embed`, `ec`), in one run.

The engine is vLLM's CPU build (the engine venv `./dev test` installs) serving mmgate's demo
Qwen2-VL checkpoint with a common deployment's image limit (max_pixels = 1280 * 28 * 28), started
with `--enable-mm-embeds` and as an EC consumer of mmgate's `ec_storage` (`ECExampleConnector`) so
that one server takes all five, and with its processor cache and prefix caching off (the workload
repeats its items, a real one would not; vLLM keeps the `uuid`s `ec` sends all the same). Each pass,
the open loop and the warm-up send their own variant of every item (the noise seeded per variant),
so no target ever sees an item twice outside the warm-up: no cache of vLLM's or mmgate's (`embed`'s
feature cache, `ec`'s store) hits. A byte-counting relay sits in front of
it: the clients of "vLLM alone" and mmgate both reach it through the relay. The workload cycles
through JPEG photos from 720p to 12 MP and two short H.264 clips, made here with ffmpeg.

vLLM is pinned to half the CPUs, mmgate and the clients to the others: the engine has the same
CPUs whoever sends to it, and a gateway in front of it has CPUs of its own. Per target:
- closed loop (PASSES passes, the targets taking turns in each): CONCURRENCY clients, each sending the next item as soon as its last answered
  (max_tokens 1): requests per second, and per request the CPU seconds of vLLM's API-server process
  (its frontend, where the HF processor runs), of its engine core process, and of mmgate, and the
  bytes sent upstream;
- open loop: requests started at a fixed RATE whatever the answers (streamed, max_tokens 2): time
  to the first token, p50 and p99.
Every ratio is against vLLM alone, measured in the same run. Goals (issue 62): throughput through
mmgate >= vLLM alone; vLLM frontend CPU per request <= 0.5x with `preprocess` and `embed`;
(issue 80) `ec` throughput >= `embed`'s and vLLM alone's, its vLLM frontend CPU per request
<= 0.15x, its bytes to vLLM per request <= 64 KiB.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from machine import cpu_name
from upstream import (MMGATE, VENV, CountingRelay, cpu_seconds, free_port, in_scratch, model_dirs,
                      wait_healthy)

CONCURRENCY = 2
PASSES = 3  # closed-loop passes over the workload, each target in turn in each pass
RATE = 0.5  # open-loop requests per second
OPEN_REQUESTS = 12
MAX_PIXELS = 1280 * 28 * 28
MAX_MODEL_LEN = 8192
# vLLM (its frontend and engine core) has CPUs of its own, the same whoever sends to it; mmgate,
# the relay and the clients have the others, as a gateway in front of an engine would.
CPUS = sorted(os.sched_getaffinity(0))
ENGINE_CPUS = CPUS[: max(1, len(CPUS) // 2)]
GATEWAY_CPUS = CPUS[len(ENGINE_CPUS):] or CPUS


def make_media(scratch: Path, variant: int) -> list[tuple[str, str, Path]]:
    """(label, kind, file) of the workload; each `variant` is new media (its own noise)."""
    ffmpeg = ["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi", "-i"]
    items = []
    for w, h in ((1280, 720), (1920, 1080), (2560, 1440), (4032, 3024)):
        path = scratch / f"photo-{w}x{h}-{variant}.jpg"
        subprocess.run(ffmpeg + [f"testsrc2=size={w}x{h}:rate=1", "-vf",
                                 f"noise=alls=12:allf=t:all_seed={variant + 1}",
                                 "-frames:v", "1", "-q:v", "3", str(path)], check=True)
        items.append((f"photo {w}x{h}", "image", path))
    for w, h, seconds in ((640, 360, 3), (854, 480, 5)):
        path = scratch / f"clip-{w}x{h}-{seconds}s-{variant}.mp4"
        subprocess.run(ffmpeg + [f"testsrc2=size={w}x{h}:rate=30", "-t", str(seconds), "-vf",
                                 f"noise=alls=6:allf=t:all_seed={variant + 1}", "-c:v",
                                 "libx264", "-preset", "veryfast", "-crf", "28", "-pix_fmt",
                                 "yuv420p", str(path)], check=True)
        items.append((f"clip {w}x{h} {seconds} s", "video", path))
    return items


def request_body(model: str, kind: str, path: Path, stream: bool) -> bytes:
    mime = "image/jpeg" if kind == "image" else "video/mp4"
    url = f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"
    key = "image_url" if kind == "image" else "video_url"
    body = {"model": model, "temperature": 0, "max_tokens": 2 if stream else 1,
            "messages": [{"role": "user", "content": [{"type": key, key: {"url": url}},
                                                      {"type": "text", "text": "What is this?"}]}]}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def send(port: int, body: bytes) -> tuple[int, float | None]:
    """Status and, for a streamed answer, seconds to its first token."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = connection.getresponse()
    first = None
    if response.status == 200 and "text/event-stream" in (response.getheader("content-type") or ""):
        for line in response:
            if first is None and line.startswith(b"data:") and b'"content":"' in line \
                    and b'"content":""' not in line:
                first = time.perf_counter() - started
        first = first if first is not None else time.perf_counter() - started
    else:
        response.read()
    connection.close()
    return response.status, first


def descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def total_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except OSError:
            pass
    return total


class Target:
    def __init__(self, label: str, port: int, model: str):
        self.label, self.port, self.model = label, port, model


def closed_loop(target: Target, items, relay, processes) -> dict:
    bodies = [request_body(target.model, kind, path, False) for _, kind, path in items]
    statuses, lock, next_index = [], threading.Lock(), [0]

    def client():
        while True:
            with lock:
                if next_index[0] >= len(bodies):
                    return
                body = bodies[next_index[0]]
                next_index[0] += 1
            status, _ = send(target.port, body)
            with lock:
                statuses.append(status)

    cpu0 = {name: total_cpu(pids) for name, pids in processes.items()}
    sent0 = relay.sent
    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    time.sleep(0.3)  # the relay's last bytes, the processes' last accounting
    return {"elapsed": elapsed, "ok": sum(s == 200 for s in statuses), "n": len(bodies),
            "cpu": {name: total_cpu(pids) - cpu0[name] for name, pids in processes.items()},
            "bytes": relay.sent - sent0}


def summed(passes: list[dict]) -> dict:
    """One target's closed-loop passes as rates and per-request costs."""
    n = sum(p["n"] for p in passes)
    return {"rps": n / sum(p["elapsed"] for p in passes), "ok": sum(p["ok"] for p in passes),
            "n": n, "bytes": sum(p["bytes"] for p in passes) / n,
            "cpu": {name: sum(p["cpu"][name] for p in passes) / n for name in passes[0]["cpu"]}}


def open_loop(target: Target, items) -> dict:
    bodies = [request_body(target.model, kind, path, True) for _, kind, path in items]
    ttfts, statuses, lock, threads = [], [], threading.Lock(), []

    def one(body):
        status, ttft = send(target.port, body)
        with lock:
            statuses.append(status)
            if status == 200 and ttft is not None:
                ttfts.append(ttft)

    started = time.perf_counter()
    for i in range(OPEN_REQUESTS):
        delay = started + i / RATE - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(bodies[i % len(bodies)],))
        thread.start()
        threads.append(thread)
    for t in threads:
        t.join()
    ttfts.sort()
    p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))] if ttfts else float("nan")
    return {"p50": statistics.median(ttfts) if ttfts else float("nan"), "p99": p99,
            "ok": sum(s == 200 for s in statuses), "n": OPEN_REQUESTS}


def main() -> None:
    print(f"# {cpu_name()}")
    os.sched_setaffinity(0, GATEWAY_CPUS)
    if not (VENV / "bin/python").exists():
        sys.exit(f"no engine venv at {VENV}: ./dev test installs it")
    in_scratch("fronting", run)


def run(scratch: Path) -> None:
    # The warm-up's media, each pass's, and the open loop's (two variants: it sends 12 requests).
    variants = [make_media(scratch, v) for v in range(PASSES + 3)]
    items = variants[0]
    engine_dir, weightless = model_dirs(scratch, scratch / "cache", MAX_PIXELS)
    vllm_port = free_port()
    store = scratch / "ec"
    transfer = json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
                           "ec_connector_extra_config": {"shared_storage_path": str(store)}})
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, ENGINE_CPUS))}
    pin = ["taskset", "-c", ",".join(map(str, ENGINE_CPUS))]
    vllm = subprocess.Popen(pin + [str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(engine_dir), "--dtype", "float32", "--max-model-len",
                             str(MAX_MODEL_LEN), "--enable-mm-embeds",
                             "--ec-transfer-config", transfer,
                             # The workload repeats its items; a real one does not: no request
                             # may be served from an earlier one's processing or prefill.
                             "--mm-processor-cache-gb", "0", "--no-enable-prefix-caching",
                             "--host", "127.0.0.1",
                             "--port", str(vllm_port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    gateway = None
    try:
        wait_healthy(f"http://127.0.0.1:{vllm_port}/health", vllm, "vLLM")
        relay = CountingRelay(vllm_port)
        config = scratch / "mmgate.toml"
        upstream = f'upstreams = ["127.0.0.1:{relay.port}"]\nupstream_model = "{engine_dir}"\n'
        config.write_text(
            f'[limits]\nmax_body_bytes = 268435456\n\n'
            f'[[models]]\nname = "forward"\n{upstream}\n'
            f'[[models]]\nname = "preprocess"\n{upstream}media = "preprocess"\npath = "{weightless}"\n'
            f'max_model_len = {MAX_MODEL_LEN}\n\n'
            f'[[models]]\nname = "embed"\n{upstream}media = "embed"\npath = "{engine_dir}"\n'
            f'max_model_len = {MAX_MODEL_LEN}\n\n'
            f'[[models]]\nname = "ec"\n{upstream}media = "ec"\npath = "{engine_dir}"\n'
            f'ec_storage = "{store}"\nec_dtype = "float32"\nmax_model_len = {MAX_MODEL_LEN}\n')
        port = free_port()
        gateway = subprocess.Popen(["taskset", "-c", ",".join(map(str, GATEWAY_CPUS)),
                                    str(MMGATE), "serve", "--config", str(config), "--listen",
                                    f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        wait_healthy(f"http://127.0.0.1:{port}/health", gateway, "mmgate")
        processes = {"vLLM frontend": [vllm.pid], "vLLM engine": descendants(vllm.pid),
                     "mmgate": [gateway.pid]}
        targets = [Target("vLLM alone", relay.port, str(engine_dir))] + \
            [Target(f"mmgate {mode}", port, mode) for mode in ("forward", "preprocess", "embed", "ec")]
        for target in targets:  # warm-up: every path compiled, cached, loaded
            for _, kind, path in items:
                send(target.port, request_body(target.model, kind, path, False))
        passes = {target.label: [] for target in targets}
        for n in range(PASSES):  # interleaved: a drift in the machine touches every target alike
            for target in targets:
                passes[target.label].append(
                    closed_loop(target, variants[1 + n], relay, processes))
        opened = variants[PASSES + 1] + variants[PASSES + 2]
        rows = [(target.label, summed(passes[target.label]), open_loop(target, opened))
                for target in targets]
    finally:
        for child in (gateway, vllm):
            if child is not None:
                try:
                    os.killpg(child.pid, 9) if child is vllm else child.kill()
                except OSError:
                    pass
                child.wait()

    print(f"# workload: {', '.join(label for label, _, _ in items)}; closed loop at concurrency "
          f"{CONCURRENCY} ({PASSES} interleaved passes), open loop at {RATE} requests/s "
          f"({OPEN_REQUESTS}); vLLM on CPU {ENGINE_CPUS}, mmgate and the clients on {GATEWAY_CPUS}")
    print(f"{'target':20} {'ok':>7} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'frontend CPU s/req':>19} {'engine CPU s/req':>17} {'mmgate CPU s/req':>17} "
          f"{'bytes up/req':>13}")
    for label, closed, opened in rows:
        cpu = closed["cpu"]
        print(f"{label:20} {closed['ok']:>3}/{closed['n']:<3} {closed['rps']:7.2f} "
              f"{opened['p50']:8.2f}s {opened['p99']:8.2f}s {cpu['vLLM frontend']:19.3f} "
              f"{cpu['vLLM engine']:17.3f} {cpu['mmgate']:17.3f} {closed['bytes']:13,.0f}")
    base = rows[0][1]
    for label, closed, opened in rows[1:]:
        frontend = closed["cpu"]["vLLM frontend"] / max(base["cpu"]["vLLM frontend"], 1e-9)
        print(f"{label}: throughput {closed['rps'] / base['rps']:.2f}x vLLM alone, TTFT p50 "
              f"{opened['p50'] / rows[0][2]['p50']:.2f}x, vLLM frontend CPU per request "
              f"{frontend:.2f}x, bytes upstream {closed['bytes'] / max(base['bytes'], 1):.2f}x")


if __name__ == "__main__":
    main()

"""P13, the native inference core vs vLLM's CPU build, on the same Qwen2-VL-2B-shaped checkpoint
with random bf16 weights (made once by bench/checkpoint_2b.py and kept in
~/.cache/mmgate/bench-models), both served over HTTP and measured by the same client, one after
the other, each with every core of the machine:

  - prefill: a ~2k-token prompt (a 448x448 image, 256 tokens, and text), max_tokens 1: prompt
    tokens per second of the whole request (the image's preprocessing and encoding included), best
    of ROUNDS, a new image and text each round so that nothing is served from a cache;
  - decode at batch 1 and 8: that many short requests at once, with max_tokens 1 and then
    DECODE_TOKENS + 1 (ignore_eos): the extra tokens over the extra time, best of ROUNDS.

vLLM runs with the checkpoint's own dtype (bf16) or, with `--vllm-dtype float32`, upcast: on CPUs
without AVX-512 bf16 its bf16 linears fall back to a slow path and float32 may be its faster one.
On CPUs with AVX-512 bf16 the native core is measured twice: as configured by default (bf16
weights, f32 activations) and with `cpu_bf16_inputs` (its linears' inputs rounded to bf16, as
vLLM's bf16 linears compute).
Prefix caching and its processor cache are off. Goal (issue 62): the native core >= vLLM on both.

Run from the repository root after `cargo build --release -p mmgate-gateway` (./dev bench does it).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from machine import cpu_name
from upstream import MMGATE, VENV, free_port, in_scratch, model_dirs, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = Path.home() / ".cache/mmgate/bench-models/qwen2-vl-2b-random-v1"
PROMPT_TOKENS = 2048
IMAGE_SIDE = 448  # 16x16 merged patches: 256 tokens
# What a prompt holds besides its text: the image's tokens, its markers and the chat template.
NON_TEXT_TOKENS = 300
DECODE_TOKENS = 16
ROUNDS = 2
MAX_MODEL_LEN = 4096
WORDS = "garden river window yellow stone cloud market bridge lantern forest".split()


def checkpoint(scratch: Path) -> Path:
    if not (CHECKPOINT / "model.safetensors.index.json").exists():
        engine_dir, _ = model_dirs(scratch, scratch / "cache")
        CHECKPOINT.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(VENV / "bin/python"), str(ROOT / "bench/checkpoint_2b.py"),
                        str(engine_dir), str(CHECKPOINT)], check=True)
    return CHECKPOINT


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def image(scratch: Path, seed: int) -> str:
    path = scratch / f"image-{seed}.jpg"
    subprocess.run(["ffmpeg", "-hide_banner", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    f"testsrc2=size={IMAGE_SIDE}x{IMAGE_SIDE}:rate=1", "-ss", str(seed),
                    "-frames:v", "1", str(path)], check=True)
    return "data:image/jpeg;base64," + base64.b64encode(path.read_bytes()).decode()


def prefill(port: int, model: str, scratch: Path, seed: int, chars: int) -> tuple[int, float]:
    """(prompt tokens, seconds) of one image prompt answered with one token."""
    text = " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] + str(i % 10) for i in range(chars))
    body = {"model": model, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image(scratch, seed)}},
        {"type": "text", "text": text[:chars]}]}]}
    started = time.perf_counter()
    answer = post(port, body)
    return answer["usage"]["prompt_tokens"], time.perf_counter() - started


def burst(port: int, model: str, batch: int, tokens: int) -> tuple[float, int]:
    """Seconds for `batch` short requests at once, and the tokens they generated."""
    counts: list[int] = []

    def one(i: int) -> None:
        body = {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Question {i}: what is new today?"}]}
        counts.append(post(port, body)["usage"]["completion_tokens"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(counts) != batch:
        raise RuntimeError(f"{batch - len(counts)} of {batch} requests failed")
    return time.perf_counter() - started, sum(counts)


def measure(port: int, model: str, scratch: Path) -> dict:
    burst(port, model, 1, 2)  # warm-up
    # The text's length for a PROMPT_TOKENS prompt, from one measured prompt.
    tokens, _ = prefill(port, model, scratch, 100, 1000)
    chars = int(1000 * (PROMPT_TOKENS - NON_TEXT_TOKENS) / max(tokens - NON_TEXT_TOKENS, 1))
    prefills = [prefill(port, model, scratch, seed, chars) for seed in range(ROUNDS)]
    result = {"prompt_tokens": prefills[0][0],
              "prefill": max(tokens / seconds for tokens, seconds in prefills)}
    for batch in (1, 8):
        rates = []
        for _ in range(ROUNDS):
            short, short_tokens = burst(port, model, batch, 1)
            long, long_tokens = burst(port, model, batch, DECODE_TOKENS + 1)
            if long_tokens != batch * (DECODE_TOKENS + 1):
                raise RuntimeError(f"{model}: {long_tokens} tokens where "
                                   f"{batch * (DECODE_TOKENS + 1)} were asked")
            rates.append((long_tokens - short_tokens) / max(long - short, 1e-9))
        result[f"decode{batch}"] = max(rates)
    return result


def native(scratch: Path, model_dir: Path, bf16_inputs: bool = False) -> dict:
    config = scratch / "native.toml"
    cores = os.cpu_count() or 1
    config.write_text(f'[limits]\nmax_body_bytes = 268435456\n\n[[models]]\nname = "native"\n'
                      f'path = "{model_dir}"\nmax_model_len = {MAX_MODEL_LEN}\n'
                      f'cpu_bf16_inputs = {str(bf16_inputs).lower()}\n'
                      # The vision tower on every core, as vLLM's: a prefill waits for it.
                      f'encoder_devices = [{{ threads = {cores} }}]\n')
    port = free_port()
    server = subprocess.Popen([str(MMGATE), "serve", "--config", str(config), "--listen",
                               f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server, "mmgate")
        return measure(port, "native", scratch)
    finally:
        server.kill()
        server.wait()


def vllm(scratch: Path, model_dir: Path, dtype: str) -> dict:
    port = free_port()
    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4",
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
    server = subprocess.Popen([str(VENV / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                               "--model", str(model_dir), "--served-model-name", "vllm",
                               "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
                               # Prefills in chunks of 512 tokens, as the native core's; its
                               # start-up dummy run is one chunk.
                               "--max-num-batched-tokens", "512",
                               "--max-num-seqs", "8", "--limit-mm-per-prompt",
                               '{"image": 1, "video": 0}', "--skip-mm-profiling",
                               "--mm-processor-cache-gb", "0", "--no-enable-prefix-caching",
                               "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        # Its start-up runs a dummy batch through the model: minutes on a small CPU.
        wait_healthy(f"http://127.0.0.1:{port}/health", server, "vLLM", 1800)
        return measure(port, "vllm", scratch)
    finally:
        try:
            os.killpg(server.pid, 9)
        except OSError:
            pass
        server.wait()


def cpu_features() -> str:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
    return " ".join(f"{f}{'+' if f in flags else '-'}" for f in wanted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-dtype", action="append", choices=["bfloat16", "float32"],
                        help="vLLM's dtype (repeatable; default bfloat16, the checkpoint's)")
    args = parser.parse_args()
    print(f"# {cpu_name()}; {cpu_features()}", flush=True)
    if not (VENV / "bin/python").exists():
        sys.exit(f"no engine venv at {VENV}: ./dev test installs it")
    in_scratch("core", lambda scratch: run(scratch, args.vllm_dtype or ["bfloat16"]))


def run(scratch: Path, dtypes: list[str]) -> None:
    model_dir = checkpoint(scratch)
    print(f"# Qwen2-VL-2B-shaped random checkpoint (bf16), a ~{PROMPT_TOKENS}-token image prompt, "
          f"{DECODE_TOKENS} tokens decoded, best of {ROUNDS}")
    print(f"{'engine':22} {'prompt':>7} {'prefill tok/s':>14} {'decode b1 tok/s':>16} "
          f"{'decode b8 tok/s':>16}", flush=True)
    rows = []
    engines = [("mmgate native (bf16)", lambda: native(scratch, model_dir))]
    if "avx512_bf16+" in cpu_features():
        # Its prefill and vision tower as bf16 GEMMs (inputs rounded to bf16, as vLLM's bf16 and
        # the CUDA backend's linears): what the CPU's AVX-512 BF16 buys.
        engines.append(("native, bf16 GEMMs", lambda: native(scratch, model_dir, True)))
    engines += [(f"vLLM CPU ({dtype})", lambda dtype=dtype: vllm(scratch, model_dir, dtype))
                for dtype in dtypes]
    for label, measured in engines:
        r = measured()
        rows.append((label, r))
        print(f"{label:22} {r['prompt_tokens']:7} {r['prefill']:14.1f} {r['decode1']:16.2f} "
              f"{r['decode8']:16.2f}", flush=True)
    natives = [row for row in rows if not row[0].startswith("vLLM")]
    for ours_label, ours in natives:
        for label, r in rows[len(natives):]:
            print(f"{ours_label} vs {label}: prefill {ours['prefill'] / r['prefill']:.2f}x, decode "
                  f"batch 1 {ours['decode1'] / r['decode1']:.2f}x, "
                  f"batch 8 {ours['decode8'] / r['decode8']:.2f}x")


if __name__ == "__main__":
    main()

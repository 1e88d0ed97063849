#!/usr/bin/env python3
"""The CUDA backend vs PyTorch eager on the same bf16 weights, on one GPU machine, in one run
(the GPU check runs it: the bundle's run.sh, see `./dev gpu-bundle`; never run in this project's
CI, which has no GPU).

A random Qwen2-VL checkpoint of the 2B model's shapes is made once (bf16, ~4.4 GB, cached), then:
  - PyTorch eager (transformers, bf16, cuda:0): the vision tower on one 1280x960 image (68x92
    patches), the LLM's prefill of 1024 tokens, its decode per token (64 tokens, KV cache);
  - mmgate (`cargo bench --bench gpu`): the same three on the CUDA backend;
and the ratios (PyTorch time / mmgate time: above 1 means mmgate is faster) are printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

MODEL = Path(os.environ.get("MMGATE_GPU_BENCH_MODEL", Path.home() / ".cache/mmgate/gpu-bench-qwen2-vl-2b"))
GRID = torch.tensor([[1, 68, 92]])
PROMPT, DECODE = 1024, 64


def make_model() -> None:
    if (MODEL / "config.json").exists():
        return
    config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4,
                           hidden_act="quick_gelu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(MODEL, safe_serialization=True)


def timed(fn, rounds: int, warmup: int) -> float:
    times = []
    for i in range(warmup + rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def torch_times() -> dict:
    model = Qwen2VLForConditionalGeneration.from_pretrained(MODEL, dtype=torch.bfloat16).to("cuda:0").eval()
    patches = int(GRID.prod())
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, dtype=torch.bfloat16, device="cuda:0")
    grid = GRID.to("cuda:0")
    ids = torch.arange(PROMPT, device="cuda:0").unsqueeze(0) * 7919 % model.config.text_config.vocab_size
    with torch.no_grad():
        vision = timed(lambda: model.model.get_image_features(pixels, grid), rounds=10, warmup=2)
        prefill = timed(lambda: model(input_ids=ids, logits_to_keep=1), rounds=5, warmup=1)
        generate = timed(
            lambda: model.generate(input_ids=ids, max_new_tokens=DECODE + 1, min_new_tokens=DECODE + 1, do_sample=False),
            rounds=3,
            warmup=1,
        )
    return {"vision_ms": vision, "prefill_ms": prefill, "decode_ms_per_token": (generate - prefill) / DECODE}


def mmgate_times() -> dict:
    # The GPU bundle carries the benchmark built (no Rust where it runs); elsewhere cargo builds it.
    built = os.environ.get("MMGATE_GPU_BENCH_BIN")
    command = [built] if built else ["cargo", "bench", "--locked", "-q", "-p", "mmgate-inference", "--bench", "gpu", "--"]
    out = subprocess.run(command + [str(MODEL)], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA GPU visible to PyTorch; this benchmark needs one")
    make_model()
    ours, theirs = mmgate_times(), torch_times()
    print(f"device: {ours['device']}; PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    print(f"{'':28} {'PyTorch eager':>14} {'mmgate':>10} {'ratio':>7}")
    rows = [("vision_ms", "vision tower, 1280x960 (ms)"), ("prefill_ms", f"prefill {PROMPT} tokens (ms)"),
            ("decode_ms_per_token", "decode per token (ms)")]
    for key, label in rows:
        print(f"{label:28} {theirs[key]:14.2f} {ours[key]:10.2f} {theirs[key] / ours[key]:6.2f}x")
    # One JSON line last, for whoever collects the numbers (the GPU bundle's report).
    print(json.dumps({"pytorch": theirs, "mmgate": ours, "gpu": torch.cuda.get_device_name(0)}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Image preprocessing throughput, one core each, all measured in this run:

  - the built-in image plugin through the host (wasm, fresh sandbox per call: probe + plan + preprocess)
  - the same plugin code built natively
  - HF transformers' PIL-backend ("slow") Qwen2-VL processor: PIL decode + processor
  - HF transformers' torchvision-backend ("fast") Qwen2-VL processor: PIL decode + processor

on a 1280x960 and a 4032x3024 JPEG (generated here, quality 90), Qwen2-VL's shipped config.
Run from the repository root:  ./dev bench   (or python bench/image.py with the reference venv).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One core for everyone: set before torch/numpy load their thread pools.
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "image"
sys.path.insert(0, str(FIXTURES))
from generate import scene  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor  # noqa: E402

torch.set_num_threads(1)
CONFIG = FIXTURES / "configs" / "qwen2-vl.json"
SIZES = [(1280, 960), (4032, 3024)]


def median_ms(fn, iterations: int) -> float:
    fn()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return float(np.median(samples))


def hf_ms(processor, data: bytes, iterations: int) -> float:
    def run():
        image = Image.open(io.BytesIO(data))
        image.load()
        processor(images=image, return_tensors="pt")

    return median_ms(run, iterations)


def rust_json(cmd: list[str], cwd: Path) -> dict:
    out = subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    config = {k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "image_processor_type"}
    slow = Qwen2VLImageProcessorPil(**config)
    fast = Qwen2VLImageProcessor(**config)
    # Build both Rust sides first so no timing includes compilation.
    subprocess.run(["cargo", "build", "--release", "--locked", "--example", "native_bench"],
                   cwd=ROOT / "plugins", check=True)
    subprocess.run(["cargo", "bench", "--locked", "-p", "mmgate-host", "--bench", "image_plugin",
                    "--no-run"], cwd=ROOT, check=True)
    native_bin = ROOT / "plugins" / "target" / "release" / "examples" / "native_bench"

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for width, height in SIZES:
            path = Path(tmp) / f"photo-{width}x{height}.jpg"
            Image.fromarray(scene(width, height, 99), "RGB").save(path, quality=90)
            data = path.read_bytes()
            iterations = 30 if width < 2000 else 8
            wasm = rust_json(["cargo", "bench", "--locked", "-q", "-p", "mmgate-host", "--bench",
                              "image_plugin", "--", str(path), str(CONFIG), str(iterations)], ROOT)
            native = rust_json([str(native_bin), str(path), str(CONFIG), str(iterations)], ROOT)
            rows.append({
                "image": f"{width}x{height} JPEG ({len(data) // 1024} KiB)",
                "tokens": wasm["tokens"],
                "wasm": wasm["wasm_ms_median"],
                "native": native["native_ms_median"],
                "hf_slow": hf_ms(slow, data, max(3, iterations // 3)),
                "hf_fast": hf_ms(fast, data, iterations),
            })

    print()
    print(f"{'image':<28} {'tokens':>6} {'plugin (wasm)':>14} {'native':>9} {'HF slow':>9} {'HF fast':>9}"
          f" {'vs slow':>8} {'vs fast':>8} {'wasm/native':>12}")
    for r in rows:
        ips = lambda ms: 1e3 / ms  # noqa: E731
        print(f"{r['image']:<28} {r['tokens']:>6} {ips(r['wasm']):>10.1f}/s  {ips(r['native']):>7.1f}/s"
              f" {ips(r['hf_slow']):>7.2f}/s {ips(r['hf_fast']):>7.2f}/s"
              f" {r['hf_slow'] / r['wasm']:>7.1f}x {r['hf_fast'] / r['wasm']:>7.2f}x"
              f" {r['wasm'] / r['native']:>11.2f}")
    print("\nimages/s on one core (medians); 'vs slow'/'vs fast': plugin speed-up over HF's PIL/torchvision"
          " processors; goals: >= 10x slow, >= 1.5x fast, wasm/native <= 1.3")


if __name__ == "__main__":
    main()

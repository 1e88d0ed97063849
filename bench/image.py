#!/usr/bin/env python3
"""Image preprocessing throughput, one core each, all measured in this run:

  - the built-in image plugin through the host (wasm, fresh sandbox per call: probe + plan + preprocess;
    its output is u8 samples plus their normalisation table, which the encoder expands to f32 a block
    of patches at a time as it embeds them; expanding it all at once is timed too and printed beside,
    for comparing with HF's floats, which are all expanded)
  - smg's `llm-multimodal` 1.14.0 (crates.io), the fastest Rust peer: libjpeg-turbo decode (when the
    library is installed) and its Qwen2-VL processor, built by bench/peer, its thread pool off
  - the same plugin code built natively (plugin code only: no u8 -> f32 mapping; no host, so the
    JPEG is decoded by the plugin's own decoder; the resize runs the AVX2 kernels the host runs)
  - HF transformers' PIL-backend ("slow") Qwen2-VL processor: PIL decode + processor
  - HF transformers' torchvision-backend ("fast") Qwen2-VL processor: PIL decode + processor

on a 1280x960 and a 4032x3024 JPEG (generated here, quality 90), Qwen2-VL's shipped config.
Run from the repository root:  ./dev bench   (or python bench/image.py with the reference venv).
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

from machine import cpu_name
from common import ROOT, build_rust_sides, median_ms, native_ms, peer_ms, wasm_ms  # sets one thread first

import torch  # noqa: E402
from PIL import Image  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "image"
sys.path.insert(0, str(FIXTURES))
from generate import scene  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor  # noqa: E402

torch.set_num_threads(1)
CONFIG = FIXTURES / "configs" / "qwen2-vl.json"
SIZES = [(1280, 960), (4032, 3024)]


def hf_ms(processor, data: bytes, iterations: int) -> float:
    def run():
        image = Image.open(io.BytesIO(data))
        image.load()
        processor(images=image, return_tensors="pt")

    return median_ms(run, iterations)


def main() -> None:
    print(f"# {cpu_name()}")
    config = {k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "image_processor_type"}
    slow = Qwen2VLImageProcessorPil(**config)
    fast = Qwen2VLImageProcessor(**config)
    build_rust_sides()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for width, height in SIZES:
            path = Path(tmp) / f"photo-{width}x{height}.jpg"
            Image.fromarray(scene(width, height, 99), "RGB").save(path, quality=90)
            data = path.read_bytes()
            iterations = 30 if width < 2000 else 8
            wasm = wasm_ms("image", path, CONFIG, iterations)
            native = native_ms("image", path, CONFIG, iterations)
            peer = peer_ms(path, CONFIG, iterations)
            if peer["tokens"] != wasm["tokens"]:
                sys.exit(f"the peer planned {peer['tokens']} tokens, the plugin {wasm['tokens']}")
            rows.append({
                "image": f"{width}x{height} JPEG ({len(data) // 1024} KiB)",
                "tokens": wasm["tokens"],
                "wasm": wasm["wasm_ms_median"],
                "expand": wasm["expand_ms_median"],
                "expand_blocks": wasm["expand_blocks_ms_median"],
                "native": native["native_ms_median"],
                "peer": peer["peer_ms_median"],
                "turbojpeg": peer["turbojpeg"],
                "jpeg_decode": wasm.get("jpeg_decode_ms_median"),
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
    for r in rows:
        with_expand = r["wasm"] + r["expand_blocks"]
        print(f"{r['image']}: u8 -> f32 expanded whole into fresh memory {r['expand']:.1f} ms, a block at"
              f" a time as the encoder does {r['expand_blocks']:.1f} ms; plugin + expansion"
              f" {1e3 / with_expand:.1f}/s, {r['hf_slow'] / with_expand:.1f}x slow, {r['hf_fast'] / with_expand:.2f}x fast")
    for r in rows:
        print(f"{r['image']}: llm-multimodal {1e3 / r['peer']:.1f}/s ({r['peer']:.1f} ms"
              f"{', libjpeg-turbo' if r['turbojpeg'] else ', no libjpeg-turbo: image crate decode'});"
              f" plugin (wasm) {r['peer'] / r['wasm']:.2f}x the peer, native {r['peer'] / r['native']:.2f}x")
    for r in rows:
        # Both sides decode with libjpeg-turbo: a processor that did nothing after the decode would
        # take its time alone, which bounds any ratio to the peer.
        if r["jpeg_decode"] and r["turbojpeg"]:
            print(f"{r['image']}: libjpeg-turbo's decode alone {r['jpeg_decode']:.1f} ms"
                  f" ({r['jpeg_decode'] / r['wasm']:.0%} of the plugin's call): at most"
                  f" {r['peer'] / r['jpeg_decode']:.2f}x the peer with nothing after it")
    print("\nimages/s on one core (medians); 'vs slow'/'vs fast': plugin speed-up over HF's PIL/torchvision"
          " processors; goals: >= 10x slow, >= 1.5x fast, wasm/native <= 1.3, >= 1.0x the peer (1.5x the aim)")


if __name__ == "__main__":
    main()

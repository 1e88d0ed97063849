#!/usr/bin/env python3
"""transformers itself on this machine's GPU, on the tiny parity checkpoints: each family's prompts
(tests/fixtures/models/*/goldens.safetensors: the inputs and the prefill logits transformers made of
them on the CPU) run again on `cuda:0` in f32, and how far those logits are from the stored ones.

The GPU check's parity steps compare mmgate's CUDA backend with the same stored logits; with this
step's numbers they bound how far mmgate on the GPU is from transformers on the same GPU.

    python3 gpu-check/transformers_on_gpu.py [--device cpu]   # prints a line per prompt, then JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(os.environ.get("MMGATE_REPO", Path(__file__).resolve().parent.parent))
FIXTURES = REPO / "tests/fixtures/models"
IMAGE_TOKEN, VIDEO_TOKEN = 500, 501


def model_class(family: str):
    import transformers

    return {
        "qwen2-vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3-vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen2-audio": transformers.Qwen2AudioForConditionalGeneration,
    }[family]


def prompts(family: str, g: dict) -> dict:
    """Each stored prompt's model inputs, as the fixtures' scripts made them."""
    if family == "qwen2-audio":
        return {"audio_prompt": dict(input_features=g["audio.input_features"],
                                     feature_attention_mask=g["audio.feature_attention_mask"])}
    video = dict(pixel_values_videos=g["video.pixel_values"], video_grid_thw=g["video.grid_thw"])
    if "video.second_per_grid_ts" in g:
        video["second_per_grid_ts"] = g["video.second_per_grid_ts"]
    return {
        "image_prompt": dict(pixel_values=g["image.pixel_values"], image_grid_thw=g["image.grid_thw"]),
        "video_prompt": video,
    }


def relative_error(ours: torch.Tensor, want: torch.Tensor) -> float:
    return float((ours - want).abs().max() / want.abs().max())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU visible to PyTorch", file=sys.stderr)
        return 2
    report = {"device": args.device, "torch": torch.__version__, "prompts": {}}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
        # f32 as the goldens were made: no TF32 in matmuls or convolutions.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    worst = 0.0
    for family in ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen2-audio"]:
        g = load_file(str(FIXTURES / family / "goldens.safetensors"))
        model = model_class(family).from_pretrained(FIXTURES / family / "model", dtype=torch.float32)
        model = model.to(args.device).eval()
        for key, media in prompts(family, g).items():
            ids = g[f"{key}.input_ids"].reshape(1, -1)
            inputs = {k: v.to(args.device) for k, v in media.items()}
            if family != "qwen2-audio":
                types = torch.zeros_like(ids, dtype=torch.int32)
                types[ids == IMAGE_TOKEN] = 1
                types[ids == VIDEO_TOKEN] = 2
                inputs["mm_token_type_ids"] = types.to(args.device)
            with torch.no_grad():
                logits = model(input_ids=ids.to(args.device), **inputs).logits[0].float().cpu()
            rows = g[f"{key}.logit_rows"].long()
            error = relative_error(logits[rows], g[f"{key}.logits"])
            worst = max(worst, error)
            report["prompts"][f"{family}/{key}"] = error
            print(f"{family}/{key}: transformers on {args.device} vs its CPU logits: relative error {error:.2e}")
        del model
    report["worst"] = worst
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A Qwen2-VL-2B-shaped checkpoint with seeded random bf16 weights, for P13 (bench/core.py).

    ENGINE_VENV/bin/python bench/checkpoint_2b.py DEMO_DIR OUT_DIR

Run with the engine venv (tests/fixtures/engine/requirements.txt pins torch, transformers and
safetensors). DEMO_DIR is mmgate's demo Qwen2-VL checkpoint as bench/upstream.py's `model_dirs`
prepares it for vLLM: its tokenizer, chat template and processor config are copied (a small byte
BPE whose ids all lie below the 2B vocabulary, and the same special-token ids), and config.json
gets Qwen2-VL-2B-Instruct's shapes: a 1.5B LLM (28 layers of 1536, 12 heads, 2 KV heads, MLP 8960,
vocabulary 151 936, tied embeddings) and its 675M vision tower (32 blocks of 1280, 16 heads).
The weights are random: what is measured is speed, never what the model says. About 4.4 GB, in
shards of at most 2 GB, written to OUT_DIR.tmp and renamed when whole.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

SEED = 20261129
SHARD_BYTES = 2 << 30

TEXT = {
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}
VISION = {
    "depth": 32,
    "embed_dim": 1280,
    "hidden_size": 1536,
    "mlp_ratio": 4,
    "num_heads": 16,
}


def main(demo: Path, out: Path) -> None:
    partial = out.with_name(out.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(demo, partial, ignore=shutil.ignore_patterns("*.safetensors", "config.json", "README.md"))
    config = json.loads((demo / "config.json").read_text())
    config["text_config"].update(TEXT)
    config["text_config"]["rope_parameters"]["mrope_section"] = [16, 24, 24]
    config["text_config"]["torch_dtype"] = "bfloat16"
    config["vision_config"].update(VISION)
    config["tie_word_embeddings"] = True
    config["torch_dtype"] = "bfloat16"
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # The parameters' names and shapes, from the model built without memory.
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**config))
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the embeddings

    generator = torch.Generator().manual_seed(SEED)
    shard, shard_bytes, index, count = {}, 0, {}, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, count
        if shard:
            count += 1
            name = f"model-{count:05d}.safetensors"
            save_file(shard, str(partial / name), metadata={"format": "pt"})
            index.update({key: name for key in shard})
            shard, shard_bytes = {}, 0

    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) >= 2:  # std 1/sqrt(fan_in): activations keep their scale through the layers
            fan_in = int(torch.tensor(shape[1:]).prod())
            value = torch.randn(shape, generator=generator) / fan_in**0.5
        elif name.endswith("weight"):  # norms
            value = torch.ones(shape)
        else:
            value = torch.randn(shape, generator=generator) * 0.02
        value = value.to(torch.bfloat16)
        if shard_bytes + value.nbytes > SHARD_BYTES:
            flush()
        shard[name] = value
        shard_bytes += value.nbytes
    flush()
    total = sum(2 * int(torch.tensor(s).prod()) for s in shapes.values())
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]))

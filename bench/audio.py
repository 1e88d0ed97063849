#!/usr/bin/env python3
"""Audio preprocessing throughput, one core each, all measured in this run:

  - the built-in audio plugin through the host (wasm, fresh sandbox per call: probe + plan + preprocess)
  - the same plugin code built natively
  - HF transformers' WhisperFeatureExtractor, numpy path (what runs without torch)
  - the same extractor's torch path (what runs when torch is installed)

on a 30 s and a 10 min clip of 16 kHz mono 16-bit WAV (generated here: a chirp under noise, so no
frame is silent), Qwen2-Audio's config (128 mel bins, 30 s chunks). The HF side includes reading the
WAV with soundfile and splitting it into 30 s chunks, as the plugin's timing includes decoding.
With ffmpeg on PATH, a third row times a 10 min 44.1 kHz stereo MP3: the plugin (decode, mix, resample)
against `librosa.load(sr=16000)` + the torch path.
Run from the repository root:  ./dev bench   (or python bench/audio.py with the reference venv).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from machine import cpu_name
from common import ROOT, build_rust_sides, median_ms, native_ms, wasm_ms  # sets one thread first

import librosa  # noqa: E402
import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import torch  # noqa: E402
from transformers.models.whisper import feature_extraction_whisper  # noqa: E402
from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor  # noqa: E402

torch.set_num_threads(1)
CONFIG = ROOT / "tests" / "fixtures" / "audio" / "configs" / "qwen2-audio.json"
SR = 16_000
CHUNK = 30 * SR


def clip(seconds: int, rate: int = SR, channels: int = 1) -> np.ndarray:
    t = np.arange(seconds * rate) / rate
    rng = np.random.default_rng(seconds)
    tone = 0.3 * np.sin(2 * np.pi * (200 * t + 20 * t * (t % 7)))
    out = np.stack([tone + rng.normal(0, 0.05, len(t)) for _ in range(channels)], axis=-1)
    return out[:, 0] if channels == 1 else out


def hf_ms(extractor: WhisperFeatureExtractor, path: Path, torch_path: bool, iterations: int,
          load=None) -> float:
    def run():
        if load is None:
            audio, _ = sf.read(path, dtype="float32")
        else:
            audio = load(path)
        chunks = [audio[i : i + CHUNK] for i in range(0, len(audio), CHUNK)]
        extractor(chunks, sampling_rate=SR, padding="max_length", return_attention_mask=True,
                  return_tensors="np")

    # transformers picks its path by whether torch is importable: switch it for the numpy runs.
    feature_extraction_whisper.is_torch_available = lambda: torch_path
    return median_ms(run, iterations)


# Rounds of each measurement, interleaved; each side's best median is reported.
ROUNDS = 3


def main() -> None:
    print(f"# {cpu_name()}")
    extractor = WhisperFeatureExtractor(feature_size=128)
    build_rust_sides()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = []
        for seconds in (30, 600):
            path = Path(tmp) / f"clip-{seconds}s.wav"
            sf.write(path, clip(seconds), SR, subtype="PCM_16")
            cases.append((f"{seconds // 60} min" if seconds >= 60 else f"{seconds} s", path, None,
                          20 if seconds < 60 else 3))
        if shutil.which("ffmpeg"):
            wav = Path(tmp) / "stereo-44k1.wav"
            mp3 = Path(tmp) / "stereo-44k1.mp3"
            sf.write(wav, clip(600, 44_100, 2), 44_100, subtype="PCM_16")
            subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(wav), "-b:a", "128k", str(mp3)],
                           check=True)
            cases.append(("10 min 44.1k stereo MP3", mp3,
                          lambda p: librosa.load(p, sr=SR, mono=True)[0], 3))

        for name, path, load, iterations in cases:
            # Interleaved rounds, the best median of each side: HF's torch path alone moved by half
            # between back-to-back runs of this script (10.5 vs 15.5 ms for the 30 s clip), more
            # than anything measured here, so one round of each is not a comparison.
            wasm, native, torch_ms = [], [], []
            for _ in range(ROUNDS):
                wasm.append(wasm_ms("audio", path, CONFIG, iterations))
                native.append(native_ms("audio", path, CONFIG, iterations)["native_ms_median"])
                torch_ms.append(hf_ms(extractor, path, True, iterations, load))
            rows.append({
                "clip": name,
                "tokens": wasm[0]["tokens"],
                "wasm": min(w["wasm_ms_median"] for w in wasm),
                "native": min(native),
                # The MP3 row's reference is librosa + torch; numpy is not run for it (decode-bound).
                "numpy": hf_ms(extractor, path, False, max(1, iterations // 3), load) if load is None else None,
                "torch": min(torch_ms),
            })

    print()
    print(f"{'clip':<24} {'tokens':>6} {'plugin (wasm)':>14} {'native':>9} {'HF numpy':>9} {'HF torch':>9}"
          f" {'vs numpy':>9} {'vs torch':>9} {'wasm/native':>12}")
    for r in rows:
        cps = lambda ms: 1e3 / ms  # noqa: E731
        numpy = f"{cps(r['numpy']):>7.2f}/s" if r["numpy"] else f"{'-':>9}"
        vs_numpy = f"{r['numpy'] / r['wasm']:>8.1f}x" if r["numpy"] else f"{'-':>9}"
        print(f"{r['clip']:<24} {r['tokens']:>6} {cps(r['wasm']):>10.2f}/s  {cps(r['native']):>7.2f}/s"
              f" {numpy} {cps(r['torch']):>7.2f}/s {vs_numpy} {r['torch'] / r['wasm']:>8.2f}x"
              f" {r['wasm'] / r['native']:>11.2f}")
    print(f"\nclips/s on one core (best of {ROUNDS} interleaved rounds' medians); 'vs numpy'/'vs torch': plugin speed-up over"
          " WhisperFeatureExtractor's numpy/torch paths; goals: >= 10x numpy, >= 2x torch,"
          " wasm/native <= 1.3")


if __name__ == "__main__":
    main()

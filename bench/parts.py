#!/usr/bin/env python3
"""One large item made whole vs in its plugin's parts (contract 0.4), plugin time only, in one run:
a 4032x3024 JPEG (Qwen2-VL's config: no resize, two bands of rows, the second entropy-decoding
the first's rows again), a 60 s 1080p H.264 video (Qwen2-VL's config at 2 fps: 60 temporal patches,
parts of 8) and a 10-minute 16 kHz PCM WAV (Qwen2-Audio's config: 20 chunks, two a part), through
the host.

For each: `preprocess` on one thread; every part on one thread, then on two (the parts taken in
order from a shared queue, as the gateway's plugin pool takes them); and the model for 8 and 16
cores, the list schedule of the parts' own one-thread times (what more cores give when the parts
do not slow each other down; the last part of a video, shorter, and the first, which also seeks,
set its tail). Prints the table and the ratios to the whole on one core.

Run from the repository root (./dev bench does): needs ffmpeg on PATH.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
ITERATIONS = 3
# The image takes a tenth of a second: more runs steady its median.
IMAGE_ITERATIONS = 8


def make_inputs(tmp: Path) -> list[tuple[str, str, Path, Path]]:
    video = tmp / "clip.mp4"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    "testsrc2=size=1920x1080:rate=30", "-t", "60", "-c:v", "libx264", "-preset",
                    "veryfast", "-crf", "30", "-g", "60", "-pix_fmt", "yuv420p", str(video)],
                   check=True)
    audio = tmp / "audio.wav"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    "aevalsrc=0.3*sin(2*PI*(200+20*mod(t\\,7))*t)+0.02*random(0):s=16000:d=600",
                    "-ac", "1", "-c:a", "pcm_s16le", str(audio)], check=True)
    photo = tmp / "photo.jpg"
    # A noisy test card at quality 2 (about 5 MB): a phone photo's size and entropy.
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    "testsrc2=size=4032x3024:rate=1,noise=alls=12:allf=t", "-frames:v", "1",
                    "-q:v", "2", "-pix_fmt", "yuvj420p", str(photo)], check=True)
    configs = ROOT / "tests" / "fixtures"
    return [
        ("4032x3024 JPEG", "image", photo, configs / "image" / "configs" / "qwen2-vl.json"),
        ("60 s 1080p video", "video", video, configs / "image" / "configs" / "qwen2-vl.json"),
        ("10 min 16 kHz WAV", "audio", audio, configs / "audio" / "configs" / "qwen2-audio.json"),
    ]


def main() -> None:
    print(f"# {cpu_name()}")
    subprocess.run(["cargo", "bench", "--locked", "-q", "-p", "mmgate-host", "--bench",
                    "plugin_parts", "--no-run"], cwd=ROOT, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for label, modality, path, config in make_inputs(Path(tmp)):
            out = subprocess.run(["cargo", "bench", "--locked", "-q", "-p", "mmgate-host",
                                  "--bench", "plugin_parts", "--", modality, str(path), str(config),
                                  str(IMAGE_ITERATIONS if modality == "image" else ITERATIONS)],
                                 cwd=ROOT, check=True, capture_output=True, text=True).stdout
            rows.append((label, json.loads(out.strip().splitlines()[-1])))
    print(f"plugin time, whole vs parts, median of {ITERATIONS} ({IMAGE_ITERATIONS} for the image) "
          "(ms; ratio to whole on 1 core)")
    print(f"{'':<18} {'parts':>5} {'whole':>8} {'parts 1 core':>14} {'parts 2 cores':>15} "
          f"{'model 8':>14} {'model 16':>14}")
    for label, r in rows:
        whole = r["whole_ms"]

        def cell(ms: float, width: int) -> str:
            return f"{ms:.0f} ({ms / whole:.2f}x)".rjust(width)

        print(f"{label:<18} {r['parts']:>5} {whole:>8.0f} {cell(r['parts_1_ms'], 14)} "
              f"{cell(r['parts_2_ms'], 15)} {cell(r['model_ms']['8'], 14)} "
              f"{cell(r['model_ms']['16'], 14)}")
        print(f"{'':<18} parts' own times: {', '.join(f'{ms:.0f}' for ms in r['part_ms'])}")
    if any(r["parts"] < 2 for _, r in rows):
        sys.exit("an item was made in one part: the plugins' parts are not in use")


if __name__ == "__main__":
    main()

"""The machine a benchmark runs on: no side effects on import (unlike `common`, which sets one
thread for numpy and torch)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_name() -> str:
    """The CPU this runs on and the vector units it has, for the first line of every benchmark:
    the machines this project runs on differ (AMX, AVX-512, AVX2 only)."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    units = [u for u in ("amx_tile", "avx512f", "avx2") if u in flags]
    return f"{model}, {os.cpu_count()} cores, {'+'.join(units) or 'no AVX2'}"

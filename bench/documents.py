#!/usr/bin/env python3
"""PDF pages rendered at a planned size, one core each, all measured in this run:

  - the built-in document plugin through the host (wasm, a fresh sandbox per call, as the gateway
    renders each page: the page drawn by hayro and encoded as the PNG the image plugin takes)
  - the same plugin code built natively: the page drawn alone, and drawn and encoded
  - pdfium (pypdfium2 5.15.2, FPDF_RenderPageBitmap at exactly that size)
  - MuPDF (PyMuPDF 2.0, get_pixmap with each axis scaled to that size)

on the document fixtures (tests/fixtures/documents: text, a photo, a vector slide, a rotated page,
a scanned page), each rendered with its long side LONG_SIDE pixels. Run from the repository root
with the fixtures' venv:  ./dev bench   (or python bench/documents.py with it).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_name
from common import ROOT, _last_json_line, median_ms  # sets one thread first

import pymupdf  # noqa: E402
import pypdfium2  # noqa: E402
import pypdfium2.raw as pdfium_c  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "documents"
PAGES = ["text", "photo", "slide", "rotated", "scanned"]
LONG_SIDE = 1024
ITERATIONS = 15


def planned_size(path: Path) -> tuple[int, int]:
    rect = pymupdf.open(path)[0].rect  # as shown, rotation applied
    scale = LONG_SIDE / max(rect.width, rect.height)
    return round(rect.width * scale), round(rect.height * scale)


def pdfium_ms(path: Path, width: int, height: int) -> float:
    pdf = pypdfium2.PdfDocument(str(path))
    page = pdf[0]

    def run():
        bitmap = pdfium_c.FPDFBitmap_Create(width, height, 0)
        pdfium_c.FPDFBitmap_FillRect(bitmap, 0, 0, width, height, 0xFFFFFFFF)
        pdfium_c.FPDF_RenderPageBitmap(bitmap, page.raw, 0, 0, width, height, 0, pdfium_c.FPDF_ANNOT)
        ctypes.string_at(pdfium_c.FPDFBitmap_GetBuffer(bitmap), 4)
        pdfium_c.FPDFBitmap_Destroy(bitmap)

    return median_ms(run, ITERATIONS)


def mupdf_ms(path: Path, width: int, height: int) -> float:
    doc = pymupdf.open(path)
    page = doc[0]
    rect = page.rect
    matrix = pymupdf.Matrix(width / rect.width, height / rect.height)
    return median_ms(lambda: page.get_pixmap(matrix=matrix, alpha=False), ITERATIONS)


def main() -> None:
    print(f"# {cpu_name()}")
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "mmgate-native-bench"],
                   cwd=ROOT / "plugins", check=True)
    subprocess.run(["cargo", "bench", "--locked", "-p", "mmgate-host", "--bench", "plugin_document",
                    "--no-run"], cwd=ROOT, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "plugins" / "target"))
    native = target / "release" / "mmgate-native-bench"
    rows = []
    for name in PAGES:
        path = FIXTURES / f"{name}.pdf"
        width, height = planned_size(path)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as config:
            json.dump({"mmgate_document_pages": [{"page": 1, "width": width, "height": height}]},
                      config)
            config.flush()
            wasm = _last_json_line(["cargo", "bench", "--locked", "-q", "-p", "mmgate-host",
                                    "--bench", "plugin_document", "--", "document", str(path),
                                    config.name, str(ITERATIONS)])
        here = _last_json_line([str(native), "document", str(path), f"{width}x{height}",
                                str(ITERATIONS)])
        row = {
            "page": name, "size": f"{width}x{height}",
            "wasm_render_png_ms": wasm["wasm_render_ms_median"],
            "native_render_ms": here["native_render_ms_median"],
            "native_render_png_ms": here["native_render_png_ms_median"],
            "pdfium_ms": pdfium_ms(path, width, height),
            "mupdf_ms": mupdf_ms(path, width, height),
            "probe_ms": wasm["probe_ms_median"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{'page':<8} {'size':>9} {'wasm+png':>9} {'native':>8} {'nat+png':>8} {'pdfium':>8} "
          f"{'MuPDF':>8}  wasm vs pdfium  wasm vs MuPDF  native vs pdfium  native vs MuPDF")
    for r in rows:
        print(f"{r['page']:<8} {r['size']:>9} {r['wasm_render_png_ms']:>9.2f} "
              f"{r['native_render_ms']:>8.2f} {r['native_render_png_ms']:>8.2f} "
              f"{r['pdfium_ms']:>8.2f} {r['mupdf_ms']:>8.2f}  "
              f"{r['pdfium_ms'] / r['wasm_render_png_ms']:>13.2f}x "
              f"{r['mupdf_ms'] / r['wasm_render_png_ms']:>13.2f}x "
              f"{r['pdfium_ms'] / r['native_render_ms']:>16.2f}x "
              f"{r['mupdf_ms'] / r['native_render_ms']:>15.2f}x")
    print("(ratios are pages per second relative to the peer: above 1x is faster than it)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Real-media JPEGs for bench/shuffle.py, made with Pillow: run in the benchmark's own virtualenv
(bench/.venv-media, bench/requirements-media.txt), never in the project's. Pillow is a benchmark
dependency only; this file imports nothing of atlasfs or of bench/.

    bench/.venv-media/bin/python bench/mediagen.py OUT COUNT SEED

writes OUT/000000.jpg ... and OUT/manifest.json ({"sizes": [[width, height], ...]}). Each image
is 224-272 px a side, smooth colour gradients with shapes on them, blurred, then grain at two
scales (a per-image strength): natural-looking content whose JPEG (quality 88) is about 40 KB,
not random bytes. The same COUNT and SEED give the same bytes (Pillow and numpy are pinned).
"""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

QUALITY = 88


def image(rng: np.random.Generator) -> tuple[bytes, int, int]:
    """One JPEG: (bytes, width, height)."""
    grain = rng.uniform(20, 36)
    w, h = (int(v) for v in rng.integers(224, 273, size=2))
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    pixels = np.empty((h, w, 3), np.float32)
    for c in range(3):
        a, b, d = rng.uniform(-1, 1, 3)
        pixels[..., c] = 128 + 90 * np.sin(a * x / 40 + b * y / 40 + d * 6) * rng.uniform(0.4, 1)
    im = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(10, 120)), y0 + int(rng.integers(10, 120))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    pixels = np.asarray(im.filter(ImageFilter.GaussianBlur(1.2))).astype(np.float32)
    coarse = rng.normal(0, grain, (h // 2 + 1, w // 2 + 1, 3)).astype(np.float32).repeat(2, 0).repeat(2, 1)[:h, :w]
    pixels += coarse + rng.normal(0, grain * 0.8, pixels.shape).astype(np.float32)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=QUALITY)
    return out.getvalue(), w, h


def main(out: str, count: int, seed: int) -> None:
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = []
    for i in range(count):
        data, w, h = image(rng)
        with open(os.path.join(out, f"{i:06d}.jpg"), "wb") as f:
            f.write(data)
        sizes.append([w, h])
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump({"sizes": sizes}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

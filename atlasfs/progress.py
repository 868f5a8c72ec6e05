"""Progress bars for long work (tqdm), shown only on a terminal, and the closing line's time."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def progress_bar(label: str, total: int | None, unit: str, quiet: bool = False) -> tqdm:
    """A bar on stderr: ``label``, done/total, rate and time left; silent when stderr is not a
    terminal (``disable=None``), so logs and pipes stay clean, or when ``quiet`` (``-q``).
    ``total`` is known before the work starts, so that the percentage and the time left mean
    something from the first update. ``unit`` ``"B"``: bytes, shown in KiB, MiB..."""
    in_bytes = unit == "B"
    return tqdm(total=total, desc=label, unit=unit if in_bytes else f" {unit}", unit_scale=in_bytes,
                unit_divisor=1024, file=sys.stderr, disable=True if quiet else None, dynamic_ncols=True,
                mininterval=0.1, leave=True)


def say(line: str, file: TextIO | None = None) -> None:
    """Print ``line`` on ``file`` (default stderr) without tearing a bar that is being drawn."""
    tqdm.write(line, file=file or sys.stderr)


def duration(seconds: float) -> str:
    """``seconds`` for a closing line: ``0.4 s``, ``12 s``, ``3 min 05 s``, ``2 h 01 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"

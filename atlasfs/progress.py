"""Progress bars for long work (tqdm), shown only on a terminal."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def progress_bar(label: str, total: int | None, unit: str) -> tqdm:
    """A bar on stderr: ``label``, done/total, rate and time left; silent when stderr is not a
    terminal (``disable=None``), so logs and pipes stay clean. ``total`` None: not known yet
    (set ``bar.total`` once it is)."""
    return tqdm(total=total, desc=label, unit=f" {unit}", file=sys.stderr, disable=None, dynamic_ncols=True,
                mininterval=0.1, leave=True)


def say(line: str, file: TextIO | None = None) -> None:
    """Print ``line`` on ``file`` (default stderr) without tearing a bar that is being drawn."""
    tqdm.write(line, file=file or sys.stderr)

"""Writing a Lavender csv shard: a producer's helper (tests, benchmarks, demos), not used by a mount."""

from __future__ import annotations

import csv
import io
from typing import Any


def write_csv_shard(path: str, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as a Lavender csv shard (for tests and demos)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(buffer.getvalue())

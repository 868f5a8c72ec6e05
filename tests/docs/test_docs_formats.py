"""The formats the docs name are the formats atlasfs has: ``factory.FORMATS``, the one table.
README.md's Formats table, ``--format``'s choices, ``atlasfs/formats/__init__.py``'s docstring
and docs/sources.md's table each name exactly its keys (a format added or renamed without its
docs fails here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import atlasfs.formats
from atlasfs.formats.factory import FORMATS

REPO = Path(__file__).resolve().parents[2]


def section(path: Path, heading: str) -> str:
    """The text of ``path`` from the line ``heading`` to the next heading of its level or above."""
    text = path.read_text()
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1:])
    return text[start:start + 1 + end.start()] if end else text[start:]


def first_column_names(markdown: str) -> list[str]:
    """The backticked names of a Markdown table's first column, its header left out."""
    lines = markdown.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith("| ---")) + 1:]
    rows = [line for line in body if line.startswith("|")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def test_readme_formats_table() -> None:
    names = first_column_names(section(REPO / "README.md", "## Formats"))
    assert names == list(FORMATS)


def test_sources_md_table_in_detection_order() -> None:
    text = (REPO / "docs" / "sources.md").read_text()
    table = text[:text.index("\n## ")]
    assert first_column_names(table) == list(FORMATS)


def test_format_flag_choices(tmp_path: Path) -> None:
    """``--format``'s choices, as the command line states them for a wrong one."""
    result = subprocess.run([sys.executable, "-m", "atlasfs", "info", "--format", "nonesuch", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    choices = re.search(r"choose one of: ([^)]*)\)", result.stderr)
    assert choices, result.stderr
    assert choices.group(1).split(", ") == list(FORMATS)


def test_formats_package_docstring() -> None:
    line = re.search(r"^Formats: ([^(]*?) \(", atlasfs.formats.__doc__, re.MULTILINE)
    assert line, atlasfs.formats.__doc__
    assert line.group(1).split(", ") == list(FORMATS)
    for kind, (module, _) in FORMATS.items():
        room = module.rsplit(".", 1)[1]
        assert f"``{room}/``" in atlasfs.formats.__doc__ or f"``{room}.py``" in atlasfs.formats.__doc__, kind

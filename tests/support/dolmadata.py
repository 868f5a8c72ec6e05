"""Dolma datasets for the tests: documents files (gz, zst, plain; nested) with an attribute
set that lines up and one that does not, and the files a mount must show for them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import zstandard

from atlasfs.formats.dolma import LINES_PER_BLOCK


def write_jsonl(path: Path, rows: list[object], kind: str) -> None:
    """Lines of JSON (bytes rows as they are) as gzip, zstd in several frames, or plain."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(r if isinstance(r, bytes) else json.dumps(r).encode() + b"\n" for r in rows)
    if kind == "gz":
        path.write_bytes(gzip.compress(data))
    elif kind == "zst":
        third = len(data) // 3
        c = zstandard.ZstdCompressor()
        path.write_bytes(b"".join(c.compress(part) for part in (data[:third], data[third:2 * third], data[2 * third:])))
    else:
        path.write_bytes(data)


def docs(prefix: str, n: int) -> list[dict[str, object]]:
    """n documents whose ids start with prefix."""
    return [{"id": f"{prefix}{i}", "text": f"text {i} ünï " + "x" * (i % 50), "source": "test"} for i in range(n)]


def make_dataset(root: Path, n: int = 2 * LINES_PER_BLOCK + 7) -> dict[str, list[dict[str, object]]]:
    """Three documents files (gz, zst, plain; nested), a set that lines up and one that does not."""
    files = {"cc/2019/a.jsonl.gz": ("gz", "a"), "cc/b.jsonl.zst": ("zst", "b"), "wiki.jsonl": ("plain", "w")}
    made = {}
    for relative, (kind, prefix) in files.items():
        rows = docs(prefix, n)
        made[relative] = rows
        write_jsonl(root / "documents" / relative, rows, kind)
        write_jsonl(root / "attributes" / "tox" / relative,
                    [{"id": r["id"], "attributes": {"tox": i / 7}} for i, r in enumerate(rows)], kind)
        swapped = [{"id": r["id"]} for r in rows]
        if n > 601:
            swapped[600], swapped[601] = swapped[601], swapped[600]
        write_jsonl(root / "attributes" / "bad" / relative, swapped, kind)
    return made


FOLDERS = {"cc/2019/a": "cc/2019/a.jsonl.gz", "cc/b": "cc/b.jsonl.zst", "wiki": "wiki.jsonl"}


def expected_files(root: Path, made: dict[str, list[dict[str, object]]]) -> dict[str, dict[str, bytes]]:
    """Folder -> {file name: bytes}, in listing order, from the lines as written."""
    out: dict[str, dict[str, bytes]] = {}
    for folder, relative in FOLDERS.items():
        files: dict[str, bytes] = {}
        for i, row in enumerate(made[relative]):
            files[f"{row['id']}.json"] = json.dumps(row).encode()
            files[f"{row['id']}.text"] = str(row["text"]).encode()
            files[f"{row['id']}.tox.json"] = json.dumps({"id": row["id"], "attributes": {"tox": i / 7}}).encode()
        out[folder] = files
    return out

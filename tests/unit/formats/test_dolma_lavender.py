"""The Dolma and Lavender format layers: samples, joins, and every bad input named in one line."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from atlasfs.formats.dolma import LINES_PER_BLOCK, DolmaError, DolmaSource
from atlasfs.formats.lavender import DEFAULT_UID, LavenderError, LavenderShard, LavenderSource, write_csv_shard


def _jsonl(path: Path, rows: list[object], kind: str = "gz") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(json.dumps(r).encode() + b"\n" if not isinstance(r, bytes) else r for r in rows)
    if kind == "gz":
        path.write_bytes(gzip.compress(data))
    elif kind == "zst":  # several frames, as zstd's multi-threaded writers make
        third = len(data) // 3
        c = zstandard.ZstdCompressor()
        path.write_bytes(c.compress(data[:third]) + c.compress(data[third:2 * third]) + c.compress(data[2 * third:]))
    else:
        path.write_bytes(data)


def _docs(prefix: str, n: int) -> list[dict[str, object]]:
    return [{"id": f"{prefix}{i}", "text": f"text {i} ünï", "source": "test"} for i in range(n)]


@pytest.mark.parametrize("kind, suffix", [("gz", ".jsonl.gz"), ("zst", ".jsonl.zst"), ("plain", ".jsonl")])
def test_dolma_samples_with_attributes_every_compression(tmp_path: Path, kind: str, suffix: str) -> None:
    docs = _docs("d", 2 * LINES_PER_BLOCK + 7)
    _jsonl(tmp_path / "documents" / "2019-09" / f"a{suffix}", docs, kind)
    _jsonl(tmp_path / "attributes" / "tox" / "2019-09" / f"a{suffix}",
           [{"id": d["id"], "attributes": {"tox": 0.5}} for d in docs], kind)
    [documents] = DolmaSource(str(tmp_path)).shards
    assert documents.name == "2019-09/a"
    scan = documents.scan()
    assert (scan.lines, documents.num_blocks, scan.problems, scan.left_out) == (len(docs), 3, [], {})
    samples = [s for b in range(documents.num_blocks) for s in documents.decode_block(b)[0]]
    assert [s["__key__"] for s in samples] == [d["id"] for d in docs]
    assert samples[600]["text"] == "text 600 ünï"
    assert json.loads(samples[600]["json"]) == docs[600]
    assert json.loads(samples[600]["tox.json"]) == {"id": "d600", "attributes": {"tox": 0.5}}
    assert documents.decode_block(1)[0] == samples[LINES_PER_BLOCK:2 * LINES_PER_BLOCK]  # random access


def test_dolma_attribute_sets_that_do_not_line_up_are_left_out_and_named(tmp_path: Path) -> None:
    docs = _docs("d", 20)
    _jsonl(tmp_path / "documents" / "a.jsonl.gz", docs)
    _jsonl(tmp_path / "attributes" / "short" / "a.jsonl.gz", [{"id": d["id"]} for d in docs[:-1]])
    swapped = [{"id": d["id"]} for d in docs]
    swapped[3], swapped[4] = swapped[4], swapped[3]
    _jsonl(tmp_path / "attributes" / "swapped" / "a.jsonl.gz", swapped)
    _jsonl(tmp_path / "attributes" / "good" / "a.jsonl.gz", [{"id": d["id"]} for d in docs])
    [documents] = DolmaSource(str(tmp_path)).shards
    scan = documents.scan()
    assert list(scan.attribute_starts) == ["good"]
    assert "line 20: no line (it has 19)" in scan.left_out["short"] and "'d19'" in scan.left_out["short"]
    why = scan.left_out["swapped"]
    assert "line 4" in why and "'d4'" in why and "'d3'" in why and str(tmp_path / "attributes" / "swapped") in why
    assert set(documents.decode_block(0)[0][0]) == {"__key__", "text", "json", "good.json"}


def test_dolma_bad_lines_are_named_and_kept_raw(tmp_path: Path) -> None:
    rows: list[object] = [*_docs("d", 3), b"{not json\n", {"text": "no id"}]
    _jsonl(tmp_path / "documents" / "a.jsonl.gz", rows)
    [documents] = DolmaSource(str(tmp_path)).shards
    scan = documents.scan()
    assert [p.split(";")[0] for p in scan.problems] == [f"{documents.path} line 4: not a JSON object",
                                                        f"{documents.path} line 5: no string id"]
    samples = documents.decode_block(0)[0]
    assert samples[3] == {"json": b"{not json"} and "__key__" not in samples[4]


def test_dolma_truncated_gzip_is_one_line_naming_the_file(tmp_path: Path) -> None:
    _jsonl(tmp_path / "documents" / "a.jsonl.gz", _docs("d", 2000))
    path = tmp_path / "documents" / "a.jsonl.gz"
    path.write_bytes(path.read_bytes()[:-200])
    [documents] = DolmaSource(str(tmp_path)).shards
    scan = documents.scan()  # the blocks before the damage still serve; the one it falls in fails
    assert scan.damage and str(path) in scan.damage and "\n" not in scan.damage
    assert documents.decode_block(0)[0][0]["__key__"] == "d0"
    with pytest.raises(DolmaError) as info:
        documents.decode_block(documents.num_blocks - 1)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_not_a_dolma_dataset(tmp_path: Path) -> None:
    with pytest.raises(DolmaError, match="no documents/ folder"):
        DolmaSource(str(tmp_path))


@dataclass
class Shard:
    """Shard index ``index`` as :class:`LavenderDataset` shows it: its samples' uids in order."""

    index: int
    uids: list[str]
    source_shard: LavenderShard

    @property
    def name(self) -> str:
        """The folder name: ``shard.NNNNN`` as the files name it."""
        return f"shard.{self.index:05d}"


class LavenderDataset:
    """A folder of shardsets read without a mount: :meth:`scan`, then :meth:`samples` (the format
    layer alone, through :class:`LavenderSource` as the tree drives it: prepare, then blocks)."""

    def __init__(self, root: str, uid: str | None = DEFAULT_UID, **join: str) -> None:
        self.source = LavenderSource(root, uid, **join)
        self.root = self.source.root
        self.uid = uid
        self.shards: list[Shard] = []

    def scan(self) -> list[str]:
        """Prepare every shard and check the rules across them; returns the problems found."""
        problems: list[str] = []
        self.shards = []
        for shard in self.source.shards:
            try:
                shard.prepare()
            except LavenderError as exc:
                problems.extend(shard.problems() or [str(exc)])
                continue
            problems.extend(shard.problems())
            uids = [s["__key__"] for b in range(shard.num_blocks) for s in shard.decode_block(b)[0]]
            self.shards.append(Shard(shard.index, uids, shard))
        problems.extend(p for p in self.source.problems() if p not in problems)
        return problems

    def samples(self, shard: Shard, first: int, count: int) -> list[dict[str, Any]]:
        """Samples ``first`` to ``first + count`` of ``shard``."""
        source_shard = shard.source_shard
        out: list[dict[str, Any]] = []
        for block in range(first // source_shard.block_size, source_shard.num_blocks):
            start = block * source_shard.block_size
            if start >= first + count:
                break
            samples, _ = source_shard.decode_block(block)
            out.extend(samples[max(0, first - start):first + count - start])
        return out


def _lavender(root: Path) -> None:
    for s in range(2):
        write_csv_shard(str(root / "images" / f"shard.{s:05d}.csv"),
                        [{"uid": str(s * 10 + i), "image_url": f"u{s * 10 + i}"} for i in range(10)])
        write_csv_shard(str(root / "captions" / f"shard.{s:05d}.csv"),
                        [{"uid": str(s * 10 + i), "caption": f"c{i}"} for i in range(9)])  # a uid short
        pq.write_table(pa.table({"uid": [s * 10 + i for i in range(10)], "score": [i / 4 for i in range(10)]}),
                       root / "scores" / f"shard.{s:05d}.parquet")


def test_lavender_joins_by_uid_and_keeps_parquet_types(tmp_path: Path) -> None:
    for name in ("images", "captions", "scores"):
        (tmp_path / name).mkdir()
    _lavender(tmp_path)
    dataset = LavenderDataset(str(tmp_path), main="images", join="left")
    assert dataset.scan() == []
    shard = dataset.shards[1]
    assert shard.name == "shard.00001" and shard.uids == [str(10 + i) for i in range(10)]
    samples = dataset.samples(shard, 0, 10)
    assert samples[2] == {"__key__": "12", "caption": "c2", "image_url": "u12", "score": 0.5}
    assert samples[9] == {"__key__": "19", "image_url": "u19", "score": 2.25}  # no caption for 19


def test_lavender_broken_rules_are_named_one_line_each(tmp_path: Path) -> None:
    for name in ("images", "captions", "scores"):
        (tmp_path / name).mkdir()
    _lavender(tmp_path)
    write_csv_shard(str(tmp_path / "captions" / "shard.00000.csv"),
                    [{"uid": "12", "caption": "moved"}, {"uid": "1", "caption": "a"}, {"uid": "1", "caption": "b"}])
    write_csv_shard(str(tmp_path / "scores" / "shard.00001.csv"), [{"id": "3", "score": "x"}])
    (tmp_path / "scores" / "shard.00001.parquet").unlink()
    problems = LavenderDataset(str(tmp_path), main="images", join="left").scan()
    assert len(problems) == 5, problems
    assert all("\n" not in p for p in problems)
    assert any("row 3: uid '1' again" in p for p in problems)
    assert any("shard.00001.csv: no 'uid' column" in p for p in problems)
    assert any("uid '12' is in shard 0 of captions but in shard 1 of images" in p for p in problems)
    assert any("uid '12' is also in shard 0 of captions" in p for p in problems)
    assert any("captions/shard.00000.csv row 1: uid '12' is not in" in p and "not shown" in p for p in problems)

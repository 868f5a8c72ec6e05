"""Lavender datasets for the tests: shardsets of csv and parquet joined by uid, and the source
opened with its shards prepared."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from atlasfs.formats import factory
from atlasfs.formats.lavender import LavenderSource, write_csv_shard


def lavender_dataset(root: Path, shards: int = 2, rows: int = 10) -> None:
    """images (csv, every uid), captions (csv, the last uid of each shard missing, one uid only
    it has), scores (parquet: float, int, binary, a null)."""
    for name in ("images", "captions", "scores"):
        (root / name).mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        uids = [f"u{s * rows + i}" for i in range(rows)]
        write_csv_shard(str(root / "images" / f"shard.{s:05d}.csv"),
                        [{"uid": u, "image_url": f"https://x/{u}.jpg"} for u in uids])
        write_csv_shard(str(root / "captions" / f"shard.{s:05d}.csv"),
                        [{"uid": u, "caption": f"a caption, \"quoted\"\nfor {u} ü"} for u in uids[:-1]]
                        + [{"uid": f"extra{s}", "caption": "only here"}])
        pq.write_table(pa.table({"uid": uids, "score": [i / 4 for i in range(rows)],
                                 "n": list(range(rows)), "jpg": [u.encode() for u in uids],
                                 "note": [None if i == 1 else f"n{i}" for i in range(rows)]}),
                       root / "scores" / f"shard.{s:05d}.parquet", row_group_size=4)


def prepared_source(root: Path, **kwargs: str) -> LavenderSource:
    """The dataset opened as Lavender with these options, every shard prepared."""
    source = factory.open_source(str(root), "lavender", factory.SourceOptions(**kwargs))
    assert isinstance(source, LavenderSource)
    for shard in source.shards:
        shard.prepare()
    return source

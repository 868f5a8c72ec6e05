"""Lavender shardsets as a mountable source: the join, blocks, names, stored state, bad input."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atlasfs.formats import factory
from atlasfs.formats import state as saved
from atlasfs.formats.lavender import (
    BLOCK_ROWS,
    STATE_VERSION,
    LavenderError,
    LavenderSource,
    looks_like,
    write_csv_shard,
)
from formatfixtures import shard_files as files_of
from lavenderdata import lavender_dataset, prepared_source


def test_a_sample_is_the_join_by_uid_with_csv_strings_and_parquet_types(tmp_path: Path) -> None:
    lavender_dataset(tmp_path)
    assert looks_like(str(tmp_path)) and not looks_like(str(tmp_path / "images"))
    source = prepared_source(tmp_path, join="left")
    # the uid column is the one every shardset has; the main shardset the one with the most columns
    assert (source.uid, source.main) == ("uid", "scores")
    assert [s.name for s in source.shards] == ["shard.00000", "shard.00001"]
    shard = source.shards[1]
    captions, scores = tmp_path / "captions" / "shard.00001.csv", tmp_path / "scores" / "shard.00001.parquet"
    # a uid only a feature shardset has is not shown (lavender-data never reads it): said, once
    assert shard.problems() == [f"{captions} row 10: uid 'extra1' is not in {scores} (the main shardset's shard): "
                                "not shown"] and source.problems() == []
    samples = [s for b in range(shard.num_blocks) for s in shard.decode_block(b)[0]]
    # the main shardset's rows in its order, the others joined onto them by uid
    assert [s["__key__"] for s in samples] == [f"u{10 + i}" for i in range(10)]
    assert samples[2] == {"__key__": "u12", "caption": 'a caption, "quoted"\nfor u12 ü', "image_url": "https://x/u12.jpg",
                          "score": 0.5, "n": 2, "jpg": b"u12", "note": "n2"}
    assert "caption" not in samples[9] and "note" not in samples[1]  # join=left: missing from captions; a null
    # join=inner (the default): the sample captions lacks is left out, in one line
    inner = prepared_source(tmp_path).shards[1]
    assert [s["__key__"] for b in range(inner.num_blocks) for s in inner.decode_block(b)[0]] == \
        [f"u{10 + i}" for i in range(9)]
    assert f"{scores} row 10: uid 'u19' is not in {captions}: left out (join=inner; join=left shows it without " \
           "those columns)" in inner.problems()
    files = files_of(shard)
    assert files["u12.caption.txt"] == 'a caption, "quoted"\nfor u12 ü'.encode()
    assert (files["u12.score.json"], files["u12.n.cls"], files["u12.jpg"]) == (b"0.5", b"2", b"u12")
    assert files["u12.image_url.txt"] == b"https://x/u12.jpg" and "u11.note.txt" not in files
    assert list(files)[:6] == ["u10.caption.txt", "u10.image_url.txt", "u10.jpg", "u10.n.cls", "u10.note.txt",
                               "u10.score.json"]


def test_blocks_follow_parquet_row_groups_and_read_only_their_rows(tmp_path: Path) -> None:
    rows = 5000
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pq.write_table(pa.table({"uid": [f"k{i}" for i in range(rows)], "x": list(range(rows))}),
                   tmp_path / "a" / "shard.00000.parquet", row_group_size=1000)
    # b holds the same uids backwards, in csv: its rows are found by uid, not by position
    write_csv_shard(str(tmp_path / "b" / "shard.00000.csv"),
                    [{"uid": f"k{i}", "y": f"y{i}"} for i in reversed(range(rows))])
    [shard] = prepared_source(tmp_path).shards
    assert (shard.block_size, shard.num_blocks) == (1000, 5)
    for block in (3, 0, 4):  # any order
        samples, held = shard.decode_block(block)
        assert held > 0
        assert samples[7] == {"__key__": f"k{block * 1000 + 7}", "x": block * 1000 + 7, "y": f"y{block * 1000 + 7}"}
    pq.write_table(pa.table({"uid": [f"k{i}" for i in range(100000)]}), tmp_path / "a" / "shard.00000.parquet")
    [shard] = prepared_source(tmp_path, main_shardset="a").shards
    assert shard.block_size == 2000 and 100000 % shard.block_size == 0  # an even part of one big row group
    (tmp_path / "a" / "shard.00000.parquet").unlink()
    [shard] = prepared_source(tmp_path).shards
    assert shard.block_size == BLOCK_ROWS  # csv: runs of rows


def test_the_stored_state_restores_without_a_pass_and_the_uid_column_is_part_of_the_key(tmp_path: Path) -> None:
    lavender_dataset(tmp_path)
    source = factory.open_source(str(tmp_path), "lavender")
    shard = source.shards[0]
    state = shard.prepare()
    fresh = LavenderSource(str(tmp_path)).shards[0]
    fresh.restore(state)
    assert files_of(fresh) == files_of(shard)
    fields = saved.decode(state, "lavender", STATE_VERSION).values()
    assert saved.encode("lavender", STATE_VERSION, fields) == state
    rows = fields["rows:images"]
    forged = [{"rows:images": rows + 100}, {"rows:images": rows - 5}, {"rows:images": rows[:-1]},
              {"offsets:images": fields["offsets:images"] + (1 << 30)}, {"offsets:images": np.zeros(0, "<i8")},
              {"offsets:images": fields["offsets:images"][::-1].copy()}, {"used": ["images", "nowhere"]},
              {"unsafe": np.array([fields["count"]])}, {"block_rows": 0}, {"extra": 1}, {"count": "3"}]
    for bad in [b"", state[:-5], saved.encode("lavender", STATE_VERSION + 1, fields),
                *(saved.encode("lavender", STATE_VERSION, {**fields, **f}) for f in forged)]:
        with pytest.raises(ValueError):
            LavenderSource(str(tmp_path)).shards[0].restore(bad)
    with pytest.raises(ValueError):  # joined by another column: not this shard's state
        LavenderSource(str(tmp_path), uid="image_url").shards[0].restore(state)
    key = shard.table_key()
    base = os.path.dirname(shard.path)  # files are named relative to the shard's folder
    assert key["uid"] == "uid" and set(key["files"]) == {
        os.path.relpath(tmp_path / n / f, base)
        for n, f in (("images", "shard.00000.csv"), ("captions", "shard.00000.csv"), ("scores", "shard.00000.parquet"))}
    assert LavenderSource(str(tmp_path), uid="image_url").shards[0].table_key() != key


def test_another_uid_column(tmp_path: Path) -> None:
    for name, column in (("a", "title"), ("b", "body")):
        (tmp_path / name).mkdir()
        write_csv_shard(str(tmp_path / name / "shard.00000.csv"), [{"id": f"d{i}", column: f"{column}{i}"} for i in range(3)])
    source = prepared_source(tmp_path, uid_column="id")
    assert files_of(source.shards[0])["d1.body.txt"] == b"body1"
    assert files_of(prepared_source(tmp_path).shards[0]) == files_of(source.shards[0])  # found: the column both have
    with pytest.raises(LavenderError, match="main shardset 'a' cannot be read .*no 'uid' column"):
        LavenderSource(str(tmp_path), uid="uid").shards[0].prepare()


def test_a_column_in_two_shardsets_is_named_by_shardset_and_logged_once(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    for name in ("v1", "v2"):
        (tmp_path / name).mkdir()
        for s in range(2):
            write_csv_shard(str(tmp_path / name / f"shard.{s:05d}.csv"),
                            [{"uid": f"a{s}{i}", "Caption" if name == "v2" else "caption": f"{name} {i}",
                              name: "own"} for i in range(3)])
    with caplog.at_level(logging.WARNING, logger="atlasfs"):
        source = prepared_source(tmp_path)
    files = files_of(source.shards[1])
    assert files["a11.v1.caption.txt"] == b"v1 1" and files["a11.v2.Caption.txt"] == b"v2 1"
    assert files["a11.v1.txt"] == b"own" and "a11.caption.txt" not in files
    clash = [r.getMessage() for r in caplog.records if "shardsets v1, v2" in r.getMessage()]
    assert len(clash) == 2 and all("\n" not in m for m in clash)  # once per column (caption, Caption)


def test_numeric_uids_keep_their_names_and_unsafe_ones_keep_their_value(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    pq.write_table(pa.table({"uid": [123456, 5, 654321, 7], "v": ["a", "b", "c", "d"]}),
                   tmp_path / "s" / "shard.00000.parquet")
    (tmp_path / "t").mkdir()
    write_csv_shard(str(tmp_path / "t" / "shard.00000.csv"), [{"uid": u, "v2": v} for u, v in (
        ("123456", "a2"), ("5", "five"), ("654321", "c2"), ("7", "d2"), ("x.y", "dotted"))])
    [shard] = prepared_source(tmp_path, main_shardset="t", join="left").shards
    assert shard.key_width == 7  # wider than the six-digit uids, which the naming layer would refuse as keys
    files = files_of(shard)
    assert files["123456.v.txt"] == b"a" and files["654321.v.txt"] == b"c" and files["5.v2.txt"] == b"five"
    # "x.y" cannot be a key (a dot): an index key, and the uid as a file so it is not lost
    assert files["0000004.v2.txt"] == b"dotted" and files["0000004.uid.txt"] == b"x.y"


def test_broken_rules_are_one_line_each_and_the_rest_serves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lavender_dataset(tmp_path, shards=4)
    # images shard 2: a duplicate uid, a row with too few cells; captions shard 3: no uid column;
    # scores shard 3 holds u1 (and shard 0 does not), which the other shardsets have in shard 0; a null uid
    (tmp_path / "images" / "shard.00002.csv").write_text(
        "uid,image_url\nu20,a\nu21,b\nu20,again\nu22\nu23,d\n", encoding="utf-8")
    write_csv_shard(str(tmp_path / "captions" / "shard.00003.csv"), [{"id": "u30", "caption": "c"}])
    pq.write_table(pa.table({"uid": ["u30", "u1", None], "score": [1.0, 2.0, 3.0]}),
                   tmp_path / "scores" / "shard.00003.parquet")
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(10) if i != 1], "score": [0.0] * 9}),
                   tmp_path / "scores" / "shard.00000.parquet")
    with caplog.at_level(logging.WARNING, logger="atlasfs"):
        source = prepared_source(tmp_path, join="left", main_shardset="scores")
    logged = [r.getMessage() for r in caplog.records]
    images2 = str(tmp_path / "images" / "shard.00002.csv")
    assert f"{images2} row 3: uid 'u20' again (first at row 1)" in source.shards[2].problems()
    assert f"{images2} line 5: 1 cells, the header has 2" in source.shards[2].problems()
    problems3 = source.shards[3].problems()
    assert f"{tmp_path / 'captions' / 'shard.00003.csv'}: no 'uid' column (choose it with -o uid_column=COLUMN or --uid-column)" in problems3
    assert f"{tmp_path / 'scores' / 'shard.00003.parquet'} row 3: no uid (null)" in problems3
    moved = f"{tmp_path}: uid 'u1' is in shard 0 of captions but in shard 3 of scores; not joined"
    assert moved in logged  # met while the shards were opened, logged, and the mount goes on
    across = source.problems()
    assert "uid 'u1' is in shard 0 of captions but in shard 3 of scores" in across
    assert all("\n" not in p for p in across + [p for s in source.shards for p in s.problems()])
    # the rest serves: shard 2 without the bad rows, shard 3 with what can be joined
    files2 = files_of(source.shards[2])
    assert files2["u20.image_url.txt"] == b"a" and "u22.image_url.txt" not in files2 and files2["u23.score.json"] == b"0.75"
    files3 = files_of(source.shards[3])
    assert files3["u30.image_url.txt"] == b"https://x/u30.jpg" and files3["u30.score.json"] == b"1.0"
    assert files3["u1.score.json"] == b"2.0" and "u30.caption.txt" not in files3
    assert "u1.caption.txt" not in files_of(source.shards[0])  # not in the main shardset's shard 0: said so
    assert (f"{tmp_path / 'captions' / 'shard.00000.csv'} row 2: uid 'u1' is not in "
            f"{tmp_path / 'scores' / 'shard.00000.parquet'} (the main shardset's shard): not shown") in source.shards[0].problems()


def test_an_unreadable_shard_file_is_left_out_alone(tmp_path: Path) -> None:
    lavender_dataset(tmp_path)
    (tmp_path / "captions" / "shard.00001.csv").write_bytes(b"\xff\xfe\x00 not csv")
    source = prepared_source(tmp_path)
    [problem] = source.shards[1].problems()
    assert problem.startswith(f"{tmp_path / 'captions' / 'shard.00001.csv'}: cannot be read") and "\n" not in problem
    assert files_of(source.shards[1])["u12.image_url.txt"] == b"https://x/u12.jpg"
    assert "u12.caption.txt" not in files_of(source.shards[1]) and "u19.score.json" in files_of(source.shards[1])
    # the main shardset's file unreadable: the shard fails, in one line
    (tmp_path / "scores" / "shard.00001.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(LavenderError, match="main shardset 'scores' cannot be read") as info:
        LavenderSource(str(tmp_path)).shards[1].prepare()
    assert "\n" not in str(info.value)


def test_not_lavender(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.csv").write_text("x\n")
    assert not looks_like(str(tmp_path)) and not looks_like(str(tmp_path / "missing"))
    with pytest.raises(LavenderError, match="no shardset folder"):
        LavenderSource(str(tmp_path))


@pytest.mark.parametrize("layout", ["unquoted", "quoted, over lines"])
def test_a_cell_longer_than_pythons_csv_limit_reads_exactly(tmp_path: Path, layout: str) -> None:
    """A text cell of 200,000 characters (past the 131,072 Python's csv refuses by default):
    the shard reads, the cell whole, in the scan and in its block's read."""
    long = "x" * 200_000 if layout == "unquoted" else "a,b\n" * 50_000
    (tmp_path / "texts").mkdir()
    rows = [{"uid": f"u{i}", "text": long if i == 1 else f"t{i}"} for i in range(3)]
    write_csv_shard(str(tmp_path / "texts" / "shard.00000.csv"), rows)
    shard = LavenderSource(str(tmp_path), main="texts").shards[0]
    shard.prepare()
    assert shard.problems() == []
    samples = [s for b in range(shard.num_blocks) for s in shard.decode_block(b)[0]]
    assert [(s["__key__"], s["text"]) for s in samples] == [(r["uid"], r["text"]) for r in rows]


def test_a_row_group_of_most_of_the_cache_is_decoded_once_for_its_blocks(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow's writer puts up to 1,048,576 rows in a row group: a group larger than half the
    row-group cache is kept (alone if it must), so a pass over its blocks decodes it once, not
    once a block; a group larger than the whole cache is not kept."""
    from atlasfs.formats.lavender import bounds, parquetrows

    (tmp_path / "texts").mkdir()
    rows = 20 * BLOCK_ROWS
    pq.write_table(pa.table({"uid": [f"u{i:06d}" for i in range(rows)], "text": [f"caption {i}" * 8 for i in range(rows)]}),
                   tmp_path / "texts" / "shard.00000.parquet")
    decodes: list[int] = []
    real = bounds.bounded_read
    monkeypatch.setattr(bounds, "bounded_read", lambda *a, **k: decodes.append((a[1], a[2])) or real(*a, **k))
    source = LavenderSource(str(tmp_path), main="texts")
    shard = source.shards[0]
    shard.prepare()
    group_bytes = pq.ParquetFile(tmp_path / "texts" / "shard.00000.parquet").read_row_group(0).nbytes
    source.row_groups.max_bytes = int(group_bytes * 1.5)  # the group: two thirds of the cache
    assert shard.num_blocks == 20
    texts = [s["text"] for b in range(shard.num_blocks) for s in shard.decode_block(b)[0]]
    assert texts == [f"caption {i}" * 8 for i in range(rows)]
    assert decodes == [(0, ["uid"]), (0, None)]  # the pass over its uids, then its blocks: once
    cache = parquetrows.RowGroupCache(group_bytes - 1)
    cache.put(("f", 0), pq.ParquetFile(tmp_path / "texts" / "shard.00000.parquet").read_row_group(0))
    assert cache.get(("f", 0)) is None

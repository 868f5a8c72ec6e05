"""Lavender shard files made to bloat a reader while their structure stays valid: rows that break
the rules by the million, blocks whose rows take gigabytes, headers of many thousand columns.
Each is bounded, in one line naming the file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atlasfs.formats.lavender import LavenderError, LavenderSource, ShardFile, write_csv_shard
from atlasfs.formats.lavender.errors import MAX_PROBLEMS
from atlasfs.formats.lavender import cells, csvrows, files
from atlasfs.formats.lavender.files import MAX_COLUMNS


def _shardset(root: Path, name: str) -> Path:
    (root / name).mkdir(parents=True, exist_ok=True)
    return root / name / "shard.00000.csv"


def test_problem_lines_are_bounded_per_file(tmp_path: Path) -> None:
    """A file of rows that each break a rule keeps its first MAX_PROBLEMS lines and a count."""
    bad = MAX_PROBLEMS + 2000
    main = _shardset(tmp_path, "texts")
    main.write_bytes(b"uid,text\n" + b"".join(b"u%d,t\n" % i for i in range(5)) + b"lone\n" * bad)
    quoted = _shardset(tmp_path, "quoted")
    quoted.write_bytes(b'uid,q\n' + b"".join(b'u%d,"a\nb"\n' % i for i in range(5)) + b"lone\n" * bad)
    extra = _shardset(tmp_path, "extra")  # uids the main shardset lacks: one line each, as many
    write_csv_shard(str(extra), [{"uid": f"u{i}", "e": "x"} for i in range(5 + bad)])
    shard = LavenderSource(str(tmp_path), main="texts").shards[0]
    shard.prepare()
    problems = shard.problems()
    for path, what in ((main, "1 cells, the header has 2"), (quoted, "1 cells, the header has 2"),
                       (extra, "is not in")):
        mine = [p for p in problems if p.startswith(f"{path} ")]
        assert len(mine) == MAX_PROBLEMS and all(what in p for p in mine), path
        assert f"{path}: 2000 more problems (the first {MAX_PROBLEMS} are listed)" in problems
    assert len(problems) == 3 * (MAX_PROBLEMS + 1)
    assert shard.num_samples == 5
    saved = shard.prepare()
    assert len(saved) < 1 << 20  # the stored state too: 9,000 lines of rows, not millions


def test_a_block_takes_no_more_than_the_block_bound(tmp_path: Path) -> None:
    """A block's rows are counted before they are read (csv) or as their row groups are
    (parquet), against max_block_bytes, as every format's block is: a csv of 2,048 rows of
    64 MiB each was 128 GiB read into one block."""
    main = _shardset(tmp_path, "texts")
    write_csv_shard(str(main), [{"uid": f"u{i}", "text": "x" * 1000} for i in range(10)])
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(9, -1, -1)], "blob": [b"y" * 1000] * 10}),
                   _shardset(tmp_path, "blobs").with_suffix(".parquet"), row_group_size=1)
    shard = LavenderSource(str(tmp_path), main="texts").shards[0]
    shard.prepare()
    assert len(shard.decode_block(0)[0]) == 10
    shard.max_block_bytes = 5000
    with pytest.raises(LavenderError) as caught:
        shard.decode_block(0)
    assert str(caught.value) == (f"{tmp_path}/*/shard.00000 samples 0..9: its rows take more than the block bound of "
                                 f"5000 bytes ({main} rows 1..10: 10050 bytes); not read")
    shard.max_block_bytes = 12000  # the csv rows fit; the parquet rows (ten row groups) pass what is left
    with pytest.raises(LavenderError, match=r"samples 0\.\.9: its rows take more than the block bound of 12000 bytes "
                                            r"\(.*blobs/shard\.00000\.parquet rows 1\.\.\d+: more than \d+ bytes\)"):
        shard.decode_block(0)


def test_rows_not_wanted_between_two_that_are_are_not_read(tmp_path: Path) -> None:
    """Two rows a block needs are read in one range only if the rows between them are small:
    a feature shardset's uid the main shardset lacks, of 2 MiB, between two it has."""
    write_csv_shard(str(_shardset(tmp_path, "texts")), [{"uid": "u0", "t": "a"}, {"uid": "u1", "t": "b"}])
    write_csv_shard(str(_shardset(tmp_path, "notes")), [{"uid": "u0", "n": "c"}, {"uid": "big", "n": "z" * (2 << 20)},
                                                        {"uid": "u1", "n": "d"}])
    shard = LavenderSource(str(tmp_path), main="texts", join="left").shards[0]
    shard.prepare()
    shard.max_block_bytes = 1 << 20
    samples, held = shard.decode_block(0)
    assert [s["n"] for s in samples] == ["c", "d"] and held < 1000


def test_a_file_of_too_many_columns_is_refused(tmp_path: Path) -> None:
    """Each column is a file of every sample: past MAX_COLUMNS a file is refused in one line,
    a csv header counted before it is split when it has no quotes."""
    names = ["uid"] + [f"c{i}" for i in range(MAX_COLUMNS)]
    plain = tmp_path / "shard.00000.csv"
    plain.write_text(",".join(names) + "\nu0" + "," * MAX_COLUMNS + "\n")
    quoted = tmp_path / "shard.00001.csv"
    quoted.write_text(",".join(f'"{n}"' for n in names) + "\nu0" + "," * MAX_COLUMNS + "\n")
    wide = tmp_path / "shard.00002.parquet"
    pq.write_table(pa.table({n: [0] for n in names}), wide)
    for path, kind in ((plain, "csv"), (quoted, "csv"), (wide, "parquet")):
        with pytest.raises(LavenderError) as caught:
            ShardFile("texts", str(path), 0, kind).scan("uid")
        assert str(caught.value) == (f"{path}: {MAX_COLUMNS + 1} columns, more than {MAX_COLUMNS} (a file each a "
                                     "sample); not read")
    names.pop()
    plain.write_text(",".join(names) + "\nu0" + "," * (MAX_COLUMNS - 1) + "\n")
    assert ShardFile("texts", str(plain), 0, "csv").scan("uid").uids == ["u0"]


def test_rows_and_uid_bytes_are_bounded_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parquet file states millions of rows of one uid in a few kilobytes (the pass made each a
    Python string); a csv file's rows cost it a byte each. Past MAX_ROWS rows, or uids of
    MAX_UID_BYTES in all, a file is refused in one line."""
    n = 1 << 20
    uids = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array(["ab"]))
    stated = tmp_path / "shard.00000.parquet"
    with pq.ParquetWriter(stated, pa.schema([("uid", uids.type)]), store_schema=False) as writer:
        for _ in range(files.MAX_ROWS // n + 1):
            writer.write_table(pa.table({"uid": uids}), row_group_size=n)
    assert stated.stat().st_size < 64 << 10
    with pytest.raises(LavenderError) as caught:
        ShardFile("texts", str(stated), 0, "parquet").scan("uid")
    assert str(caught.value) == f"{stated}: {files.MAX_ROWS + n} rows, more than {files.MAX_ROWS}; not read"

    monkeypatch.setattr(files, "MAX_ROWS", 10)
    plain, quoted, unterminated = (tmp_path / f"shard.0000{i}.csv" for i in (1, 2, 3))
    plain.write_bytes(b"uid,t\n" + b"".join(b"u%d,x\n" % i for i in range(11)))
    quoted.write_bytes(b"uid,t\n" + b"".join(b'u%d,"x"\n' % i for i in range(11)))
    unterminated.write_bytes(b"uid,t\n" + b"\n".join(b"u%d,x" % i for i in range(11)))
    for path in (plain, quoted, unterminated):
        with pytest.raises(LavenderError) as caught:
            ShardFile("texts", str(path), 0, "csv").scan("uid")
        assert str(caught.value) == f"{path}: more than 10 rows; not read"
        path.write_bytes(b"\n".join(path.read_bytes().split(b"\n")[:11]))  # the header and 10 rows
        assert len(ShardFile("texts", str(path), 0, "csv").scan("uid").uids) == 10

    monkeypatch.setattr(files, "MAX_ROWS", 1000)
    monkeypatch.setattr(files, "MAX_UID_BYTES", 100_000)
    long_uids = tmp_path / "shard.00004.parquet"
    pq.write_table(pa.table({"uid": [f"{i:04d}" + "x" * 1000 for i in range(200)]}), long_uids, row_group_size=10)
    with pytest.raises(LavenderError, match=f"^{long_uids}: its 'uid' cells take more than 100000 bytes; not read$"):
        ShardFile("texts", str(long_uids), 0, "parquet").scan("uid")
    long_csv = tmp_path / "shard.00005.csv"
    long_csv.write_bytes(b"uid,t\n" + b"".join(b'%04d%s,"x"\n' % (i, b"x" * 20_000) for i in range(6)))
    with pytest.raises(LavenderError, match=f"^{long_csv}: its uids take more than 100000 bytes; not read$"):
        ShardFile("texts", str(long_csv), 0, "csv").scan("uid")


def _serialized(shape: list[int], dtype: str, strides: list[int], body: bytes) -> bytes:
    """A cell as lavender-data's serialize_ndarray lays it out (header items ``js`` + JSON)."""
    items = b"".join(len(b"js" + json.dumps(x).encode()).to_bytes(4, "big") + b"js" + json.dumps(x).encode()
                     for x in (shape, dtype, strides))
    return len(items).to_bytes(4, "big") + items + body


def test_a_serialized_ndarray_states_no_more_than_its_bytes() -> None:
    """Strides of 0 fit any shape in 8 bytes: such a cell of 60 bytes stated 8 EB, which the
    .npy it becomes would write out in full. Refused as not a serialized ndarray."""
    real = np.arange(12, dtype="int32").reshape(3, 4)
    cell = _serialized([3, 4], "int32", list(real.strides), real.tobytes())
    assert cells.sniff(cell) == cells.NDARRAY
    assert np.array_equal(np.load(io.BytesIO(cells.cell_bytes(cells.NDARRAY, cell))), real)
    for shape in ([1000, 1000], [10 ** 9, 10 ** 9]):
        forged = _serialized(shape, "float64", [0, 0], b"\0" * 8)
        assert cells.sniff(forged) is None
        with pytest.raises(ValueError, match=r"not a lavender serialized ndarray \(its shape states \d+ bytes, "
                                             r"more than the 8 it holds"):
            cells.cell_bytes(cells.NDARRAY, forged)


def test_a_csv_row_is_bounded_as_a_line_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quoted cell spanning lines makes one row of many lines: each line within
    MAX_CSV_LINE_BYTES, and the row too (here lowered to 1,000 bytes)."""
    monkeypatch.setattr(csvrows, "MAX_CSV_LINE_BYTES", 1000)
    path = tmp_path / "shard.00000.csv"
    spanning = b'a","b","c\n'  # starts and ends inside a quoted cell: the row goes on
    path.write_bytes(b'uid,t\nu0,"a"\nu1,"' + spanning * 200 + b'"\nu2,"b"\n')
    with pytest.raises(LavenderError) as caught:
        ShardFile("texts", str(path), 0, "csv").scan("uid")
    # the row starts on line 3 with 14 bytes; 10 a line after: past 1,000 bytes on line 3 + 99
    assert str(caught.value) == (f"{path} line 102: a row of more than 1000 bytes (a quoted cell spanning lines); "
                                 "not read")
    path.write_bytes(b'uid,t\nu0,"a"\nu1,"' + spanning * 20 + b'"\nu2,"b"\n')
    assert ShardFile("texts", str(path), 0, "csv").scan("uid").uids == ["u0", None, "u2"]


def test_problems_across_shards_are_bounded_per_file(tmp_path: Path) -> None:
    """A shard repeating every uid of another: a line each, up to MAX_PROBLEMS, then a count."""
    rows = MAX_PROBLEMS + 200
    for index in (0, 1):
        write_csv_shard(str(_shardset(tmp_path, "texts").with_name(f"shard.{index:05d}.csv")),
                        [{"uid": f"u{i}", "t": "x"} for i in range(rows)])
    problems = LavenderSource(str(tmp_path)).problems()
    again = tmp_path / "texts" / "shard.00001.csv"
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[0] == f"{again} row 1: uid 'u0' is also in shard 0 of texts"
    assert problems[-1] == f"{again}: 200 more problems (the first {MAX_PROBLEMS} are listed)"


def _lists(path: Path, rows: int, per_row: int, dtype: str = "bool") -> Path:
    """A parquet file of ``rows`` uids and a column of lists of ``per_row`` values each."""
    offsets = pa.array(np.arange(0, (rows + 1) * per_row, per_row, dtype=np.int32))
    flags = pa.ListArray.from_arrays(offsets, pa.array(np.ones(rows * per_row, dtype=dtype)))
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(rows)], "flags": flags}), path, compression="zstd")
    return path


def test_values_in_lists_count_against_the_bounds(tmp_path: Path) -> None:
    """A bool in a list is a bit on its page, four bytes of levels in pyarrow and a Python value
    of eight once read: 2,048 lists of 50,000 bools, 6 KiB on disk, took a block to 1.7 GB. A
    row group's values are counted from its page headers (LEVEL_BYTES each), and a block's
    rows as the Python values they become (PYTHON_VALUE_BYTES each)."""
    path = _lists(_shardset(tmp_path, "texts").with_suffix(".parquet"), 2048, 20_000)
    assert path.stat().st_size < 64 << 10
    shard = LavenderSource(str(tmp_path)).shards[0]
    shard.prepare()
    with pytest.raises(LavenderError, match=r"row group 0 holds \d+ values \(its lists' each\), more than the "
                                            r"row-group bound of 134217728 bytes allows at 4 bytes a value; not read"):
        shard.decode_block(0)

    small = tmp_path / "small"
    _lists(_shardset(small, "texts").with_suffix(".parquet"), 2048, 10, dtype="int8")
    shard = LavenderSource(str(small)).shards[0]
    shard.prepare()
    samples, _ = shard.decode_block(0)
    assert samples[5]["flags"] == [1] * 10
    shard.max_block_bytes = 100_000  # its Arrow bytes fit (about 40 KB); its 22,528 Python values do not
    with pytest.raises(LavenderError, match="its rows take more than the block bound of 100000 bytes"):
        shard.decode_block(0)

"""Parquet decompression bombs under Lavender's reads (``atlasfs.formats.lavender.bounds``): a
row group is refused, in one line naming the file and the row group, before it decodes past
``MAX_ROW_GROUP_BYTES``, whatever its footer states; real files read as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atlasfs.formats.lavender import bounds
from atlasfs.formats.lavender.files import LavenderError, RowGroupCache, ShardFile
from parquetbomb import (dictionary_bomb, padding_bomb, page_bomb, retyped_page_size, understate_first_page,
                         understate_footer)

UIDS = [f"u{i}" for i in range(5400)]
BOUND = str(bounds.MAX_ROW_GROUP_BYTES)


def shard_file(path: Path) -> ShardFile:
    return ShardFile("texts", str(path), 0, "parquet")


def test_a_dictionary_bomb_is_refused_as_it_decodes(tmp_path: Path) -> None:
    """5,400 rows of one 1 MiB string: 15 KB on disk, its pages ~1 MB, 5.4 GB decoded."""
    path = dictionary_bomb(tmp_path / "shard.00000.parquet", UIDS)
    assert path.stat().st_size < 64 << 10
    file = shard_file(path)
    assert file.scan("uid").uids == UIDS  # the uid column alone is small: read
    with pytest.raises(LavenderError) as caught:
        file.read_rows(np.arange(10), RowGroupCache(64 << 20))
    assert str(caught.value) == (f"{path}: row group 0 decodes to more than the row-group bound of {BOUND} bytes "
                                 "(a decompression bomb?); not read")


def test_a_bomb_in_the_uid_column_or_a_binary_column(tmp_path: Path) -> None:
    uid_bomb = dictionary_bomb(tmp_path / "a.parquet", UIDS, column="id")
    with pytest.raises(LavenderError, match="row group 0 decodes to more than"):
        shard_file(uid_bomb).scan("id")
    binary = dictionary_bomb(tmp_path / "b.parquet", UIDS, value_bytes=bounds.MAX_ROW_GROUP_BYTES + 1, binary=True)
    with pytest.raises(LavenderError, match="pages decompress to more than"):  # its dictionary page alone
        shard_file(binary).first_cell("text")


def test_a_footer_that_understates_its_sizes_does_not_get_past(tmp_path: Path) -> None:
    """pyarrow never compares the footer's sizes with the pages: the page headers are read."""
    path = page_bomb(tmp_path / "p.parquet", UIDS[:4], bounds.MAX_ROW_GROUP_BYTES + (1 << 20))
    changed = understate_footer(path)
    assert changed and all(after < 1 << 28 for _, after in changed)
    stated = pq.ParquetFile(path).metadata.row_group(0).column(1).total_uncompressed_size
    assert stated <= bounds.MAX_ROW_GROUP_BYTES, "the footer still states more than the bound"
    with pytest.raises(LavenderError) as caught:
        shard_file(path).read_rows(np.arange(4), RowGroupCache(64 << 20))
    assert str(caught.value) == (f"{path}: row group 0's pages decompress to more than the row-group bound of "
                                 f"{BOUND} bytes; not read")
    # a page header that understates: pyarrow fails the page, it never decompresses past the header
    assert understate_first_page(path, 1, bounds.MAX_ROW_GROUP_BYTES) > bounds.MAX_ROW_GROUP_BYTES
    with pytest.raises(LavenderError, match="cannot be read .*Destination buffer is too small"):
        shard_file(path).scan("text")  # that column alone: its page states no more than the bound
    bomb = dictionary_bomb(tmp_path / "d.parquet", UIDS)
    understate_footer(bomb)
    with pytest.raises(LavenderError, match="row group 0 decodes to more than"):
        shard_file(bomb).read_rows(np.arange(4), RowGroupCache(64 << 20))


_PEAK = """
import sys
import numpy as np
from atlasfs.formats.lavender.files import LavenderError, RowGroupCache, ShardFile
file = ShardFile("texts", sys.argv[1], 0, "parquet")
try:
    file.read_rows(np.arange(5400), RowGroupCache(64 << 20))
except LavenderError as exc:
    print(exc)
# VmHWM, not ru_maxrss: that one starts from the forking parent's (pytest's) and survives exec
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


def test_refusing_it_costs_a_bounded_memory(tmp_path: Path) -> None:
    path = dictionary_bomb(tmp_path / "shard.00000.parquet", UIDS)
    result = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    message, peak = result.stdout.splitlines()
    assert "decodes to more than" in message
    assert int(peak) < 500 << 20, f"peak {int(peak) >> 20} MiB"


def test_page_headers_of_real_files(tmp_path: Path) -> None:
    """Every page pyarrow writes (dictionary pages, data pages v1 and v2, statistics, several
    pages per chunk, every codec) is found, and the sizes sum to the footer's (less headers)."""
    rng = np.random.default_rng(0)
    table = pa.table({"uid": [f"u{i}" for i in range(20000)], "n": np.arange(20000),
                      "blob": [rng.bytes(int(k)) for k in rng.integers(0, 200, 20000)],
                      "f": rng.random(20000), "flag": rng.random(20000) > 0.5})
    for version in ("1.0", "2.0"):
        for codec in ("none", "snappy", "zstd", "gzip"):
            path = tmp_path / f"{version}-{codec}.parquet"
            pq.write_table(table, path, compression=codec, data_page_version=version, data_page_size=8192,
                           row_group_size=7000)
            metadata = pq.ParquetFile(path).metadata
            data = path.read_bytes()
            for g in range(metadata.num_row_groups):
                for j in range(metadata.num_columns):
                    chunk = metadata.row_group(g).column(j)
                    start = min(o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o)
                    pages = bounds.page_sizes(lambda at, n: data[at:at + n], start,
                                              start + chunk.total_compressed_size)
                    sizes = [page[0] for page in pages]
                    assert sum(sizes) <= chunk.total_uncompressed_size < sum(sizes) + 200 * len(sizes)
            file = shard_file(path)
            assert file.scan("uid").uids == table.column("uid").to_pylist()
            rows, _ = file.read_rows(np.array([0, 6999, 7000, 19999]), RowGroupCache(64 << 20))
            assert rows[19999] == tuple(table.slice(19999, 1).to_pylist()[0].values())


def test_a_forged_page_header_is_one_refusal(tmp_path: Path) -> None:
    for forged in (b"", b"\x15", b"\x15\x02\x15\x04", b"\x19" + b"\xff" * 12, b"\x1c" * 40, b"\x15\x02\x15\x7f\x00"):
        with pytest.raises(bounds.Refused):
            list(bounds.page_sizes(lambda at, n: forged[at:at + n], 0, max(len(forged), 1)))


def test_delta_byte_array_pages(tmp_path: Path) -> None:
    """DELTA_BYTE_ARRAY rebuilds each value from the one before: 200 values of 1 MiB sharing
    their prefix are ~1 KB on disk. pyarrow cannot read such pages as dictionaries: they are
    read plain, a few rows at a time, counted. A small file of them reads as it is."""
    base = "x" * (1 << 20)
    bomb = tmp_path / "delta.parquet"
    pq.write_table(pa.table({"uid": UIDS[:200], "text": [base + str(i) for i in range(200)]}), bomb,
                   compression="zstd", use_dictionary=False, column_encoding={"text": "DELTA_BYTE_ARRAY"},
                   store_schema=False)
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(LavenderError, match="row group 0 decodes to more than"):
        shard_file(bomb).read_rows(np.arange(3), RowGroupCache(64 << 20))
    small = tmp_path / "small.parquet"
    texts = [f"text {i}" for i in range(100)]
    pq.write_table(pa.table({"uid": UIDS[:100], "text": texts}), small, use_dictionary=False,
                   column_encoding={"text": "DELTA_BYTE_ARRAY", "uid": "DELTA_BYTE_ARRAY"})
    file = shard_file(small)
    assert file.scan("uid").uids == UIDS[:100]
    rows, _ = file.read_rows(np.array([0, 99]), RowGroupCache(64 << 20))
    assert rows == {0: ("u0", "text 0"), 99: ("u99", "text 99")}


def _how(path: Path) -> tuple[int, bool]:
    data = path.read_bytes()
    metadata = pq.ParquetFile(path).metadata
    return bounds.batch_rows(metadata, 0, ["uid", "text"], lambda at, n: data[at:at + n], len(data))


def test_each_way_of_reading_a_row_group(tmp_path: Path) -> None:
    """Whole and plain where the pages bound the rows; plain in batches where a batch of values
    as large as the dictionary page stays small (2.7 GB of 512 KiB strings counted as they
    come); as dictionaries where it would not (a dictionary page of 1 MiB; of 10 MB: 1,000
    values of 10 KB, repeated over 100,000 rows: 1 GB)."""
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"uid": UIDS, "text": [f"t{i}" for i in range(5400)]}), plain, use_dictionary=False)
    assert _how(plain) == (0, False)
    small = tmp_path / "small.parquet"  # a dictionary of small strings: each counted as its whole page
    pq.write_table(pa.table({"uid": UIDS, "text": [f"t{i}" for i in range(5400)]}), small)
    rows, dictionaries = _how(small)
    assert 16 <= rows <= 1024 and dictionaries is False
    half = dictionary_bomb(tmp_path / "half.parquet", UIDS, value_bytes=512 << 10)  # batches of 31 (page + header)
    assert _how(half) == (31, False)
    with pytest.raises(LavenderError, match="row group 0 decodes to more than"):
        shard_file(half).read_rows(np.arange(3), RowGroupCache(64 << 20))
    assert _how(dictionary_bomb(tmp_path / "bomb.parquet", UIDS)) == (0, True)  # a dictionary page of 1 MiB
    many = tmp_path / "many.parquet"
    values = pa.array([f"{i:05d}" + "x" * 10000 for i in range(1000)])
    cells = pa.DictionaryArray.from_arrays(pa.array(np.arange(100000) % 1000, pa.int32()), values)
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(100000)], "text": cells}), many, compression="zstd",
                   store_schema=False, row_group_size=100000)
    assert _how(many) == (0, True)
    with pytest.raises(LavenderError, match="row group 0 decodes to more than"):
        shard_file(many).read_rows(np.arange(3), RowGroupCache(64 << 20))
    legit = tmp_path / "legit.parquet"  # the same dictionary under a few rows: read, as it is
    cells = pa.DictionaryArray.from_arrays(pa.array(np.arange(2000) % 1000, pa.int32()), values)
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(2000)], "text": cells}), legit, store_schema=False)
    assert _how(legit) == (0, True)
    rows, _ = shard_file(legit).read_rows(np.array([0, 1999]), RowGroupCache(64 << 20))
    assert rows[1999] == ("u1999", values[999].as_py())


def test_a_page_past_a_chunks_stated_end_is_counted(tmp_path: Path) -> None:
    """An old parquet-mr's chunk (PARQUET-816): pyarrow reads 100 bytes past its stated end, so
    a data page there is decoded though the walk of the chunk never sees it. pyarrow reads pages
    until their values add up to the footer's: a chunk whose walked pages hold fewer is refused."""
    small = padding_bomb(tmp_path / "small.parquet", UIDS, value_bytes=8192)
    assert len(pq.read_table(small).column("text")[5399].as_py()) == 8192  # pyarrow reads the hidden page
    path = padding_bomb(tmp_path / "shard.00000.parquet", UIDS)
    file = shard_file(path)
    assert file.scan("uid").uids == UIDS
    with pytest.raises(LavenderError) as caught:
        file.read_rows(np.arange(10), RowGroupCache(64 << 20))
    assert str(caught.value) == (f"{path}: row group 0 column 'text': its data pages hold 0 values, fewer than the "
                                 "5400 the footer states; not read")


def test_a_field_of_another_wire_type_is_skipped(tmp_path: Path) -> None:
    """A second ``uncompressed_page_size`` as an i64 after the true i32: pyarrow's Thrift reader
    skips it (not the declared type) and decompresses the page to the true size; so does the walk."""
    path = page_bomb(tmp_path / "p.parquet", UIDS[:4], bounds.MAX_ROW_GROUP_BYTES + (1 << 20))
    retyped_page_size(path, 1, 100)
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(1)
    data = path.read_bytes()
    pages = list(bounds.page_sizes(lambda at, n: data[at:at + n], chunk.data_page_offset,
                                   chunk.data_page_offset + chunk.total_compressed_size))
    assert len(pages) == 1 and pages[0][0] > bounds.MAX_ROW_GROUP_BYTES + (1 << 20)  # the true size, not 100
    with pytest.raises(LavenderError, match="row group 0's pages decompress to more than"):
        shard_file(path).read_rows(np.arange(4), RowGroupCache(64 << 20))
    # an i32 is read as Thrift reads it: its varint cut to 32 bits
    header = b"\x15\x00\x15" + bounds_varint((1 << 33) | (100 << 1)) + b"\x15\x14\x00"
    assert bounds._page_header(header, 0)[1:3] == (100, 10)


def bounds_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _timed_out(signum: int, frame: object) -> None:
    raise TimeoutError("a page header's walk went on for 10 s")


def test_collections_of_bools_and_their_sizes(tmp_path: Path) -> None:
    """In a Thrift compact list or map a bool is a byte; a collection's size is checked against
    the bytes left (a map of 2^32 bools was a loop without end, with the file's lock held)."""
    sizes = b"\x15\x00\x15\xc8\x01\x15\x14"  # type 0, 100 bytes decompressed, 10 compressed
    header = sizes + b"\x1b\x02\x11\x01\x00\x01\x01" + b"\x19\x21\x01\x00" + b"\x00"  # map<bool,bool>, list<bool>
    assert bounds._page_header(header, 0) == (len(header), 100, 10, -1, -1, 0)
    forged = sizes + b"\x1b\xff\xff\xff\xff\x0f\x11" + b"\x00" * 200
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(10)
    try:
        with pytest.raises(bounds.Refused, match="cannot be read"):
            list(bounds.page_sizes(lambda at, n: forged[at:at + n], 0, len(forged)))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_nesting_and_page_counts_are_bounded(tmp_path: Path) -> None:
    """Lists in lists are refused past a depth, as structs are; pages are read one at a time and
    at most ``max_pages`` of them (a chunk holds at most a data page a value and a dictionary
    page: 7-byte empty pages cannot make the walk as long as the chunk)."""
    nested = b"\x15\x00" + b"\x19" * 5000 + b"\x00" * 10
    with pytest.raises(bounds.Refused, match="nested too deep"):
        bounds._page_header(nested, 0)
    empty = b"\x15\x00\x15\x00\x15\x00\x00" * 100000
    pages = bounds.page_sizes(lambda at, n: empty[at:at + n], 0, len(empty))
    assert next(pages) == (0, -1, -1, 0) and sum(1 for _ in pages) == 99999
    with pytest.raises(bounds.Refused, match="more than 10 pages"):
        list(bounds.page_sizes(lambda at, n: empty[at:at + n], 0, len(empty), max_pages=10))


def test_an_empty_row_group_reads_no_page(tmp_path: Path) -> None:
    """An empty chunk states data_page_offset 0 (the file's magic): pyarrow reads no page of it."""
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"uid": pa.array([], pa.string()), "text": pa.array([], pa.string())}), path)
    assert _how(path) == (0, False)
    assert shard_file(path).scan("uid").uids == []


def test_a_chunk_of_more_pages_than_the_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A footer stating millions of values may not buy millions of page headers parsed with the
    file's lock held: past :data:`bounds.MAX_PAGES` a chunk is refused (here lowered to 4, over
    a real chunk of 24 pages)."""
    path = tmp_path / "pages.parquet"
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(3000)], "n": np.arange(3000)}), path,
                   data_page_size=1024, compression="none", use_dictionary=False, write_batch_size=64)
    metadata = pq.ParquetFile(path).metadata
    data = path.read_bytes()
    assert bounds.batch_rows(metadata, 0, ["n"], lambda at, n: data[at:at + n], len(data)) is not None
    monkeypatch.setattr(bounds, "MAX_PAGES", 4)
    with pytest.raises(bounds.Refused, match="more than 4 pages"):
        bounds.batch_rows(metadata, 0, ["n"], lambda at, n: data[at:at + n], len(data))


def test_the_pages_walked_are_those_of_the_file_pyarrow_reads(tmp_path: Path) -> None:
    """A row group's page headers are read through the descriptor pyarrow reads, within that
    descriptor's size (``fstat``), not through the path as it is now: the path replaced by a
    decoy once the file is open (its page header understating the bomb's) must not let pyarrow
    decode the bomb it still holds; nor a shorter file there refuse a good file's row group."""
    path = page_bomb(tmp_path / "shard.00000.parquet", UIDS[:4], bounds.MAX_ROW_GROUP_BYTES + (1 << 20))
    decoy = tmp_path / "decoy.parquet"
    decoy.write_bytes(path.read_bytes())
    understate_first_page(decoy, 1, bounds.MAX_ROW_GROUP_BYTES)  # that page alone: within the bound
    file = shard_file(path)
    assert file.scan("uid").uids == UIDS[:4]  # opened: pyarrow holds the bomb
    decoy.replace(path)
    with pytest.raises(LavenderError) as caught:  # read through the decoy, pyarrow decoded 129 MiB first
        file.scan("text")
    assert str(caught.value) == (f"{path}: row group 0's pages decompress to more than the row-group bound of "
                                 f"{BOUND} bytes; not read")

    _good_file_read_after_its_path_is_replaced(tmp_path / "shard.00001.parquet")


def test_without_proc_the_descriptor_itself_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``/proc/self/fd`` is missing, pyarrow and the page walk read the checked descriptor
    through Python: still the file opened, whatever the path names after."""
    from atlasfs.formats.lavender import parquetrows

    exists = os.path.exists
    monkeypatch.setattr(parquetrows.os.path, "exists", lambda p: not str(p).startswith("/proc/self/fd/") and exists(p))
    file = _good_file_read_after_its_path_is_replaced(tmp_path / "shard.00000.parquet")
    assert isinstance(file._parquet._opened._file, pa.PythonFile)


def _good_file_read_after_its_path_is_replaced(good: Path) -> ShardFile:
    """A good parquet file at ``good``, opened, then another file (4 bytes) put at its path: its
    rows are read from the file opened, as they are. Returns the opened file."""
    pq.write_table(pa.table({"uid": UIDS[:100], "n": np.arange(100)}), good)
    file = shard_file(good)
    assert file.scan("uid").uids == UIDS[:100]
    short = good.parent / "short.parquet"
    short.write_bytes(b"PAR1")
    short.replace(good)
    rows, _ = file.read_rows(np.array([0, 99]), RowGroupCache(64 << 20))
    assert rows == {0: ("u0", 0), 99: ("u99", 99)}
    return file

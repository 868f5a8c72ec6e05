"""WebDataset tar shards as a source: a second tree over a stored table reads no header, and bad
members are left out or fail alone, one line each naming shard and member, grouped as
webdataset's own group_by_keys groups them (through a mount:
tests/mount/test_webdataset_mount.py)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tarfile
from pathlib import Path

import pytest
from webdataset import handlers, tariterators

from atlasfs.errors import AtlasFormatError
from atlasfs.formats import webdataset as wds_format
from atlasfs.formats.factory import detect, open_source
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore
from corpus import FIXTURES
from fusemount import atlasfs
from tardata import add, fields_of


def test_a_second_mount_reads_no_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk's result is stored with the file table: a tree over a stored table lists and
    reads every file without walking any tar."""
    data = Path(shutil.copytree(FIXTURES / "webdataset" / "images" / "data", tmp_path / "data"))
    store = TableStore(str(data), index_dir=str(tmp_path / "tables"))
    first = BlockTree(open_source(str(data)), store=store)
    listed = {f: [(n, first.read(e, 0, e.size)) for n, e in first.listdir(f"/{f}")] for f in first.shard_folders()}

    def no_walk(*args: object) -> None:
        raise AssertionError("a tar's headers were read again")

    monkeypatch.setattr(wds_format.source, "walk", no_walk)
    again = BlockTree(open_source(str(data)), store=store)
    assert {f: [(n, again.read(e, 0, e.size)) for n, e in again.listdir(f"/{f}")] for f in listed} == listed


#: Members of a tar with everything webdataset's grouping meets: a name without '.', a second
#: file of one field (after lower-casing), a link, metadata, a key coming back later, folders.
ODD_MEMBERS = [("a.txt", b"A"), ("a.json", b"{}"), ("README", b"no dot"), ("b.txt", b"B1"), ("b.TXT", b"B2"),
               ("b.seg.png", b"png"), ("b.lnk", None), ("__meta__", b"m"), ("c.", b"empty field"),
               ("dir/", None), ("dir/x.y/k.txt", b"K"), ("a.txt", b"A again")]


def odd_tar(path: Path) -> Path:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in ODD_MEMBERS:
            if data is not None:
                add(tar, name, data)
            else:
                add(tar, name, kind=tarfile.DIRTYPE if name.endswith("/") else tarfile.SYMTYPE)
    return path


def webdataset_samples(path: Path) -> list[dict]:
    """What webdataset's own tar_file_iterator and group_by_keys make of a tar, going on past
    what they refuse (handler ignore_and_continue), without the fields atlasfs leaves out
    because no file can be named so (an empty field: a member ``c.``)."""
    with open(path, "rb") as f:
        files = [{**x, "__url__": str(path)} for x in tariterators.tar_file_iterator(
            f, handler=handlers.ignore_and_continue)]
    samples = [{k: v for k, v in fields_of(s).items() if k} for s in
               tariterators.group_by_keys(iter(files), handler=handlers.ignore_and_continue)]
    return [s for s in samples if len(s) > 1]


def test_members_are_grouped_as_webdataset_groups_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Samples are webdataset's; what it skips or refuses is left out with one line each naming
    the shard and member, logged once by a mount and listed by verify."""
    (tmp_path / "ds").mkdir()
    path = odd_tar(tmp_path / "ds" / "odd.tar")
    with open_source(str(tmp_path / "ds")) as source:
        shard = source.shards[0]
        shard.prepare()
        ours = [s for b in range(shard.num_blocks) for s in shard.decode_block(b)[0]]
        assert ours == webdataset_samples(path)
        assert [s["__key__"] for s in ours] == ["a", "b", "dir/x.y/k", "a"]
        problems = shard.problems()
    assert len(problems) == 4 and all(p.startswith(f"{path} member ") and "\n" not in p for p in problems), problems
    for member, why in [("README", "no '.'"), ("b.TXT", "a second 'txt' file"), ("b.lnk", "not a regular file"),
                        ("c.", "field name is empty")]:
        assert any(f"member {member!r}: " in p and why in p for p in problems), (member, problems)
    with caplog.at_level(logging.INFO, logger="atlasfs"), open_source(str(tmp_path / "ds")) as source:
        tree = BlockTree(source)
        names = [n for n, _ in tree.listdir("/odd")]
    assert sorted(names) == ["000002.txt", "000003.txt", "a.json", "a.txt", "b.seg.png", "b.txt"]
    assert tree.read(tree.lookup("/odd/b.txt"), 0, 10) == b"B1"
    # keys the naming layer cannot show get their index keys: a '.' in a folder, a key used before
    assert tree.read(tree.lookup("/odd/000002.txt"), 0, 10) == b"K"
    assert tree.read(tree.lookup("/odd/000003.txt"), 0, 10) == b"A again"
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(logged) == sorted(problems)
    verify = atlasfs("verify", str(tmp_path / "ds"))
    assert verify.returncode == 1 and all(p in verify.stdout for p in problems), verify.stdout


def test_a_damaged_header_keeps_the_samples_before_it(tmp_path: Path) -> None:
    """Garbage over a header part-way: the samples before it serve, the last of them (which may
    lack files) fails alone, and nothing after it is guessed at."""
    (tmp_path / "ds").mkdir()
    path = tmp_path / "ds" / "bad.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for n in range(4):
            add(tar, f"s{n}.txt", f"text {n}".encode())
    raw = bytearray(path.read_bytes())
    at = raw.index(b"s2.txt")
    raw[at:at + 512] = b"\xff" * 512
    path.write_bytes(bytes(raw))
    with open_source(str(tmp_path / "ds")) as source:
        shard = source.shards[0]
        shard.prepare()
        assert shard.decode_block(0)[0] == [{"__key__": "s0", "txt": b"text 0"}]
        cut = (f"{path} sample 's1': may lack files, as the tar after it is cut short or damaged at offset {at} "
               f"(not a tar header; {len(raw) - at} bytes left out)")
        with pytest.raises(AtlasFormatError, match=re.escape(cut)):
            shard.decode_block(shard.num_blocks - 1)
        assert shard.problems() == [cut]


def test_layouts_a_single_tar_a_nested_folder_and_compressed_shards(tmp_path: Path) -> None:
    """One .tar file mounts as one folder; --format webdataset finds tars in sub-folders
    (named by their path); a .tar.gz is refused in one line."""
    data = Path(shutil.copytree(FIXTURES / "webdataset" / "tiny", tmp_path / "tiny"))
    one = data / "data" / "tiny-000001.tar"
    assert detect(str(one)) == "webdataset"
    with open_source(str(one)) as source:
        assert [s.name for s in source.shards] == ["tiny-000001"]
    with pytest.raises(AtlasFormatError):
        detect(str(data))  # the tars are one folder down: named with --format
    with open_source(str(data), "webdataset") as source:
        assert [s.name for s in source.shards] == ["data/tiny-000000", "data/tiny-000001"]
    gz = tmp_path / "gz"
    gz.mkdir()
    with tarfile.open(gz / "x.tar", "w:gz") as tar:
        add(tar, "a.txt", b"A")
    result = atlasfs("verify", str(gz))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = [line for line in result.stdout.splitlines() if "x.tar" in line]
    assert "not an uncompressed tar file (gzip-compressed)" in line, result.stdout


def test_a_tar_rewritten_under_its_stored_table_fails_rather_than_serving_other_bytes(tmp_path: Path) -> None:
    """The stored walk places members by offset; a tar rewritten with the same size and mtime
    (its samples in another order) is caught by the header read along with each member."""
    (tmp_path / "ds").mkdir()
    path = tmp_path / "ds" / "t.tar"

    def write(order: list[int]) -> None:
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for n in order:
                add(tar, f"s{n}.txt", f"text {n}".encode())

    write([0, 1, 2])
    stat = path.stat()
    store = TableStore(str(tmp_path / "ds"), index_dir=str(tmp_path / "tables"))
    BlockTree(open_source(str(tmp_path / "ds")), store=store).listdir("/t")
    write([2, 1, 0])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    tree = BlockTree(open_source(str(tmp_path / "ds")), store=store)
    with pytest.raises(OSError) as info:
        tree.read(tree.lookup("/t/s0.txt"), 0, 100)
    assert info.value.errno == 5


def test_a_forged_state_is_refused(tmp_path: Path) -> None:
    """A stored walk whose members overlap, lie past the file, are not on header bounds, or are
    of another file size is refused (ValueError), never taken."""
    from atlasfs.formats import state

    data = Path(shutil.copytree(FIXTURES / "webdataset" / "tiny" / "data", tmp_path / "data"))
    shard = open_source(str(data)).shards[0]
    fields = state.decode(shard.prepare(), "webdataset", wds_format.STATE_VERSION).values()
    offsets = fields["offsets"].copy()
    forged = [{"file_size": 1}, {"offsets": offsets + 1}, {"offsets": offsets[::-1].copy()},
              {"offsets": offsets + (1 << 40)}, {"sizes": fields["sizes"] * 0 - 1}, {"names": fields["names"][:-1]},
              {"names": ["", *fields["names"][1:]]}, {"extra": 1}]
    for change in forged:
        with pytest.raises(ValueError):
            open_source(str(data)).shards[0].restore(state.encode("webdataset", wds_format.STATE_VERSION,
                                                                  {**fields, **change}))
    open_source(str(data)).shards[0].restore(state.encode("webdataset", wds_format.STATE_VERSION, fields))

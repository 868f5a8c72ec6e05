"""The block tree over any source: shards named with slashes, a source's stored state,
names and sizes from a source's own index, and shards that cannot be read.

The source here is a small one written for these tests (lines of a text file, a block
of lines at a time); the real formats have their own tests."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.naming import NO_KEY, encode_as, index_key_width
from atlasfs.formats.source import Source, SourceShard
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore

LINES_PER_BLOCK = 3


class LinesShard(SourceShard):
    """A text file of ``key<TAB>text`` lines; ``prepare`` counts them (the pass a Dolma shard makes)."""

    def __init__(self, root: Path, relative: str, describe: bool = False) -> None:
        self.name = relative.removesuffix(".txt")
        self.path = str(root / relative)
        self.describe = describe
        self.lines: int | None = None
        self.passes = 0
        self.decodes = 0

    def prepare(self) -> bytes:
        self.passes += 1
        with open(self.path, "rb") as f:
            data = f.read()
        if b"\0" in data:
            raise AtlasFormatError(f"{self.path}: a NUL byte (not a text file)")
        self.lines = data.count(b"\n")
        return json.dumps({"lines": self.lines}).encode()

    def restore(self, state: bytes) -> None:
        try:
            lines = json.loads(state)["lines"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a state of this shard ({exc})") from None
        if type(lines) is not int or lines < 0:
            raise ValueError(f"{lines!r} lines")
        self.lines = lines

    @property
    def num_blocks(self) -> int:
        assert self.lines is not None, "used before prepare() or restore()"
        return -(-self.lines // LINES_PER_BLOCK)

    @property
    def block_size(self) -> int:
        return LINES_PER_BLOCK

    @property
    def key_width(self) -> int:
        return index_key_width(self.lines or 0)

    def block_length(self, block: int) -> int:
        return min(LINES_PER_BLOCK, (self.lines or 0) - block * LINES_PER_BLOCK)

    def _lines(self, block: int) -> list[bytes]:
        with open(self.path, "rb") as f:
            lines = f.read().splitlines()
        return lines[block * LINES_PER_BLOCK:(block + 1) * LINES_PER_BLOCK]

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        self.decodes += 1
        samples = []
        for line in self._lines(block):
            if line.startswith(b"BAD"):
                raise AtlasFormatError(f"{self.path} block {block}: a bad line")
            key, _, text = line.decode().partition("\t")
            samples.append({"__key__": key, "txt": text} if key else {"txt": text})
        return samples, 100

    def describe_block(self, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        if not self.describe:
            return None
        described = []
        for line in self._lines(block):
            key, _, text = line.decode().partition("\t")
            described.append((key or NO_KEY, [("txt", len(encode_as("txt", text)))]))
        return described

    def table_files(self) -> list[str]:
        return [self.path]


class LinesSource(Source):
    kind = "lines"

    def __init__(self, root: Path, names: list[str], describe: bool = False) -> None:
        self.root = str(root)
        self.shards = [LinesShard(root, name, describe) for name in names]


def _write(root: Path, relative: str, lines: list[str]) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))


@pytest.fixture
def nested(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    _write(root, "a.txt", ["k1\tone", "k2\ttwo"])
    _write(root, "cc/en/part-1.txt", ["x\talpha", "y\tbeta", "z\tgamma", "\tno key"])
    _write(root, "cc/de/part-1.txt", ["p\teins"])
    return root


def _tree_names(tree: BlockTree, path: str = "/") -> list[str]:
    return [name for name, _, _ in tree.names(path)]


def test_shards_named_with_slashes_sit_in_folders_made_from_their_names(nested: Path) -> None:
    source = LinesSource(nested, ["a.txt", "cc/en/part-1.txt", "cc/de/part-1.txt"])
    tree = BlockTree(source)
    assert _tree_names(tree) == ["a", "cc"]
    assert _tree_names(tree, "/cc") == ["en", "de"]  # in shard order
    assert _tree_names(tree, "/cc/en") == ["part-1"]
    assert tree.lookup("/cc").is_dir and tree.lookup("/cc/en").is_dir
    assert _tree_names(tree, "/cc/en/part-1") == ["x.txt", "y.txt", "z.txt", "000003.txt"]
    entry = tree.lookup("/cc/en/part-1/y.txt")
    assert tree.read(entry, 0, 100) == b"beta"
    assert [path for path, _ in tree.walk("/cc")] == [
        "en/part-1/x.txt", "en/part-1/y.txt", "en/part-1/z.txt", "en/part-1/000003.txt", "de/part-1/p.txt"]
    inos = [entry.ino for _, entry in tree.listdir("/")] + [entry.ino for _, entry in tree.listdir("/cc")]
    assert len(set(inos)) == len(inos)
    for missing in ("/cc/fr", "/cc/en/part-2", "/cc/en/part-1/q.txt", "/b"):
        with pytest.raises(OSError) as caught:
            tree.lookup(missing)
        assert caught.value.errno == errno.ENOENT
    with pytest.raises(OSError) as caught:
        tree.listdir("/a/k1.txt")
    assert caught.value.errno == errno.ENOTDIR


def test_a_shard_whose_name_is_a_folder_of_others_is_left_out_and_logged(
        nested: Path, caplog: pytest.LogCaptureFixture) -> None:
    _write(nested, "cc.txt", ["q\tclash"])
    with caplog.at_level(logging.ERROR, logger="atlasfs"):
        tree = BlockTree(LinesSource(nested, ["cc/en/part-1.txt", "cc.txt", "a.txt"]))
    assert _tree_names(tree) == ["cc", "a"]
    assert _tree_names(tree, "/cc/en/part-1")[0] == "x.txt"
    assert any("cc.txt" in r.getMessage() and "left out" in r.getMessage() for r in caplog.records)


def test_the_state_a_pass_learned_is_stored_with_the_table_and_no_pass_is_made_again(
        nested: Path, tmp_path: Path) -> None:
    store = TableStore(str(nested), index_dir=str(tmp_path / "tables"))
    first = LinesSource(nested, ["cc/en/part-1.txt"])
    assert _tree_names(BlockTree(first, store=store), "/cc/en/part-1")[0] == "x.txt"
    assert first.shards[0].passes == 1
    assert os.listdir(tmp_path / "tables") == ["cc%2Fen%2Fpart-1.table"]

    second = LinesSource(nested, ["cc/en/part-1.txt"])
    tree = BlockTree(second, store=store)
    assert _tree_names(tree, "/cc/en/part-1") == ["x.txt", "y.txt", "z.txt", "000003.txt"]
    assert second.shards[0].passes == 0 and second.shards[0].decodes == 0
    assert second.shards[0].lines == 4  # restored from the stored state
    assert tree.read(tree.lookup("/cc/en/part-1/z.txt"), 0, 10) == b"gamma"


def test_a_stored_state_that_does_not_fit_is_ignored_and_the_pass_made_again(
        nested: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = TableStore(str(nested), index_dir=str(tmp_path / "tables"))
    first = BlockTree(LinesSource(nested, ["a.txt"]), store=store)
    first.names("/a")
    stored = tmp_path / "tables" / "a.table"
    table = first.table(0)
    assert table.state == json.dumps({"lines": 2}).encode()
    table.state = json.dumps({"lines": -7}).encode()  # well formed, checksums right: only the source refuses it
    table.save(str(stored), first.tables.table_key(0))
    again = LinesSource(nested, ["a.txt"])
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        assert _tree_names(BlockTree(again, store=store), "/a") == ["k1.txt", "k2.txt"]
    assert again.shards[0].passes == 1
    assert any("does not fit" in r.getMessage() for r in caplog.records)


def test_names_and_sizes_from_the_source_s_index_need_no_decoding(nested: Path) -> None:
    source = LinesSource(nested, ["cc/en/part-1.txt"], describe=True)
    tree = BlockTree(source)
    listing = tree.listdir("/cc/en/part-1")
    assert [(name, entry.size) for name, entry in listing] == [
        ("x.txt", 5), ("y.txt", 4), ("z.txt", 5), ("000003.txt", 6)]
    assert source.shards[0].decodes == 0
    assert tree.read(tree.lookup("/cc/en/part-1/000003.txt"), 0, 100) == b"no key"


def test_a_source_that_lies_about_sizes_fails_with_eio_not_wrong_bytes(nested: Path) -> None:
    source = LinesSource(nested, ["a.txt"], describe=True)
    shard = source.shards[0]
    honest = shard.describe_block
    shard.describe_block = lambda block: [(key, [(suffix, size + 1) for suffix, size in files])  # type: ignore
                                          for key, files in honest(block)]
    tree = BlockTree(source)
    entry = tree.lookup("/a/k1.txt")
    assert entry.size == 4
    with pytest.raises(OSError) as caught:
        tree.read(entry, 0, 10)
    assert caught.value.errno == errno.EIO


def test_a_failing_pass_fails_its_folder_alone_and_a_bad_block_its_files_alone(nested: Path) -> None:
    (nested / "a.txt").write_bytes(b"k1\tone\0\n")
    _write(nested, "b.txt", ["k1\tone", "k2\ttwo", "k3\tthree", "BAD", "k5\tfive"])
    tree = BlockTree(LinesSource(nested, ["a.txt", "b.txt", "cc/de/part-1.txt"]))
    with pytest.raises(OSError) as caught:
        tree.names("/a")
    assert caught.value.errno == errno.EIO and "a NUL byte" in str(caught.value)
    names = _tree_names(tree, "/b")
    assert names[:3] == ["k1.txt", "k2.txt", "k3.txt"]
    assert names[3:] == ["000003.unreadable", "000004.unreadable"]
    with pytest.raises(OSError) as caught:
        tree.lookup("/b/000003.unreadable")
    assert caught.value.errno == errno.EIO
    assert tree.read(tree.lookup("/b/k2.txt"), 0, 10) == b"two"
    assert _tree_names(tree, "/cc/de/part-1") == ["p.txt"]


def test_a_pass_s_problems_are_logged_ten_at_most_then_counted(
        nested: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = LinesSource(nested, ["a.txt"])
    source.shards[0].problems = lambda: [f"a.txt line {n}: not a sample" for n in range(25)]  # type: ignore
    with caplog.at_level(logging.WARNING, logger="atlasfs"):
        BlockTree(source).names("/a")
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "not a sample" in m] == [f"a.txt line {n}: not a sample" for n in range(10)]
    assert any(m.endswith("15 more problems (atlasfs verify lists them all)") for m in messages)


def test_a_stored_table_still_serves_once_the_dataset_is_moved(nested: Path, tmp_path: Path) -> None:
    store = TableStore(str(nested), index_dir=str(tmp_path / "tables"))
    BlockTree(LinesSource(nested, ["cc/en/part-1.txt"]), store=store).names("/cc/en/part-1")
    moved = Path(shutil.move(str(nested), str(tmp_path / "moved")))
    again = LinesSource(moved, ["cc/en/part-1.txt"])
    tree = BlockTree(again, store=TableStore(str(moved), index_dir=str(tmp_path / "tables")))
    assert _tree_names(tree, "/cc/en/part-1")[0] == "x.txt"
    assert again.shards[0].passes == 0, "the table stored before the move was used"

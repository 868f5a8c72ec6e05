"""The tar view: each shard as a seekable <shard>.tar equal to `atlasfs export`'s, and a wids
index; any byte range reads only the blocks under it. Real mounts at the end."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore
from atlasfs.tree.tarview import TarLayout, TarView
from fusemount import atlasfs, engine_answered_in_log, mounted
from helpers import REFERENCE, TORCH_STANDIN, expected_examples, in_threads, reference_names
from locateddata import read_through


def _dataset(path: Path, examples: int = 120, plain_keys: bool = False, jpg_bytes: int = 3000) -> Path:
    rng = random.Random(7)
    keys = [f"k{i:04d}" for i in range(examples)]
    rng.shuffle(keys)  # written shuffled: the view keeps that order
    if not plain_keys:  # names that need a pax header: too long, not ASCII
        keys[3], keys[8] = "x" * 120, "ünï/" + keys[8]
    with AtlasWriter(path, shard_size=50, block_size=6, compression_strategy=1) as writer:
        for i, key in enumerate(keys):
            writer.add_example({"__key__": key,
                                "jpg": rng.randbytes(rng.randrange(1, jpg_bytes)), "cls": i,
                                "json": {"i": i}})
    return path


def _export(dataset: Path, out: Path) -> None:
    result = atlasfs("export", str(dataset), str(out))
    assert result.returncode == 0, result.stderr


def test_every_byte_range_equals_export(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    _export(dataset, tmp_path / "out")
    view = TarView(BlockTree(AtlasDataset(dataset)))
    assert [name for name, _, _ in view.names("/")][:4] == ["0.tar", "1.tar", "2.tar", "shards.json"]
    rng = random.Random(1)
    for shard in ("0", "1", "2"):
        expected = (tmp_path / "out" / f"{shard}.tar").read_bytes()
        entry = view.lookup(f"/{shard}.tar")
        assert entry.size == len(expected)
        assert view.read(entry, 0, entry.size + 100) == expected
        for _ in range(300):
            offset = rng.randrange(entry.size + 10)
            size = rng.choice([1, 511, 512, 4096, 70000])
            assert view.read(entry, offset, size) == expected[offset:offset + size]
    index = view.read(view.lookup("/shards.json"), 0, 1 << 20)
    assert index == (tmp_path / "out" / "shards.json").read_bytes()
    assert json.loads(index)["shardlist"] == [{"url": "0.tar", "nsamples": 50}, {"url": "1.tar", "nsamples": 50},
                                              {"url": "2.tar", "nsamples": 20}]


def test_layouts_past_their_bound_are_let_go_and_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atlasfs.tree.tarview as tarview

    dataset = _dataset(tmp_path / "ds")
    _export(dataset, tmp_path / "out")
    view = TarView(BlockTree(AtlasDataset(dataset)))
    monkeypatch.setattr(tarview, "LAYOUT_BYTES", view.layout("0").nbytes() + 1)  # room for one
    for _ in range(2):
        for shard in ("0", "1", "2"):
            entry = view.lookup(f"/{shard}.tar")
            assert view.read(entry, 0, entry.size) == (tmp_path / "out" / f"{shard}.tar").read_bytes()
            assert list(view._layouts) == [shard]
    assert json.loads(view.read(view.lookup("/shards.json"), 0, 1 << 20))["shardlist"][2] == {"url": "2.tar",
                                                                                                 "nsamples": 20}
    assert len(view._layouts) == 1


def test_a_random_read_decodes_only_the_blocks_under_it(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    BlockTree(AtlasDataset(dataset), cache_bytes=0, store=TableStore(str(dataset))).table(0, sizes=True)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    tree.blocks.readahead = None  # only what the reads need (read-ahead serves readers going in order)
    tree.located.enabled = False  # and through blocks (a member read through its locator decodes none)
    view = TarView(tree)
    entry = view.lookup("/0.tar")  # its size: from the stored table, nothing decoded
    assert tree.cache.misses == 0
    layout: TarLayout = entry.ref
    expected: set[int] = set()
    for offset in (700, 40_000, int(layout.starts[-1]) - 5000):
        view.read(entry, offset, 4096)
        for i in range(len(layout)):  # the blocks of the members whose bytes the range touches
            data = int(layout.starts[i]) + len(layout.header(i))
            if data < offset + 4096 and offset < data + int(layout.sizes[i]):
                expected.add(tree.lookup(f"/0/{layout.name(i)}").ref.block)
        assert {block for _, block in tree.cache._items} == expected
    assert 1 < len(expected) < 9
    end = int(layout.starts[-1])  # the end blocks and record padding: zeros, nothing decoded
    assert view.read(entry, end, entry.size) == bytes(entry.size - end) and len(tree.cache) == len(expected)


@pytest.mark.parametrize("name", reference_names())
def test_every_reference_fixture_tar_equals_export_and_reads_back(tmp_path: Path, name: str) -> None:
    dataset = REFERENCE / name / "dataset"
    _export(dataset, tmp_path / "out")
    view = TarView(BlockTree(AtlasDataset(dataset)))
    total = 0
    for shard in AtlasDataset(dataset).shards:
        expected = (tmp_path / "out" / f"{shard.name}.tar").read_bytes()
        entry = view.lookup(f"/{shard.name}.tar")
        assert view.read(entry, 0, entry.size) == expected
        with tarfile.open(tmp_path / "out" / f"{shard.name}.tar") as archive:
            assert all(m.isreg() and not m.name.startswith("./") for m in archive.getmembers())
        total += len(list(wds.WebDataset(str(tmp_path / "out" / f"{shard.name}.tar"), shardshuffle=False,
                                         empty_check=False)))
    assert total == len(expected_examples(name))


# ---------------------------------------------------------------- through a real mount


def test_the_tar_view_through_a_mount(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    _export(dataset, tmp_path / "out")
    with mounted(dataset, "--view", "tars") as mnt:
        assert sorted(os.listdir(mnt)) == [".nv-meta", "0.idx", "0.tar", "0.tar.idx", "1.idx", "1.tar", "1.tar.idx",
                                           "2.idx", "2.tar", "2.tar.idx", "shards.json"]  # and the loaders' indexes
        for shard in ("0", "1", "2"):
            assert subprocess.run(["cmp", str(mnt / f"{shard}.tar"), str(tmp_path / "out" / f"{shard}.tar")]).returncode == 0
            listed = subprocess.run(["tar", "tf", str(mnt / f"{shard}.tar")], capture_output=True, text=True, check=True)
            exported = subprocess.run(["tar", "tf", str(tmp_path / "out" / f"{shard}.tar")], capture_output=True,
                                      text=True, check=True)
            assert listed.stdout == exported.stdout
        expected = (tmp_path / "out" / "1.tar").read_bytes()
        tail = subprocess.run(["tail", "-c", "5000", str(mnt / "1.tar")], capture_output=True, check=True).stdout
        assert tail == expected[-5000:]
        part = subprocess.run(["dd", f"if={mnt / '1.tar'}", "bs=512", "skip=7", "count=9", "status=none"],
                              capture_output=True, check=True).stdout
        assert part == expected[7 * 512:16 * 512]
        samples = list(wds.WebDataset(str(mnt / "{0..2}.tar"), shardshuffle=False).decode())
        assert [s["cls"] for s in samples] == list(range(120))
        assert not any(s["__key__"].startswith("./") for s in samples)

        errors: list[str] = []

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            fd = os.open(mnt / "1.tar", os.O_RDONLY)
            try:
                for _ in range(200):
                    offset = rng.randrange(len(expected))
                    size = rng.choice([1, 4096, 65536])
                    if os.pread(fd, size, offset) != expected[offset:offset + size]:
                        errors.append(f"{offset}+{size}")
            finally:
                os.close(fd)

        in_threads(reader, 8)
        assert errors == []


def test_view_both_shows_folders_and_tars(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds", examples=60)
    with mounted(dataset, "-o", "view=both") as mnt:
        assert sorted(os.listdir(mnt)) == [".nv-meta", "0", "0.idx", "0.tar", "0.tar.idx", "1", "1.idx", "1.tar",
                                           "1.tar.idx", "shards.json"]
        assert sum(len(files) for _, _, files in os.walk(mnt / "0")) == 150
        with tarfile.open(mnt / "0.tar") as archive:
            assert archive.getnames()[:3] == [n for n in os.listdir(mnt / "0")][:3]


def _members(tar: Path) -> dict[str, bytes]:
    """Member path -> bytes of a tar ``atlasfs export`` wrote."""
    with tarfile.open(tar) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers()}  # type: ignore[union-attr]


@pytest.mark.parametrize("view", ["files", "both"])
def test_view_both_answers_per_sample_files_in_c_as_view_files_does(tmp_path: Path, view: str) -> None:
    """Per-sample files under --view both are the engine's in C, as under --view files (issue
    #36, point 2): 4 readers, each opening every file by its path in its own order, then
    listing each folder with attributes; bytes and listings those of export, no read and no
    lookup in a shard folder asked Python past the first few that attach its table."""
    dataset = _dataset(tmp_path / "ds", examples=150, plain_keys=True)
    _export(dataset, tmp_path / "out")
    atlasfs("index", str(dataset))  # sizes stored, as a training set would be
    shards = ["0", "1", "2"]
    exported = {shard: _members(tmp_path / "out" / f"{shard}.tar") for shard in shards}
    files = [(shard, name) for shard in shards for name in exported[shard]]
    log = tmp_path / "daemon.log"
    with mounted(dataset, "--view", view, "-o", f"log_file={log}") as mnt:
        errors = read_through(mnt, exported)
        for shard in shards:  # listed in example order, with their sizes (READDIRPLUS, then stat)
            assert os.listdir(mnt / shard) == list(exported[shard])
            assert [(mnt / shard / name).stat().st_size for name in exported[shard]] == \
                [len(data) for data in exported[shard].values()]
    assert errors == []
    answered = engine_answered_in_log(log)
    assert answered["read"][1] == 0 and answered["read"][0] >= len(files), answered
    # Python: the root's lookups of each shard folder, and in each folder the first lookups
    # before its table is attached (one a reader at most)
    assert answered["lookup"][1] <= len(shards) * 5 and answered["lookup"][0] > 0, answered
    assert answered["getattr"][1] <= len(shards) + 1, answered


def test_view_both_reads_files_and_tars_at_once_with_the_exported_bytes(tmp_path: Path) -> None:
    """Readers of per-sample files (answered in C) and of the tars (the view's) at once: each
    tar byte for byte the export's, every file its member's bytes."""
    dataset = _dataset(tmp_path / "ds", examples=150, plain_keys=True)
    _export(dataset, tmp_path / "out")
    atlasfs("index", str(dataset))
    shards = ["0", "1", "2"]
    exported = {shard: _members(tmp_path / "out" / f"{shard}.tar") for shard in shards}
    tars = {shard: (tmp_path / "out" / f"{shard}.tar").read_bytes() for shard in shards}
    errors: list[str] = []
    with mounted(dataset, "--view", "both") as mnt:
        def reader(i: int) -> None:
            rng = random.Random(i)
            if i % 2:  # a tar read whole, then pieces of it at random
                shard = shards[i // 2 % len(shards)]
                if (mnt / f"{shard}.tar").read_bytes() != tars[shard]:
                    errors.append(f"{shard}.tar")
                fd = os.open(mnt / f"{shard}.tar", os.O_RDONLY)
                try:
                    for _ in range(100):
                        offset, size = rng.randrange(len(tars[shard])), rng.choice([1, 700, 4096, 200_000])
                        if os.pread(fd, size, offset) != tars[shard][offset:offset + size]:
                            errors.append(f"{shard}.tar {offset}+{size}")
                finally:
                    os.close(fd)
            else:
                order = [(shard, name) for shard in shards for name in exported[shard]]
                rng.shuffle(order)
                for shard, name in order:
                    if (mnt / shard / name).read_bytes() != exported[shard][name]:
                        errors.append(f"{shard}/{name}")

        in_threads(reader, 6)
    assert errors == []


def test_wids_reads_every_sample_by_index_through_the_mount(tmp_path: Path) -> None:
    # wids reads member names from the ustar header only (docs/layout.md): keys that fit it
    dataset = _dataset(tmp_path / "ds", plain_keys=True)
    script = TORCH_STANDIN + f'''
import os
import wids
from atlasfs import wids_in_place
copied = wids.ShardListDataset(sys.argv[1], transformations=[], cache_dir={str(tmp_path / "copies")!r})
linked = wids.ShardListDataset(sys.argv[1], transformations=[], localname=wids_in_place({str(tmp_path / "links")!r}))
for ds in (copied, linked):
    assert len(ds) == 120, len(ds)
    for i in range(len(ds)):
        sample = ds[i]
        assert int(sample[".cls"].read()) == i, (i, sample["__key__"])
links = os.listdir({str(tmp_path / "links")!r})
assert len(links) == 3 and all(os.path.islink(os.path.join({str(tmp_path / "links")!r}, l)) for l in links), links
print("ok", len(ds))
'''
    with mounted(dataset, "--view", "tars") as mnt:
        result = subprocess.run([sys.executable, "-c", script, str(mnt / "shards.json")], capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 0 and "ok 120" in result.stdout, result.stderr[-3000:]


def test_listing_the_tar_view_from_stored_tables_decodes_nothing(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    atlasfs("index", str(dataset))
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    view = TarView(tree)
    sizes = {name: view.lookup(f"/{name}").size for name, is_dir, _ in view.names("/") if not is_dir}
    sizes |= {name: view.lookup(f"/.nv-meta/{name}").size for name, _, _ in view.names("/.nv-meta")}
    assert len(sizes) == 15 and all(sizes.values())  # the loaders' indexes too
    assert tree.cache.misses == 0


def _wids_names_ok(names: list[str]) -> bool:
    """What wids can read: names kept whole in the ustar name field (docs/layout.md)."""
    return all(n.isascii() and len(n) <= 100 for n in names)


@pytest.mark.parametrize("name", reference_names())
def test_every_reference_fixture_through_the_tar_view(tmp_path: Path, name: str) -> None:
    dataset = REFERENCE / name / "dataset"
    _export(dataset, tmp_path / "out")
    shards = [s.name for s in AtlasDataset(dataset).shards]
    with mounted(dataset, "--view", "both") as mnt:
        assert sorted(os.listdir(mnt)) == sorted([*shards, *[f"{s}{x}" for s in shards for x in (".tar", ".tar.idx", ".idx")],
                                                  "shards.json", ".nv-meta"])
        assert (mnt / "shards.json").read_bytes() == (tmp_path / "out" / "shards.json").read_bytes()
        names: list[str] = []
        for shard in shards:
            tar, exported = mnt / f"{shard}.tar", tmp_path / "out" / f"{shard}.tar"
            assert subprocess.run(["cmp", str(tar), str(exported)]).returncode == 0, shard
            listed = subprocess.run(["tar", "tf", str(tar)], capture_output=True, check=True).stdout
            assert listed == subprocess.run(["tar", "tf", str(exported)], capture_output=True, check=True).stdout
            with tarfile.open(exported) as archive:
                names += archive.getnames()
        urls = f"{mnt}/{{{','.join(shards)}}}.tar" if len(shards) > 1 else f"{mnt}/{shards[0]}.tar"
        from_mount = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
        from_export = [s for shard in shards for s in wds.WebDataset(
            str(tmp_path / "out" / f"{shard}.tar"), shardshuffle=False, empty_check=False)]
        assert [s["__key__"] for s in from_mount] == [s["__key__"] for s in from_export]
        assert len(from_mount) == len(expected_examples(name))
        assert not any(s["__key__"].startswith("./") for s in from_mount)
        if _wids_names_ok(names) and names:
            script = TORCH_STANDIN + '''
import wids
from atlasfs import wids_in_place
ds = wids.ShardListDataset(sys.argv[1], transformations=[], localname=wids_in_place(sys.argv[2]))
print(len(ds), *[ds[i]["__key__"] for i in range(len(ds))])
'''
            result = subprocess.run([sys.executable, "-c", script, str(mnt / "shards.json"), str(tmp_path / "links")],
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr[-2000:]
            count, *keys = result.stdout.split()
            assert int(count) == len(from_export) and keys == [s["__key__"] for s in from_export]


def test_a_corrupt_block_fails_only_the_tar_ranges_over_it(tmp_path: Path) -> None:
    # Big enough files that the kernel's read-ahead (up to 1 MiB) from the ranges read
    # below stays clear of the broken block: a read fails if any byte it asks for does.
    dataset = _dataset(tmp_path / "ds", examples=60, jpg_bytes=400_000)
    _export(dataset, tmp_path / "out")
    expected = (tmp_path / "out" / "0.tar").read_bytes()
    atlasfs("index", str(dataset))  # sizes stored: the tar is placed without decoding
    layout = TarView(BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))).layout("0")
    data = dataset / "0" / "data.bin"
    st = data.stat()
    index = np.load(dataset / "0" / "index.npy")
    raw = bytearray(data.read_bytes())
    raw[int(index[3]) + 8:int(index[4]) - 8] = bytes(int(index[4]) - int(index[3]) - 16)  # block 3's frame
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    in_block_3 = [i for i in range(len(layout)) if 18 <= i // 3 < 24]  # examples 18-23, three files each
    first = int(layout.starts[in_block_3[0]])
    after = int(layout.starts[in_block_3[-1] + 1])
    assert first > 2 << 20 and layout.size - after > 2 << 20
    with mounted(dataset, "--view", "tars") as mnt:
        fd = os.open(mnt / "0.tar", os.O_RDONLY)
        try:
            with pytest.raises(OSError) as info:
                os.pread(fd, 4096, first + 600)
            assert info.value.errno == errno.EIO
            assert os.pread(fd, 4096, 0) == expected[:4096]  # before it
            past = -(-after // 4096) * 4096  # the kernel reads whole pages: the first one wholly after it
            assert os.pread(fd, 4096, past) == expected[past:past + 4096]
            assert (mnt / "1.tar").read_bytes() == (tmp_path / "out" / "1.tar").read_bytes()  # and the others
        finally:
            os.close(fd)

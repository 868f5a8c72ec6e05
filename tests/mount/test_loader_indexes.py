"""The loaders' indexes of the tar view (issue #36): energon's <shard>.tar.idx and .nv-meta/,
DALI's <shard>.idx, computed from the tar layouts, never written into the dataset.

Here each file is checked against the exported tars as Python's tarfile reads them, and the
mount's behaviour (options, storage and trust of index.sqlite, failures, time). The same
files against the real `energon prepare` and `wds2idx`, and the real loaders training from
a mount, are in test_loaders_real.py (marker `loaders`: `make test-loaders`)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import stat
import struct
import tarfile
import time
from pathlib import Path

import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.indexes import energon
from atlasfs.tree.indexes.served import LoaderSettings
from atlasfs.tree.table.store import TableStore
from atlasfs.tree.tarview import TarView
from fusemount import atlasfs, mounted
from loaderdata import loader_dataset, sqlite_rows
from otheruser import NOBODY, require_root

# energon's rules (megatron/energon/flavors/webdataset/config.py), restated to check against
SPLIT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
META = re.compile(r"__[^/]*__($|/)")


def _dataset(path: Path, examples: int = 120, shard_size: int = 50, odd_keys: bool = True) -> Path:
    return loader_dataset(path, 7, examples, shard_size, odd_keys)


def _export(dataset: Path, out: Path) -> None:
    result = atlasfs("export", str(dataset), str(out))
    assert result.returncode == 0, result.stderr


def _read(view: TarView, path: str) -> bytes:
    entry = view.lookup(path)
    data = view.read(entry, 0, entry.size + 10)
    assert len(data) == entry.size
    return data


def _tarfile_expectations(tar: Path, tar_id: int) -> tuple[bytes, list[str], list[tuple], list[tuple]]:
    """What energon and DALI find in ``tar``, read with tarfile: the .tar.idx, DALI's lines
    (without the name escaping), sample rows and part rows."""
    starts: list[int] = []
    dali: list[list[str]] = []
    samples: list[tuple] = []
    parts: list[tuple] = []
    last_key = last_dali = None
    with tarfile.open(tar) as archive:
        for m in archive:
            base = m.name[m.name.rfind("/") + 1:]
            dot = m.name.find(".", m.name.rfind("/") + 1)
            if base.find(".") > 0:
                entry = f"{m.name[dot + 1:]} {m.offset_data} {m.size} {m.name}"
                if m.name[:dot] != last_dali:
                    dali.append([entry])
                    last_dali = m.name[:dot]
                else:
                    dali[-1].append(entry)
            match = None if META.match(m.name) else SPLIT.match(m.name)
            if match is None:
                continue
            if match.group(1) != last_key:
                starts.append(m.offset)
                samples.append((tar_id, match.group(1), len(samples), m.offset))
                last_key = match.group(1)
            parts.append((tar_id, len(samples) - 1, match.group(2), m.offset_data, m.size))
        end = archive.offset
    ends = [s[3] for s in samples[1:]] + [end]
    samples = [(*s, e - s[3]) for s, e in zip(samples, ends)]
    lines = [f"v1.2 {len(dali)}", *(" ".join(s) for s in dali)]
    return struct.pack(f"<{len(starts) + 1}Q", *starts, end), lines, samples, parts


def test_every_index_agrees_with_the_tars_as_tarfile_reads_them(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    _export(dataset, tmp_path / "out")
    view = TarView(BlockTree(AtlasDataset(dataset)))
    names = [n for n, _, _ in view.names("/")]
    assert names == ["0.tar", "1.tar", "2.tar", "shards.json", "0.tar.idx", "0.idx", "1.tar.idx", "1.idx",
                     "2.tar.idx", "2.idx", ".nv-meta"]
    assert [n for n, _, _ in view.names("/.nv-meta")] == [".info.json", "split.yaml", "dataset.yaml",
                                                           "index.sqlite", "index.uuid"]
    all_samples: list[tuple] = []
    all_parts: list[tuple] = []
    counts = {}
    for tar_id, shard in enumerate("012"):
        tar_idx, dali_lines, samples, parts = _tarfile_expectations(tmp_path / "out" / f"{shard}.tar", tar_id)
        assert _read(view, f"/{shard}.tar.idx") == tar_idx
        assert _read(view, f"/{shard}.idx").decode().split("\n") == [*dali_lines, ""]
        all_samples += samples
        all_parts += parts
        counts[f"{shard}.tar"] = len(samples)
    assert counts == {"0.tar": 50, "1.tar": 50, "2.tar": 20}
    info = json.loads(_read(view, "/.nv-meta/.info.json"))
    assert info == {"energon_version": "7.4.1", "shard_counts": counts}
    assert _read(view, "/.nv-meta/split.yaml") == b"split_parts:\n  train:\n  - '{0..2}.tar'\nexclude: []\n"
    assert _read(view, "/.nv-meta/dataset.yaml") == b"__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    (tmp_path / "index.sqlite").write_bytes(_read(view, "/.nv-meta/index.sqlite"))
    schema, samples, parts = sqlite_rows(tmp_path / "index.sqlite")
    assert [(kind, name) for kind, name, _, _ in schema] == list(energon.SCHEMA)
    assert samples == sorted(all_samples) and parts == sorted(all_parts)
    uuid = _read(view, "/.nv-meta/index.uuid")
    assert re.fullmatch(rb"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuid)
    assert _read(TarView(BlockTree(AtlasDataset(dataset))), "/.nv-meta/index.uuid") == uuid  # stable


def test_names_as_energon_and_wds2idx_split_them() -> None:
    assert energon.split_member("a/b.c.d") == ("a/b", "c.d")
    assert energon.split_member("a.b/c") is None and energon.split_member("__x__/a.json") is None
    assert energon.tar_order(["a-b.tar", "a/b.tar", "10.tar", "9.tar"]) == ["10.tar", "9.tar", "a/b.tar", "a-b.tar"]
    assert energon.collapse(["0.tar", "1.tar", "2.tar", "x.tar", "04.tar", "05.tar", "7.tar"]) == [
        "{0..2}.tar", "x.tar", "{04..05}.tar", "7.tar"]
    assert energon.split_by_ratio([f"{i}.tar" for i in range(5)], (1, 1, 1)) == {
        "train": ["0.tar"], "val": ["1.tar", "2.tar"], "test": ["3.tar", "4.tar"]}
    from atlasfs.tree.indexes import dali
    assert dali.split_name("a/b.c.d") == ("a/b", "c.d") and dali.split_name("a/bc") == ("a/b", "a/bc")
    assert dali.tar_printed("ü\\a\tb") == "ü\\\\a\\tb" and dali.tar_printed("x\udcff") == "x\\377"


def _snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
            for p in sorted(folder.rglob("*"))} | {".": (0, folder.stat().st_mtime_ns, folder.stat().st_mode)}


def test_a_mount_serves_them_writes_nothing_and_builds_index_sqlite_once(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    _export(dataset, tmp_path / "out")
    view = TarView(BlockTree(AtlasDataset(dataset)))
    expected = {path: _read(view, "/" + path) for path in
                ["0.tar.idx", "1.idx", "2.tar.idx", ".nv-meta/.info.json", ".nv-meta/split.yaml",
                 ".nv-meta/dataset.yaml", ".nv-meta/index.uuid", ".nv-meta/index.sqlite"]}
    before = _snapshot(dataset)
    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": str(cache)}
    for attempt in range(2):
        with mounted(dataset, "--view", "tars", env=env) as mnt:
            assert sorted(os.listdir(mnt / ".nv-meta")) == sorted([".info.json", "split.yaml", "dataset.yaml",
                                                                     "index.sqlite", "index.uuid"])
            for path, data in expected.items():
                assert (mnt / path).read_bytes() == data, path
                assert (mnt / path).stat().st_size == len(data)
            with pytest.raises(OSError) as info:
                (mnt / ".nv-meta" / "new").write_bytes(b"x")
            assert info.value.errno in (errno.EROFS, errno.EACCES)
        stored = list(cache.rglob("energon-*.sqlite"))
        assert len(stored) == 1 and stored[0].read_bytes() == expected[".nv-meta/index.sqlite"]
        assert stat.S_IMODE(stored[0].stat().st_mode) == 0o600
        if attempt == 0:
            first = stored[0].stat().st_mtime_ns
    assert stored[0].stat().st_mtime_ns == first  # the second mount used it as stored
    assert _snapshot(dataset) == before  # nothing written into the dataset


def test_energon_split_and_dataset_options(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds", examples=100, shard_size=20, odd_keys=False)
    with mounted(dataset, "--view", "tars", "-o", "energon_split=1:1:1") as mnt:
        assert (mnt / ".nv-meta" / "split.yaml").read_bytes() == (
            b"split_parts:\n  train:\n  - 0.tar\n  val:\n  - '{1..2}.tar'\n  test:\n  - '{3..4}.tar'\nexclude: []\n")
    split = tmp_path / "my-split.yaml"
    split.write_text("split_parts:\n  train: ['{0..3}.tar']\n  val: [4.tar]\nexclude: []\n")
    yaml = tmp_path / "my-dataset.yaml"
    yaml.write_text("sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
                    "field_map:\n  image: jpg\n  caption: json\n")
    with mounted(dataset, "--view", "both", "-o", f"energon_split={split},energon_dataset={yaml}") as mnt:
        assert (mnt / ".nv-meta" / "split.yaml").read_bytes() == split.read_bytes()
        assert (mnt / ".nv-meta" / "dataset.yaml").read_bytes() == yaml.read_bytes()
        assert {"0", "0.tar", "0.tar.idx", "0.idx", ".nv-meta", "shards.json"} <= set(os.listdir(mnt))
    (tmp_path / "mp").mkdir()
    result = atlasfs("mount", str(dataset), str(tmp_path / "mp"), "--view", "tars", "--energon-dataset",
                     str(tmp_path / "missing.yaml"))
    assert result.returncode != 0 and "energon_dataset=" in result.stderr and "No such file" in result.stderr
    result = atlasfs("mount", str(dataset), str(tmp_path / "mp"), "-o", "energon_split=1:1:1")
    assert result.returncode != 0 and "--view tars" in result.stderr
    assert LoaderSettings.from_options("8:1:1", None).split_ratio == (8.0, 1.0, 1.0)


def test_atlasfs_index_stores_index_sqlite_beside_and_a_mount_trusts_it_only_as_it_trusts_tables(
        tmp_path: Path) -> None:
    require_root()
    dataset = _dataset(tmp_path / "ds")
    result = atlasfs("index", str(dataset))
    assert result.returncode == 0 and result.stderr == "", result.stderr  # stored: the tables' line says it all
    beside, = (dataset / ".atlasfs-tables").glob("energon-*.sqlite")
    assert stat.S_IMODE(beside.stat().st_mode) == 0o644
    served = beside.read_bytes()
    cache = tmp_path / "cache"

    def mount_once(log: Path) -> bytes:
        with mounted(dataset, "--view", "tars", "--log-file", str(log), env={"XDG_CACHE_HOME": str(cache)}) as mnt:
            return (mnt / ".nv-meta" / "index.sqlite").read_bytes()

    assert mount_once(tmp_path / "a.log") == served and not list(cache.rglob("*.sqlite"))  # used as stored
    for i, spoil in enumerate(("group-writable", "another user's", "a link", "not SQLite")):
        original = beside.with_suffix(".keep")
        os.replace(beside, original)
        if spoil == "a link":
            beside.symlink_to(original)
        else:
            beside.write_bytes(b"not an sqlite file" * 100 if spoil == "not SQLite" else original.read_bytes())
            os.chmod(beside, 0o664 if spoil == "group-writable" else 0o644)
            if spoil == "another user's":
                os.chown(beside, NOBODY.pw_uid, NOBODY.pw_gid)
        log = tmp_path / f"{i}.log"
        assert mount_once(log) == served, spoil
        assert f"ignoring {beside}" in log.read_text(), (spoil, log.read_text())
        built, = cache.rglob("energon-*.sqlite")  # built again, into the user's cache
        built.unlink()
        beside.unlink()
        os.replace(original, beside)


def test_a_key_in_two_tars_fails_index_sqlite_alone(tmp_path: Path) -> None:
    wds = tmp_path / "wds"
    wds.mkdir()
    for shard in ("a", "b"):
        with tarfile.open(wds / f"{shard}.tar", "w", format=tarfile.USTAR_FORMAT) as archive:
            for key in ("same", f"only-{shard}"):
                info = tarfile.TarInfo(f"{key}.txt")
                info.size = 3
                archive.addfile(info, __import__("io").BytesIO(b"abc"))
    log = tmp_path / "mount.log"
    with mounted(wds, "--view", "tars", "--log-file", str(log), env={"XDG_CACHE_HOME": str(tmp_path / "c")}) as mnt:
        assert json.loads((mnt / ".nv-meta" / ".info.json").read_bytes())["shard_counts"] == {"a.tar": 2, "b.tar": 2}
        with pytest.raises(OSError) as info:
            (mnt / ".nv-meta" / "index.sqlite").read_bytes()
        assert info.value.errno == errno.EIO
        assert len((mnt / "b.tar.idx").read_bytes()) == 24 and (mnt / "b.idx").read_bytes().startswith(b"v1.2 2\n")
    assert "the sample key same is in more than one sample" in log.read_text()


def test_each_index_of_a_2500_sample_shard_in_under_a_second_cold(tmp_path: Path) -> None:
    dataset = tmp_path / "big"
    rng = random.Random(3)
    with AtlasWriter(dataset, shard_size=2500, block_size=50, compression_strategy=1) as writer:
        for i in range(2500):
            writer.add_example({"__key__": f"s{i:05d}", "jpg": rng.randbytes(2000), "cls": i, "json": {"i": i}})
    times = {}
    for path in ("/0.tar.idx", "/0.idx", "/.nv-meta/.info.json", "/.nv-meta/index.sqlite"):
        source = open_source(str(dataset), None, SourceOptions())
        view = TarView(BlockTree(source, store=TableStore(str(dataset), index_dir=str(tmp_path / f"t{len(times)}"))),
                       store=TableStore(str(dataset), index_dir=str(tmp_path / f"t{len(times)}")))
        start = time.perf_counter()
        data = _read(view, path)  # cold: no table stored, the shard decoded and sized to lay it out
        times[path] = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(10):
            assert _read(view, path) == data
        times[path + " again"] = (time.perf_counter() - start) / 10
        view.loaders.close()
    assert all(t < 1.0 for t in times.values()), times
    assert all(times[p + " again"] < 0.01 for p in ("/0.tar.idx", "/0.idx", "/.nv-meta/.info.json")), times
    digest = hashlib.sha256(data).hexdigest()
    assert digest  # the sqlite read back whole

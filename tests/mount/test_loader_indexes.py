"""The loaders' indexes of the tar view through a real mount (issue #36): the mount serves them,
writes nothing into the dataset and builds index.sqlite once; energon's split and dataset
options; index.sqlite stored by ``atlasfs index`` and trusted only as tables are; a key in two
tars fails index.sqlite alone (the files themselves: tests/unit/tree/test_indexes.py)."""

from __future__ import annotations

import errno
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from atlasfs import AtlasDataset
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.indexes.served import LoaderSettings
from atlasfs.tree.tarview import TarView
from fusemount import atlasfs, mounted
from loaderdata import export_tars, indexes_dataset, view_read
from otheruser import NOBODY, require_root


def _snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
            for p in sorted(folder.rglob("*"))} | {".": (0, folder.stat().st_mtime_ns, folder.stat().st_mode)}


def test_a_mount_serves_them_writes_nothing_and_builds_index_sqlite_once(tmp_path: Path) -> None:
    dataset = indexes_dataset(tmp_path / "ds")
    export_tars(dataset, tmp_path / "out")
    view = TarView(BlockTree(AtlasDataset(dataset)))
    expected = {path: view_read(view, "/" + path) for path in
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
    dataset = indexes_dataset(tmp_path / "ds", examples=100, shard_size=20, odd_keys=False)
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
    dataset = indexes_dataset(tmp_path / "ds")
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

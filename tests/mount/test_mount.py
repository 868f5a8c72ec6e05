"""The mount, for real: every reference fixture through FUSE, driven by real programs."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import tarfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import webdataset as wds

from fusemount import atlasfs, mounted
from helpers import (
    BYTES_ONLY,
    REFERENCE,
    contract_files,
    deep_equal,
    expected_examples,
    in_threads,
    reference_names,
    shard_sizes,
)


@pytest.fixture(scope="module", params=reference_names())
def fixture_mount(request: pytest.FixtureRequest) -> Iterator[tuple[str, Path]]:
    name = request.param
    with mounted(REFERENCE / name / "dataset", "-o", "cache_size=64K") as mnt:
        yield name, mnt


def contract(name: str) -> dict[str, dict[str, tuple[bytes, Any]]]:
    """shard folder -> relative path -> (bytes, promised value)."""
    dirs = sorted(p.name for p in (REFERENCE / name / "dataset").iterdir() if p.is_dir())
    return dict(zip(dirs, contract_files(expected_examples(name), shard_sizes(name))))


def test_find_lists_exactly_the_contract_names_and_sizes(fixture_mount: tuple[str, Path]) -> None:
    name, mnt = fixture_mount
    expected = {f"{shard}/{path}": len(data) for shard, files in contract(name).items()
                for path, (data, _) in files.items()}
    found = subprocess.run(["find", ".", "-type", "f", "-printf", r"%P\t%s\n"], cwd=mnt,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    listed = dict(line.rsplit("\t", 1) for line in found)
    assert {k: int(v) for k, v in listed.items()} == expected
    shards = subprocess.run(["ls", "-1"], cwd=mnt, capture_output=True, text=True, check=True).stdout.split()
    assert shards == sorted(contract(name))


def _children_in_order(paths: list[str], folder: str) -> list[str]:
    """The samples and sub-folders directly in ``folder`` in order of first appearance among
    ``paths`` (in example order); a sample is its key's last part, the name up to its first dot."""
    prefix = f"{folder}/" if folder else ""
    seen: dict[str, None] = {}
    for path in paths:
        if path.startswith(prefix):
            first, slash, _ = path[len(prefix):].partition("/")
            seen[first if slash else first.split(".")[0]] = None
    return list(seen)


def test_ls_lR_shows_modes_sizes_and_example_order(fixture_mount: tuple[str, Path]) -> None:
    name, mnt = fixture_mount
    listing = subprocess.run(["ls", "-lRn", "--time-style=+%s"], cwd=mnt, capture_output=True, text=True,
                             check=True, env={**os.environ, "LC_ALL": "C"}).stdout
    for line in listing.splitlines():
        if line.startswith("-"):
            assert line.startswith("-r--r--r-- 1 "), line
        elif line.startswith("d"):
            assert line.startswith("dr-xr-xr-x 1 "), line
    for shard, files in contract(name).items():
        for folder, _, _ in os.walk(mnt / shard):
            inside = "" if folder == str(mnt / shard) else os.path.relpath(folder, mnt / shard)
            names = os.listdir(folder)  # readdir order
            samples = [n if os.path.isdir(os.path.join(folder, n)) else n.split(".")[0] for n in names]
            assert list(dict.fromkeys(samples)) == _children_in_order(list(files), inside), folder
            for sample in set(samples):  # a sample's files adjacent, by suffix bytes
                own = [n for n in names if n.split(".")[0] == sample and not os.path.isdir(os.path.join(folder, n))]
                at = [i for i, n in enumerate(names) if n in own]
                assert at == list(range(at[0], at[0] + len(at))) if at else True
                assert own == sorted(own, key=lambda n: n.encode()), folder


def test_listings_and_stat_agree_on_inode_numbers(fixture_mount: tuple[str, Path]) -> None:
    """readdir answers from names alone (no sizes); its inode numbers must still be stat's."""
    _, mnt = fixture_mount
    seen = 0
    for folder, _, _ in os.walk(mnt):
        with os.scandir(folder) as entries:
            for entry in entries:
                assert entry.inode() == os.stat(entry.path).st_ino, entry.path
                seen += 1
    assert seen > 0


def test_cat_returns_the_contract_bytes(fixture_mount: tuple[str, Path]) -> None:
    name, mnt = fixture_mount
    for shard, files in contract(name).items():
        paths = sorted(files)
        for chunk in range(0, len(paths), 200):
            batch = paths[chunk:chunk + 200]
            out = subprocess.run(["cat", *batch], cwd=mnt / shard, capture_output=True, check=True).stdout
            assert out == b"".join(files[p][0] for p in batch)
        for path in paths:
            st = os.stat(mnt / shard / path)
            assert st.st_size == len(files[path][0])
            assert st.st_blocks == -(-st.st_size // 512)
            assert st.st_uid == os.getuid()


def _check_samples(samples: list[dict[str, Any]], files: dict[str, tuple[bytes, Any]], raw: dict[str, bytes]) -> None:
    """Every sample's decoded values equal the contract's promise; raw bytes equal everywhere."""
    assert raw == {p: d for p, (d, _) in files.items()}
    by_key: dict[str, dict[str, tuple[bytes, Any]]] = {}
    for path, item in files.items():
        folder, _, base = path.rpartition("/")
        stem, _, suffix = base.partition(".")
        by_key.setdefault(f"{folder}/{stem}" if folder else stem, {})[suffix.lower()] = item
    assert len(samples) == len(by_key)
    for sample in samples:
        fields = by_key[sample["__key__"]]
        shown = {k: v for k, v in sample.items() if not k.startswith("__")}
        assert set(shown) == set(fields), sample["__key__"]
        for suffix, (data, promised) in fields.items():
            if promised is BYTES_ONLY:
                continue
            assert deep_equal(shown[suffix], promised), (sample["__key__"], suffix)


def _tar_members(path: Path, strip: str = "") -> tuple[list[str], dict[str, bytes]]:
    with tarfile.open(path) as archive:
        members = [m for m in archive if m.isfile()]
        names = [m.name[len(strip):] if m.name.startswith(strip) else m.name for m in members]
        return names, {n: archive.extractfile(m).read() for n, m in zip(names, members)}


def test_plain_tar_and_export_give_the_examples_through_webdataset(
        fixture_mount: tuple[str, Path], tmp_path: Path) -> None:
    name, mnt = fixture_mount
    result = atlasfs("export", str(REFERENCE / name / "dataset"), str(tmp_path / "export"))
    assert result.returncode == 0, result.stderr
    for shard, files in contract(name).items():
        plain = tmp_path / f"plain-{shard}.tar"
        subprocess.run(["tar", "cf", str(plain), "-C", str(mnt / shard), "."], check=True)
        exported = tmp_path / "export" / f"{shard}.tar"
        plain_names, plain_raw = _tar_members(plain, strip="./")
        export_names, export_raw = _tar_members(exported)
        assert sorted(export_names) == sorted(plain_names) and export_raw == plain_raw  # same members and bytes
        if not any("/" in n for n in export_names):  # tar walks folders together; export keeps example order
            assert export_names == plain_names
        examples_in_shard = dict(zip(sorted(contract(name)), shard_sizes(name)))[shard]
        for path, strip in ((plain, "./"), (exported, "")):
            dataset = wds.WebDataset(str(path), shardshuffle=False, empty_check=False).decode()
            samples = [{**s, "__key__": s["__key__"].removeprefix(strip)} for s in dataset]
            assert len(samples) == examples_in_shard
            _check_samples(samples, files, export_raw)
        with tarfile.open(exported) as archive:
            assert all(m.mode == 0o444 and not m.name.startswith("./") for m in archive)


def test_writes_fail_with_erofs_and_missing_paths_with_enoent(fixture_mount: tuple[str, Path]) -> None:
    name, mnt = fixture_mount
    some_file = next((Path(d) / f for d, _, fs in os.walk(mnt) for f in fs), None)
    attempts = [
        lambda: open(mnt / "new-file", "w"),
        lambda: os.mkdir(mnt / "new-folder"),
    ]
    if some_file is not None:
        attempts += [
            lambda: open(some_file, "r+b"),
            lambda: os.rename(some_file, some_file.with_name("renamed")),
            lambda: os.chmod(some_file, 0o777),
            lambda: os.unlink(some_file),
            lambda: os.setxattr(some_file, "user.test", b"x"),
            lambda: os.truncate(some_file, 0),
        ]
    for attempt in attempts:
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EROFS
    for missing in (mnt / "no-such-shard", mnt / sorted(os.listdir(mnt))[0] / "no-such-file.txt"):
        with pytest.raises(FileNotFoundError):
            os.stat(missing)
    for raw in (b"\xff", b"\xc3(.txt"):  # names that are not UTF-8 cannot be in the tree
        with pytest.raises(FileNotFoundError):
            os.stat(os.fsencode(mnt / sorted(os.listdir(mnt))[0]) + b"/" + raw)
    result = subprocess.run(["cat", str(mnt / "nope")], capture_output=True, text=True)
    assert result.returncode != 0 and "No such file" in result.stderr


def test_eight_concurrent_readers_get_correct_bytes(fixture_mount: tuple[str, Path]) -> None:
    name, mnt = fixture_mount
    files = {f"{shard}/{p}": d for shard, fs in contract(name).items() for p, (d, _) in fs.items()}
    if not files:  # the empty dataset: its shard folders must list empty
        assert all(os.listdir(mnt / shard) == [] for shard in os.listdir(mnt))
        return
    errors: list[str] = []

    def reader(seed: int) -> None:
        order = list(files)
        random.Random(seed).shuffle(order)
        for path in order * 2:
            with open(mnt / path, "rb") as f:
                if f.read() != files[path]:
                    errors.append(path)

    in_threads(reader, 8)
    assert errors == []


def test_tar_through_a_mount_that_reads_ahead_matches_export(tmp_path: Path) -> None:
    """tar goes through a shard in order, so the mount decodes and encodes blocks ahead of it
    on a background thread; what tar gets must still be export's bytes exactly."""
    from atlasfs import AtlasDataset, AtlasWriter
    from atlasfs.commands.export import write_shard_tar
    from atlasfs.tree.blocktree import BlockTree

    rng = random.Random(11)
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=400, block_size=8, compression_strategy=1) as writer:
        for i in range(800):
            writer.add_example({"jpg": rng.randbytes(rng.randrange(500, 3000)), "cls": i % 7,
                                "json": {"i": i, "v": [rng.random() for _ in range(10)]}})
    expected = tmp_path / "expected.tar"
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=0)  # no cache, so no read-ahead
    assert tree.blocks.readahead is None
    write_shard_tar(tree, "/0", str(expected))
    for run in range(2):  # the first mount sizes files as tar looks them up; the second has tables stored
        with mounted(dataset) as mnt:  # default cache: reads ahead
            plain = tmp_path / f"plain{run}.tar"
            subprocess.run(["tar", "cf", str(plain), "-C", str(mnt / "0"), "."], check=True)
            assert _tar_members(plain, strip="./") == _tar_members(expected)

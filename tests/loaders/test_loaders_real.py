"""The real loaders against a tar view mount (issue #36), run by `make test-loaders` (marker
`loaders`, deselected from `make test`): they need torch, megatron-energon 7.4.1 and
nvidia-dali-cuda120 2.4.0 (about 6.5 GB), installed in their own virtualenv,
$ATLASFS_LOADERS_VENV (default .venv-loaders), never in atlasfs's. Without it these tests
fail: they are never skipped.

- The files each loader's own tool writes (`energon prepare`, DALI's `wds2idx`) for the tars
  `atlasfs export` writes equal what the mount serves, for a dataset of every format.
- Energon (get_train_dataset, get_val_dataset, get_loader with 0 and 2 workers, `energon
  mount`) and DALI's CPU webdataset reader with the served indexes read exact samples
  straight from `atlasfs mount --view tars`, of an Atlas dataset and of WebDataset tars.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from fusemount import atlasfs, force_unmount, is_mounted, mounted
from helpers import REFERENCE, REPO
from loaderdata import loader_dataset, sqlite_rows


LOADERS = Path(os.environ.get("ATLASFS_LOADERS_VENV") or REPO / ".venv-loaders")
SCRIPTS = REPO / "tests" / "support" / "loaderscripts"
FIXTURES = REPO / "tests" / "fixtures"
# wds2idx names files as GNU tar lists them: in a UTF-8 locale, as the mount does
TOOL_ENV = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONWARNINGS": "ignore"}


def _tool(name: str) -> str:
    path = LOADERS / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: make test-loaders installs megatron-energon 7.4.1 and "
                    f"nvidia-dali-cuda120 2.4.0 there (or set ATLASFS_LOADERS_VENV)")
    return str(path)


def _run(*args: str, cwd: Path | None = None, timeout: float = 300) -> str:
    result = subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env=TOOL_ENV, timeout=timeout)
    assert result.returncode == 0, f"{args[:3]}: {result.stderr[-3000:]}"
    return result.stdout


def _atlas(path: Path, examples: int = 120, shard_size: int = 50, odd_keys: bool = False) -> Path:
    return loader_dataset(path, 5, examples, shard_size, odd_keys)


def _webdataset(path: Path) -> Path:
    import webdataset as wds
    path.mkdir()
    rng = random.Random(6)
    for shard in range(3):
        with wds.TarWriter(str(path / f"part-{shard:03d}.tar")) as sink:
            for i in range(40):
                sink.write({"__key__": f"s{shard}_{i:03d}", "jpg": rng.randbytes(rng.randrange(1, 5000)),
                            "cls": str(i).encode(), "json": json.dumps({"i": i}).encode()})
    return path


# ------------------------------------------------------------ the files the tools write


def _prepared(out: Path, work: Path) -> Path:
    """`atlasfs export`'s tars with what `energon prepare` and `wds2idx` write beside them."""
    prepared = Path(shutil.copytree(out, work))
    _run(_tool("energon"), "prepare", str(prepared), "--non-interactive", "--split-parts", "train:.*",
         "--sample-type", "CrudeWebdataset", "--no-progress", "--num-workers", "2")
    for tar in sorted(prepared.rglob("*.tar")):  # named <shard>.idx: wds2idx's own name for a shard without a dot
        _run(_tool("python"), _tool("wds2idx"), str(tar), str(tar)[:-len(".tar")] + ".idx", cwd=tar.parent)
    return prepared


def _source(case: str, tmp_path: Path) -> Path:
    """A copy of a dataset of each format atlasfs mounts."""
    if case == "atlas-pax-names":
        return _atlas(tmp_path / "ds", odd_keys=True)
    if case.startswith("reference/"):
        return Path(shutil.copytree(REFERENCE / case.split("/", 1)[1] / "dataset", tmp_path / "ds"))
    if case == "webdataset-writer":
        return _webdataset(tmp_path / "ds")
    return Path(shutil.copytree(FIXTURES / case / "data", tmp_path / "ds"))


CASES = ["atlas-pax-names", "reference/s1_tricky_keys_and_fields", "reference/s2_twelve_shards",
         "reference/s0_wds_keyed_dicts", "webdataset-writer", "webdataset/images", "dolma/mixed",
         "lavender/wds_images", "modalities/merged"]


@pytest.mark.parametrize("case", CASES)
def test_the_served_indexes_equal_what_energon_prepare_and_wds2idx_write(tmp_path: Path, case: str) -> None:
    dataset = _source(case, tmp_path)
    out = tmp_path / "out"
    result = atlasfs("export", str(dataset), str(out))
    assert result.returncode == 0, result.stderr
    prepared = _prepared(out, tmp_path / "prepared")
    tars = sorted(str(p.relative_to(prepared)) for p in prepared.rglob("*.tar"))
    assert tars
    with mounted(dataset, "--view", "tars", env={"XDG_CACHE_HOME": str(tmp_path / "cache")}) as mnt:
        for tar in tars:
            assert (mnt / f"{tar}.idx").read_bytes() == (prepared / f"{tar}.idx").read_bytes(), tar  # energon's
            dali = tar[:-len(".tar")] + ".idx"
            assert (mnt / dali).read_bytes() == (prepared / dali).read_bytes(), dali
        meta, theirs = mnt / ".nv-meta", prepared / ".nv-meta"
        for name in (".info.json", "split.yaml", "dataset.yaml"):
            assert (meta / name).read_bytes() == (theirs / name).read_bytes(), name
        (tmp_path / "served.sqlite").write_bytes((meta / "index.sqlite").read_bytes())
        assert sqlite_rows(tmp_path / "served.sqlite") == sqlite_rows(theirs / "index.sqlite")
        assert len((meta / "index.uuid").read_bytes()) == len((theirs / "index.uuid").read_bytes()) == 36


def test_the_split_by_ratio_equals_energon_prepare_split_ratio(tmp_path: Path) -> None:
    dataset = _atlas(tmp_path / "ds", examples=140, shard_size=20)
    atlasfs("export", str(dataset), str(tmp_path / "out"))
    prepared = Path(shutil.copytree(tmp_path / "out", tmp_path / "prepared"))
    _run(_tool("energon"), "prepare", str(prepared), "--non-interactive", "--split-ratio", "5,1,1",
         "--skip-dataset-yaml", "--no-progress")
    with mounted(dataset, "--view", "tars", "-o", "energon_split=5:1:1") as mnt:
        assert (mnt / ".nv-meta" / "split.yaml").read_bytes() == (prepared / ".nv-meta" / "split.yaml").read_bytes()


# ------------------------------------------------------------ the loaders reading a mount


def _expected(out: Path) -> dict[str, dict[str, str]]:
    """key -> {part: SHA-256} of every sample of the exported tars, in tar order."""
    samples: dict[str, dict[str, str]] = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as archive:
            for member in archive:
                key, _, part = member.name.partition(".")
                samples.setdefault(key, {})[part] = hashlib.sha256(archive.extractfile(member).read()).hexdigest()
    return samples


def _loader_dataset(kind: str, tmp_path: Path) -> Path:
    return _atlas(tmp_path / "ds") if kind == "atlas" else _webdataset(tmp_path / "ds")


def _energon(mnt: Path, kind: str, split: str, workers: int, count: int) -> list[dict]:
    output = _run(_tool("python"), str(SCRIPTS / "energon_read.py"), str(mnt), kind, split, str(workers), str(count))
    return json.loads(output)


@pytest.mark.parametrize("kind", ["atlas", "webdataset"])
def test_energon_trains_from_the_mount_with_no_step_before(tmp_path: Path, kind: str) -> None:
    dataset = _loader_dataset(kind, tmp_path)
    atlasfs("export", str(dataset), str(tmp_path / "out"))
    expected = _expected(tmp_path / "out")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in dataset.rglob("*"))
    with mounted(dataset, "--view", "tars", env={"XDG_CACHE_HOME": str(tmp_path / "cache")}) as mnt:
        # validation: every sample once, in tar order with no worker; the same set with two
        got = _energon(mnt, "val", "train", 0, 10 * len(expected))
        assert [s["key"] for s in got] == list(expected)
        assert all(s["parts"] == expected[s["key"]] for s in got)
        got = _energon(mnt, "val", "train", 2, 10 * len(expected))
        assert sorted(s["key"] for s in got) == sorted(expected)
        assert all(s["parts"] == expected[s["key"]] for s in got)
        # training: shuffled and endless; every sample is exact and each one comes
        for workers in (0, 2):
            got = _energon(mnt, "train", "train", workers, 3 * len(expected))
            assert {s["key"] for s in got} == set(expected)
            assert all(s["parts"] == expected[s["key"]] for s in got)
    assert sorted((str(p), p.stat().st_mtime_ns) for p in dataset.rglob("*")) == before  # no write


def test_energon_reads_the_split_asked_at_mount(tmp_path: Path) -> None:
    dataset = _atlas(tmp_path / "ds", examples=100, shard_size=20)
    atlasfs("export", str(dataset), str(tmp_path / "out"))
    expected = _expected(tmp_path / "out")
    in_val: list[str] = []
    for tar in ("1.tar", "2.tar"):
        with tarfile.open(tmp_path / "out" / tar) as archive:
            in_val += list(dict.fromkeys(m.name.partition(".")[0] for m in archive))
    with mounted(dataset, "--view", "tars", "-o", "energon_split=1:1:1") as mnt:
        got = _energon(mnt, "val", "val", 0, 1000)
    assert [s["key"] for s in got] == in_val and all(s["parts"] == expected[s["key"]] for s in got)


@pytest.mark.parametrize("kind", ["atlas", "webdataset"])
def test_energon_mount_shows_every_sample_file_of_the_mount(tmp_path: Path, kind: str) -> None:
    dataset = _loader_dataset(kind, tmp_path)
    atlasfs("export", str(dataset), str(tmp_path / "out"))
    expected = _expected(tmp_path / "out")
    with mounted(dataset, "--view", "tars") as mnt:
        inner = tmp_path / "energon-mnt"
        inner.mkdir()
        _run(_tool("energon"), "mount", "--detach", str(mnt), str(inner))
        try:
            deadline = time.monotonic() + 30
            while not is_mounted(inner):
                assert time.monotonic() < deadline, "energon mount did not mount"
                time.sleep(0.1)
            names = sorted(os.listdir(inner))
            assert names == sorted(f"{key}.{part}" for key, parts in expected.items() for part in parts)
            for name in names:
                key, _, part = name.partition(".")
                assert hashlib.sha256((inner / name).read_bytes()).hexdigest() == expected[key][part], name
        finally:
            force_unmount(inner)


@pytest.mark.parametrize("kind", ["atlas", "webdataset"])
def test_dali_reads_the_mount_with_the_served_indexes(tmp_path: Path, kind: str) -> None:
    dataset = _loader_dataset(kind, tmp_path)
    atlasfs("export", str(dataset), str(tmp_path / "out"))
    expected = _expected(tmp_path / "out")
    exts = ["jpg", "cls", "json"]
    with mounted(dataset, "--view", "tars") as mnt:
        tars = sorted(str(p) for p in mnt.glob("*.tar"))
        indexes = [t[:-len(".tar")] + ".idx" for t in tars]
        got = json.loads(_run(_tool("python"), str(SCRIPTS / "dali_read.py"), ",".join(tars), ",".join(indexes),
                              ",".join(exts)))
        unindexed = json.loads(_run(_tool("python"), str(SCRIPTS / "dali_read.py"), ",".join(tars), "",
                                    ",".join(exts)))
    assert got["size"] == len(expected)
    assert got["samples"] == [[parts[e] for e in exts] for parts in expected.values()]
    assert unindexed == got  # what DALI finds reading every tar itself


def test_a_failing_index_sqlite_does_not_stop_training(tmp_path: Path) -> None:
    """Keys shared across tars: energon prepare refuses the dataset; the mount serves all but
    index.sqlite (EIO), and energon trains, as it needs no index.sqlite for that."""
    wds = tmp_path / "wds"
    wds.mkdir()
    for shard in ("a", "b"):
        with tarfile.open(wds / f"{shard}.tar", "w", format=tarfile.USTAR_FORMAT) as archive:
            for key in ("same", f"only-{shard}"):
                info = tarfile.TarInfo(f"{key}.txt")
                info.size = 3
                archive.addfile(info, io.BytesIO(shard.encode() * 3))
    with mounted(wds, "--view", "tars") as mnt:
        with pytest.raises(OSError) as info:
            (mnt / ".nv-meta" / "index.sqlite").read_bytes()
        assert info.value.errno == errno.EIO
        got = _energon(mnt, "val", "train", 0, 100)
    assert [s["key"] for s in got] == ["same", "only-a", "same", "only-b"]

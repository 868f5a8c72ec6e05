"""A mount writes nothing into the dataset and stores its tables in the user's cache, which
stays right when the shard changes (tables alone: tests/unit/tree/test_filetable.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fusemount import atlasfs, mounted
from tabledata import keyed_dataset


def _state(folder: Path) -> list[str]:
    """What ``find FOLDER -printf '%p %s %T@ %m'`` shows: every path, size, mtime and mode."""
    result = subprocess.run(["find", str(folder), "-printf", r"%p %s %T@ %m\n"], capture_output=True, text=True,
                            check=True)
    return sorted(result.stdout.splitlines())


def test_a_mount_writes_nothing_into_the_dataset_and_stores_tables_in_the_user_cache(tmp_path: Path) -> None:
    dataset = keyed_dataset(tmp_path / "ds")
    before = _state(dataset)
    cache = tmp_path / "cache"
    env = {"XDG_CACHE_HOME": str(cache)}
    with mounted(dataset, env=env) as mnt:
        first = os.listdir(mnt / "1" / "k")
        assert (mnt / "1" / "k" / "021.txt").read_bytes() == b"t21"
    assert _state(dataset) == before  # writable, and still untouched
    stored = sorted(cache.glob("atlasfs/tables/*/*.table"))
    assert [p.name for p in stored] == ["1.table"]  # only shard 1 was looked at
    listed = atlasfs("cache", env={**os.environ, **env})
    assert str(dataset) in listed.stdout and "1 tables" in listed.stdout, listed.stdout
    # Damage block 0 of shard 1 without changing its size or mtime: the stored table still
    # applies, so the listing must come out whole (nothing decoded), and only reads fail.
    # (A small file kept in the table is checked against its block's frame checksum, the
    # block's last 4 bytes: the damage reaches them.)
    data = dataset / "1" / "data.bin"
    st = data.stat()
    raw = bytearray(data.read_bytes())
    end = int(np.load(dataset / "1" / "index.npy")[1])
    raw[20:end] = bytes(end - 20)
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    with mounted(dataset, env=env) as mnt:
        assert os.listdir(mnt / "1" / "k") == first
        with pytest.raises(OSError):
            (mnt / "1" / "k" / "020.txt").read_bytes()
        assert (mnt / "1" / "k" / "039.txt").read_bytes() == b"t39"
    # A real change (new mtime) makes the table stale: rebuilt, the damage now shows in names.
    os.utime(data)
    with mounted(dataset, env=env) as mnt:
        names = os.listdir(mnt / "1")
        assert "000020.unreadable" in names
    assert (cache / "atlasfs" / "validated-tables").exists()  # the mounts recorded tables found valid
    cleared = atlasfs("cache", "--clear", env={**os.environ, **env})
    assert cleared.returncode == 0 and not list(cache.glob("atlasfs/tables/*/*.table")), cleared.stderr
    assert not (cache / "atlasfs" / "validated-tables").exists()  # nor the record of tables found valid

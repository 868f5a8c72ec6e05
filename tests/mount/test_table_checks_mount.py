"""A second mount maps the stored tables an earlier mount (or ``atlasfs index``) found valid
without checking every page again (issue #39, point 5: those checks were most of what a
second mount's ``find`` cost the daemon). Counted from the daemon's debug log lines ("file
table ...: checked" or "found valid before"), not timed."""

from __future__ import annotations

import os
from pathlib import Path

from fusemount import atlasfs, engine_answered_in_log, mounted
from tabledata import shards_dataset

SHARDS = 3


def _list_every_shard(dataset: Path, log: Path, env: dict[str, str]) -> dict[str, int]:
    """Mount with -v, list every shard, unmount: how many stored tables the daemon checked in
    full and how many it found valid before."""
    log.unlink(missing_ok=True)
    with mounted(dataset, "-v", "--log-file", str(log), env=env) as mnt:
        for s in range(SHARDS):
            assert len(os.listdir(mnt / str(s))) == 40  # 20 examples, txt and cls
    engine_answered_in_log(log)  # the daemon has ended: its log is whole
    lines = [line for line in log.read_text().splitlines() if "file table" in line]
    return {"checked": sum(line.endswith(": checked") for line in lines),
            "known": sum(line.endswith(": found valid before") for line in lines)}


def test_tables_stored_by_index_are_not_checked_again_by_each_mount(tmp_path: Path) -> None:
    dataset = shards_dataset(tmp_path / "ds", SHARDS)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    indexed = atlasfs("index", str(dataset), env={**os.environ, **env})
    assert indexed.returncode == 0, indexed.stderr
    for _ in range(2):
        assert _list_every_shard(dataset, tmp_path / "mount.log", env) == {"checked": 0, "known": SHARDS}


def test_tables_in_the_user_cache_stay_found_valid_across_mounts(tmp_path: Path) -> None:
    """The cache's tables are touched at each use (eviction goes by mtime), which changes their
    identity: the record follows them."""
    dataset = shards_dataset(tmp_path / "ds", SHARDS)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    log = tmp_path / "mount.log"
    first = _list_every_shard(dataset, log, env)  # built, stored, mapped from the store: checked there
    assert first["known"] == 0
    for _ in range(2):
        assert _list_every_shard(dataset, log, env) == {"checked": 0, "known": SHARDS}


def test_a_record_others_can_write_or_a_changed_table_is_checked_in_full(tmp_path: Path) -> None:
    dataset = shards_dataset(tmp_path / "ds", SHARDS)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    log = tmp_path / "mount.log"
    assert atlasfs("index", str(dataset), env={**os.environ, **env}).returncode == 0
    record = tmp_path / "xdg" / "atlasfs" / "validated-tables"
    assert len(record.read_text().splitlines()) >= SHARDS  # (index may store a table more than once)
    record.chmod(0o666)  # anyone could have written it: not used
    assert _list_every_shard(dataset, log, env) == {"checked": SHARDS, "known": 0}
    record.chmod(0o600)
    # One table rewritten in place (same inode and size, a new mtime): that one is checked again.
    table = dataset / ".atlasfs-tables" / "1.table"
    table.write_bytes(table.read_bytes())
    assert _list_every_shard(dataset, log, env) == {"checked": 1, "known": SHARDS - 1}

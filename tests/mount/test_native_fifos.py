"""A FIFO put in place of a shard's data.bin or table file while mounted (issue #35, point 1):
once the tree lets go of the shard's table, the native engine attaches it from its file and
opens its data.bin itself. A blocking open() of a FIFO there, holding the GIL, froze the whole
daemon (statfs, listings and lookups never answered, umount said busy). The engine opens every
file with O_NONBLOCK and attaches only a regular file that is the one checked: the daemon keeps
answering, that shard is the control plane's (it serves it, or fails it with EIO), the other
shards serve their exact bytes, and the mount unmounts.

Every operation on the mount runs in a child process with a timeout: a frozen daemon fails
the test instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusemount import force_unmount, is_mounted, require_fuse, wait_mounted
from locateddata import export_shards, index_tables, located_tree, random_examples, write_dataset

TIMEOUT = 10
_FOREGROUND = """
import sys
from atlasfs.commands import cli
from atlasfs.tree.table import tables
tables.RESIDENT_TABLE_BYTES = 1  # the tree holds one table at a time: the others are the engine's, from their files
sys.exit(cli.main(["mount", "-f", sys.argv[1], sys.argv[2], "-o", "log_file=" + sys.argv[3]]))
"""


class _Frozen(Exception):
    pass


def _run(daemon: subprocess.Popen[str], *command: str) -> subprocess.CompletedProcess[bytes]:
    """``command`` on the mount; if it takes more than TIMEOUT seconds, the daemon is killed (a
    request the daemon was sent waits for its answer even through SIGKILL: only the end of the
    connection ends it) and the test fails."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        daemon.kill()
        child.kill()
        child.communicate()
        raise _Frozen(f"{' '.join(command)}: no answer within {TIMEOUT} s (the daemon froze)") from None
    return subprocess.CompletedProcess(command, child.returncode, out, err)


def _daemon(dataset: Path, mnt: Path, log: Path) -> subprocess.Popen[str]:
    env = dict(os.environ)
    preload = os.environ.get("ATLASFS_TEST_DAEMON_PRELOAD")  # scripts/test-sanitized.sh
    if preload:
        env["LD_PRELOAD"] = preload
    process = subprocess.Popen([sys.executable, "-c", _FOREGROUND, str(dataset), str(mnt), str(log)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wait_mounted(process, mnt)
    return process


@pytest.mark.parametrize("replaced", ["data.bin", "table"])
def test_a_fifo_in_place_of_a_shard_file_never_freezes_the_daemon(tmp_path: Path, replaced: str) -> None:
    require_fuse()
    dataset = write_dataset(tmp_path / "ds", random_examples(11, 36), 2, block_size=3, shard_size=12)  # 3 shards
    exported = export_shards(dataset, tmp_path / "export")
    tables = dataset / ".atlasfs-tables"  # where a mount finds them
    index_tables(dataset, tables)
    tree = located_tree(dataset, tables)
    shards = [shard.name for shard in tree.shards]
    victim = tree.shards[0]
    path = Path(victim.data_path) if replaced == "data.bin" else Path(tree.table(0).path)
    tree.source.close()
    assert path.is_file()
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    process = _daemon(dataset, mnt, log)
    try:
        first = next(iter(exported[shards[0]]))
        got = _run(process, "cat", str(mnt / shards[0] / first))  # the tree holds shard 0's table: attached from its columns
        assert got.returncode == 0 and got.stdout == exported[shards[0]][first]
        path.rename(path.with_name(path.name + ".moved"))
        os.mkfifo(path)
        # Shard 1's table: the tree lets go of shard 0's, which the engine attaches from its file
        # (and opens its data.bin), then shard 2's.
        for shard in shards[1:]:
            assert _run(process, "ls", str(mnt / shard)).stdout.decode().split() == sorted(exported[shard])
        assert _run(process, "stat", "-f", str(mnt)).returncode == 0
        assert _run(process, "ls", str(mnt)).returncode == 0
        for name, data in exported[shards[0]].items():  # the control plane's: right, or failed (EIO, ESTALE)
            got = _run(process, "cat", str(mnt / shards[0] / name))
            assert (got.returncode, got.stdout) == (0, data) or (
                got.returncode != 0 and (b"Input/output error" in got.stderr or b"Stale file handle" in got.stderr)), \
                (name, got)
        for shard in shards[1:]:
            for name, data in exported[shard].items():
                got = _run(process, "cat", str(mnt / shard / name))
                assert (got.returncode, got.stdout) == (0, data), (shard, name, got.stderr)
        assert _run(process, "stat", "-f", str(mnt)).returncode == 0
        assert _run(process, "fusermount3", "-u", str(mnt)).returncode == 0
        process.wait(timeout=TIMEOUT)
        assert not is_mounted(mnt)
    except _Frozen as exc:
        pytest.fail(str(exc))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        force_unmount(mnt)
        path.unlink(missing_ok=True)
    assert "Traceback" not in log.read_text()

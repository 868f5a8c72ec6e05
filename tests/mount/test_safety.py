"""What another user meets (issue #23): tables `atlasfs index` stores for them, and errors
naming the real cause when a dataset or /dev/fuse is not theirs to open.

The other user is ``nobody`` (tests/support/otheruser.py): a real second user, in a private
mount namespace, with the machine left as it was.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fusemount import mounted, require_fuse
from helpers import REFERENCE
from otheruser import nobody_folder, run_as_nobody, shared_folder

GOOD = REFERENCE / "s2_shared_dict" / "dataset"

#: As nobody: mount $DS on $MNT in the foreground (log in $LOG), wait until it answers,
#: list every file with its size into $LIST, then unmount; the daemon never outlives it.
MOUNT_AND_LIST = """
"$PYTHON" -m atlasfs mount -f "$DS" "$MNT" $ARGS 2>"$LOG" &
daemon=$!
trap 'fusermount3 -u "$MNT" 2>/dev/null; kill $daemon 2>/dev/null; wait $daemon' EXIT
tries=0
until mountpoint -q "$MNT"; do
    tries=$((tries + 1))
    if [ $tries -gt 600 ] || ! kill -0 $daemon 2>/dev/null; then echo "the mount did not come up" >&2; exit 3; fi
    sleep 0.05
done
(cd "$MNT" && find . -type f -printf '%P %s\\n' | sort) >"$LIST"
"""


def _listing(mnt: Path) -> str:
    """Every file of a mount with its size, as MOUNT_AND_LIST writes them."""
    result = subprocess.run(f"cd {shlex.quote(str(mnt))} && find . -type f -printf '%P %s\\n' | sort",
                            shell=True, capture_output=True, text=True, check=True)
    return result.stdout


def _one_line(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atlasfs: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("where", ["beside", "index-dir"])
def test_tables_atlasfs_index_stores_serve_another_users_mount(where: str) -> None:
    require_fuse()
    with shared_folder() as shared:
        dataset = Path(shutil.copytree(GOOD, shared / "ds"))
        tables = dataset / ".atlasfs-tables" if where == "beside" else shared / "tables" / "for" / "all"
        extra = [] if where == "beside" else ["--index-dir", str(tables)]
        # a private umask: the tables must be readable by others all the same
        result = subprocess.run([sys.executable, "-m", "atlasfs", "index", str(dataset), *extra],
                                capture_output=True, text=True, umask=0o077, timeout=120)
        assert result.returncode == 0, result.stderr
        stored = sorted(tables.iterdir())
        assert [p.name for p in stored if p.suffix == ".table"] == ["0.table", "1.table", "2.table"]
        assert {stat.S_IMODE(p.stat().st_mode) for p in stored} == {0o644}
        made = [tables] if where == "beside" else [shared / "tables", shared / "tables" / "for", tables]
        assert {stat.S_IMODE(p.stat().st_mode) for p in made} == {0o755}

        cache = nobody_folder(shared / "nobody-cache")
        out = nobody_folder(shared / "nobody-out")
        env = {"DS": str(dataset), "MNT": str(nobody_folder(shared / "mnt")), "LOG": str(out / "log"),
               "LIST": str(out / "list"), "ARGS": " ".join(extra), "XDG_CACHE_HOME": str(cache)}
        result = run_as_nobody(MOUNT_AND_LIST, shared / "ns", fuse_mode=0o666, env=env)
        log = (out / "log").read_text()
        assert result.returncode == 0, (result.stderr, log)
        assert "building it again" not in log and "Permission denied" not in log, log
        # Another user's tables are mapped from copies in nobody's own cache (their owner may
        # change them in place: docs/reliability.md), byte for byte the stored ones.
        copies = {p.name: p.read_bytes() for p in cache.rglob("*.table")}
        assert copies == {p.name: p.read_bytes() for p in stored if p.suffix == ".table"}, \
            "nobody built tables of its own instead of reading the stored ones"
        with mounted(dataset, *extra) as mnt:  # root's view of the same dataset
            assert (out / "list").read_text() == _listing(mnt) != ""


def test_a_dataset_another_user_may_not_read_says_permission_denied() -> None:
    with shared_folder() as shared:
        dataset = Path(shutil.copytree(GOOD, shared / "ds"))
        dataset.chmod(0o700)  # root's own
        closed = shared / "closed"
        closed.mkdir(mode=0o700)
        hidden = Path(shutil.copytree(GOOD, closed / "ds"))
        out = nobody_folder(shared / "out")
        script = """
        "$PYTHON" -m atlasfs info "$DS" 2>"$OUT/info"; echo $? >>"$OUT/info"
        "$PYTHON" -m atlasfs export "$DS" "$OUT/tars" 2>"$OUT/export"; echo $? >>"$OUT/export"
        "$PYTHON" -m atlasfs info "$HIDDEN" 2>"$OUT/hidden"; echo $? >>"$OUT/hidden"
        """
        result = run_as_nobody(script, shared / "ns", env={"DS": str(dataset), "HIDDEN": str(hidden),
                                                            "OUT": str(out)})
        assert result.returncode == 0, result.stderr
        for name in ("info", "export"):
            message, code = (out / name).read_text().splitlines()
            assert code == "1"
            assert message == (f"atlasfs: {dataset}: permission denied (cannot read the folder; "
                               "check its permissions)"), message
        message, code = (out / "hidden").read_text().splitlines()
        assert code == "1" and message.startswith(f"atlasfs: {hidden}: permission denied (cannot reach it"), message


def test_mounting_a_dataset_another_user_may_not_read_says_permission_denied() -> None:
    require_fuse()
    with shared_folder() as shared:
        dataset = Path(shutil.copytree(GOOD, shared / "ds"))
        dataset.chmod(0o700)
        out = nobody_folder(shared / "out")
        script = '"$PYTHON" -m atlasfs mount "$DS" "$MNT" 2>"$OUT/err"; echo $? >>"$OUT/err"'
        env = {"DS": str(dataset), "MNT": str(nobody_folder(shared / "mnt")), "OUT": str(out)}
        result = run_as_nobody(script, shared / "ns", fuse_mode=0o666, env=env)
        assert result.returncode == 0, result.stderr
        message, code = (out / "err").read_text().splitlines()
        assert code == "1"
        assert message == f"atlasfs: {dataset}: permission denied (cannot read the folder; check its permissions)"


def test_dev_fuse_another_user_may_not_open_says_permission_denied() -> None:
    require_fuse()
    with shared_folder() as shared:
        dataset = Path(shutil.copytree(GOOD, shared / "ds"))
        out = nobody_folder(shared / "out")
        script = '"$PYTHON" -m atlasfs mount "$DS" "$MNT" 2>"$OUT/err"; echo $? >>"$OUT/err"'
        env = {"DS": str(dataset), "MNT": str(nobody_folder(shared / "mnt")), "OUT": str(out)}
        before = os.stat("/dev/fuse")
        # root's own /dev/fuse (0600), in nobody's namespace only
        result = run_as_nobody(script, shared / "ns", fuse_mode=0o600, env=env)
        assert result.returncode == 0, result.stderr
        message, code = (out / "err").read_text().splitlines()
        assert code == "1"
        assert message == "atlasfs: /dev/fuse: permission denied (make it 0666, or add the user to the group owning it)"
        after = os.stat("/dev/fuse")
        assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid)

"""The native engine (atlasfs.fuse._native), mounted for real.

Every FUSE test mounts through it (it is atlasfs's one engine, docs/native.md); these are its
own: the mount shows the tree the control plane reads, life cycle, parallel readers, rows
answered in C, what ``atlasfs mount`` says when it is not built, and wrong answers from its
control plane.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from fusemount import IN_CI, atlasfs, engine_answered, force_unmount, is_mounted, mounted, require_fuse, wait_mounted
from helpers import REFERENCE

pytestmark = pytest.mark.fuse

DATASET = REFERENCE / "s1_tricky_keys_and_fields" / "dataset"
#: Where native_hostile.py is (run as the hostile bridge's script).
HERE = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(autouse=True)
def _native_built() -> None:
    try:
        import atlasfs.fuse._native  # noqa: F401
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"the native engine is not built in CI: {exc}")
        pytest.skip(f"the native engine is not built: {exc}")


def tree_of(mnt: Path) -> list[str]:
    """Every path below ``mnt`` with its type, size, inode number and content's hash, as find sees them."""
    found = subprocess.run(["find", ".", "-printf", r"%P\t%y\t%s\t%i\t%m\n"], cwd=mnt, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    out = []
    for line in sorted(found):
        path, kind = line.split("\t")[:2]
        digest = hashlib.md5((mnt / path).read_bytes()).hexdigest() if kind == "f" else ""
        out.append(f"{line}\t{digest}")
    return out


def tree_read_in_python(dataset: Path) -> list[str]:
    """What :func:`tree_of` should see: the lines of the dataset's tree, as the control plane's
    own :class:`BlockTree` answers them in this process (no FUSE, no table store)."""
    from atlasfs.formats.factory import open_source
    from atlasfs.tree.blocktree import BlockTree

    tree = BlockTree(open_source(str(dataset)))
    out = []

    def walk(path: str, shown: str) -> None:
        entry = tree.lookup(path)
        digest = "" if entry.is_dir else hashlib.md5(tree.read(entry, 0, entry.size)).hexdigest()
        out.append("\t".join([shown, "d" if entry.is_dir else "f", str(entry.size), str(entry.ino),
                              "555" if entry.is_dir else "444", digest]))
        if entry.is_dir:
            for name, _ in tree.listdir(path):
                walk(f"{path.rstrip('/')}/{name}", f"{shown}/{name}".lstrip("/"))

    walk("/", "")
    return sorted(out)


def tar_members(mnt: Path, folder: str) -> list[tuple[str, bool, bytes]]:
    """(name, is_dir, bytes) of each member of ``tar cf`` of ``mnt/folder``, in the tar's order."""
    tar = subprocess.run(["tar", "cf", "-", "--sort=none", "-C", str(mnt / folder), "."], capture_output=True,
                         check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        return [(member.name, member.isdir(), archive.extractfile(member).read() if member.isfile() else b"")
                for member in archive.getmembers()]


def test_the_mount_shows_the_tree_the_control_plane_reads() -> None:
    expected = tree_read_in_python(DATASET)
    with mounted(DATASET) as mnt:
        assert tree_of(mnt) == expected
        listed = subprocess.run(["ls", "-la", str(mnt / "0")], capture_output=True, text=True, check=True).stdout
        assert "dr-xr-xr-x" in listed and "-r--r--r--" in listed
        in_tar = sorted((name[2:], is_dir, "" if is_dir else hashlib.md5(data).hexdigest())
                        for name, is_dir, data in tar_members(mnt, "0") if name != ".")
        fields = [line.split("\t") for line in expected if line.startswith("0/")]
        assert in_tar == sorted((path[2:], kind == "d", digest) for path, kind, *_, digest in fields)
        assert os.statvfs(mnt).f_bsize == 4096
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / "0" / "no-such-file")
        for folder in (mnt, mnt / "0"):  # tree names are UTF-8: a name that is not cannot be found
            with pytest.raises(FileNotFoundError):
                os.stat(os.fsencode(folder) + b"/\xff.txt")
        with pytest.raises(NotADirectoryError):
            os.listdir(next(p for p in (mnt / "0").rglob("*") if p.is_file()))
        with pytest.raises(OSError) as refused:
            (mnt / "new").write_bytes(b"x")
        assert refused.value.errno == errno.EROFS


def test_parallel_readers_read_what_one_reader_reads() -> None:
    with mounted(DATASET, "-o", "cache_size=64K") as mnt:
        files = sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*") if p.is_file())
        expected = {path: (mnt / path).read_bytes() for path in files}
    # A fresh mount (cold cache, a cache of 64 KiB: blocks decoded and evicted while others
    # read them), four processes, each through every file from another start.
    with mounted(DATASET, "-o", "cache_size=64K") as mnt:
        starts = [0, len(files) // 4, len(files) // 2, 3 * len(files) // 4]
        readers = [subprocess.Popen(["cat", *files[s:], *files[:s]], cwd=mnt, stdout=subprocess.PIPE)
                   for s in starts]
        outputs = [reader.communicate(timeout=60)[0] for reader in readers]
        assert [reader.returncode for reader in readers] == [0] * 4
    for start, output in zip(starts, outputs):
        assert output == b"".join(expected[path] for path in files[start:] + files[:start])


@contextlib.contextmanager
def _daemon(mnt: Path, dataset: Path = DATASET) -> Iterator[subprocess.Popen[str]]:
    """:func:`_serve_foreground` for the duration; killed after if it is still running."""
    process = _serve_foreground(mnt, dataset)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _serve_foreground(mnt: Path, dataset: Path = DATASET) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", str(dataset), str(mnt)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_mounted(process, mnt)
    return process


@pytest.fixture
def mountpoint() -> Iterator[Path]:
    require_fuse()
    mnt = Path(tempfile.mkdtemp(prefix="atlasfs-test-mnt-"))
    try:
        yield mnt
    finally:
        force_unmount(mnt)
        mnt.rmdir()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "fusermount3 -u"])
def test_the_daemon_unmounts_and_exits_cleanly(mountpoint: Path, how: str) -> None:
    with _daemon(mountpoint) as process:
        assert len(list(mountpoint.rglob("*"))) > 10  # worker threads made and kept their Python states
        if how == "fusermount3 -u":
            subprocess.run(["fusermount3", "-u", str(mountpoint)], check=True)
        else:
            process.send_signal(getattr(signal, how))
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert not is_mounted(mountpoint)
    assert "Fatal" not in err and "Traceback" not in err
    assert "unmounted" in err


def test_rows_of_an_attached_table_are_answered_in_c(tmp_path: Path, mountpoint: Path) -> None:
    """A flat shard whose table knows every size (``atlasfs index``): once the control plane
    has the table (the first lookup in the shard), lookups, attributes and listings of its
    rows are answered by C, with what the control plane's tree answers."""
    from atlasfs import AtlasWriter

    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=60, block_size=10) as writer:
        for i in range(120):
            writer.add_example({"bin": bytes([i]) * (i + 1), "json": {"i": i}})
    assert atlasfs("index", str(dataset)).returncode == 0
    expected = tree_read_in_python(dataset)
    names = sorted(line.split("\t")[0][2:] for line in expected if line.startswith("0/"))
    with _daemon(mountpoint, dataset) as process:
        first, *rest = names
        assert os.stat(mountpoint / "0" / first).st_size > 0  # the control plane maps the table
        for name in rest:  # by name, without a listing: LOOKUPs
            st = os.stat(mountpoint / "0" / name)
            assert st.st_ino > 1 << 32 and st.st_mode == 0o100444
        assert tree_of(mountpoint) == expected
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=True)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    (line,) = [line for line in err.splitlines() if "native engine answered" in line]
    answered = engine_answered(line)
    assert answered["lookup"][0] >= len(rest), line
    assert answered["readdir"][0] >= 1, line  # shard 0's listing (its table attached)
    assert answered["read"][0] >= 1, line  # from the byte cache: blocks decoded once


def test_a_mount_without_the_extension_says_what_to_install(mountpoint: Path) -> None:
    # The extension's import fails as it does where it was never built.
    code = ("import sys; sys.modules['atlasfs.fuse._native'] = None\n"
            "from atlasfs.commands.cli import main\n"
            f"sys.exit(main(['mount', {str(DATASET)!r}, {str(mountpoint)!r}]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    from atlasfs.fuse.engine import INSTALL_HINT
    assert lines[0].startswith(f"atlasfs: {INSTALL_HINT} (")
    assert "apt-get install libfuse3-dev libzstd-dev zlib1g-dev pkg-config gcc python3-dev" in lines[0] and "ATLASFS_ENGINE" not in lines[0]
    assert not is_mounted(mountpoint)


def test_wrong_answers_of_the_control_plane_are_eio_never_a_crash(mountpoint: Path) -> None:
    process = subprocess.Popen([sys.executable, str(HERE / "native_hostile.py"), str(mountpoint)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready", process.stderr.read() if process.stderr else ""
        deadline = time.monotonic() + 30
        while not is_mounted(mountpoint):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        sys.path.insert(0, str(HERE))
        from native_hostile import ANSWERS
        assert os.stat(mountpoint / "nan-mtime").st_mtime == 0
        for name in [*ANSWERS, "raises"]:
            with pytest.raises(OSError) as failed:
                os.stat(mountpoint / name)
            assert failed.value.errno == errno.EIO, name
            assert os.stat(mountpoint / "good").st_size == 5  # still serving
        for name in ("too-long", "text", "parts-long", "parts-text"):
            with pytest.raises(OSError) as failed:
                (mountpoint / name).read_bytes()
            assert failed.value.errno == errno.EIO, name
        assert (mountpoint / "parts").read_bytes() == b"hello"
        with pytest.raises(OSError) as failed:
            os.listdir(mountpoint)  # a name with a NUL, then an entry of two fields
        assert failed.value.errno == errno.EIO
        # Table columns that lie: C checks every row, offset and size against its buffers. (A
        # lookup tries the row after the last one found first, row 0 at first: "ab" is found
        # there, whole and consistent, before the path order that lies is searched.)
        assert os.stat(mountpoint / "lying" / "ab").st_size == 5
        for path in ("lying/cd", "lying/zz", "sizes/big"):
            with pytest.raises(OSError) as failed:
                os.stat(mountpoint / path)
            assert failed.value.errno == errno.EIO, path
        assert os.stat(mountpoint / "sizes" / "ok").st_size == 2
        assert os.stat(mountpoint / "sizes" / "ok").st_ino == (2 << 32) + 2
        with pytest.raises(FileNotFoundError):
            os.stat(mountpoint / "sizes" / "no")
        with pytest.raises(OSError) as failed:
            os.listdir(mountpoint / "lying")
        assert failed.value.errno == errno.EIO
        assert sorted(os.listdir(mountpoint / "sizes")) == ["big", "ok"]
        with pytest.raises(OSError) as failed:  # the block's files, offsets past their bytes
            (mountpoint / "sizes" / "ok").read_bytes()
        assert failed.value.errno == errno.EIO
        assert (mountpoint / "good").read_bytes() == b"hello"
        assert process.poll() is None
    finally:
        force_unmount(mountpoint)
        try:
            _, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
    assert process.returncode == 0, err
    assert "Fatal" not in err
    assert "a bug in the control plane" in err  # said where Python says it

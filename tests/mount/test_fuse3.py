"""libfuse 3 under the native engine, for real: the library the daemon maps, the requests a
listing costs (READDIRPLUS), the size of the reads a big file arrives in, what INIT settles.

The request-counting tests serve an in-memory tree with atlasfs's own ``serve`` in a child
process (this file run as a script) that logs every call the engine makes into the tree.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

if __name__ == "__main__":  # run as the server: import atlasfs from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from atlasfs.tree.base import Entry, Tree, not_found

#: Files in the listed folder: more than one READDIRPLUS reply holds, and more than one
#: window of known entries (engine.KNOWN_WINDOW).
FILES = 2500
FILE_SIZE = 100
#: The big file: its bytes are a pattern that does not repeat at any power of two.
BIG_SIZE = 8 << 20
BIG_DATA = (bytes(range(251)) * (BIG_SIZE // 251 + 1))[:BIG_SIZE]
#: The largest read libfuse 2 and the kernel's default read-ahead allow.
OLD_MAX_READ = 128 * 1024
#: The kernel's INIT flag for asynchronous reads (linux/fuse.h).
FUSE_ASYNC_READ = 1 << 0


class LoggingTree(Tree):
    """``/d`` holds ``files`` files of ``size`` bytes, ``/big`` one of :data:`BIG_SIZE`
    bytes. With ``known``, the entries of ``/d`` are known up front (as with a stored
    table); without, :meth:`known_entries` answers None for them (as on a first mount
    of a dataset whose sizes take work). Every call is counted by method and path."""

    def __init__(self, files: int, size: int, known: bool = True) -> None:
        self.known = known
        self.root = Entry(True, 0, 0.0, 1)
        self.folder = Entry(True, 0, 0.0, 2)
        self.big = Entry(False, BIG_SIZE, 0.0, 3)
        self.files = {f"{i:05d}.txt": Entry(False, size, 0.0, 100 + i) for i in range(files)}
        self.listing = list(self.files.items())
        self.listed_names = [(name, False, entry.ino) for name, entry in self.listing]
        self.calls: collections.Counter[str] = collections.Counter()
        self.read_sizes: list[int] = []

    def lookup(self, path: str) -> Entry:
        self.calls[f"lookup {path}"] += 1
        entry = {"/": self.root, "/d": self.folder, "/big": self.big}.get(path)
        if entry is None and path.startswith("/d/"):
            entry = self.files.get(path[3:])
        if entry is None:
            raise not_found(path)
        return entry

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        self.calls[f"listdir {path}"] += 1
        return [("big", self.big), ("d", self.folder)] if path == "/" else self.listing

    def names(self, path: str) -> Sequence[tuple[str, bool, int]]:
        self.calls[f"names {path}"] += 1
        return [("big", False, 3), ("d", True, 2)] if path == "/" else self.listed_names

    def known_entries(self, path: str, start: int = 0, stop: int | None = None) -> Sequence[Entry | None]:
        self.calls[f"known_entries {path}"] += 1
        if path == "/":
            return [self.big, self.folder][start:stop]
        return [entry if self.known else None for _, entry in self.listing[start:stop]]

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        self.read_sizes.append(size)
        if entry is self.big:
            return BIG_DATA[offset:offset + size]
        return b"x" * max(0, min(size, entry.size - offset))


def serve_logging_tree(mountpoint: str, log_path: str, known: bool) -> None:
    """Mount a :class:`LoggingTree` with atlasfs's ``serve`` until unmounted, then write
    its counts to ``log_path`` as JSON. Prints ``ready`` once the mount answers."""
    from atlasfs.fuse.mount import serve
    from atlasfs.options import MountOptions

    tree = LoggingTree(FILES, FILE_SIZE, known)
    serve(tree, mountpoint, MountOptions(foreground=True), "logging-tree", lambda: print("ready", flush=True))
    with open(log_path, "w") as f:
        json.dump({"calls": tree.calls, "read_sizes": tree.read_sizes}, f)


if __name__ == "__main__":
    serve_logging_tree(sys.argv[1], sys.argv[2], sys.argv[3] == "known")
    sys.exit(0)

from fusemount import atlasfs, force_unmount, is_mounted, mounted, require_fuse  # noqa: E402


class Served:
    """A mounted :class:`LoggingTree`; :attr:`log` holds its counts once unmounted."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.log: dict[str, Any] = {}

    def file_lookups(self) -> int:
        """How many times a file of ``/d`` was looked up (a LOOKUP or GETATTR each)."""
        return sum(n for call, n in self.log["calls"].items() if call.startswith("lookup /d/"))


@contextlib.contextmanager
def served(known: bool = True) -> Iterator[Served]:
    """Serve a :class:`LoggingTree` on a fresh mount point for the duration."""
    require_fuse()
    folder = Path(tempfile.mkdtemp(prefix="atlasfs-test-fuse3-"))
    mountpoint, log_path = folder / "mnt", folder / "log.json"
    mountpoint.mkdir()
    server = subprocess.Popen([sys.executable, __file__, str(mountpoint), str(log_path),
                               "known" if known else "unknown"], stdout=subprocess.PIPE, text=True)
    result = Served(mountpoint)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready", "the server did not mount"
        yield result
    finally:
        force_unmount(mountpoint)
        server.wait(timeout=30)
        if log_path.exists():
            result.log = json.loads(log_path.read_text())
            log_path.unlink()
        mountpoint.rmdir()
        folder.rmdir()


def _listing(mountpoint: Path, command: list[str]) -> str:
    return subprocess.run(command, cwd=mountpoint, capture_output=True, text=True, check=True,
                          env={**os.environ, "LC_ALL": "C"}).stdout


def test_the_daemon_maps_libfuse3_and_not_libfuse2(tmp_path: Path) -> None:
    from atlasfs import AtlasWriter

    with AtlasWriter(tmp_path / "ds", shard_size=4, block_size=2) as writer:
        for i in range(4):
            writer.add_example({"bin": bytes([i]) * 10})
    with mounted(tmp_path / "ds") as mnt:
        daemons = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid)[-2:] == [
            str(tmp_path / "ds"), str(mnt)]]
        assert len(daemons) == 1, daemons
        with open(f"/proc/{daemons[0]}/maps") as f:
            libraries = {Path(line.split()[-1]).name for line in f if ".so" in line}
    assert any(name.startswith("libfuse3.so.3") for name in libraries), sorted(libraries)
    assert not any(name.startswith("libfuse.so.2") for name in libraries), sorted(libraries)


def _cmdline(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [os.fsdecode(arg) for arg in f.read().split(b"\0")[:-1]]
    except OSError:  # gone meanwhile
        return []


def test_find_asks_for_no_attributes_and_looks_up_no_file() -> None:
    """find needs names and types only: the kernel asks for attributes (READDIRPLUS) with the
    first listing reply alone (READDIRPLUS_AUTO), so the daemon works out no entry past its
    first window and the kernel keeps no inode for the files listed."""
    with served(known=True) as tree:
        out = _listing(tree.mountpoint, ["find", "d", "-type", "f"])
    assert len(out.splitlines()) == FILES
    assert tree.file_lookups() == 0
    calls = tree.log["calls"]
    assert calls["names /d"] == 1 and calls["known_entries /d"] <= 1


def test_ls_l_gets_every_attribute_with_the_listing() -> None:
    """ls -l stats each file as it reads the folder, so the kernel asks for attributes with
    every reply: the daemon is asked about no file, the second time not even for the listing."""
    with served(known=True) as tree:
        first = _listing(tree.mountpoint, ["ls", "-ln", "d"])
        assert _listing(tree.mountpoint, ["ls", "-ln", "d"]) == first
    assert first.count(f" {FILE_SIZE} ") == FILES
    # The native engine answers OPENDIR with ENOSYS, so the kernel keeps the listing itself
    # (FOPEN_CACHE_DIR) and the second ls does not reach the daemon at all.
    assert tree.file_lookups() == 0
    assert tree.log["calls"]["names /d"] == 1


@pytest.mark.parametrize("command", [["find", "d", "-type", "f", "-printf", "%s %i\n"], ["du", "-ab", "d"]])
def test_a_listing_read_whole_before_its_stats_gets_attributes_first_then_lookups(command: list[str]) -> None:
    """find -printf %s and du read a folder whole, then stat every file: the first reply
    carries attributes, and the files past it are looked up, each once."""
    with served(known=True) as tree:
        out = _listing(tree.mountpoint, command)
    assert out.count(str(FILE_SIZE)) >= FILES
    assert 0 < tree.file_lookups() < FILES
    assert tree.log["calls"]["names /d"] == 1 and tree.log["calls"]["known_entries /d"] == 1


def test_entries_the_tree_does_not_know_are_looked_up() -> None:
    """The other side: a tree that would have to work out its sizes answers None, and the
    kernel looks each file up when ls -l stats it (what the first test would miss)."""
    with served(known=False) as tree:
        out = _listing(tree.mountpoint, ["ls", "-ln", "d"])
    assert len([line for line in out.splitlines() if f" {FILE_SIZE} " in line]) == FILES
    assert tree.file_lookups() == FILES


def test_a_big_sequential_read_comes_in_reads_of_a_mebibyte() -> None:
    """libfuse 3 lets a request carry 1 MiB and the mount widens its read-ahead to match,
    so dd bs=1M reaches the daemon in reads of more than libfuse 2's 128 KiB."""
    if os.geteuid() != 0:
        pytest.skip("only root may widen a mount's read-ahead (sysfs)")
    with served() as tree:
        dev = os.stat(tree.mountpoint).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
            assert int(f.read()) == 1024
        copy = subprocess.run(["dd", f"if={tree.mountpoint / 'big'}", "bs=1M", "status=none"],
                              capture_output=True, check=True).stdout
    assert copy == BIG_DATA
    sizes = tree.log["read_sizes"]
    assert max(sizes) > OLD_MAX_READ, collections.Counter(sizes)
    assert sum(size > OLD_MAX_READ for size in sizes) * 1024 * 1024 >= BIG_SIZE * 3 // 4, collections.Counter(sizes)


@contextlib.contextmanager
def debug_mount(dataset: Path, mnt: Path, log_path: Path, options: str = "") -> Iterator[tuple[Path, Path]]:
    """``atlasfs mount -f -o debug[,options]`` of ``dataset`` for the duration, libfuse's debug
    log (every request and reply) in ``log_path``; unmounted with ``atlasfs umount`` after."""
    require_fuse()
    mnt.mkdir()
    with open(log_path, "w") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", "-o",
                                   ",".join(filter(None, ["debug", options])), str(dataset), str(mnt)],
                                  stderr=log, stdout=log)
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(mnt) and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert is_mounted(mnt), log_path.read_text()[-2000:]
        yield mnt, log_path
        assert atlasfs("umount", str(mnt)).returncode == 0
        daemon.wait(timeout=30)
    finally:
        force_unmount(mnt)
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def test_atlas_mount_of_known_sizes_lists_with_attributes(tmp_path: Path) -> None:
    """End to end on an Atlas dataset whose files are all ``bytes`` fields (sizes known from
    the first listing): libfuse's own debug log shows READDIRPLUS, and a folder small
    enough for one reply is listed by ls -l without a LOOKUP per file."""
    from atlasfs import AtlasWriter

    files = 20  # ls -l reads a folder whole before it stats a file: one reply's worth
    with AtlasWriter(tmp_path / "ds", shard_size=files // 2, block_size=10) as writer:
        for i in range(files // 2):
            writer.add_example({"jpg": bytes([i % 256]) * (i + 1), "bin": b"y" * 7})
    with debug_mount(tmp_path / "ds", tmp_path / "mnt", tmp_path / "debug.log") as (mnt, log_path):
        shard = sorted(os.listdir(mnt))[0]
        out = _listing(mnt / shard, ["ls", "-ln"])
        assert len([line for line in out.splitlines() if line.startswith("-r--r--r--")]) == files
    debug = log_path.read_text()
    assert "opcode: READDIRPLUS" in debug
    assert debug.count("opcode: LOOKUP") <= 2, debug.count("opcode: LOOKUP")  # the shard folder, at most twice


def test_init_settles_the_connection_with_the_libfuse2_options(tmp_path: Path) -> None:
    """libfuse 3 takes these in INIT, not on its command line: the engine's INIT reply (libfuse's
    debug log) carries them, and sync_read turns asynchronous reads off (they are on otherwise)."""
    from atlasfs import AtlasWriter

    with AtlasWriter(tmp_path / "ds", shard_size=4, block_size=2) as writer:
        for i in range(4):
            writer.add_example({"bin": bytes([i]) * 1000})
    options = "max_read=65536,max_readahead=32768,sync_read,max_background=20,congestion_threshold=10"
    replies = {}
    for name, given in (("set", options), ("default", "")):
        with debug_mount(tmp_path / "ds", tmp_path / f"mnt-{name}", tmp_path / f"{name}.log", given) as (mnt, _):
            shard = mnt / sorted(os.listdir(mnt))[0]
            assert [(shard / n).read_bytes() for n in sorted(os.listdir(shard))] == [bytes([i]) * 1000 for i in range(4)]
        replies[name] = _init_reply((tmp_path / f"{name}.log").read_text())
    got = replies["set"]
    assert (got["max_readahead"], got["max_background"], got["congestion_threshold"]) == ("0x00008000", "20", "10"), got
    assert int(got["flags"], 16) & FUSE_ASYNC_READ == 0, got
    assert int(replies["default"]["flags"], 16) & FUSE_ASYNC_READ, replies["default"]
    assert replies["default"]["max_readahead"] != "0x00008000", replies["default"]


def _init_reply(debug: str) -> dict[str, str]:
    """The fields of the INIT reply in libfuse's debug log (its indented ``name=value`` lines)."""
    lines = debug.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("   INIT: "))
    fields = {}
    for line in lines[start + 1:]:
        name, equals, value = line.strip().partition("=")
        if not line.startswith("   ") or not equals:
            break
        fields[name] = value
    return fields


def test_libfuse2_options_still_mount(tmp_path: Path) -> None:
    """libfuse 3 refuses these on its command line (and max_read unless init repeats it)."""
    from atlasfs import AtlasWriter

    with AtlasWriter(tmp_path / "ds", shard_size=4, block_size=2) as writer:
        for i in range(4):
            writer.add_example({"bin": bytes([i]) * 300_000})
    options = "max_read=65536,max_readahead=65536,sync_read,max_background=20,congestion_threshold=10,noforget"
    with mounted(tmp_path / "ds", "-o", options) as mnt:
        shard = mnt / sorted(os.listdir(mnt))[0]
        assert [(shard / name).read_bytes() for name in sorted(os.listdir(shard))] == [
            bytes([i]) * 300_000 for i in range(4)]


def test_known_entries_of_an_blocktree(tmp_path: Path) -> None:
    """An Atlas folder's entries are known once their sizes are: at once for ``bytes`` fields,
    else once a file of their block is looked up; and they are the entries lookups give."""
    from atlasfs import AtlasDataset, AtlasWriter
    from atlasfs.tree.blocktree import BlockTree

    for name, fields in (("raw", lambda i: {"bin": bytes([i]) * (i + 1)}),
                         # json too big to be kept in the table (128 bytes) and no run of the block
                         ("encoded", lambda i: {"bin": bytes([i]), "json": {"i": i, "v": list(range(60))}})):
        with AtlasWriter(tmp_path / name, shard_size=6, block_size=3) as writer:
            for i in range(6):
                writer.add_example(fields(i))
    raw = BlockTree(AtlasDataset(tmp_path / "raw"))
    assert raw.known_entries("/") == [entry for _, entry in raw.listdir("/")]
    names = [name for name, _, _ in raw.names("/0")]
    assert list(raw.known_entries("/0")) == [raw.lookup(f"/0/{name}") for name in names]
    assert list(raw.known_entries("/0", 2, 5)) == [raw.lookup(f"/0/{name}") for name in names[2:5]]

    encoded = BlockTree(AtlasDataset(tmp_path / "encoded"))
    names = [name for name, _, _ in encoded.names("/0")]
    # bytes fields are sized at once; the others when a file of their block is looked up
    assert [e is not None for e in encoded.known_entries("/0")] == [n.endswith(".bin") for n in names]
    encoded.lookup(f"/0/{names[1]}")  # a json of block 0 (examples 0-2): the whole block is sized
    expected = [encoded.lookup(f"/0/{n}") if i < 6 or n.endswith(".bin") else None for i, n in enumerate(names)]
    assert list(encoded.known_entries("/0")) == expected

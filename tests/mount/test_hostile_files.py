"""Files of a dataset that are not what their names say (issue #35, points 2 and 5): a FIFO, a
socket, a device or a folder where a file is read, and a dictionary far past any real size.

The rule: every file atlasfs reads is opened without blocking (a FIFO never waits for a writer)
and read only if it is a regular file (links followed: datasets are assembled from links), and
a file read whole is read within a stated bound (a dictionary: ``MAX_DICTIONARY_BYTES``). Anything
else is one line naming the file and what it is, and fails only what needs it: a block, a shard,
or (a strategy-2 dataset's own dictionary) the dataset.

Everything that could hang runs in a child process with a deadline, and a mount's daemon is
this test's own process: a hang kills it (which ends every request waiting on it) and fails.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from atlasfs import AtlasWriter
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.atlas.codec import MAX_DICTIONARY_BYTES
from atlasfs.storage import LocalStorage, UnfitFileError
from fusemount import atlasfs, force_unmount, is_mounted, require_fuse

#: Seconds any command or file system call may take here; these datasets take well under one.
DEADLINE = 20
#: A daemon's peak memory serving these small datasets; a dictionary read whole took 2 GiB.
#: Sanitized builds (scripts/test-sanitized.sh) carry their shadow memory on top.
PEAK = (768 if os.environ.get("ATLASFS_TEST_SANITIZED") else 256) << 20
GIB = 1 << 30
SHARDS = ("0", "1", "2", "3")
FIFO = "not a regular file (a FIFO)"
BOUND = f"past the bound of a zstd dictionary (16.0 MiB, {MAX_DICTIONARY_BYTES} bytes)"


def atlas(path: Path, strategy: int) -> Path:
    """Four shards of 16 examples in blocks of 2 (8 blocks: enough for zstd to train a dictionary)."""
    examples = [{"__key__": f"s{i:03d}", "txt": f"text {i} " * 20, "cls": i} for i in range(16 * len(SHARDS))]
    with AtlasWriter(path, shard_size=16, block_size=2, compression_strategy=strategy) as writer:
        writer.add_examples(examples)
    dictionaries = {1: [], 2: [path / "zstd_dict.bin"]}.get(strategy, [path / s / "zstd_dict.bin" for s in SHARDS])
    assert all(d.is_file() for d in dictionaries), "the writer fell back to strategy 1"
    return path


def text(i: int) -> bytes:
    return (f"text {i} " * 20).encode()


def fifo(path: Path) -> Path:
    """``path`` replaced by (or made) a FIFO nothing ever writes to."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def sparse(path: Path, size: int = GIB) -> Path:
    """``path`` replaced by (or made) a sparse file of ``size`` bytes (costs no disk)."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def empty_folder(tmp_path: Path) -> Path:
    """A mount point (a mount refused leaves it empty)."""
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """``atlasfs ARGS`` within the deadline (a hang is a TimeoutExpired: the test fails)."""
    return atlasfs(*args, timeout=DEADLINE)


_MEASURED = """
import resource, subprocess, sys
result = subprocess.run([sys.executable, "-m", "atlasfs", *sys.argv[2:]])
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(result.returncode)
"""


def run_measured(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``atlasfs ARGS`` as :func:`run`, and its peak resident memory in bytes."""
    peak = tmp_path / "peak"
    result = subprocess.run([sys.executable, "-c", _MEASURED, str(peak), *args], capture_output=True, text=True,
                            timeout=DEADLINE)
    return result, int(peak.read_text())


def one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """The one line of ``result``'s stdout and stderr holding every fragment (and no traceback)."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if all(f in line for f in fragments)]
    assert len(lines) == 1, output
    return lines[0]


# ---------------------------------------------------------------- a mount of our own


class Daemon:
    """A foreground ``atlasfs mount -f`` of ``dataset`` on a folder of ``tmp_path``, logging to
    ``self.log``. :meth:`run` runs a command on it within the deadline; one that hangs kills the
    daemon (so that the kernel answers every request waiting on it) and fails the test."""

    def __init__(self, dataset: Path, tmp_path: Path, *args: str) -> None:
        require_fuse()
        self.mnt = tmp_path / "mnt"
        self.mnt.mkdir()
        self.log = tmp_path / "daemon.log"
        self.stderr_path = tmp_path / "daemon.stderr"
        self.stderr = open(self.stderr_path, "w")
        env = dict(os.environ)
        preload = os.environ.get("ATLASFS_TEST_DAEMON_PRELOAD")  # its sanitizers, under test-sanitized.sh
        if preload:
            env["LD_PRELOAD"] = preload
        self.process = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", str(dataset), str(self.mnt),
                                         "-o", f"log_file={self.log}", *args],
                                        stdout=subprocess.DEVNULL, stderr=self.stderr, text=True, env=env)
        deadline = time.monotonic() + DEADLINE
        while not is_mounted(self.mnt):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"not mounted within {DEADLINE} s: {self.logged()}")
            time.sleep(0.02)

    def logged(self) -> str:
        """The daemon's log and stderr so far."""
        return (self.log.read_text() if self.log.exists() else "") + self.stderr_path.read_text()

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        """``command`` on the mount, within the deadline."""
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = child.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self.process.kill()  # the kernel fails what waits on it: the child can end
            child.kill()
            child.communicate()
            force_unmount(self.mnt)
            pytest.fail(f"{' '.join(command)} hung (over {DEADLINE} s)")
        return subprocess.CompletedProcess(command, child.returncode, out, err)

    def ls(self, folder: str = "") -> subprocess.CompletedProcess[str]:
        return self.run("ls", "-1", str(self.mnt / folder))

    def cat(self, path: str) -> subprocess.CompletedProcess[str]:
        return self.run("cat", str(self.mnt / path))

    def peak(self) -> int:
        """The daemon's peak resident memory so far, in bytes."""
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def stop(self) -> None:
        """Unmount (``fusermount3 -u``, within the deadline) and wait for the daemon to end."""
        try:
            if is_mounted(self.mnt):
                result = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True, text=True,
                                        timeout=DEADLINE)
                assert result.returncode == 0, result.stderr
            self.process.wait(timeout=DEADLINE)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            force_unmount(self.mnt)
            self.stderr.close()


@contextmanager
def mounted(dataset: Path, tmp_path: Path, *args: str) -> Iterator[Daemon]:
    daemon = Daemon(dataset, tmp_path, *args)
    try:
        yield daemon
        assert daemon.process.poll() is None, f"the daemon died: {daemon.logged()}"
    finally:
        daemon.stop()


def assert_eio(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode != 0 and "Input/output error" in result.stderr, result


def assert_serves(daemon: Daemon, shard: str) -> None:
    """Every file of ``shard`` (16 examples) lists and reads right."""
    listed = daemon.ls(shard)
    first = int(shard) * 16
    assert listed.returncode == 0 and listed.stdout.split() == sorted(
        f"s{i:03d}.{ext}" for i in range(first, first + 16) for ext in ("cls", "txt")), listed
    shown = daemon.cat(f"{shard}/s{first + 5:03d}.txt")
    assert shown.returncode == 0 and shown.stdout.encode() == text(first + 5), shown


def assert_unreadable(daemon: Daemon, shard: str) -> None:
    """``shard``'s listing answers, each block as ``<index key>.unreadable``, each failing with EIO."""
    listed = daemon.ls(shard)
    assert listed.returncode == 0, listed
    first = int(shard) * 16
    assert listed.stdout.split() == [f"{i:06d}.unreadable" for i in range(first, first + 16)], listed.stdout
    assert_eio(daemon.cat(f"{shard}/{first:06d}.unreadable"))


# ---------------------------------------------------------------- the dictionary (points 2 and 5)


@pytest.mark.parametrize("strategy", [2, 3])
def test_a_fifo_put_in_place_of_the_dictionary_after_mounting_fails_only_what_needs_it(
        tmp_path: Path, strategy: int) -> None:
    """Every first look into a shard hung in the dictionary's open(); now the blocks that need it
    fail with EIO at once, with a log line naming it, and the mount answers and unmounts."""
    dataset = atlas(tmp_path / "ds", strategy)
    dictionary = dataset / "zstd_dict.bin" if strategy == 2 else dataset / "1" / "zstd_dict.bin"
    with mounted(dataset, tmp_path) as daemon:
        fifo(dictionary)
        assert_unreadable(daemon, "1")
        assert daemon.run("stat", "-f", str(daemon.mnt)).returncode == 0  # statfs answers
        for shard in ("0", "2"):
            if strategy == 2:  # every shard needs the shared dictionary
                assert_unreadable(daemon, shard)
            else:  # shards of their own dictionary serve
                assert_serves(daemon, shard)
        root = daemon.ls()
        assert root.returncode == 0 and root.stdout.split() == list(SHARDS), root
    logged = daemon.logged()
    lines = [line for line in logged.splitlines() if f"{dictionary}: {FIFO}" in line]
    assert lines and all(f"{dataset}/" in line and "/data.bin block " in line for line in lines), logged
    assert "Traceback" not in logged, logged


@pytest.mark.parametrize("strategy", [2, 3])
def test_a_fifo_in_place_of_the_dictionary_before_mounting_is_said_at_once(tmp_path: Path, strategy: int) -> None:
    """Strategy 2: the dataset's dictionary, so the dataset is refused in one line; strategy 3:
    the shard's, so that shard fails (EIO) and the others serve."""
    dataset = atlas(tmp_path / "ds", strategy)
    dictionary = fifo(dataset / "zstd_dict.bin" if strategy == 2 else dataset / "1" / "zstd_dict.bin")
    line = f"{dictionary}: {FIFO}"
    for command in ("info", "verify"):
        result = run(command, str(dataset))
        assert result.returncode == 1
        one_line(result, line)
    if strategy == 2:
        result = run("mount", str(dataset), str(empty_folder(tmp_path)))
        assert result.returncode == 1 and result.stderr == f"atlasfs: {line}\n", result.stderr
        return
    with mounted(dataset, tmp_path) as daemon:
        assert_eio(daemon.ls("1"))
        assert_serves(daemon, "2")
    assert line in daemon.logged()


@pytest.mark.parametrize("strategy", [2, 3])
def test_a_sparse_1_gib_dictionary_is_refused_unread(tmp_path: Path, strategy: int) -> None:
    """A 1 GiB dictionary was read whole (the daemon at 2 GiB). Past MAX_DICTIONARY_BYTES it is
    one line naming the file and the bound, in every command, and never read."""
    dataset = atlas(tmp_path / "ds", strategy)
    dictionary = sparse(dataset / "zstd_dict.bin" if strategy == 2 else dataset / "1" / "zstd_dict.bin")
    line = f"{dictionary}: {GIB} bytes, {BOUND}"
    for command in ("info", "verify"):
        result, peak = run_measured(tmp_path, command, str(dataset))
        assert result.returncode == 1
        one_line(result, line)
        assert peak < PEAK, f"atlasfs {command} peaked at {peak >> 20} MiB"
    if strategy == 2:
        result = run("mount", str(dataset), str(empty_folder(tmp_path)))
        assert result.returncode == 1 and result.stderr == f"atlasfs: {line}\n", result.stderr
        return
    result = run("show", str(dataset), "20")
    assert result.returncode == 1 and result.stderr == f"atlasfs: {line}\n", result.stderr
    with mounted(dataset, tmp_path) as daemon:
        assert_eio(daemon.ls("1"))
        assert_serves(daemon, "0")
        assert daemon.peak() < PEAK, f"the daemon peaked at {daemon.peak() >> 20} MiB"
    assert line in daemon.logged()


@pytest.mark.parametrize("tables", [False, True])
def test_a_dictionary_grown_past_its_bound_after_mounting_is_not_read(tmp_path: Path, tables: bool) -> None:
    """Checked at open by its size, the dictionary is checked again (fstat) when it is read: grown
    to 1 GiB meanwhile, its shard's blocks fail, naming the bound, and the daemon stays small.
    With tables stored before (``atlasfs index``), the same: a table keyed on the dictionary's
    size is stale, so the shard is decoded again (which read the whole file: 2 GiB before)."""
    dataset = atlas(tmp_path / "ds", 3)
    if tables:
        assert run("index", str(dataset)).returncode == 0
    dictionary = dataset / "1" / "zstd_dict.bin"
    with mounted(dataset, tmp_path) as daemon:
        with open(dictionary, "r+b") as f:  # in place: the same file, grown
            f.truncate(GIB)
        assert_unreadable(daemon, "1")
        assert_serves(daemon, "2")
        assert daemon.peak() < PEAK, f"the daemon peaked at {daemon.peak() >> 20} MiB"
    assert f"{dictionary}: {GIB} bytes, {BOUND}" in daemon.logged()


# ---------------------------------------------------------------- the other files of a shard


def test_a_fifo_in_place_of_data_bin_is_one_line_in_every_command_and_fails_its_shard_alone(tmp_path: Path) -> None:
    dataset = atlas(tmp_path / "ds", 3)
    line = f"{fifo(dataset / '1' / 'data.bin')}: {FIFO}"
    info = run("info", str(dataset))
    assert info.returncode == 1 and f"1 problem: {line}" in one_line(info, line)
    assert "shards       4 (1 with problems, below)" in info.stdout
    verify = run("verify", str(dataset))
    assert verify.returncode == 1 and verify.stdout.splitlines()[0] == line, verify.stdout
    export = run("export", str(dataset), str(tmp_path / "out"))
    assert export.returncode == 1
    assert one_line(export, line) == f"atlasfs: export of shard 1 failed: {line}; the other shards are written"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0.tar", "2.tar", "3.tar", "shards.json"]
    show = run("show", str(dataset), "20")  # show opens shards without checking data.bin's size: it read it
    assert show.returncode == 1 and show.stderr == f"atlasfs: {line}\n", show.stderr
    show = run("show", str(dataset), "40")
    assert show.returncode == 0 and "s040" in show.stdout, show.stderr
    with mounted(dataset, tmp_path) as daemon:
        assert_eio(daemon.ls("1"))
        for shard in ("0", "2"):
            assert_serves(daemon, shard)
        fifo(dataset / "3" / "data.bin")  # after mounting, before any look: its blocks fail (changed)
        listed = daemon.ls("3")
        assert listed.returncode == 0 and all(n.endswith(".unreadable") for n in listed.stdout.split()), listed
        assert daemon.run("stat", "-f", str(daemon.mnt)).returncode == 0
    assert line in daemon.logged()


@pytest.mark.parametrize("name", ["meta.json", "index.npy"])
def test_a_fifo_for_a_shards_meta_or_index_fails_that_shard_alone(tmp_path: Path, name: str) -> None:
    """Both were opened blocking: verify, info and the mount hung at open."""
    dataset = atlas(tmp_path / "ds", 3)
    line = f"{fifo(dataset / '1' / name)}: {FIFO}"
    for command in ("info", "verify"):
        result = run(command, str(dataset))
        assert result.returncode == 1
        one_line(result, line)
    with mounted(dataset, tmp_path) as daemon:
        assert_eio(daemon.ls("1"))
        assert_serves(daemon, "3")
    assert line in daemon.logged()


def test_a_fifo_for_the_root_meta_refuses_the_dataset_in_one_line(tmp_path: Path) -> None:
    dataset = atlas(tmp_path / "ds", 1)
    line = f"{fifo(dataset / 'meta.json')}: {FIFO}"
    for command in ("info", "verify"):
        result = run(command, str(dataset))
        assert result.returncode == 1
        one_line(result, line)


def test_data_files_may_be_links_but_not_to_devices(tmp_path: Path) -> None:
    """A dataset assembled from links (a Hugging Face cache) reads as before; a link to a device
    is the device: refused, never opened."""
    dataset = atlas(tmp_path / "ds", 3)
    store = tmp_path / "blobs"
    store.mkdir()
    for shard in SHARDS:
        for name in ("data.bin", "index.npy", "meta.json", "zstd_dict.bin"):
            blob = store / f"{shard}-{name}"
            os.rename(dataset / shard / name, blob)
            os.symlink(blob, dataset / shard / name)
    assert run("verify", str(dataset)).returncode == 0
    (dataset / "2" / "data.bin").unlink()
    os.symlink("/dev/zero", dataset / "2" / "data.bin")
    result = run("verify", str(dataset))
    assert result.returncode == 1
    one_line(result, f"{dataset / '2' / 'data.bin'}: not a regular file (a character device)")


# ---------------------------------------------------------------- other formats


def webdataset_tars(folder: Path) -> Path:
    folder.mkdir()
    for n in range(3):
        with tarfile.open(folder / f"s{n}.tar", "w") as tar:
            for i in range(4):
                for ext, data in (("txt", f"hello {n} {i}".encode()), ("cls", str(i).encode())):
                    member = tarfile.TarInfo(f"k{n}_{i}.{ext}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    return folder


def test_a_fifo_in_place_of_a_webdataset_tar(tmp_path: Path) -> None:
    """Before, a FIFO named like a tar was left out without a word (verify said OK), and one put
    there after mounting hung the first look into its shard."""
    root = webdataset_tars(tmp_path / "wds")
    line = f"{fifo(root / 's1.tar')}: {FIFO}"
    result = run("verify", str(root))
    assert result.returncode == 1 and result.stdout.splitlines()[0] == line, result.stdout
    with mounted(root, tmp_path) as daemon:
        assert_eio(daemon.ls("s1"))
        shown = daemon.cat("s0/k0_2.txt")
        assert shown.returncode == 0 and shown.stdout == "hello 0 2", shown
        fifo(root / "s2.tar")  # after mounting, before any look
        assert_eio(daemon.ls("s2"))
        assert daemon.run("stat", "-f", str(daemon.mnt)).returncode == 0
    logged = daemon.logged()
    assert line in logged and f"{root / 's2.tar'}: " in logged, logged


def dolma(root: Path) -> Path:
    (root / "documents").mkdir(parents=True)
    for n, name in enumerate(("a.jsonl.gz", "b.jsonl", "c.jsonl.gz")):
        rows = "".join(json.dumps({"id": f"d{n}_{i}", "text": f"t {n} {i}"}) + "\n" for i in range(5)).encode()
        (root / "documents" / name).write_bytes(gzip.compress(rows) if name.endswith(".gz") else rows)
    return root


@pytest.mark.parametrize("name", ["b.jsonl", "c.jsonl.gz"])
def test_a_fifo_in_place_of_a_dolma_documents_file(tmp_path: Path, name: str) -> None:
    """The documents file was opened blocking by the pass (verify and the mount's first look hung)."""
    root = dolma(tmp_path / "dolma")
    line = f"{fifo(root / 'documents' / name)}: {FIFO}"
    result = run("verify", str(root))
    assert result.returncode == 1
    one_line(result, line)
    with mounted(root, tmp_path) as daemon:
        listed = daemon.ls()
        assert listed.returncode == 0 and listed.stdout.split() == ["a", "b", "c"], listed
        assert_eio(daemon.ls(name.split(".")[0]))
        shown = daemon.cat("a/d0_3.text")
        assert shown.returncode == 0 and shown.stdout == "t 0 3", shown
    assert line in daemon.logged()


def test_a_fifo_for_a_dolma_file_after_opening_is_one_line(tmp_path: Path) -> None:
    """Put there after the dataset was opened, the pass over it meets it: one line, no hang."""
    from atlasfs.formats.factory import open_source
    root = dolma(tmp_path / "dolma")
    source = open_source(str(root))
    fifo(root / "documents" / "b.jsonl")
    with deadline():
        with pytest.raises(AtlasFormatError, match=f"^{root / 'documents' / 'b.jsonl'}: not a regular file"):
            source.shards[1].prepare()
        assert len(source.shards[0].prepare()) > 0


def test_a_fifo_in_place_of_a_pbin_or_lavender_file(tmp_path: Path) -> None:
    """A .pbin FIFO was left out without a word; a Lavender parquet FIFO hung pyarrow's open."""
    from atlasfs.formats.pbin import write_pbin
    root = tmp_path / "pbin"
    root.mkdir()
    for name in ("a", "c"):
        write_pbin(str(root / f"{name}.pbin"), [[1, 2], [3]], token_width=2)
    line = f"{fifo(root / 'b.pbin')}: {FIFO}"
    result = run("verify", str(root))
    assert result.returncode == 1 and result.stdout.splitlines()[0] == line, result.stdout

    import pyarrow as pa
    import pyarrow.parquet as pq
    from atlasfs.formats.lavender import write_csv_shard
    lavender = tmp_path / "lavender"
    for shardset in ("images", "scores"):
        (lavender / shardset).mkdir(parents=True)
    for s in range(2):
        uids = [f"u{s}{i}" for i in range(4)]
        write_csv_shard(str(lavender / "images" / f"shard.{s:05d}.csv"), [{"uid": u, "url": f"x/{u}"} for u in uids])
        pq.write_table(pa.table({"uid": uids, "score": [0.5] * 4}), lavender / "scores" / f"shard.{s:05d}.parquet")
    parquet = fifo(lavender / "scores" / "shard.00001.parquet")
    result = run("verify", str(lavender))
    assert result.returncode == 1
    one_line(result, str(parquet), FIFO)


# ---------------------------------------------------------------- LocalStorage itself


@contextmanager
def deadline(seconds: float = 5) -> Iterator[None]:
    """Fail (rather than hang) if the block takes longer: a blocking open() of a FIFO is
    interrupted by the alarm's signal, whose handler raises."""
    def expired(*_: Any) -> None:
        raise TimeoutError(f"blocked for over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_local_storage_reads_only_regular_files_and_never_blocks(tmp_path: Path) -> None:
    storage = LocalStorage()
    regular = tmp_path / "file"
    regular.write_bytes(b"0123456789")
    link = tmp_path / "link"
    link.symlink_to(regular)
    assert storage.read(str(link)) == b"0123456789" and storage.pread(str(link), 2, 3) == b"234"
    with storage.open(str(link)) as f:
        assert f.name == str(link) and f.read() == b"0123456789"
    os.mkfifo(tmp_path / "fifo")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "socket"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "device").symlink_to("/dev/null")
    cases = {"fifo": "a FIFO", "socket": "a socket", "folder": "a folder", "device": "a character device"}
    try:
        with deadline():
            for name, kind in cases.items():
                path = str(tmp_path / name)
                for call in (lambda: storage.read(path), lambda: storage.read(path, 4),
                             lambda: storage.pread(path, 0, 4), lambda: storage.open(path),
                             lambda: storage.read_bounded(path, 100, "a test file"),
                             lambda: storage.check_file(path)):
                    with pytest.raises(UnfitFileError) as raised:
                        call()
                    assert str(raised.value) == f"{path}: not a regular file ({kind})"
    finally:
        server.close()
        storage.close()


def test_a_bound_is_checked_before_anything_is_read(tmp_path: Path) -> None:
    storage = LocalStorage()
    big = sparse(tmp_path / "big")
    with pytest.raises(UnfitFileError) as raised:
        storage.read_bounded(str(big), 100, "a test file")
    assert str(raised.value) == f"{big}: {GIB} bytes, past the bound of a test file (100 B, 100 bytes)"
    with pytest.raises(UnfitFileError):
        storage.check_file(str(big), 100, "a test file")
    small = tmp_path / "small"
    small.write_bytes(b"x" * 100)
    assert storage.read_bounded(str(small), 100, "a test file") == b"x" * 100
    storage.check_file(str(small), 100, "a test file")



# ---------------------------------------------------------------- sizes stated over sparse files (point 5)


def sparse_index(dataset: Path, shard: str, blocks: int) -> Path:
    """Shard ``shard``'s meta.json (and the root's shard_sizes) made to claim ``blocks`` blocks of
    one example, over a sparse index.npy whose header states that shape (so its size matches
    it) and a sparse data.bin: a forgery costing no disk."""
    import numpy as np
    root = json.loads((dataset / "meta.json").read_text())
    root["shard_sizes"][int(shard)] = blocks
    (dataset / "meta.json").write_text(json.dumps(root))
    meta = json.loads((dataset / shard / "meta.json").read_text())
    meta.update(stored_examples=blocks, block_size=1)
    (dataset / shard / "meta.json").write_text(json.dumps(meta))
    index = dataset / shard / "index.npy"
    with open(index, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<u8", "fortran_order": False, "shape": (blocks + 1,)})
        f.truncate(f.tell() + 8 * (blocks + 1))
    sparse(dataset / shard / "data.bin", blocks + 100)
    return index


def test_an_index_npy_claiming_a_huge_shape_over_a_sparse_file_is_refused_at_its_first_chunk(tmp_path: Path) -> None:
    """A meta.json claiming 2^27 blocks beside a sparse 1 GiB index.npy of that shape: the
    header matched the file's size, so info, verify and a mount's daemon read it whole (1.2 GB)
    before finding entry 1 not after entry 0. Now the index is read and checked a chunk at a
    time: one line, and memory for one chunk."""
    dataset = atlas(tmp_path / "ds", 1)
    index = sparse_index(dataset, "1", 1 << 27)
    line = f"{index}: index is not increasing (entry 1 is 0, after 0)"
    for command in ("info", "verify"):
        result, peak = run_measured(tmp_path, command, str(dataset))
        assert result.returncode == 1
        one_line(result, line)
        assert peak < PEAK, f"atlasfs {command} peaked at {peak >> 20} MiB"
    with mounted(dataset, tmp_path) as daemon:
        assert_eio(daemon.ls("1"))
        assert_serves(daemon, "2")
        assert daemon.peak() < PEAK, f"the daemon peaked at {daemon.peak() >> 20} MiB"
    assert line in daemon.logged()


def sparse_tar(path: Path, size: int) -> Path:
    """A tar of one sample, ``big.bin`` of ``size`` bytes (sparse: no disk) and ``big.txt``."""
    with open(path, "wb") as f:
        for name, length in (("big.bin", size), ("big.txt", 2)):
            member = tarfile.TarInfo(name)
            member.size = length
            f.write(member.tobuf(format=tarfile.GNU_FORMAT))
            f.seek(-(-length // 512) * 512, os.SEEK_CUR)
        f.write(b"\0" * 1024)
    return path


def test_a_webdataset_member_past_the_block_bound_is_refused_unread(tmp_path: Path) -> None:
    """A sparse tar whose one member states 1.5 GiB: verify and the daemon read the member
    whole (3 GiB with its copy) before the block bound was applied to what was read. Now a
    block whose members take more than max_block_bytes (1 GiB) fails unread, in one line."""
    root = webdataset_tars(tmp_path / "wds")
    tar = sparse_tar(root / "s1.tar", 3 * GIB // 2)
    line = f"{tar} sample 'big': its members take {3 * GIB // 2 + 2} bytes, more than the block bound of {GIB} bytes"
    result, peak = run_measured(tmp_path, "verify", str(root))
    assert result.returncode == 1
    one_line(result, line)
    assert peak < PEAK, f"atlasfs verify peaked at {peak >> 20} MiB"
    with mounted(root, tmp_path) as daemon:
        assert_eio(daemon.cat("s1/big.txt"))
        shown = daemon.cat("s0/k0_2.txt")
        assert shown.returncode == 0 and shown.stdout == "hello 0 2", shown
        assert daemon.peak() < PEAK, f"the daemon peaked at {daemon.peak() >> 20} MiB"
    assert line in daemon.logged()


def test_a_sparse_lavender_csv_is_read_a_bounded_line_at_a_time(tmp_path: Path) -> None:
    """A csv grown sparse to 3 GiB (NULs, no newline) was read whole, then split: info and
    verify took 6.3 GB. Now one line (verify) naming the file and the line past the bound."""
    from atlasfs.formats.lavender import write_csv_shard
    from atlasfs.formats.lavender.files import MAX_CSV_LINE_BYTES
    lavender = tmp_path / "lavender"
    for shardset in ("images", "labels"):
        (lavender / shardset).mkdir(parents=True)
        for s in range(2):
            write_csv_shard(str(lavender / shardset / f"shard.{s:05d}.csv"),
                            [{"uid": f"u{s}{i}", shardset: f"x{i}"} for i in range(4)])
    csv_file = lavender / "labels" / "shard.00001.csv"
    with open(csv_file, "r+b") as f:
        f.truncate(3 * GIB)
    result, peak = run_measured(tmp_path, "verify", str(lavender))
    assert result.returncode == 1
    one_line(result, f"{csv_file} line 6: longer than {MAX_CSV_LINE_BYTES} bytes")
    assert peak < PEAK, f"atlasfs verify peaked at {peak >> 20} MiB"
    result, peak = run_measured(tmp_path, "info", str(lavender))  # its rows are counted, so scanned
    assert "Traceback" not in result.stderr and peak < PEAK, (result, peak >> 20)


def test_a_pbin_document_past_the_block_bound_is_refused_unread(tmp_path: Path) -> None:
    """A sparse .pbin whose index states one document of 1.5 GiB: verify and the daemon read it
    whole (and its .npy copy). Now its block fails unread, in one line; other files serve."""
    import pickle
    import struct

    from atlasfs.formats.pbin import write_pbin
    root = tmp_path / "pbin"
    root.mkdir()
    write_pbin(str(root / "a.pbin"), [[1, 2], [3]], token_width=2)
    size = 3 * GIB // 2
    with open(root / "b.pbin", "wb") as f:
        f.write(struct.pack("<QI", size, 4))
        f.seek(12 + size)
        f.write(pickle.dumps([(0, size)]))
    line = f"{root / 'b.pbin'} document 0: its documents take {size} bytes, more than the block bound of {GIB} bytes"
    result, peak = run_measured(tmp_path, "verify", str(root))
    assert result.returncode == 1
    one_line(result, line)
    assert peak < PEAK, f"atlasfs verify peaked at {peak >> 20} MiB"
    with mounted(root, tmp_path) as daemon:
        listed = daemon.ls("b")
        assert listed.returncode == 0 and listed.stdout.split() == ["000000.npy"], listed  # its size from the index
        assert_eio(daemon.cat("b/000000.npy"))
        import numpy as np

        from atlasfs.formats.naming import encode_as
        (tmp_path / "expected.npy").write_bytes(encode_as("npy", np.array([3], dtype=np.uint16)))
        served = daemon.run("cmp", str(daemon.mnt / "a" / "000001.npy"), str(tmp_path / "expected.npy"))
        assert served.returncode == 0, served
        assert daemon.peak() < PEAK, f"the daemon peaked at {daemon.peak() >> 20} MiB"
    assert line in daemon.logged()


def test_a_dolma_block_past_the_block_bound_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    """A 6 MB .json.gz of 7 documents of 192 MiB each (each line within MAX_LINE_BYTES) had
    verify inflate its one block whole (3.2 GB) and say OK. The scan knows each block's text
    bytes: past max_block_bytes the block fails before a byte of it is read (the bound here
    made small, so that the test inflates nothing large)."""
    from atlasfs.formats.factory import open_source
    root = dolma(tmp_path / "dolma")
    source = open_source(str(root))
    shard = source.shards[0]
    shard.prepare()
    assert len(shard.decode_block(0)[0]) == 5
    shard.max_block_bytes = 100
    with pytest.raises(AtlasFormatError, match=(
            rf"^{root / 'documents' / 'a.jsonl.gz'}: block 0 \(lines 1\.\.5\) takes \d+ bytes of text, more than "
            r"the block bound of 100 bytes; not read$")):
        shard.decode_block(0)
    source.close()


@pytest.mark.parametrize("kind", ["pax", "gnu"])
def test_a_pax_or_long_name_header_stating_a_huge_size_is_not_read(tmp_path: Path, kind: str) -> None:
    """A pax (or GNU long-name) header member stating 1.5 GiB, over a sparse tar: tarfile read
    its payload whole in the walk (info, verify and the daemon at 1.6 GB for 30 s). Now the
    walk stops there with one line naming the offset; the other tars serve."""
    root = webdataset_tars(tmp_path / "wds")
    size = 3 * GIB // 2
    tar = root / "s1.tar"
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as archive:
        member = tarfile.TarInfo("k1_0.txt")
        member.size = 5
        archive.addfile(member, io.BytesIO(b"first"))
    with open(tar, "r+b") as f:
        f.seek(1024)  # after the first member
        header = tarfile.TarInfo("././@PaxHeader" if kind == "pax" else "././@LongLink")
        header.type = tarfile.XHDTYPE if kind == "pax" else tarfile.GNUTYPE_LONGNAME
        header.size = size
        f.write(header.tobuf(format=tarfile.GNU_FORMAT))
        f.seek(-(-size // 512) * 512, os.SEEK_CUR)
        member = tarfile.TarInfo("k1_1.txt")
        member.size = 2
        f.write(member.tobuf(format=tarfile.USTAR_FORMAT) + b"hi".ljust(512, b"\0") + b"\0" * 1024)
    line = (f"{tar} sample 'k1_0': may lack files, as the tar after it is cut short or damaged at offset 1024 "
            f"(a pax or long-name header of {size} bytes, more than")
    result, peak = run_measured(tmp_path, "verify", str(root))
    assert result.returncode == 1 and line in result.stdout and "Traceback" not in result.stderr, result
    assert peak < PEAK, f"atlasfs verify peaked at {peak >> 20} MiB"
    result, peak = run_measured(tmp_path, "info", str(root))  # the walk counts the samples before it
    assert result.returncode == 0 and "Traceback" not in result.stderr and peak < PEAK, (result, peak >> 20)
    with mounted(root, tmp_path) as daemon:
        listed = daemon.ls("s1")  # its last sample read may lack files: a block alone, failing (reliability.md)
        assert listed.returncode == 0 and len(listed.stdout.split()) == 1, listed
        shown = daemon.cat("s0/k0_2.txt")
        assert shown.returncode == 0 and shown.stdout == "hello 0 2", shown
        assert daemon.peak() < PEAK, f"the daemon peaked at {daemon.peak() >> 20} MiB"


def test_a_stale_sparse_table_of_the_datasets_owner_is_not_copied(tmp_path: Path) -> None:
    """The dataset's owner (another user) leaves a sparse 1 GiB file in .atlasfs-tables whose
    header states its size, but another key (stale, or foreign): each mount copied it whole into
    the user's cache, a megabyte at a time (1 GiB written, the cache's other tables evicted),
    before reading its key. Now its header alone is checked first: one log line, nothing copied."""
    import zlib

    from otheruser import NOBODY, require_root
    require_root()
    dataset = atlas(tmp_path / "ds", 1)
    tables = dataset / ".atlasfs-tables"
    tables.mkdir()
    size = GIB - 4096
    header = json.dumps({"key": {"stale": True}, "entries": 0, "sections": [["names", 4096, size - 4096, 0]]}).encode()
    table = tables / "0.table"
    with open(table, "wb") as f:
        f.write(b"ATLFSTB7" + len(header).to_bytes(4, "little") + zlib.crc32(header).to_bytes(4, "little") + header)
        f.truncate(size)
    for path in (dataset, tables, table):
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    cache = tmp_path / "cache"
    os.environ["XDG_CACHE_HOME"] = str(cache)  # the daemon's (inherited), not the user's own
    try:
        with mounted(dataset, tmp_path) as daemon:
            assert_serves(daemon, "0")
            with open(f"/proc/{daemon.process.pid}/io") as f:
                written = int(next(line for line in f if line.startswith("wchar:")).split()[1])
            assert written < 64 << 20, f"the daemon wrote {written >> 20} MiB"
    finally:
        del os.environ["XDG_CACHE_HOME"]
    assert (f"ignoring the stored file table {table}: it was built from other files or by other naming rules "
            "(stale or foreign)") in daemon.logged()


def test_a_parquet_footer_stating_gigabytes_is_not_read(tmp_path: Path) -> None:
    """A sparse 3 GiB Lavender parquet whose last 8 bytes state a 3 GiB footer: pyarrow read the
    footer whole (info and verify at 3.2 GB). Now the stated length is checked first: one line."""
    import struct

    import pyarrow as pa
    import pyarrow.parquet as pq

    from atlasfs.formats.lavender.files import MAX_PARQUET_FOOTER_BYTES
    lavender = tmp_path / "lavender"
    (lavender / "scores").mkdir(parents=True)
    for s in range(2):
        pq.write_table(pa.table({"uid": [f"u{s}{i}" for i in range(4)], "score": [0.5] * 4}),
                       lavender / "scores" / f"shard.{s:05d}.parquet")
    parquet = lavender / "scores" / "shard.00001.parquet"
    size = 3 * GIB
    with open(parquet, "wb") as f:
        f.write(b"PAR1")
        f.truncate(size - 8)
        f.seek(size - 8)
        f.write(struct.pack("<I", size - 16) + b"PAR1")
    for command in ("info", "verify"):
        result, peak = run_measured(tmp_path, command, str(lavender))
        assert result.returncode == 1
        one_line(result, f"{parquet}: cannot be read (its footer states {size - 16} bytes of metadata, more than "
                         f"{MAX_PARQUET_FOOTER_BYTES}; not read)")
        assert peak < PEAK, f"atlasfs {command} peaked at {peak >> 20} MiB"

"""Hostile and broken datasets through a real mount: nothing executed, nothing escapes,
EIO only where the damage is, and the rest byte-correct."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import zstandard

from atlasfs import AtlasDataset, AtlasWriter
from fusemount import atlasfs, force_unmount, is_mounted, mounted, require_fuse


class Payload:
    """Pickles to a call of ``func(*args)``: what a hostile dataset would contain."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def files_of(mnt: Path) -> dict[str, bytes]:
    """Every readable file under ``mnt`` (relative path -> bytes); EIO files are left out."""
    out = {}
    for folder, _, names in os.walk(mnt):
        for name in names:
            path = Path(folder) / name
            try:
                out[str(path.relative_to(mnt))] = path.read_bytes()
            except OSError as exc:
                assert exc.errno == errno.EIO, (path, exc)
    return out


def write(path: Path, examples: list[Any], strategy: int = 1, shard_size: int = 8, block_size: int = 2) -> Path:
    with AtlasWriter(path, shard_size=shard_size, block_size=block_size, compression_strategy=strategy) as w:
        w.add_examples(examples)
    return path


def plain_examples(n: int) -> list[dict[str, Any]]:
    return [{"__key__": f"s{i:03d}", "txt": f"text {i}", "cls": i, "npy": np.arange(i % 5)} for i in range(n)]


def test_hostile_pickle_is_refused_with_eio_and_a_log_line(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    examples: list[Any] = plain_examples(8)
    examples[5] = {"__key__": "evil", "txt": Payload(os.system, f"touch {marker}")}
    dataset = write(tmp_path / "ds", examples)
    log = tmp_path / "log"
    with mounted(dataset, "-o", f"log_file={log}") as mnt:
        names = sorted(os.listdir(mnt / "0"))
        assert names.count("000004.unreadable") == 1 and "000005.unreadable" in names
        for name in ("000004.unreadable", "000005.unreadable"):
            with pytest.raises(OSError) as info:
                (mnt / "0" / name).read_bytes()
            assert info.value.errno == errno.EIO
        assert (mnt / "0" / "s003.txt").read_bytes() == b"text 3"
        assert (mnt / "0" / "s006.txt").read_bytes() == b"text 6"
    assert not marker.exists()
    text = log.read_text()
    lines = [line for line in text.splitlines() if "system" in line]
    assert len(lines) == 1, text
    assert str(dataset / "0" / "data.bin") in lines[0] and "block 2" in lines[0] and "--trust-pickle" in lines[0]
    # the opt-in really lifts the restriction
    with mounted(dataset, "--trust-pickle") as mnt:
        assert "evil.txt.cls" in os.listdir(mnt / "0")
    assert marker.exists()


HOSTILE_KEYS = ["../../etc/passwd", "/etc/passwd", "a/../../b", "nul\x00x", "nul\x00y", "new\nline", "k" * 4096,
                ".", "..", "dup", "dup", "x.cls", "a//b", "__key__/x", "s002", "000003", "ok/../..", "tab\tkey",
                "\u202eevil", "é/../é"]


def test_hostile_names_never_escape_or_collide(tmp_path: Path) -> None:
    examples: list[Any] = []
    for i, key in enumerate(HOSTILE_KEYS):
        examples.append({"__key__": key, "txt": f"sample {i}", "../../field": b"x" if i % 3 == 0 else None,
                         "x" * 300: b"long" if i % 5 == 0 else None} if i % 2 else {"__key__": key, "cls": i})
    examples.append({"__key__": "s002", "cls": 1})  # the key of another sample
    examples.append({"cls": 5, "CLS": 6})  # differ only in case
    dataset = write(tmp_path / "ds", examples, shard_size=100, block_size=4)
    with mounted(dataset) as mnt:
        listing = subprocess.run(["ls", "-lR", str(mnt)], capture_output=True, text=True)
        assert listing.returncode == 0, listing.stderr
        found = subprocess.run(["find", str(mnt), "-print0"], capture_output=True, check=True).stdout.split(b"\0")
        root = os.fsencode(mnt)
        for path in filter(None, found):
            assert os.path.realpath(path).startswith(root), path
            assert b"\n" not in path and b"\t" not in path
        files = files_of(mnt)
        subprocess.run(["tar", "cf", str(tmp_path / "x.tar"), "-C", str(mnt / "0"), "."], check=True)
    with tarfile.open(tmp_path / "x.tar") as archive:
        names = [m.name for m in archive if m.isfile()]
    assert len(names) == len(set(names)) == len(files)
    stems = {(n.rpartition("/")[0], n.rpartition("/")[2].partition(".")[0]) for n in names}
    assert len(stems) == len(examples)  # one sample per example, none merged, none lost
    for name in names:
        assert ".." not in name.split("/") and not name.startswith("/")


def _damage(kind: str, shard: Path) -> None:
    """Break ``shard`` (a strategy-3 shard with its own dictionary) in the way ``kind`` names."""
    data, index_path, meta_path = shard / "data.bin", shard / "index.npy", shard / "meta.json"
    index = np.load(index_path)
    meta = json.loads(meta_path.read_text())
    if kind == "truncated data.bin":
        data.write_bytes(data.read_bytes()[:-10])
    elif kind == "index not monotonic":
        index[2], index[3] = index[3], index[2]
        np.save(index_path, index)
    elif kind == "index signed":
        np.save(index_path, index.astype(np.int32))
    elif kind == "index float":
        np.save(index_path, index.astype(np.float64))
    elif kind == "index past end":
        index[-1] += 100
        np.save(index_path, index)
    elif kind in ("meta missing key", "meta extra key", "meta wrong type", "meta version 2", "meta count"):
        if kind == "meta missing key":
            del meta["block_size"]
        elif kind == "meta extra key":
            meta["extra"] = 1
        elif kind == "meta wrong type":
            meta["block_size"] = "2"
        elif kind == "meta version 2":
            meta["version"] = 2
        else:
            meta["stored_examples"] += 3
        meta_path.write_text(json.dumps(meta))
    elif kind == "missing dictionary":
        (shard / "zstd_dict.bin").unlink()
    elif kind == "wrong dictionary":
        other = zstandard.train_dictionary(1024, [os.urandom(64) + bytes(range(200)) * 3 for _ in range(40)])
        (shard / "zstd_dict.bin").write_bytes(other.as_bytes())
    elif kind == "corrupt frame":
        raw = bytearray(data.read_bytes())
        start = int(index[1])
        raw[start + 6:start + 30] = os.urandom(24)
        data.write_bytes(bytes(raw))
    elif kind == "empty data.bin":
        data.write_bytes(b"")
    elif kind == "decompression bomb":
        # a frame header claiming 2**40 bytes (single segment, 8-byte size), then one raw block
        body = b"x" * 16
        frame = (b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + (2**40).to_bytes(8, "little")
                 + ((len(body) << 3) | 1).to_bytes(3, "little") + body)
        _replace_block(shard, 1, frame)
    elif kind in ("not a list", "wrong length"):
        dictionary = zstandard.ZstdCompressionDict((shard / "zstd_dict.bin").read_bytes())
        value: Any = {"a": 1} if kind == "not a list" else [{"txt": "only one"}]
        _replace_block(shard, 1, zstandard.ZstdCompressor(dict_data=dictionary).compress(pickle.dumps(value)))
    else:
        raise AssertionError(kind)


def _replace_block(shard: Path, block: int, frame: bytes) -> None:
    """Put ``frame`` in place of ``block`` of ``shard``, fixing the index."""
    index = np.load(shard / "index.npy")
    data = (shard / "data.bin").read_bytes()
    start, end = int(index[block]), int(index[block + 1])
    new = data[:start] + frame + data[end:]
    shift = len(frame) - (end - start)
    fixed = index.astype(np.int64)
    fixed[block + 1:] += shift
    (shard / "data.bin").write_bytes(new)
    np.save(shard / "index.npy", fixed.astype(index.dtype))


SHARD_DAMAGE = ["truncated data.bin", "index not monotonic", "index signed", "index float", "index past end",
                "meta missing key", "meta extra key", "meta wrong type", "meta version 2", "meta count",
                "missing dictionary", "wrong dictionary", "corrupt frame", "empty data.bin",
                "decompression bomb", "not a list", "wrong length"]


DECODE_ONLY = {"not a list", "wrong length"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A 3-shard strategy-3 dataset (each shard with its own dictionary) and its files through a mount."""
    path = write(tmp_path_factory.mktemp("pristine") / "ds", plain_examples(48), strategy=3,
                 shard_size=16, block_size=2)
    with mounted(path) as mnt:
        return path, files_of(mnt)


@pytest.mark.parametrize("kind", SHARD_DAMAGE)
def test_damaged_shard_fails_only_its_files(kind: str, tmp_path: Path, pristine: tuple[Path, dict[str, bytes]]) -> None:
    source, good_files = pristine
    dataset = tmp_path / "ds"
    shutil.copytree(source, dataset)
    _damage(kind, dataset / "1")
    # info checks metas, indexes and frame headers; only verify decodes block contents
    commands = ("verify",) if kind in DECODE_ONLY else ("verify", "info")
    for command in commands:
        result = atlasfs(command, str(dataset))
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        out = (result.stdout + result.stderr).splitlines()
        problem = [line for line in out if str(dataset / "1") in line]
        assert problem, (command, out)
        assert "Traceback" not in result.stderr
    with mounted(dataset) as mnt:
        served = files_of(mnt)
        # every file outside the damaged shard is there and byte-identical
        for path, data in good_files.items():
            if not path.startswith("1/"):
                assert served[path] == data, path
        # inside it, whatever is served is correct, and something fails with EIO
        assert all(good_files.get(path) == data for path, data in served.items())
        failures = 0
        try:
            names = os.listdir(mnt / "1")
        except OSError as exc:
            assert exc.errno == errno.EIO
            failures += 1
            names = []
        for name in names:
            try:
                (mnt / "1" / name).read_bytes()
            except OSError as exc:
                assert exc.errno == errno.EIO
                failures += 1
        assert failures > 0


@pytest.mark.parametrize("kind", ["root meta missing", "root meta not json", "root dictionary missing",
                                  "non-numeric shard folder"])
def test_root_damage_refuses_the_mount(kind: str, tmp_path: Path) -> None:
    require_fuse()
    dataset = write(tmp_path / "ds", plain_examples(40), strategy=2, shard_size=16, block_size=2)
    culprit = {"root meta missing": dataset / "meta.json", "root meta not json": dataset / "meta.json",
               "root dictionary missing": dataset / "zstd_dict.bin",
               "non-numeric shard folder": dataset / "backup"}[kind]
    if kind == "root meta not json":
        culprit.write_text("{")
    elif kind == "non-numeric shard folder":
        culprit.mkdir()
    else:
        culprit.unlink()
    (tmp_path / "mnt").mkdir()
    result = atlasfs("mount", str(dataset), str(tmp_path / "mnt"))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and str(culprit) in result.stderr, result.stderr
    assert not is_mounted(tmp_path / "mnt")


def test_files_changing_under_the_mount_fail_instead_of_mixing(tmp_path: Path) -> None:
    dataset = write(tmp_path / "ds", plain_examples(16), strategy=1, shard_size=16, block_size=2)
    library = AtlasDataset(dataset)
    with mounted(dataset, "-o", "cache_size=0") as mnt:
        names = sorted(os.listdir(mnt / "0"))  # builds the file table
        first = (mnt / "0" / "s000.txt").read_bytes()
        assert first == b"text 0"
        with open(dataset / "0" / "data.bin", "ab") as f:
            f.write(b"appended")
        with pytest.raises(OSError) as info:
            (mnt / "0" / "s009.txt").read_bytes()  # never read before: must not come from any cache
        assert info.value.errno in (errno.EIO, errno.ESTALE)
        assert (mnt / "0" / "s000.txt").read_bytes() == first  # the kernel's copy of unchanged bytes is fine
    assert len(library) == 16 and names


def test_sigkill_leaves_a_dead_mount_that_umount_z_recovers(tmp_path: Path) -> None:
    require_fuse()
    dataset = write(tmp_path / "ds", plain_examples(8))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    daemon = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", str(dataset), str(mnt)],
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not (is_mounted(mnt) and os.listdir(mnt)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        daemon.kill()
        daemon.wait()
        with pytest.raises(OSError) as info:
            # statfs, not a listing: under the native engine the kernel may list a folder
            # listed before from its own cache, dead daemon or not (docs/native.md)
            os.statvfs(mnt)
        assert info.value.errno == errno.ENOTCONN
        result = atlasfs("mount", str(dataset), str(mnt))
        assert result.returncode == 1 and "umount -z" in result.stderr
        result = atlasfs("umount", "-z", str(mnt))
        assert result.returncode == 0, result.stderr
        assert not is_mounted(mnt) and os.listdir(mnt) == []
        with mounted(dataset) as again:
            assert os.listdir(again) == ["0"]
    finally:
        if daemon.poll() is None:
            daemon.kill()
        force_unmount(mnt)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_reads_unmounts_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    require_fuse()
    dataset = write(tmp_path / "ds", plain_examples(200), shard_size=50, block_size=4)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    daemon = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", str(dataset), str(mnt),
                               "-o", "cache_size=0"], stderr=subprocess.DEVNULL)
    readers: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 20
        while not (is_mounted(mnt) and os.listdir(mnt)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        readers = [subprocess.Popen(["sh", "-c", f"while tar cf - -C {mnt} . >/dev/null 2>&1; do :; done"])
                   for _ in range(4)]
        time.sleep(1.0)
        daemon.send_signal(sig)
        assert daemon.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while is_mounted(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_mounted(mnt)
    finally:
        for reader in readers:
            reader.kill()
            reader.wait()
        if daemon.poll() is None:
            daemon.kill()
        force_unmount(mnt)


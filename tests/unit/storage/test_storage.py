"""The storage layer (atlasfs.storage) against real servers on 127.0.0.1.

Remote reads go to moto's S3 server (tests/support/s3server.py) through a forwarder the tests
can cut or make answer 503 (tests/support/tcpcut.py); nothing of fsspec or s3fs is mocked.
GET counts are the forwarder's: what went over the wire, not what the code believes
it sent.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from atlasfs.storage import (
    LOCAL,
    LocalStorage,
    StorageChangedError,
    StorageOptions,
    StorageUnavailableError,
    health,
    is_url,
    open_storage,
    redact,
)
from atlasfs.storage.diskcache import DiskCache
from helpers import REFERENCE
from s3server import S3Server, free_port, s3_server, upload_copy
from tcpcut import Forwarder

BUCKET = "atlas-storage-test"
DATASET = f"s3://{BUCKET}/twelve"
BIG = f"s3://{BUCKET}/big"
BIG_SIZE = (6 << 20) + 12345  # six and a bit windows of 1 MiB
WINDOW = 1 << 20


@pytest.fixture(scope="module")
def server():
    with s3_server() as s:
        s.make_bucket(BUCKET)
        local = upload_copy(s, REFERENCE / "s2_twelve_shards" / "dataset", DATASET)
        big = os.urandom(BIG_SIZE)
        s.filesystem().pipe_file(f"{BIG.removeprefix('s3://')}/x.bin", big)
        s.local = local  # type: ignore[attr-defined]
        s.big = big  # type: ignore[attr-defined]
        yield s
        shutil.rmtree(local.parent, ignore_errors=True)


@pytest.fixture
def forwarder(server: S3Server):
    with Forwarder(server.port) as fw:
        yield fw


def remote(url: str, endpoint: str, **options):
    """A fresh remote storage (its own buffer and passes) on ``url`` through ``endpoint``."""
    defaults = dict(coalesce_bytes=WINDOW, prefetch=2, deadline=3.0, attempt_timeout=1.0)
    return open_storage(url, StorageOptions(endpoint_url=endpoint, **{**defaults, **options}))


# -------------------------------------------------------------------- local and paths


def test_local_storage_is_the_os(tmp_path: Path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"0123456789")
    storage, root = open_storage(tmp_path)
    assert storage is LOCAL and root == str(tmp_path) and not storage.remote
    assert sorted(storage.listdir(root)) == [("d", True), ("f", False)]
    assert storage.stat(f"{root}/f")[0] == 10 and storage.stat(f"{root}/nope") is None
    assert storage.read(f"{root}/f") == b"0123456789" and storage.read(f"{root}/f", 3) == b"012"
    assert storage.pread(f"{root}/f", 4, 100) == b"456789"
    assert storage.read_ranges(f"{root}/f", [(0, 2), (8, 2)]) == [b"01", b"89"]
    assert storage.isdir(f"{root}/d") and not storage.isfile(f"{root}/d") and storage.isfile(f"{root}/f")
    storage.close_file(f"{root}/f")
    with pytest.raises(FileNotFoundError):
        storage.listdir(f"{root}/nope")


def test_urls_and_redaction():
    assert is_url("s3://b/p") and is_url("https://h/x") and is_url("gs://b")
    assert not is_url("/data/ds") and not is_url("data:set") and not is_url("./s3:/x")
    assert redact("https://me:hunter2@host/x and s3://b/k") == "https://***@host/x and s3://b/k"
    storage, root = open_storage("https://me:hunter2@127.0.0.1:9/ds/")
    assert root == "https://127.0.0.1:9/ds" and "hunter2" not in repr(storage)


# -------------------------------------------------------------------- listing and reads


def test_listing_and_reads_match_the_local_copy(server: S3Server, forwarder: Forwarder):
    storage, root = remote(DATASET, forwarder.endpoint)
    local = server.local  # type: ignore[attr-defined]
    assert storage.remote and root == DATASET
    assert sorted(storage.listdir(root)) == sorted((e.name, e.is_dir()) for e in os.scandir(local))
    assert sorted(storage.listdir(f"{root}/00")) == sorted((n, False) for n in os.listdir(local / "00"))
    listing_gets = forwarder.gets
    assert listing_gets <= 2, "the whole dataset is listed in one go"
    for shard in ("00", "07", "11"):
        for name in ("meta.json", "index.npy", "data.bin"):
            path = f"{root}/{shard}/{name}"
            expected = (local / shard / name).read_bytes()
            assert storage.stat(path)[0] == len(expected)
            assert storage.read(path) == expected
            assert storage.read(path, 10) == expected[:10]
            assert storage.pread(path, 5, 40) == expected[5:45]
    assert storage.isdir(f"{root}/03") and not storage.isdir(f"{root}/03/data.bin")
    assert storage.isfile(f"{root}/zstd_dict.bin") and not storage.isfile(f"{root}/03")
    assert storage.stat(f"{root}/99/data.bin") is None
    with pytest.raises(FileNotFoundError):
        storage.pread(f"{root}/99/data.bin", 0, 1)
    with pytest.raises(FileNotFoundError):
        storage.listdir(f"{root}/99")
    with pytest.raises(NotADirectoryError):
        storage.listdir(f"{root}/meta.json")
    assert forwarder.counts.keys() <= {"GET"}, "reads only: nothing is written to the bucket"


def test_missing_dataset_fails_at_once(server: S3Server, forwarder: Forwarder):
    storage, root = remote(f"s3://{BUCKET}/no-such-prefix", forwarder.endpoint, deadline=20.0)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError):
        storage.listdir(root)
    assert time.monotonic() - start < 5.0 and not storage.isdir(root)  # not retried to the deadline


def test_a_random_read_is_one_exact_get(server: S3Server, forwarder: Forwarder):
    storage, root = remote(BIG, forwarder.endpoint)
    storage.listdir(root)
    before = forwarder.gets
    assert storage.pread(f"{root}/x.bin", 3_000_000, 1000) == server.big[3_000_000:3_001_000]  # type: ignore[attr-defined]
    assert forwarder.gets - before == 1 and storage.bytes_fetched == 1000


def test_a_sequential_reader_costs_one_get_per_window(server: S3Server, forwarder: Forwarder):
    """Small reads in order: ceil(size / window) GETs, however small the reads, and the
    windows after the reader's are fetched ahead of it."""
    storage, root = remote(BIG, forwarder.endpoint)
    storage.listdir(root)
    before = forwarder.gets
    step = 40_000
    parts = [storage.pread(f"{root}/x.bin", offset, step) for offset in range(0, BIG_SIZE, step)]
    assert b"".join(parts) == server.big  # type: ignore[attr-defined]
    assert forwarder.gets - before == math.ceil(BIG_SIZE / WINDOW)
    assert storage.bytes_fetched == BIG_SIZE


def test_prefetch_runs_ahead_of_the_reader(server: S3Server, forwarder: Forwarder):
    storage, root = remote(BIG, forwarder.endpoint, prefetch=3)
    storage.listdir(root)
    before = forwarder.gets
    storage.pread(f"{root}/x.bin", 0, 100)
    deadline = time.monotonic() + 5
    while forwarder.gets - before < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert forwarder.gets - before == 4, "the first window and three ahead"


def test_a_second_reader_in_what_a_pass_fetched_costs_nothing(server: S3Server, forwarder: Forwarder):
    storage, root = remote(BIG, forwarder.endpoint)
    storage.listdir(root)
    storage.pread(f"{root}/x.bin", 0, WINDOW)  # window 0, and 1-2 ahead
    time.sleep(0.5)
    before = forwarder.gets
    assert storage.pread(f"{root}/x.bin", WINDOW + 77, 5000) == server.big[WINDOW + 77:WINDOW + 5077]  # type: ignore[attr-defined]
    assert forwarder.gets == before


def test_read_ranges_coalesces_neighbours(server: S3Server, forwarder: Forwarder):
    storage, root = remote(BIG, forwarder.endpoint)
    storage.listdir(root)
    big = server.big  # type: ignore[attr-defined]
    ranges = [(2_000_000, 1000), (2_001_000, 5000), (2_006_500, 300), (5_000_000, 10)]
    before = forwarder.gets
    assert storage.read_ranges(f"{root}/x.bin", ranges) == [big[o:o + n] for o, n in ranges]
    assert forwarder.gets - before == 2, "three neighbours in one GET, the far one in another"


def test_buffer_stays_bounded(server: S3Server, forwarder: Forwarder):
    storage, root = remote(BIG, forwarder.endpoint, buffer_bytes=0, prefetch=1)
    storage.listdir(root)
    for offset in range(0, BIG_SIZE, 100_000):
        storage.pread(f"{root}/x.bin", offset, 100_000)
        assert storage.windows.buffered_bytes <= 3 * WINDOW  # (prefetch + 2) windows: the floor of the bound


# -------------------------------------------------------------------- failures


def test_a_503_storm_is_retried(server: S3Server, forwarder: Forwarder):
    storage, root = remote(BIG, forwarder.endpoint, deadline=10.0)
    storage.listdir(root)
    forwarder.storm(6)
    start = time.monotonic()
    assert storage.pread(f"{root}/x.bin", 1_000_000, 64) == server.big[1_000_000:1_000_064]  # type: ignore[attr-defined]
    assert forwarder.storm_answers == 6 and storage.retries >= 6
    assert time.monotonic() - start < 8


def test_a_storm_past_the_deadline_fails_in_bound_then_reads_work(server: S3Server, forwarder: Forwarder):
    storage, root = remote(BIG, forwarder.endpoint, deadline=2.0)
    storage.listdir(root)
    forwarder.storm(10**6)
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError) as info:
        storage.pread(f"{root}/x.bin", 1_000_000, 64)
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 2.0 + 1.0, elapsed
    message = str(info.value)
    assert message.startswith(f"{BIG}/x.bin: the store did not answer within 2 s") and "503" in message
    assert "\n" not in message and "atlasfs-test-secret" not in message
    forwarder.storm(0)
    time.sleep(health.QUIET)  # the store is taken for down: asked again a second after a failure
    assert storage.pread(f"{root}/x.bin", 1_000_000, 64) == server.big[1_000_000:1_000_064]  # type: ignore[attr-defined]


@pytest.mark.parametrize("pattern", ["random", "sequential"])
def test_a_cut_mid_read_fails_within_the_deadline_and_the_same_read_works_once_restored(
        server: S3Server, pattern: str):
    """The link goes silent while a response is on its way: the read fails with
    StorageUnavailableError within the deadline (no hang), and once the link is back,
    the very same read returns the right bytes through the same storage object."""
    big = server.big  # type: ignore[attr-defined]
    with Forwarder(server.port, rate=2 << 20) as fw:  # 2 MiB/s: a 1 MiB window takes 0.5 s
        storage, root = remote(BIG, fw.endpoint, deadline=3.0, attempt_timeout=1.0)
        storage.listdir(root)
        offset, size = (0, 300_000) if pattern == "sequential" else (2_500_000, WINDOW)
        outcome: dict[str, object] = {}

        def read() -> None:
            try:
                outcome["data"] = storage.pread(f"{root}/x.bin", offset, size)
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = exc
            outcome["at"] = time.monotonic()

        reader = threading.Thread(target=read)
        start = time.monotonic()
        reader.start()
        time.sleep(0.2)  # part of the response has passed
        fw.cut()
        reader.join(10)
        assert not reader.is_alive(), "the read hung"
        assert isinstance(outcome.get("error"), StorageUnavailableError), outcome.get("error")
        assert outcome["at"] - start <= 3.0 + 1.0  # type: ignore[operator]
        assert str(outcome["error"]).startswith(f"{BIG}/x.bin: the store did not answer within 3 s")
        fw.restore()
        time.sleep(health.QUIET)  # the store is taken for down: asked again a second after a failure
        assert storage.pread(f"{root}/x.bin", offset, size) == big[offset:offset + size]


OUTAGES = ["refuse", "reset", "black_hole"]


@pytest.mark.parametrize("outage", OUTAGES)
def test_a_store_gone_fails_one_read_in_the_deadline_and_the_next_ones_fast(server: S3Server, outage: str):
    """The store refuses connections, resets them, or accepts and never answers: the first
    read fails within the deadline; the store is then taken for down, so the next reads
    (the kernel asking again, the next files of a tar) fail at once, a sequential one
    (windows) included, and after a quiet second one asks again with the short probe
    deadline; once it answers, reads work and it is up again."""
    big = server.big  # type: ignore[attr-defined]
    with Forwarder(server.port) as fw:
        storage, root = remote(BIG, fw.endpoint, deadline=3.0, attempt_timeout=1.0)
        path = f"{root}/x.bin"
        assert storage.pread(path, 6_000_000, 10) == big[6_000_000:6_000_010]
        getattr(fw, outage)()
        start = time.monotonic()
        with pytest.raises(StorageUnavailableError) as info:
            storage.pread(path, 5_000_000, 1000)
        elapsed = time.monotonic() - start
        assert 2.5 <= elapsed < 3.0 + 1.0, elapsed
        assert str(info.value).startswith(f"{BIG}/x.bin: the store did not answer within 3 s")
        assert storage.health.down()
        for offset in (2_000_000, 0):  # a random read, then one that starts a pass (windows)
            start = time.monotonic()
            with pytest.raises(StorageUnavailableError) as info:
                storage.pread(path, offset, 1000)
            assert time.monotonic() - start < 0.5
            assert "the store has not answered for 3 s" in str(info.value)
        assert storage.health.failed_fast >= 2
        time.sleep(health.QUIET + 0.2)
        start = time.monotonic()
        with pytest.raises(StorageUnavailableError) as info:
            storage.pread(path, 4_000_000, 1000)  # asks the store again, for the probe's deadline only
        assert time.monotonic() - start < health.PROBE_DEADLINE + 1.0
        assert "reads fail within 2 s, not 3 s" in str(info.value)
        if outage == "reset":
            assert fw.resets > 0, "the forwarder reset connections"
        fw.restore()
        time.sleep(health.QUIET + 0.2)
        start = time.monotonic()
        assert storage.pread(path, 3_000_000, 1000) == big[3_000_000:3_001_000]
        assert time.monotonic() - start < 1.0 and not storage.health.down()
        assert storage.pread(path, 0, 300_000) == big[:300_000]  # a pass, through windows


def test_the_down_state_ends_with_an_answer_or_after_its_window(monkeypatch):
    """StoreHealth's rules on a short clock: a full deadline run out marks the store down;
    requests then fail at once for the quiet spell after each failure, and ask with the
    probe's deadline after it; a probe that fails does not prolong the down state, whose
    window ends it (full deadline again); an answer ends it at once."""
    monkeypatch.setattr(health, "PROBE_DEADLINE", 0.1)
    monkeypatch.setattr(health, "QUIET", 0.2)
    monkeypatch.setattr(health, "WINDOW", 0.0)  # at least the deadline: 1 s
    state = health.StoreHealth("s3://b/ds", deadline=1.0)
    assert not state.down() and state.budget() == 1.0 and state.refuse_now("x") is None
    assert str(state.failed("s3://b/ds/x", 1.0, 4, "timed out")) == \
        "s3://b/ds/x: the store did not answer within 1 s (4 attempts, last: timed out)"
    assert state.down() and state.budget() == 0.1
    assert "has not answered for 1 s (last: timed out); reads fail at once" in str(state.refuse_now("s3://b/ds/x"))
    time.sleep(0.25)
    assert state.refuse_now("x") is None  # quiet spell over: ask (a probe)
    assert "reads fail within 0.1 s, not 1 s" in str(state.failed("x", 0.1, 1, "HTTP 503 SlowDown"))
    assert state.refuse_now("x") is not None  # a new quiet spell...
    time.sleep(0.8)
    assert not state.down() and state.budget() == 1.0  # ...but the window did not move: over
    state.failed("x", 1.0, 2, "timed out")
    state.answered()
    assert not state.down() and state.refuse_now("x") is None and state.failed_fast == 2


def test_the_forwarder_refuses_resets_and_black_holes(server: S3Server):
    """The test tool does what the tests above say it does, to new connections too."""
    with Forwarder(server.port) as fw:
        fw.refuse()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", fw.port), timeout=2)
        fw.restore()
        fw.reset()
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # the reset may come at once, or at a send
            with socket.create_connection(("127.0.0.1", fw.port), timeout=2) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                sock.recv(1)
        fw.restore()
        fw.black_hole()
        with socket.create_connection(("127.0.0.1", fw.port), timeout=2) as sock:
            sock.settimeout(1.0)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with pytest.raises(socket.timeout):
                sock.recv(1)
        fw.restore()
        with socket.create_connection(("127.0.0.1", fw.port), timeout=2) as sock:
            sock.sendall(b"GET /moto-api/ HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(12).startswith(b"HTTP/1.1")


def test_changed_objects_are_refused(server: S3Server, forwarder: Forwarder):
    """An object rewritten after the listing: reads fail, never mix old and new bytes."""
    fs = server.filesystem()
    key = f"{BUCKET}/changing/x.bin"
    fs.pipe_file(key, b"a" * 5000)
    storage, root = remote(f"s3://{BUCKET}/changing", forwarder.endpoint)
    assert storage.pread(f"{root}/x.bin", 100, 10) == b"a" * 10
    fs.pipe_file(key, b"b" * 5000)
    with pytest.raises(StorageChangedError) as info:
        storage.pread(f"{root}/x.bin", 200, 10)
    assert str(info.value).startswith(f"s3://{BUCKET}/changing/x.bin: changed in the store")


def test_refused_access_is_not_retried(server: S3Server, forwarder: Forwarder, monkeypatch):
    """A missing bucket: one error at once, not a wait for the deadline."""
    storage, root = remote(f"s3://no-such-bucket-{os.getpid()}/x", forwarder.endpoint, deadline=20.0)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError):
        storage.listdir(root)
    assert time.monotonic() - start < 5


# -------------------------------------------------------------------- the disk cache


def test_disk_cache_serves_a_second_storage_without_gets(server: S3Server, forwarder: Forwarder, tmp_path: Path):
    big = server.big  # type: ignore[attr-defined]
    cache = str(tmp_path / "cache")
    first, root = remote(BIG, forwarder.endpoint, disk_cache=cache)
    first.pread(f"{root}/x.bin", 0, BIG_SIZE)  # windows
    first.pread(f"{root}/x.bin", 4_444_444, 1234)  # within a window: from the buffer
    second, _ = remote(BIG, forwarder.endpoint, disk_cache=cache)
    second.listdir(root)
    before = forwarder.gets
    assert second.pread(f"{root}/x.bin", 0, BIG_SIZE) == big
    assert forwarder.gets == before, "every window from the disk cache"
    assert second.disk is not None and second.disk.hits >= math.ceil(BIG_SIZE / WINDOW)


def test_disk_cache_stays_within_its_bound(server: S3Server, forwarder: Forwarder, tmp_path: Path):
    cache = tmp_path / "cache"
    bound = 3 * WINDOW
    storage, root = remote(BIG, forwarder.endpoint, disk_cache=str(cache), disk_cache_bytes=bound)
    assert storage.pread(f"{root}/x.bin", 0, BIG_SIZE) == server.big  # type: ignore[attr-defined]
    on_disk = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert 0 < on_disk <= bound


def test_disk_cache_evicts_least_recently_used(tmp_path: Path):
    cache = DiskCache(str(tmp_path), max_bytes=10_000)
    ident = DiskCache.identity("s3://b/k", 1, 2, "e")
    for i in range(4):
        cache.put(ident, i * 2000, bytes([i]) * 2000)
        past = time.time() - 100 + i
        os.utime(os.path.join(cache._folder(ident), f"{i * 2000}-2000"), (past, past))
    assert cache.get(ident, 0, 2000) == bytes([0]) * 2000  # used now: the newest
    cache.put(ident, 8000, b"x" * 2000)  # 10,000: at the bound
    cache.put(ident, 10_000, b"y" * 2000)  # over: down to 9,000 at most
    assert cache.total_bytes <= 9000
    assert cache.get(ident, 2000, 2000) is None and cache.get(ident, 4000, 2000) is None  # oldest gone
    assert cache.get(ident, 0, 2000) is not None and cache.get(ident, 10_000, 2000) == b"y" * 2000
    other = DiskCache.identity("s3://b/k", 1, 3, "e")  # another version of the object
    assert cache.get(other, 0, 2000) is None
    assert not [f for f in tmp_path.rglob(".tmp-*")]


# -------------------------------------------------------------------- any fsspec URL


def test_http_urls_read_through_fsspec(tmp_path: Path):
    """An https:// (here http://) dataset served by a plain web server with directory
    index pages: listed, sized and read like a bucket."""
    local = Path(shutil.copytree(REFERENCE / "s2_twelve_shards" / "dataset", tmp_path / "ds"))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "http.server", "-b", "127.0.0.1", str(port),
                                "-d", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/ds"
        deadline = time.monotonic() + 20
        while True:
            try:
                storage, root = open_storage(url, StorageOptions(deadline=3.0))
                entries = storage.listdir(root)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert sorted(entries) == sorted((e.name, e.is_dir()) for e in os.scandir(local))
        expected = (local / "05" / "data.bin").read_bytes()
        assert storage.stat(f"{root}/05/data.bin")[0] == len(expected)
        assert storage.pread(f"{root}/05/data.bin", 7, 50) == expected[7:57]
    finally:
        process.terminate()
        process.wait()


def test_a_local_descriptor_let_go_of_under_a_read_is_closed_after_it(tmp_path: Path) -> None:
    """``close_file`` while a read uses the descriptor (export done with a shard its
    read-ahead thread still reads) closes it only when that read is done: its number is not
    given to another file under the read."""
    path = tmp_path / "data.bin"
    path.write_bytes(b"abcdef")
    storage = LocalStorage()
    under_way = storage._take(str(path))  # a read that has its descriptor, not yet pread
    storage.close_file(str(path))
    assert os.pread(under_way[0], 3, 0) == b"abc"  # still this file's
    assert storage.pread(str(path), 3, 3) == b"def"  # a new read opens it again
    storage._give(str(path), under_way)
    with pytest.raises(OSError):
        os.fstat(under_way[0])  # closed by its last read
    storage.close()

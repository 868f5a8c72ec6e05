"""A tar read front to back is served by one pass over its members (atlasfs/tree/tarstream.py):
the bytes export writes, requests a little out of order served from the pass's window, the
others (and any once the pass failed) left to the random-access read."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import atlasfs.tree.tarstream as tarstream
from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore
from atlasfs.tree.tarview import TarView
from fusemount import atlasfs


def _read(streams: tarstream.Streams, key: str, offset: int, stop: int,
          pieces: Callable[[], Iterator[bytes]]) -> bytes | None:
    parts = streams.read(key, offset, stop, pieces)
    return None if parts is None else b"".join(parts)


DATA = bytes(random.Random(3).randbytes(50_000))


def _pieces(fail_at: int | None = None) -> Iterator[bytes]:
    for at in range(0, len(DATA), 700):
        if fail_at is not None and at >= fail_at:
            raise OSError(5, "a bad block")
        yield DATA[at:at + 700]


def test_a_pass_serves_requests_in_and_a_little_out_of_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tarstream, "WINDOW", 9000)
    monkeypatch.setattr(tarstream, "AHEAD", 5000)
    monkeypatch.setattr(tarstream, "LEAD", 0)  # only as far as asked: the window's bounds are what is tested
    streams = tarstream.Streams()
    made = []

    def pieces() -> Iterator[bytes]:
        made.append(1)
        return _pieces()

    assert _read(streams, "t", 100, 200, pieces) is None  # no pass begins past offset 0
    assert _read(streams, "t", 0, 4096, pieces) == DATA[:4096]
    assert _read(streams, "t", 8192, 12288, pieces) == DATA[8192:12288]  # within AHEAD of its end
    assert _read(streams, "t", 4096, 8192, pieces) == DATA[4096:8192]  # behind, within its window
    assert _read(streams, "t", 20_000, 21_000, pieces) is None  # far past it
    assert _read(streams, "t", 100, 200, pieces) is None  # before its window
    assert _read(streams, "t", 12288, 60_000, pieces) == DATA[12288:]  # to the end
    assert made == [1]


def test_a_pass_goes_on_by_itself_past_what_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tarstream, "LEAD", 7000)
    streams = tarstream.Streams()
    made: list[int] = []

    def pieces() -> Iterator[bytes]:
        for piece in _pieces():
            made.append(len(piece))
            yield piece

    assert _read(streams, "t", 0, 1000, pieces) == DATA[:1000]
    deadline = time.monotonic() + 10
    while sum(made) < 8000 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert 8000 <= sum(made) < 8000 + 700  # as far as asked + LEAD, and no further
    assert _read(streams, "t", 1000, 8000, lambda: iter(())) == DATA[1000:8000]


def test_a_pass_that_fails_is_left_to_the_random_read() -> None:
    streams = tarstream.Streams()
    assert _read(streams, "t", 0, 1000, lambda: _pieces(fail_at=3000)) == DATA[:1000]
    assert _read(streams, "t", 1000, 5000, lambda: _pieces(fail_at=3000)) is None  # the error is not raised here
    assert _read(streams, "t", 5000, 6000, lambda: _pieces()) is None
    assert _read(streams, "t", 0, 1000, lambda: _pieces()) == DATA[:1000]  # a new pass from the start


def test_passes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tarstream, "STREAMS", 2)
    streams = tarstream.Streams()
    for key in ("a", "b", "c"):
        assert _read(streams, key, 0, 10, _pieces) == DATA[:10]
    assert _read(streams, "a", 10, 20, _pieces) is None  # the oldest was dropped
    assert _read(streams, "c", 10, 20, _pieces) == DATA[10:20]
    streams.forget("c")
    assert _read(streams, "c", 10, 20, _pieces) is None


def test_a_request_whose_bytes_are_made_is_answered_while_the_pass_makes_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tarstream, "LEAD", 7000)
    streams = tarstream.Streams()
    at_gate, gate = threading.Event(), threading.Event()

    def pieces() -> Iterator[bytes]:
        for i, piece in enumerate(_pieces()):
            if i == 5:  # bytes 3500-4200: a piece slow to make (a block to decode)
                at_gate.set()
                gate.wait(10)
            yield piece

    try:
        assert _read(streams, "t", 0, 1000, pieces) == DATA[:1000]
        assert at_gate.wait(10)  # the lead thread is making the slow piece
        started = time.monotonic()
        assert _read(streams, "t", 1000, 3500, pieces) == DATA[1000:3500]
        assert time.monotonic() - started < 5  # not held up behind the piece under way
    finally:
        gate.set()
    assert _read(streams, "t", 3500, 9000, pieces) == DATA[3500:9000]


def test_requests_from_many_threads_at_once_get_the_pass_s_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the kernel's read-ahead sends them: issued in order, answered by threads in any order."""
    monkeypatch.setattr(tarstream, "WINDOW", 100_000)  # a quarter of the tar: pieces let go of as it goes
    monkeypatch.setattr(tarstream, "LEAD", 3000)
    data = bytes(random.Random(5).randbytes(400_000))

    def pieces() -> Iterator[bytes]:
        rng = random.Random(6)
        at = 0
        while at < len(data):
            n = rng.choice([1, 300, 512, 5000, 17_000])
            if rng.random() < 0.05:
                time.sleep(0.001)
            yield data[at:at + n]
            at += n

    for _ in range(3):
        streams = tarstream.Streams()
        requests = iter(range(0, len(data), 4096))
        lock = threading.Lock()
        got: dict[int, bytes | None] = {}

        def reader() -> None:
            while True:
                with lock:
                    offset = next(requests, None)
                if offset is None:
                    return
                got[offset] = _read(streams, "t", offset, min(offset + 4096, len(data)), pieces)

        threads = [threading.Thread(target=reader) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
        assert sorted(got) == list(range(0, len(data), 4096))
        # each answer the tar's bytes; None (left to the random read) only for a request whose
        # thread was held up while the others went a whole window further
        assert all(part is None or part == data[offset:offset + 4096] for offset, part in got.items())
        assert sum(part is None for part in got.values()) <= len(got) // 10


def _dataset(path: Path) -> Path:
    """120 examples in 3 shards of blocks of 6, a key needing a pax header among them."""
    rng = random.Random(7)
    keys = [f"k{i:04d}" for i in range(120)]
    keys[3] = "x" * 120
    with AtlasWriter(path, shard_size=50, block_size=6, compression_strategy=1) as writer:
        for i, key in enumerate(keys):
            writer.add_example({"__key__": key, "jpg": rng.randbytes(rng.randrange(1, 3000)), "cls": i,
                                "json": {"i": i}})
    return path


def test_a_tar_read_in_order_through_the_view_makes_no_lookup_per_member(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = _dataset(tmp_path / "ds")
    assert atlasfs("export", str(dataset), str(tmp_path / "out")).returncode == 0
    atlasfs("index", str(dataset))
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    view = TarView(tree)
    lookups = []
    lookup = tree.lookup
    monkeypatch.setattr(tree, "lookup", lambda path: lookups.append(path) or lookup(path))
    for shard in ("0", "1", "2"):
        expected = (tmp_path / "out" / f"{shard}.tar").read_bytes()
        entry = view.lookup(f"/{shard}.tar")
        got = b"".join(view.read(entry, offset, 4096) for offset in range(0, entry.size, 4096))
        assert got == expected
        # requests out of order, as the kernel's read-ahead answered by several threads
        entry = view.lookup(f"/{shard}.tar")
        order = list(range(0, entry.size, 8192))
        for i in range(0, len(order) - 1, 2):
            order[i], order[i + 1] = order[i + 1], order[i]
        order.remove(0)
        parts = {0: view.read(entry, 0, 8192), **{offset: view.read(entry, offset, 8192) for offset in order}}
        assert b"".join(parts[offset] for offset in sorted(parts)) == expected
    assert len(lookups) <= 10, lookups[:20]  # the folders', not one a member


def test_a_pass_gathers_small_pieces_and_gives_the_bytes_export_writes(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = _dataset(tmp_path / "ds")
    with AtlasWriter(tmp_path / "named", shard_size=40, block_size=8) as writer:  # a name not ASCII: no slice of the names blob
        for i in range(40):
            writer.add_example({"__key__": f"é{i:03d}" if i % 7 else f"k{i:03d}", "bin": bytes([i]) * (i * 997)})
    for source in (dataset, tmp_path / "named"):
        out = tmp_path / f"out-{source.name}"
        assert atlasfs("export", str(source), str(out)).returncode == 0
        atlasfs("index", str(source))
        view = TarView(BlockTree(AtlasDataset(source), store=TableStore(str(source))))
        for shard in sorted(p.name[:-4] for p in out.glob("*.tar")):
            expected = (out / f"{shard}.tar").read_bytes()
            layout = view.lookup(f"/{shard}.tar").ref
            plain = list(layout.pieces())
            gathered = list(layout.pieces(gather=4096))
            assert b"".join(plain) == b"".join(gathered) == expected
            # three pieces a member at most without gathering; with it, every small piece is in a
            # run of them joined up to the size asked, and a piece of SMALL_PIECE or more goes alone
            assert len(gathered) < len(plain)
            small = [len(p) for p in gathered if len(p) < 4096]
            assert len(small) <= sum(1 for p in plain if len(p) >= 16 << 10) + 2
    # a pass that fails part way (the tree changed under its layout) still fails as before
    layout = view.lookup("/0.tar").ref
    monkeypatch.setattr(layout, "sizes", layout.sizes + 1)
    with pytest.raises(OSError, match="changed since its tar was laid out"):
        list(layout.pieces(gather=4096))

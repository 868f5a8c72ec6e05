"""A mount whose control plane answers the native engine with wrong values, for
tests/mount/test_native.py: ``python native_hostile.py MOUNTPOINT``.

Each name at the root is one way of answering wrong (see ``ANSWERS``); ``good`` is answered
right, so that the test can see the daemon still serves after every wrong answer. The
folders ``lying`` and ``sizes`` are shard folders whose attached table columns lie (a row
past the entries, a name past the names blob; a size past ``off_t``), as a forged table
file's could if validation missed something: C must check them itself.
"""

from __future__ import annotations

import sys
import types

import numpy as np

from atlasfs.fuse.engine import NativeBridge, NativeSession
from atlasfs.tree.base import Entry, Tree, not_found

GOOD = Entry(False, 5, 0.0, 77)

#: lookup answers by name: each is wrong for the C side to catch (EIO, never a crash).
ANSWERS = {
    "not-a-tuple": "a string",
    "short-tuple": (5, False),
    "negative-size": (5, False, -5, 0.0, 7),
    "huge-size": (5, False, 1 << 63, 0.0, 7),
    "root-node": (1, True, 0, 0.0, 7),
    "text-node": ("5", False, 1, 0.0, 7),
    "positive-errno": 5,
}


#: The shard folders with attached tables: name -> (node id, columns).
TABLES = {
    # names "ab", "cd"; the second row's name ends past the blob, the path order names row 7
    "lying": (1 << 32, (b"abcd", np.array([0, 2, 99], np.uint64), np.zeros(2, np.uint8),
                        np.array([5, 5], np.uint64), np.array([0, 7], np.uint32), np.zeros(2, np.uint32))),
    # names "big", "ok"; "big" is 2^63 bytes
    "sizes": (2 << 32, (b"bigok", np.array([0, 3, 5], np.uint64), np.zeros(2, np.uint8),
                        np.array([1 << 63, 2], np.uint64), np.array([0, 1], np.uint32), np.zeros(2, np.uint32))),
}


class Flat(Tree):
    """``/good``, ``/parts`` read in pieces, and ``/too-long``, ``/text``, ``/parts-long`` and
    ``/parts-text`` whose reads the bridge answers wrong; the
    folders of :data:`TABLES`."""

    tables = types.SimpleNamespace(shards=list(TABLES), on_release=None, tables={})

    def path_of_ino(self, ino: int) -> str | None:
        return next((f"/{name}" for name, (node, _) in TABLES.items() if node == ino), None)

    def lookup(self, path: str) -> Entry:
        if path == "/":
            return Entry(True, 0, 0.0, 1)
        if path[1:] in TABLES:
            return Entry(True, 0, 0.0, TABLES[path[1:]][0])
        if path in ("/good", "/too-long", "/text", "/parts", "/parts-long", "/parts-text"):
            return GOOD
        raise not_found(path)

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        return [("good", GOOD)] if path == "/" else []

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        return b"hello"[offset:offset + size]


class Hostile(NativeBridge):
    """Answers right for ``good``, wrong for the rest."""

    def lookup(self, parent: int, name: bytes):  # type: ignore[override]
        text = name.decode()
        if text == "raises":
            raise RuntimeError("a bug in the control plane")
        if text in ANSWERS:
            return ANSWERS[text]
        if text == "nan-mtime":  # a value C takes, as no time
            return self._register("/good"), False, 5, float("nan"), 77
        return super().lookup(parent, name)

    def read(self, node: int, offset: int, size: int):  # type: ignore[override]
        path = self._nodes[node][0]
        if path == "/too-long":
            return b"x" * (size + 1)
        if path == "/text":
            return "hello"
        if path == "/parts":  # pieces, gathered in order (the tar view's)
            return [b"he", b"", b"llo"][:3 if offset == 0 else 0]
        if path == "/parts-long":
            return [b"x" * size, b"y"]
        if path == "/parts-text":
            return [b"he", "llo"]
        return super().read(node, offset, size)

    def fill(self, shard: int, row: int, offset: int, size: int):  # type: ignore[override]
        """The files of "sizes"' block, offsets past the bytes: C keeps nothing, EIO."""
        return 0, np.array([0, 3, 99], np.uint64), b"bigok"

    def readdir(self, node: int, offset: int, count: int, plus: bool):  # type: ignore[override]
        if node != 1:
            return super().readdir(node, offset, count, plus)
        if offset == 0:
            return [(b"bad\0name", False, 3, 0, 1, 0.0, 1)]
        return [(b"x", False)]


def main() -> None:
    mountpoint = sys.argv[1]
    def ready() -> None:
        for s, (_, columns) in enumerate(TABLES.values()):
            bridge.session.attach(s, 0.0, *columns)
        print("ready", flush=True)

    bridge = Hostile(Flat(), ready)
    NativeSession(bridge, mountpoint, {"fsname": "hostile", "subtype": "atlasfs", "ro": True}).run()


if __name__ == "__main__":
    main()
